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

Multi-token prediction of depth D (`mtp_depth`): a chunk reads D more raw tokens (and D more loss-mask
entries), [a, b + 1 + D) clipped at the document's end, and the micro-batch carries each depth's shifted
tokens, labels, positions and per-document weighted loss mask (`data/mtp_shift.py`), which Megatron's
MTP block takes instead of rolling the packed row (`megatron/layers/mtp.py`). With a loss mask the whole
document's mask is read once per document (its loss-token count normalises the document's MTP loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from megatron_hdp.attention.layout import AttentionGroup
from megatron_hdp.data.mtp_shift import depth_weights, shifted_chunk
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
    mtp_tokens: Optional[torch.Tensor] = None
    """[D, T] int64 with multi-token prediction of depth D: row d-1 is each token's input d positions ahead
    in its document (0 past its end); None without MTP."""
    mtp_labels: Optional[torch.Tensor] = None
    """[D, T] int64: the labels d positions ahead (0 past the document's end)."""
    mtp_position_ids: Optional[torch.Tensor] = None
    """[D, T] int64: the positions d ahead (0 past the document's end)."""
    mtp_loss_mask: Optional[torch.Tensor] = None
    """[D, T] float32: the loss mask d positions ahead times the document's depth-d weight
    (`mtp_shift.depth_weights`), 0 past its end and on padding."""

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def mtp_depth(self) -> int:
        """D, the multi-token prediction depth it was collated for (0: none)."""
        return 0 if self.mtp_tokens is None else int(self.mtp_tokens.shape[0])

    _TENSORS = ("tokens", "labels", "loss_mask", "position_ids", "cu_seqlens", "mtp_tokens", "mtp_labels",
                "mtp_position_ids", "mtp_loss_mask")

    def _with(self, convert) -> "PackedMicroBatch":
        moved = {name: None if getattr(self, name) is None else convert(getattr(self, name)) for name in self._TENSORS}
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


class _ChunkReader:
    """Reads one chunk's tokens and loss mask (with `depth` > 0, also the D positions after it, and each
    document's whole loss mask once, for its MTP weights)."""

    def __init__(self, read_tokens: TokenReader, read_loss_mask: Optional[MaskReader], depth: int):
        self.read_tokens, self.read_loss_mask, self.depth = read_tokens, read_loss_mask, depth
        self._documents: dict[int, tuple[Optional[np.ndarray], np.ndarray]] = {}

    def _document(self, seq: int, length: int) -> tuple[Optional[np.ndarray], np.ndarray]:
        """(the document's whole loss mask or None, its MTP depth weights), read once per document."""
        if seq not in self._documents:
            if self.read_loss_mask is None:
                whole, head, total = None, np.ones(min(self.depth, length)), float(length)
            else:
                whole = np.asarray(self.read_loss_mask(seq, 0, length), dtype=np.float32).reshape(length)
                head, total = whole[: self.depth], float(whole.sum(dtype=np.float64))
            self._documents[seq] = (whole, depth_weights(head, num_loss_tokens=total, depth=self.depth))
        return self._documents[seq]

    def tokens(self, seq: int, start: int, end: int, length: int) -> np.ndarray:
        """Raw tokens [start, end) of `seq`, checked against its plan length."""
        raw = np.asarray(self.read_tokens(seq, start, end), dtype=np.int64)
        if raw.shape != (end - start,):
            raise ValueError(
                f"read_tokens({seq}, {start}, {end}) returned shape {raw.shape}, expected ({end - start},) "
                f"(sequence {seq} has plan length {length}, so {length + 1} raw tokens)"
            )
        return raw

    def chunk(self, seq: int, a: int, b: int, length: int) -> tuple[np.ndarray, np.ndarray, Optional[tuple]]:
        """(raw tokens [a, b + 1), loss mask of [a, b), the `shifted_chunk` of depth 1..D or None)."""
        raw = self.tokens(seq, a, min(b + 1 + self.depth, length + 1), length)
        if not self.depth:
            mask = np.ones(b - a, dtype=np.float32)
            if self.read_loss_mask is not None:
                mask = np.asarray(self.read_loss_mask(seq, a, b), dtype=np.float32).reshape(b - a)
            return raw, mask, None
        whole, weights = self._document(seq, length)
        ahead = np.ones(min(b + self.depth, length) - a, dtype=np.float32) if whole is None else whole[a:b + self.depth]
        shifted = shifted_chunk(raw, ahead, start=a, end=b, length=length, weights=weights)
        return raw[: b + 1 - a], ahead[: b - a], shifted


