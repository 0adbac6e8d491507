"""The flash-attn package's varlen kernels (FlashAttention-2, `pip install flash-attn`), when installed.

`flash_attn_varlen_func` does not take an external out/lse in its backward, so this backend calls the
two functions it is built on, `_flash_attn_varlen_forward` and `_flash_attn_varlen_backward` (as
ring-flash-attention does), by keyword, with the signatures of flash-attn >= 2.6 (separate
window_size_left/right, softcap). lse comes back as [Hq, Tq] float32. Not run in this repository's CI.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_hdp.attention.backends.base import AttentionBackend, Segments


class FlashAttnVarlenBackend(AttentionBackend):
    """One flash-attn varlen call per block."""

    name = "flash_attn"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return (
            device.type == "cuda"
            and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None
        )

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_forward

        out, lse, _, _ = _flash_attn_varlen_forward(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=segments.cu_seqlens_q,
            cu_seqlens_k=segments.cu_seqlens_k,
            max_seqlen_q=segments.max_q,
            max_seqlen_k=segments.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
        )
        return out, lse

    def backward(self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float):
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_varlen_backward(
            dout=dout,
            q=q,
            k=k,
            v=v,
            out=out,
            softmax_lse=lse.contiguous(),
            dq=dq,
            dk=dk,
            dv=dv,
            cu_seqlens_q=segments.cu_seqlens_q,
            cu_seqlens_k=segments.cu_seqlens_k,
            max_seqlen_q=segments.max_q,
            max_seqlen_k=segments.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            window_size_left=-1,
            window_size_right=-1,
            softcap=0.0,
            alibi_slopes=None,
            deterministic=False,
        )
        return dq, dk, dv
