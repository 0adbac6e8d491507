"""Local attention kernels behind one interface, and the choice of one by name or automatically.

"auto" takes the first backend in `PREFERENCE` that supports the device and dtype and has a kernel for
the call's shape (heads, head dim, segment-length bucket: TE asks cuDNN's rules, see `te_fused`), chosen
once per shape and cached (`ShapeDispatch`), so a GPU or shape TE cannot serve falls through to
flash-attn or PyTorch instead of failing inside the first attention call. The order is the
expected speed on Hopper (H100/H200) GPUs for fp16/bf16: Transformer Engine's cuDNN fused attention
first (cuDNN 9's Hopper kernels use the sm90 instructions FlashAttention-2 does not, and are at least
as fast as FA2 there; with cuDNN >= 9.6 TE also buckets THD shapes so that variable document lengths
do not build a new cuDNN graph per micro-batch), then flash-attn's own varlen kernels
(FlashAttention-2), then the same FlashAttention-2 built into PyTorch, then compiled flex attention, the
only one of them for fp32; on CPU there is one. On Ampere FA2 may be the faster one.
V's head dim may differ from Q's and K's (multi-latent attention): te_fused (where TE's selector has a
kernel for the pair of head dims) and flex take it natively, flash_attn, torch_varlen and cpu_flash run
it on V zero-padded to Q's head dim (exact, `base.pad_head_dim`).
`benchmarks/ring_bench.py` measures every available backend on a GPU (per-backend TFLOP/s table),
which is how to revisit the order. The TE backend is written against TE 2.x's low-level API and has not
yet run on a GPU in this repository's CI (see `te_fused`).
"""

from __future__ import annotations

import functools
import logging

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    KernelShape,
    Segments,
    grads_by_recompute,
)
from megatron_hdp.attention.backends.cpu_flash import CpuFlashBackend
from megatron_hdp.attention.backends.flash_attn_varlen import FlashAttnVarlenBackend
from megatron_hdp.attention.backends.flex import FlexBackend
from megatron_hdp.attention.backends.te_fused import TeFusedBackend
from megatron_hdp.attention.backends.torch_varlen import TorchVarlenBackend

logger = logging.getLogger(__name__)

PREFERENCE: tuple[type[AttentionBackend], ...] = (
    TeFusedBackend,
    FlashAttnVarlenBackend,
    TorchVarlenBackend,
    FlexBackend,
    CpuFlashBackend,
)
BACKENDS: dict[str, type[AttentionBackend]] = {cls.name: cls for cls in PREFERENCE}


def available_backends(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """Names of the backends that run here for this device and dtype, fastest expected first."""
    device = torch.device(device)
    return [cls.name for cls in PREFERENCE if cls.supports(device, dtype)]


@functools.cache
def _resolve(name: str, device: torch.device, dtype: torch.dtype, deterministic: bool) -> ShapeDispatch:
    if name == "auto":
        names = available_backends(device, dtype)
        if not names:
            raise ValueError(f"no attention backend supports device {device} with dtype {dtype}")
        return ShapeDispatch(name, tuple(BACKENDS[n] for n in names), deterministic=deterministic)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}")
    cls = BACKENDS[name]
    if not cls.supports(device, dtype):
        reason = getattr(cls, "unsupported_reason", None)  # a backend may say why (te_fused: TE version)
        why = f": {reason(device, dtype)}" if reason is not None else ""
        raise ValueError(f"attention backend {name!r} does not run on device {device} with dtype {dtype}{why}")
    return ShapeDispatch(name, (cls,), deterministic=deterministic)


@functools.cache
def _kernel_for(name: str, candidates: tuple[type[AttentionBackend], ...], shape: KernelShape) -> AttentionBackend:
    """The first candidate with a kernel for `shape`: asked once per shape signature, then cached."""
    problems = []
    for cls in candidates:
        problem = cls.shape_problem(shape)
        if problem is None:
            if name == "auto":
                logger.info("attention backend 'auto' for %s: %s (candidates: %s)", shape, cls.name, problems or "-")
            return cls(deterministic=shape.deterministic)
        problems.append(f"{cls.name}: {problem}")
    raise ValueError(f"attention backend {name!r} has no kernel for {shape}: {'; '.join(problems)}")


class ShapeDispatch(AttentionBackend):
    """What `get_backend` returns: the named backend, or for "auto" the candidates fastest first, resolved
    per call shape (TE's fused kernels exist for some head counts, head dims and GPUs only). The choice is
    made once per `KernelShape` and cached; a call costs one dictionary look-up."""

    def __init__(self, name: str, candidates: tuple[type[AttentionBackend], ...], *, deterministic: bool) -> None:
        super().__init__(deterministic=deterministic)
        self.name = name
        self.candidates = candidates

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return bool(available_backends(device, dtype))

    def kernel_for(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        segments: Segments,
        window: BlockWindow | None = None,
        *,
        v: torch.Tensor | None = None,
    ) -> AttentionBackend:
        """The backend that runs calls of this shape (`v`: the call's V, when its head dim may differ from
        K's). ValueError when none of the candidates has a kernel."""
        shape = KernelShape.of(q, k, segments, v=v, deterministic=self.deterministic, window=window)
        return _kernel_for(self.name, self.candidates, shape)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        kernel = self.kernel_for(q, k, segments, window, v=v)
        return kernel.forward(q, k, v, segments=segments, causal=causal, scale=scale, window=window)

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        kernel = self.kernel_for(q, k, segments, window, v=v)
        return kernel.backward(dout, q, k, v, out, lse, segments=segments, causal=causal, scale=scale, window=window)


def get_backend(
    name: str, *, device: torch.device | str, dtype: torch.dtype, deterministic: bool = False
) -> ShapeDispatch:
    """The backend called `name` ("auto": the fastest available) for tensors on `device` of `dtype`.

    ValueError for an unknown name or a backend that does not run here. Which kernel runs a call is
    decided per call shape (`KernelShape`: heads, head dim, length bucket, determinism), once, and for
    "auto" logged once per shape; a named backend with no kernel for a shape raises ValueError at that
    call. `deterministic` (Megatron's `deterministic_mode`) asks for a deterministic backward: flash-attn
    and TE get their `deterministic=True`, the CPU kernel is deterministic, and the PyTorch CUDA kernels
    (torch_varlen, flex) have no kernel for such calls.
    """
    device = torch.device(device)
    return _resolve(name, torch.device(device.type), dtype, bool(deterministic))


__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "BlockWindow",
    "KernelShape",
    "PREFERENCE",
    "Segments",
    "ShapeDispatch",
    "available_backends",
    "get_backend",
    "grads_by_recompute",
]
