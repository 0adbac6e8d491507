"""THD collation of one rank's micro-batch from its shards of a StepPlan.

A rank loads only the tokens it holds and packs them into one THD row (`[T]` tensors, documents one after
another). The packed order is a contract with the core-attention module (`attention/core_attention.py`):

1. the whole documents (ring of one) in ascending sequence id, as one local group;
2. the split documents, grouped by ring (documents sharing the same ring tuple form one group, in
   ascending sequence id), groups in ascending order of their smallest sequence id — the one global order
   in which every rank enters its rings, which is what keeps ring P2P free of deadlock;
   inside a group each document contributes its zigzag shard: chunk p, then chunk 2k-1-p;
3. padding up to `pad_to_multiple` tokens (for sequence parallelism): its own local document, masked out
   of the loss, so it attends only to itself.

Label convention (project-wide): a document of plan length L has L + 1 raw tokens; position i's input is
raw[i] and its label raw[i + 1], so a chunk [a, b) reads raw tokens [a, b + 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from megatron_hdp.attention.layout import AttentionGroup
from megatron_hdp.plan.step_plan import MicroBatch, StepPlan

TokenReader = Callable[[int, int, int], np.ndarray]
"""read_tokens(seq_id, start, end) -> the int64 raw tokens [start, end) of that sequence (end <= L + 1)."""

MaskReader = Callable[[int, int, int], np.ndarray]
"""read_loss_mask(seq_id, start, end) -> the loss mask (0/1) of input positions [start, end)."""


@dataclass
class PackedMicroBatch:
    """One rank's micro-batch in THD layout (collated on the host; the step moves it to the model's device
    with `to`, from pinned memory when `pin_memory` was called)."""

    tokens: torch.Tensor
    """[T] int64 input token ids."""
    labels: torch.Tensor
    """[T] int64 next-token labels."""
    loss_mask: torch.Tensor
    """[T] float32, 1 for tokens that count in the loss (0 for padding and masked positions)."""
    position_ids: torch.Tensor
    """[T] int64 position of each token inside its document (for RoPE)."""
    cu_seqlens: torch.Tensor
    """[S + 1] int32 boundaries of the packed segments: one per document shard, plus one for padding."""
    groups: tuple[AttentionGroup, ...]
    """Attention groups in packed (and execution) order; they tile [0, T) exactly."""
    num_loss_tokens: int
    """Tokens of this micro-batch that count in the loss."""
    num_padding: int
    """Padding tokens appended at the end."""
    offload_ratio: float = 0.0
    """Fraction of its activations the forward offloads (`ActivationOffloader.microbatch`): the largest
    planned ratio of its sequences (the planner sized the micro-batch with it), 0 for padding."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    _TENSORS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens")

    def _with(self, convert) -> "PackedMicroBatch":
        moved = {name: convert(getattr(self, name)) for name in self._TENSORS}
        return PackedMicroBatch(**moved, groups=self.groups, num_loss_tokens=self.num_loss_tokens,
                                num_padding=self.num_padding, offload_ratio=self.offload_ratio)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "PackedMicroBatch":
        """The same micro-batch with its tensors on `device` (asynchronous from pinned memory when
        `non_blocking`)."""
        return self._with(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PackedMicroBatch":
        """The same micro-batch in page-locked host memory (so that `to(cuda, non_blocking=True)` overlaps)."""
        return self._with(lambda t: t.pin_memory())

    @property
    def max_segment_length(self) -> int:
        """Longest packed segment (`cu_seqlens` step), read on the host: the kernels' max_seqlen."""
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def _rank_of(plan: StepPlan, microbatch: MicroBatch) -> int:
    """The HDP rank whose schedule holds `microbatch` (by identity, then by equality)."""
    for schedule in plan.ranks:
        if any(mb is microbatch for mb in schedule.microbatches):
            return schedule.rank
    for schedule in plan.ranks:
        if microbatch in schedule.microbatches:
            return schedule.rank
    raise ValueError("the micro-batch is not part of this plan")


def _group_order(plan: StepPlan, microbatch: MicroBatch) -> list[tuple[tuple[int, ...], list[int]]]:
    """(ring, sequence ids) of each attention group, in the packed order of the module docstring."""
    whole = sorted(sh.seq for sh in microbatch.shards if len(plan.sequences[sh.seq].ring) == 1)
    by_ring: dict[tuple[int, ...], list[int]] = {}
    for seq in sorted(sh.seq for sh in microbatch.shards if len(plan.sequences[sh.seq].ring) > 1):
        by_ring.setdefault(tuple(plan.sequences[seq].ring), []).append(seq)
    groups = [(ring, seqs) for ring, seqs in by_ring.items()]
    groups.sort(key=lambda item: item[1][0])
    if whole:
        groups.insert(0, ((plan.sequences[whole[0]].ring[0],), whole))
    return groups


def collate_microbatch(
    plan: StepPlan,
    microbatch: MicroBatch,
    read_tokens: TokenReader,
    *,
    pad_to_multiple: int = 1,
    read_loss_mask: Optional[MaskReader] = None,
    rank: Optional[int] = None,
) -> PackedMicroBatch:
    """Pack `microbatch` (one of `plan`'s) into THD tensors plus the attention groups.

    `read_tokens(seq_id, start, end)` returns raw tokens [start, end) of a sequence; every chunk [a, b)
    reads [a, b + 1) so that labels are the next tokens. `read_loss_mask`, when given, masks input
    positions out of the loss (default: every position counts). The result has a multiple of
    `pad_to_multiple` tokens. `rank` (the HDP rank running it) is found from the plan when not given.
    A micro-batch without shards (a slot a plan leaves empty to keep ring members aligned) packs as
    `empty_microbatch`.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    if rank is None:
        rank = _rank_of(plan, microbatch)
    elif microbatch not in plan.microbatches(rank):
        raise ValueError(f"the micro-batch is not one of rank {rank}'s in this plan")
    if not microbatch.shards:
        return empty_microbatch(rank=rank, num_tokens=pad_to_multiple)
    shards = {sh.seq: sh for sh in microbatch.shards}
    inputs, labels, masks, positions = [], [], [], []
    segments: list[int] = [0]
    groups: list[AttentionGroup] = []
    offset = 0
    for ring, seq_ids in _group_order(plan, microbatch):
        start = offset
        for seq in seq_ids:
            length = plan.sequences[seq].length
            for a, b in shards[seq].chunks:
                if b <= a:
                    continue
                raw = np.asarray(read_tokens(seq, a, b + 1), dtype=np.int64)
                if raw.shape != (b + 1 - a,):
                    raise ValueError(
                        f"read_tokens({seq}, {a}, {b + 1}) returned shape {raw.shape}, expected ({b + 1 - a},) "
                        f"(sequence {seq} has plan length {length}, so {length + 1} raw tokens)"
                    )
                inputs.append(raw[:-1])
                labels.append(raw[1:])
                mask = np.ones(b - a, dtype=np.float32)
                if read_loss_mask is not None:
                    mask = np.asarray(read_loss_mask(seq, a, b), dtype=np.float32).reshape(b - a)
                masks.append(mask)
                positions.append(np.arange(a, b, dtype=np.int64))
                offset += b - a
            if offset > segments[-1]:
                segments.append(offset)
        groups.append(
            AttentionGroup(
                ring=tuple(ring),
                seq_ids=tuple(seq_ids),
                seqlens=tuple(plan.sequences[s].length for s in seq_ids),
                tokens=(start, offset),
                ring_kind=plan.sequences[seq_ids[0]].ring_kind,  # one per ring call (`StepPlan.validate`)
            )
        )
    assert all(rank in g.ring for g in groups), f"rank {rank} packed a group it is not a member of"
    num_padding = (-offset) % pad_to_multiple if offset else pad_to_multiple
    if num_padding:
        inputs.append(np.zeros(num_padding, dtype=np.int64))
        labels.append(np.zeros(num_padding, dtype=np.int64))
        masks.append(np.zeros(num_padding, dtype=np.float32))
        positions.append(np.arange(num_padding, dtype=np.int64))
        groups.append(
            AttentionGroup(ring=(rank,), seq_ids=(), seqlens=(num_padding,), tokens=(offset, offset + num_padding))
        )
        offset += num_padding
        segments.append(offset)
    loss_mask = torch.from_numpy(np.concatenate(masks))
    return PackedMicroBatch(
        tokens=torch.from_numpy(np.concatenate(inputs)),
        labels=torch.from_numpy(np.concatenate(labels)),
        loss_mask=loss_mask,
        position_ids=torch.from_numpy(np.concatenate(positions)),
        cu_seqlens=torch.tensor(segments, dtype=torch.int32),
        groups=tuple(groups),
        num_loss_tokens=int(loss_mask.sum().item()),
        num_padding=num_padding,
        offload_ratio=max(plan.sequences[seq].offload_ratio for seq in shards),
    )


def empty_microbatch(*, rank: int, num_tokens: int = 1) -> PackedMicroBatch:
    """A micro-batch of `num_tokens` padding tokens with no loss: what a rank with nothing planned runs,
    so that it still takes part in every collective of the step (gradient reduction, EP all-to-all)."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    zeros = torch.zeros(num_tokens, dtype=torch.int64)
    return PackedMicroBatch(
        tokens=zeros,
        labels=zeros.clone(),
        loss_mask=torch.zeros(num_tokens, dtype=torch.float32),
        position_ids=torch.arange(num_tokens, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, num_tokens], dtype=torch.int32),
        groups=(AttentionGroup(ring=(rank,), seq_ids=(), seqlens=(num_tokens,), tokens=(0, num_tokens)),),
        num_loss_tokens=0,
        num_padding=num_tokens,
    )
