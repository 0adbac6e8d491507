"""The core attention of an HDP micro-batch: whole documents to the local kernel, split ones to their ring.

A micro-batch packed by `megatron_hdp.data.collate.collate_microbatch` is a run of attention groups:
first the whole documents (one local kernel call), then the ring groups in ascending order of their
smallest sequence id, then padding (a document of its own). This module walks the groups in that order
— the one global order every rank follows, which keeps ring point-to-point traffic free of deadlock —
and concatenates the outputs in packed order.

It is torch-only: Megatron's `core_attention` leaf (`megatron_hdp.megatron.layers.spec.HDPCoreAttention`)
applies RoPE and calls `hdp_core_attention`; the per-micro-batch metadata rides in `HDPBatchMeta`, which
the Megatron side carries inside its `PackedSeqParams`.

Multi-latent attention: a ring group the plan gives the latent ring (`AttentionGroup.ring_kind`) runs
`latent_ring_attention` on the group's rows of `LatentRingInputs` instead of `ring_attention` on its K and V;
the other groups attend with q, k, v as always. The caller (the MLA layer) passes the latent as the ring
must see it (see `LatentRingInputs.latent`).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megatron_hdp.attention import latent_ring_attention, local_varlen_attention, ring_attention
from megatron_hdp.attention.backends import Segments
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import AttentionGroup
from megatron_hdp.attention.local import local_segments
from megatron_hdp.attention.zigzag_ring import prepare_ring_plan

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HDPBatchMeta:
    """What the core attention needs to know about one packed micro-batch, beyond q, k, v.

    Made once per micro-batch (by the forward step, after the micro-batch reached the device), shared
    by every layer: what the layers need on the device is made here or memoised on first use, so that
    no layer copies from the host or syncs with it."""

    groups: tuple[AttentionGroup, ...]
    """Attention groups in packed order (rings name HDP ranks)."""
    hdp_global_ranks: tuple[int, ...]
    """Global rank (default process group) of each HDP rank at this rank's TP/PP coordinate."""
    position_ids: torch.Tensor
    """[T] position of every packed token inside its document (RoPE)."""
    backend: str = "auto"
    """Local kernel of `megatron_hdp.attention.backends` ("auto": the best available)."""
    windows: tuple[Optional[int], ...] = (None,)
    """The sliding windows the model's layers use (None: full causal): ring plans are prepared for each."""
    segments: tuple[Optional[Segments], ...] = field(init=False, repr=False, compare=False)
    """Per group: the kernel segments of a local group, cu_seqlens on the device of `position_ids`."""
    document_lengths: torch.Tensor = field(init=False, repr=False, compare=False)
    """[documents] int64 on the device: the full length of each document of the micro-batch, in packed
    order (padding left out); the MoE router's per-document losses divide by them."""
    _memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # every device table the layers need (cu_seqlens, ring row indices, lengths) in one asynchronous
        # copy from pinned memory: a synchronous copy per table would drain the GPU queue each time
        device, tables = self.position_ids.device, HostTables()
        segments = tuple(None if g.is_ring else local_segments(g.seqlens, device, tables) for g in self.groups)
        object.__setattr__(self, "segments", segments)
        for group, window in itertools.product(filter(lambda g: g.is_ring, self.groups), self.windows):
            prepare_ring_plan(group.seqlens, self.global_ring(group), tables=tables, device=device, window=window)
        lengths = [n for g in self.groups if g.seq_ids for n in g.seqlens]
        tables.add(lengths, lambda t: object.__setattr__(self, "document_lengths", t), dtype=torch.int64)
        tables.transfer(device)

    def memo(self, key: object, make: Callable[[], object]) -> object:
        """`make()` on the first call with `key` for this micro-batch, the same object after (every layer
        shares it: e.g. the RoPE angles of the micro-batch's positions)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def global_ring(self, group: AttentionGroup) -> list[int]:
        """The group's ring as global ranks, in ring order."""
        return [self.hdp_global_ranks[r] for r in group.ring]


