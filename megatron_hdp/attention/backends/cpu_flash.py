"""PyTorch's CPU flash attention (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward).

The op works on [B, H, S, D] and returns the log-sum-exp, handles GQA natively and accepts strided
inputs, so a THD segment is passed as a free view (rows -> [1, H, S, D]). Varlen is a loop over segments:
one call per document, no mask and no padding, so no work is spent on masked-out blocks. The op cannot
take an empty sequence (it crashes), which the segment contract already excludes. A sliding window
(`BlockWindow`, any offsets) is the op's boolean `attn_mask` per segment. The op refuses a V head dim
other than Q's and K's ("Q/K/V should have the same head size"), so multi-latent attention's narrower V
is zero-padded to Q's head dim here and the output and dV cut back (exact: `base.pad_head_dim`).
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    Segments,
    narrow_head_dim,
    pad_head_dim,
)

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] rows as a [1, H, S, D] view."""
    return x.transpose(0, 1).unsqueeze(0)


def _thd(x: torch.Tensor) -> torch.Tensor:
    """[1, H, S, D] back to [S, H, D]."""
    return x.squeeze(0).transpose(0, 1)


def _cat(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _bounds(segments: Segments):
    """(q0, q1, k0, k1) row bounds of each segment."""
    return zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:])


def _mask(
    segment: int, num_q: int, num_k: int, causal: bool, window: BlockWindow | None, x: torch.Tensor
) -> tuple[bool, torch.Tensor | None]:
    """(is_causal, attn_mask) of one segment's op call: the causal flag alone, or the window's mask as
    the additive 0 / -inf mask in `x`'s dtype (the op takes no boolean mask)."""
    if window is None:
        return causal, None
    assert causal, "a sliding window is a causal mask"
    visible = window.mask(segment, num_q, num_k, x.device)
    return False, torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, -torch.inf)


class CpuFlashBackend(AttentionBackend):
    """One CPU flash call per segment."""

    name = "cpu_flash"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in _DTYPES

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        value_dim, v = v.shape[2], pad_head_dim(v, q.shape[2])
        outs, lses = [], []
        for s, (q0, q1, k0, k1) in enumerate(_bounds(segments)):
            causal_s, mask = _mask(s, q1 - q0, k1 - k0, causal, window, q)
            out, lse = _FORWARD(
                _bhsd(q[q0:q1]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), 0.0, causal_s, attn_mask=mask, scale=scale
            )
            outs.append(_thd(out))
            lses.append(lse.squeeze(0))
        return narrow_head_dim(_cat(outs, 0), value_dim), _cat(lses, 1)

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        value_dim = v.shape[2]
        dout, v, out = (pad_head_dim(x, q.shape[2]) for x in (dout, v, out))
        dqs, dks, dvs = [], [], []
        for s, (q0, q1, k0, k1) in enumerate(_bounds(segments)):
            causal_s, mask = _mask(s, q1 - q0, k1 - k0, causal, window, q)
            dq, dk, dv = _BACKWARD(
                _bhsd(dout[q0:q1]),
                _bhsd(q[q0:q1]),
                _bhsd(k[k0:k1]),
                _bhsd(v[k0:k1]),
                _bhsd(out[q0:q1]),
                lse[:, q0:q1].unsqueeze(0),
                0.0,
                causal_s,
                attn_mask=mask,
                scale=scale,
            )
            dqs.append(_thd(dq))
            dks.append(_thd(dk))
            dvs.append(_thd(dv))
        return _cat(dqs, 0), _cat(dks, 0), narrow_head_dim(_cat(dvs, 0), value_dim)