def collate_microbatch(
    plan: StepPlan,
    microbatch: MicroBatch,
    read_tokens: TokenReader,
    *,
    pad_to_multiple: int = 1,
    read_loss_mask: Optional[MaskReader] = None,
    rank: Optional[int] = None,
    mtp_depth: int = 0,
) -> PackedMicroBatch:
    """Pack `microbatch` (one of `plan`'s) into THD tensors plus the attention groups.

    `read_tokens(seq_id, start, end)` returns raw tokens [start, end) of a sequence; every chunk [a, b)
    reads [a, b + 1) so that labels are the next tokens (with `mtp_depth` D, [a, b + 1 + D) clipped at the
    document's end: module docstring). `read_loss_mask`, when given, masks input positions out of the loss
    (default: every position counts). The result has a multiple of `pad_to_multiple` tokens. `rank` (the
    HDP rank running it) is found from the plan when not given. A micro-batch without shards (a slot a
    plan leaves empty to keep ring members aligned) packs as `empty_microbatch`.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    if mtp_depth < 0:
        raise ValueError(f"mtp_depth must be >= 0, got {mtp_depth}")
    if rank is None:
        rank = _rank_of(plan, microbatch)
    elif microbatch not in plan.microbatches(rank):
        raise ValueError(f"the micro-batch is not one of rank {rank}'s in this plan")
    if not microbatch.shards:
        return empty_microbatch(rank=rank, num_tokens=pad_to_multiple, mtp_depth=mtp_depth)
    reader = _ChunkReader(read_tokens, read_loss_mask, mtp_depth)
    shards = {sh.seq: sh for sh in microbatch.shards}
    inputs, labels, masks, positions, shifted = [], [], [], [], []
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
                raw, mask, ahead = reader.chunk(seq, a, b, length)
                inputs.append(raw[:-1])
                labels.append(raw[1:])
                masks.append(mask)
                positions.append(np.arange(a, b, dtype=np.int64))
                shifted.append(ahead)
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
        shifted.append(_padding_shift(mtp_depth, num_padding))
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
        **_mtp_fields(shifted, mtp_depth),
    )


def _padding_shift(depth: int, num_tokens: int) -> Optional[tuple]:
    """The depth 1..D inputs of padding tokens: all 0 (None without MTP)."""
    if not depth:
        return None
    zeros = np.zeros((depth, num_tokens), dtype=np.int64)
    return zeros, zeros, zeros, np.zeros((depth, num_tokens), dtype=np.float32)


def _mtp_fields(shifted: list[Optional[tuple]], depth: int) -> dict[str, torch.Tensor]:
    """The `PackedMicroBatch` MTP fields from each packed piece's `shifted_chunk` (none without MTP)."""
    if not depth:
        return {}
    names = ("mtp_tokens", "mtp_labels", "mtp_position_ids", "mtp_loss_mask")
    return {name: torch.from_numpy(np.concatenate([piece[i] for piece in shifted], axis=1))
            for i, name in enumerate(names)}


def empty_microbatch(*, rank: int, num_tokens: int = 1, mtp_depth: int = 0) -> PackedMicroBatch:
    """A micro-batch of `num_tokens` padding tokens with no loss: what a rank with nothing planned runs,
    so that it still takes part in every collective of the step (gradient reduction, EP all-to-all).
    With `mtp_depth` D its multi-token prediction inputs are all 0."""
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
        **_mtp_fields([_padding_shift(mtp_depth, num_tokens)], mtp_depth),
    )
