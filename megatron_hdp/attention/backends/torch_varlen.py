"""PyTorch's CUDA varlen attention (`torch.nn.attention.varlen.varlen_attn`, FlashAttention-2 in aten).

Forward through the public `varlen_attn(..., return_aux=AuxRequest(lse=True))`. Its autograd backward
cannot take an external out/lse, so the backward calls the op that `varlen_attn` registers for its own
backward, `torch.ops.torch_attn._varlen_attn_backward` (same arguments as the forward plus out, lse and
the unused dropout RNG state). FlashAttention-2 takes V only at Q's and K's head dim (aten's
`mha_varlen_fwd` checks v's shape against q's head size, torch 2.11 and 2.13 alike), so multi-latent
attention's narrower V is zero-padded to Q's head dim here and the output and dV cut back (exact:
`base.pad_head_dim`; costs the padded columns' share of the P V product). Not run in this repository's
CI (no GPU there).
"""

from __future__ import annotations

import importlib.util
import inspect

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    KernelShape,
    Segments,
    narrow_head_dim,
    offset_window_problem,
    pad_head_dim,
    window_pair,
)


def _takes_enable_gqa() -> bool:
    """torch 2.13 added `enable_gqa` (and refuses Hq != Hkv without it); torch 2.11 (seen on an H100) has no such
    argument and pass differing head counts straight to the FlashAttention-2 kernel, which does GQA. Asked
    per call (microseconds against a kernel's milliseconds), so it follows the function actually bound."""
    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


class TorchVarlenBackend(AttentionBackend):
    """One `varlen_attn` call per block (all segments at once)."""

    name = "torch_varlen"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
            return False
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            return False
        from torch.nn.attention.varlen import varlen_attn

        if "window_size" not in inspect.signature(varlen_attn).parameters:
            return False  # torch < 2.10: is_causal only, no window (README "Supported versions")
        return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(device)[0] >= 8

    @classmethod
    def shape_problem(cls, shape: KernelShape) -> str | None:
        if shape.deterministic:
            return "varlen_attn's backward op takes no deterministic flag (deterministic_mode)"
        return offset_window_problem(shape)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        out, lse = varlen_attn(
            q,
            k,
            pad_head_dim(v, q.shape[2]),
            segments.cu_seqlens_q,
            segments.cu_seqlens_k,
            segments.max_q,
            segments.max_k,
            return_aux=AuxRequest(lse=True),
            scale=scale,
            window_size=window_pair(causal, window),
            **({"enable_gqa": q.shape[1] != k.shape[1]} if _takes_enable_gqa() else {}),
        )
        assert lse.shape == (q.shape[1], q.shape[0]), f"varlen_attn lse has shape {tuple(lse.shape)}"
        return narrow_head_dim(out, v.shape[2]), lse

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: the state is unused
        head_dim = q.shape[2]
        dq, dk, dv = torch.ops.torch_attn._varlen_attn_backward(
            pad_head_dim(dout, head_dim).contiguous(),
            q.contiguous(),
            k.contiguous(),
            pad_head_dim(v, head_dim).contiguous(),
            pad_head_dim(out, head_dim).contiguous(),
            lse.contiguous(),
            segments.cu_seqlens_q,
            segments.cu_seqlens_k,
            segments.max_q,
            segments.max_k,
            causal,
            rng_state,
            scale,
            list(window_pair(causal, window)),
        )
        return dq, dk, narrow_head_dim(dv, v.shape[2])
