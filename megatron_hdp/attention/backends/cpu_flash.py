"""PyTorch's CPU flash attention (`aten::_scaled_dot_product_flash_attention_for_cpu` and its backward).

The op works on [B, H, S, D] and returns the log-sum-exp, handles GQA natively and accepts strided
inputs, so a THD segment is passed as a free view (rows -> [1, H, S, D]). Varlen is a loop over segments:
one call per document, no mask and no padding, so no work is spent on masked-out blocks. The op cannot
take an empty sequence (it crashes), which the segment contract already excludes.
"""

from __future__ import annotations

import torch

from megatron_hdp.attention.backends.base import AttentionBackend, Segments

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


class CpuFlashBackend(AttentionBackend):
    """One CPU flash call per segment."""

    name = "cpu_flash"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type == "cpu" and dtype in _DTYPES

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float):
        outs, lses = [], []
        for q0, q1, k0, k1 in zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:]):
            out, lse = _FORWARD(_bhsd(q[q0:q1]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), 0.0, causal, scale=scale)
            outs.append(_thd(out))
            lses.append(lse.squeeze(0))
        return _cat(outs, 0), _cat(lses, 1)

    def backward(self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float):
        dqs, dks, dvs = [], [], []
        for q0, q1, k0, k1 in zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:]):
            dq, dk, dv = _BACKWARD(
                _bhsd(dout[q0:q1]),
                _bhsd(q[q0:q1]),
                _bhsd(k[k0:k1]),
                _bhsd(v[k0:k1]),
                _bhsd(out[q0:q1]),
                lse[:, q0:q1].unsqueeze(0),
                0.0,
                causal,
                scale=scale,
            )
            dqs.append(_thd(dq))
            dks.append(_thd(dk))
            dvs.append(_thd(dv))
        return _cat(dqs, 0), _cat(dks, 0), _cat(dvs, 0)
