"""PyTorch flex attention on CUDA: the fallback for dtypes and GPUs the flash kernels do not cover (fp32).

Packed segments become one [1, H, T, D] call with a block mask from per-row segment ids (and the causal
order inside a segment), so fully masked tiles are skipped. The forward returns the lse through
`AuxRequest(lse=True)`; flex's backward cannot take an external out/lse, so the block gradients come
from `grads_by_recompute` (one extra forward). flex runs compiled (`torch.compile`); block masks are
cached per segment layout. Not run in this repository's CI (flex has no CPU backward, and no GPU here).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from megatron_hdp.attention.backends.base import AttentionBackend, Segments, grads_by_recompute


def _row_ids(seqlens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per packed row: its segment id and its position inside the segment."""
    lengths = torch.tensor(seqlens, device=device)
    segment = torch.repeat_interleave(torch.arange(len(seqlens), device=device), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    return segment, torch.arange(int(lengths.sum()), device=device) - starts[segment]


@functools.lru_cache(maxsize=64)
def _block_mask(segments: Segments, causal: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    seg_q, pos_q = _row_ids(segments.seqlens_q, segments.device)
    seg_k, pos_k = _row_ids(segments.seqlens_k, segments.device)

    def mask_mod(b, h, q_idx, kv_idx):
        same = seg_q[q_idx] == seg_k[kv_idx]
        return same & (pos_q[q_idx] >= pos_k[kv_idx]) if causal else same

    return create_block_mask(
        mask_mod, None, None, segments.cu_q[-1], segments.cu_k[-1], device=segments.device
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


class FlexBackend(AttentionBackend):
    """One compiled flex-attention call per block."""

    name = "flex"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float32, torch.float16, torch.bfloat16)
            and importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
        )

    def _attend(self, q, k, v, *, segments: Segments, causal: bool, scale: float):
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = _compiled_flex()(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            block_mask=_block_mask(segments, causal),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
        )
        return out.squeeze(0).transpose(0, 1), aux.lse.squeeze(0)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float):
        out, lse = self._attend(q, k, v, segments=segments, causal=causal, scale=scale)
        return out, lse.float()

    def backward(self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float):
        return grads_by_recompute(
            lambda q_, k_, v_: self._attend(q_, k_, v_, segments=segments, causal=causal, scale=scale),
            dout,
            q,
            k,
            v,
            out,
            lse,
        )