@dataclass(frozen=True)
class LatentRingInputs:
    """What latent ring groups attend with (multi-latent attention), every row in packed order like q."""

    latent: torch.Tensor
    """[T, kv_lora_rank], normalised, as the ring must see it: through the TP input mapping of Megatron's
    `linear_kv_up_proj` (`copy_to_tensor_model_parallel_region`; with sequence parallelism
    `gather_from_sequence_parallel_region`), whose backward sums the ring's per-TP-rank latent gradients."""
    k_rope: torch.Tensor
    """[T, 1, qk_pos_emb_head_dim], rotated (each token at its position inside its document)."""
    up_weight: torch.Tensor
    """`linear_kv_up_proj.weight`: [heads of this TP rank x (qk_head_dim + v_head_dim), kv_lora_rank]."""
    qk_head_dim: int
    v_head_dim: int


def check_group_order(groups: Sequence[AttentionGroup], *, num_tokens: int) -> None:
    """Assert the packing contract: groups tile [0, num_tokens) and rings come in the global order."""
    assert groups and groups[0].tokens[0] == 0 and groups[-1].tokens[1] == num_tokens, (
        f"attention groups {[g.tokens for g in groups]} do not tile {num_tokens} tokens"
    )
    assert all(a.tokens[1] == b.tokens[0] for a, b in zip(groups, groups[1:]))
    firsts = [g.seq_ids[0] for g in groups if g.is_ring]
    assert firsts == sorted(firsts), f"ring groups out of the global order: first sequence ids {firsts}"


def hdp_core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    meta: HDPBatchMeta,
    softmax_scale: float | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
    latent: LatentRingInputs | None = None,
) -> torch.Tensor:
    """Causal attention of a packed HDP micro-batch: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] -> [T, Hq, Dv].

    Whole documents attend locally; each ring group calls `ring_attention` with its ring's global ranks,
    in the packed (= global) order, or, for a latent ring group, `latent_ring_attention` on the rows of
    `latent` (its rows of k and v are not read). Differentiable in q, k, v and `latent`'s tensors.
    `deterministic`: every kernel call runs a deterministic backward (Megatron's `deterministic_mode`).
    `window`: sliding-window attention, query i sees keys i - window .. i of its document (Megatron's
    `window_size = (window, 0)`); None: all earlier keys. `sink` [Hq]: the query heads' sink logits
    (Megatron's `softmax_offset`: zeros for the off-by-one softmax, the parameter for the learnable one),
    on every group's rows (latent ring groups too); None: the plain softmax. ValueError before any ring
    call when a latent ring group has no `latent`.
    """
    check_group_order(meta.groups, num_tokens=q.shape[0])
    if latent is None and any(g.is_ring and g.ring_kind == "latent" for g in meta.groups):
        raise ValueError("the plan runs latent rings in this micro-batch but no latent inputs were given: a latent "
                         "ring needs a multi-latent attention layer (LatentRingInputs)")
    outputs = []
    for group, segments in zip(meta.groups, meta.segments):
        lo, hi = group.tokens
        if group.is_ring and group.ring_kind == "latent":
            out = latent_ring_attention(
                q[lo:hi], latent.latent[lo:hi], latent.k_rope[lo:hi], up_weight=latent.up_weight,
                seqlens=group.seqlens, ring=meta.global_ring(group), qk_head_dim=latent.qk_head_dim,
                v_head_dim=latent.v_head_dim, causal=True, softmax_scale=softmax_scale, backend=meta.backend,
                deterministic=deterministic, window=window, sink=sink,
            )
        elif group.is_ring:
            out = ring_attention(
                q[lo:hi],
                k[lo:hi],
                v[lo:hi],
                seqlens=group.seqlens,
                ring=meta.global_ring(group),
                causal=True,
                softmax_scale=softmax_scale,
                backend=meta.backend,
                deterministic=deterministic,
                window=window,
                sink=sink,
            )
        else:
            out = local_varlen_attention(
                q[lo:hi], k[lo:hi], v[lo:hi], seqlens=group.seqlens, causal=True,
                softmax_scale=softmax_scale, backend=meta.backend, segments=segments, deterministic=deterministic,
                window=window, sink=sink,
            )
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
