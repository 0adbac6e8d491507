"""The flash-attn package's varlen kernels (FlashAttention-2, `pip install flash-attn`), when installed.

`flash_attn_varlen_func` does not take an external out/lse in its backward, so this backend calls the
two functions it is built on, `_flash_attn_varlen_forward` and `_flash_attn_varlen_backward` of
`flash_attn.flash_attn_interface` (as ring-flash-attention does), by keyword. lse comes back as
[Hq, Tq] float32. Not run in this repository's CI; `tests/attention/test_attention_backends_flash.py` calls it
through stand-ins with the exact parameter lists of flash-attn v2.6.3, v2.7.x and v2.8.3.

Versions (read from Dao-AILab/flash-attention's `flash_attn/flash_attn_interface.py` at those tags):
2.6.x takes `window_size` as one (left, right) tuple, requires `block_table` in the forward, and the
forward returns eight values (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state); from 2.7 the
window is `window_size_left` / `window_size_right` and the forward returns four (out, softmax_lse,
S_dmask, rng_state). Older releases lack `softcap` (2.6 added it) and are refused. The `flash-attn-4`
package installs only `flash_attn.cute` (a namespace package `flash_attn` without the FA2 interface),
so the check is the `flash-attn` distribution's version plus a real `flash_attn` package, not
`find_spec("flash_attn")` alone. FlashAttention-2 needs compute capability 8.0 or newer.

Head dims: FlashAttention-2 takes V only at Q's and K's head dim (`mha_varlen_fwd` checks v's shape
against q's head size in every 2.x), so multi-latent attention's narrower V is zero-padded to Q's head
dim here and the output and dV cut back (exact: `base.pad_head_dim`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.util
import logging
import re
from typing import Callable

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    KernelShape,
    Segments,
    half_precision_cuda_problem,
    narrow_head_dim,
    offset_window_problem,
    pad_head_dim,
    window_pair,
)

logger = logging.getLogger(__name__)

MIN_VERSION = (2, 6)
"""The oldest flash-attn whose varlen forward/backward this file calls (2.6 added `softcap`)."""


def installed_flash_attn_version() -> str | None:
    """The installed `flash-attn` (FlashAttention-2) distribution's version, without importing it."""
    try:
        return importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return None


def _version_tuple(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


@functools.cache
def flash_attn_problem() -> str | None:
    """Why the installed flash-attn cannot be used by this backend (None: it can). Warns once when a
    flash_attn module is present but unusable."""
    version = installed_flash_attn_version()
    spec = importlib.util.find_spec("flash_attn")
    if version is None:
        if spec is None:
            return "flash-attn is not installed (pip install flash-attn)"
        problem = (
            "a flash_attn module is importable but the flash-attn (FlashAttention-2) distribution is not "
            "installed (flash-attn-4 provides only flash_attn.cute, without the varlen interface)"
        )
    elif spec is None or spec.origin is None:
        problem = f"flash-attn {version} is recorded as installed but flash_attn is not a regular package here"
    elif not MIN_VERSION <= _version_tuple(version) < (MIN_VERSION[0] + 1, 0):
        problem = f"flash-attn {version} is installed, but the flash_attn backend supports 2.6 - 2.x only"
    else:
        return None
    logger.warning("%s; other attention backends will be used", problem)
    return problem


@dataclasses.dataclass(frozen=True)
class _FlashApi:
    """flash-attn's varlen forward/backward and how their window argument and forward results look."""

    fwd: Callable
    bwd: Callable
    window_tuple: bool
    """2.6.x: `window_size=(left, right)` and an eight-value forward; 2.7+: left/right, four values."""

    def window_kwargs(self, window: BlockWindow | None) -> dict:
        """The sliding window: none (the causal flag alone makes the mask) or an aligned (left, 0)."""
        left, right = (-1, -1) if window is None else window_pair(True, window)
        if self.window_tuple:
            return {"window_size": (left, right)}
        return {"window_size_left": left, "window_size_right": right}

    def out_and_lse(self, results: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return (results[0], results[5]) if self.window_tuple else (results[0], results[1])


@functools.cache
def _flash_api() -> _FlashApi:
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward, _flash_attn_varlen_forward

    window_tuple = _version_tuple(installed_flash_attn_version()) < (2, 7)
    return _FlashApi(_flash_attn_varlen_forward, _flash_attn_varlen_backward, window_tuple)


class FlashAttnVarlenBackend(AttentionBackend):
    """One flash-attn varlen call per block."""

    name = "flash_attn"

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on `device` with `dtype` (None: it can)."""
        return half_precision_cuda_problem(device, dtype, flash_attn_problem, "FlashAttention-2")

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return cls.unsupported_reason(device, dtype) is None

    @classmethod
    def shape_problem(cls, shape: KernelShape) -> str | None:
        return offset_window_problem(shape)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        api = _flash_api()
        results = api.fwd(
            q=q,
            k=k,
            v=pad_head_dim(v, q.shape[2]),
            cu_seqlens_q=segments.cu_seqlens_q,
            cu_seqlens_k=segments.cu_seqlens_k,
            max_seqlen_q=segments.max_q,
            max_seqlen_k=segments.max_k,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
            softcap=0.0,
            alibi_slopes=None,
            return_softmax=False,
            block_table=None,
            **api.window_kwargs(window),
        )
        out, lse = api.out_and_lse(results)
        return narrow_head_dim(out, v.shape[2]), lse

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        api = _flash_api()
        value_dim = v.shape[2]
        dout, v, out = (pad_head_dim(x, q.shape[2]) for x in (dout, v, out))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        api.bwd(
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
            softcap=0.0,
            alibi_slopes=None,
            deterministic=self.deterministic,
            **api.window_kwargs(window),
        )
        return dq, dk, narrow_head_dim(dv, value_dim)
