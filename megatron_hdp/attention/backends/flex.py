"""PyTorch flex attention on CUDA: the fallback for dtypes and GPUs the flash kernels do not cover (fp32).

Packed segments become one [1, H, T, D] call with a block mask from per-row segment ids (and the causal
order inside a segment), so fully masked tiles are skipped. The forward returns the lse through
`AuxRequest(lse=True)`; flex's backward cannot take an external out/lse, so the block gradients come
from `grads_by_recompute` (one extra forward). V's head dim may differ from Q's and K's (multi-latent
attention): flex takes it natively (inductor's kernel has separate QK and V head dims, each rounded up to
a power of two inside the kernel). Not run on a GPU in this repository's CI (flex has no
CPU backward); `tests/attention/test_attention_kernels.py` checks on CPU what does not need one.

Varying lengths. HDP packs a different number of tokens T into every micro-batch. flex runs compiled
with dynamic shapes (`torch.compile(flex_attention, dynamic=True)`): one graph for every T. A static
compile would recompile per T and, past Dynamo's recompile limit (8), run flex eagerly, which
materialises the [H, T, T] scores. The block mask is built from the segment lengths at block level
(`BlockMask.from_kv_blocks`), never as the dense [T, T] mask that an uncompiled `create_block_mask`
evaluates; block masks are cached per segment layout.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    KernelShape,
    Segments,
    grads_by_recompute,
    segment_rows,
)


BLOCK = 128
"""flex's sparse block size (`_DEFAULT_SPARSE_BLOCK_SIZE`), for q and kv tiles alike."""


def _tile_segments(segment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per BLOCK-row tile: the first and last segment id in it (ids grow with the row) and whether the
    tile is complete (the last tile may be cut off at T; flex never treats such a tile as full)."""
    rows = segment.shape[0]
    starts = torch.arange(0, rows, BLOCK, device=segment.device)
    ends = torch.clamp(starts + BLOCK, max=rows) - 1
    return segment[starts], segment[ends], starts + BLOCK <= rows


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A [q tiles, kv tiles] bool matrix as BlockMask's (count, column indices) per q tile, [1, 1, ...]."""
    counts = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int32), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), indices[None, None].contiguous()


def _tile_masks(seg_q: torch.Tensor, seg_k: torch.Tensor, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) [q tiles, kv tiles]: which tiles hold some / only allowed (q, kv) pairs.

    A tile pair holds some pair when its segment-id ranges overlap (ids are contiguous and sorted);
    it is full when both tiles are complete and lie inside one and the same segment. Causal segments
    pack q and kv rows alike, so inside a shared segment the rule q >= kv is the tile rule j <= i
    (some pair) and j < i (all pairs).
    """
    q_first, q_last, q_complete = _tile_segments(seg_q)
    k_first, k_last, k_complete = _tile_segments(seg_k)
    some = (q_first[:, None] <= k_last[None, :]) & (k_first[None, :] <= q_last[:, None])
    one_segment = (q_first == q_last) & q_complete
    full = one_segment[:, None] & ((k_first == k_last) & k_complete)[None, :] & (q_first[:, None] == k_first[None, :])
    if causal:
        i = torch.arange(q_first.shape[0], device=seg_q.device)[:, None]
        j = torch.arange(k_first.shape[0], device=seg_q.device)[None, :]
        some &= j <= i
        full &= j < i
    return some & ~full, full


def window_mask_mod(
    seg_q: torch.Tensor, pos_q: torch.Tensor, seg_k: torch.Tensor, pos_k: torch.Tensor, window: BlockWindow
):
    """flex's mask_mod of a windowed call: same segment and 0 <= (i + shift) - j <= left (`BlockWindow`).
    The shifts come from `BlockWindow.shift_table` (a ring plan's arrive with its micro-batch's tables);
    whole documents, all shifts 0, read none."""
    shifts = window.shift_table(seg_q.device) if any(window.shifts) else None

    def mask_mod(b, h, q_idx, kv_idx):
        diff = pos_q[q_idx] - pos_k[kv_idx]
        if shifts is not None:
            diff = diff + shifts[seg_q[q_idx]]
        return (seg_q[q_idx] == seg_k[kv_idx]) & (diff >= 0) & (diff <= window.left)

    return mask_mod


@functools.lru_cache(maxsize=64)
def _block_mask(segments: Segments, causal: bool, window: BlockWindow | None = None):
    """The BlockMask of one call, built at tile level: O(T + (T / BLOCK)^2) memory, never [T, T]. A
    windowed call keeps every tile pair of a shared segment partial (the mask_mod decides each pair)."""
    from torch.nn.attention.flex_attention import BlockMask

    seg_q, pos_q = segment_rows(segments.cu_seqlens_q, segments.cu_q[-1])
    seg_k, pos_k = segment_rows(segments.cu_seqlens_k, segments.cu_k[-1])

    def mask_mod(b, h, q_idx, kv_idx):
        same = seg_q[q_idx] == seg_k[kv_idx]
        return same & (pos_q[q_idx] >= pos_k[kv_idx]) if causal else same

    partial, full = _tile_masks(seg_q, seg_k, causal and window is None)
    if window is not None:
        mask_mod = window_mask_mod(seg_q, pos_q, seg_k, pos_k, window)
        partial, full = partial | full, torch.zeros_like(full)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(segments.cu_q[-1], segments.cu_k[-1]),
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


_KERNEL_OPTIONS = {"FORCE_USE_FLEX_ATTENTION": True}
"""Always inductor's main flex kernel. Its split-KV decoding kernel, picked when a graph's query length
hints < 128 tokens, failed to lower under the dynamic-shape compile on an H100 with torch 2.11
("NoValidChoicesError", GQA, bf16, a 3-rank ring's short shards); packed micro-batches of any T must take
one kernel family."""


class FlexBackend(AttentionBackend):
    """One compiled flex-attention call per block."""

    name = "flex"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float32, torch.float16, torch.bfloat16)
            and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
            and hasattr(importlib.import_module("torch.nn.attention.flex_attention"), "AuxRequest")
        )  # AuxRequest (the LSE): torch >= 2.9 (README "Supported versions")

    @classmethod
    def shape_problem(cls, shape: KernelShape) -> str | None:
        if shape.deterministic:
            return "compiled flex attention's backward is not deterministic (deterministic_mode)"
        return None

    def _attend(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None):
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _compiled_flex()(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            block_mask=_block_mask(segments, causal, window),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
            kernel_options=_KERNEL_OPTIONS,
        )
        return out.squeeze(0).transpose(0, 1), aux.lse.squeeze(0)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        out, lse = self._attend(q, k, v, segments=segments, causal=causal, scale=scale, window=window)
        return out, lse.float()

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        return grads_by_recompute(
            lambda q_, k_, v_: self._attend(q_, k_, v_, segments=segments, causal=causal, scale=scale, window=window),
            dout,
            q,
            k,
            v,
            out,
            lse,
        )
