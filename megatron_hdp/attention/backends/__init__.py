"""Local attention kernels behind one interface, and the choice of one by name or automatically.

"auto" takes the first backend in `PREFERENCE` that supports the device and dtype. The order is the
expected speed on Hopper (H100/H200) GPUs for fp16/bf16: Transformer Engine's cuDNN fused attention
first (cuDNN 9's Hopper kernels use the sm90 instructions FlashAttention-2 does not, and are at least
as fast as FA2 there; with cuDNN >= 9.6 TE also buckets THD shapes so that variable document lengths
do not build a new cuDNN graph per micro-batch), then flash-attn's own varlen kernels
(FlashAttention-2), then the same FlashAttention-2 built into PyTorch, then compiled flex attention, the
only one of them for fp32; on CPU there is one. On Ampere FA2 may be the faster one.
`benchmarks/ring_bench.py` measures every available backend on a GPU (per-backend TFLOP/s table),
which is how to revisit the order. The TE backend is written against TE 2.x's low-level API and has not
yet run on a GPU in this repository's CI (see `te_fused`).
"""

from __future__ import annotations

import functools
import logging

import torch

from megatron_hdp.attention.backends.base import AttentionBackend, Segments, grads_by_recompute
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
def _resolve(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    if name == "auto":
        names = available_backends(device, dtype)
        if not names:
            raise ValueError(f"no attention backend supports device {device} with dtype {dtype}")
        logger.info("attention backend 'auto' on %s/%s: %s (available: %s)", device.type, dtype, names[0], names)
        return BACKENDS[names[0]]()
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto' or one of {sorted(BACKENDS)}")
    cls = BACKENDS[name]
    if not cls.supports(device, dtype):
        reason = getattr(cls, "unsupported_reason", None)  # a backend may say why (te_fused: TE version)
        why = f": {reason(device, dtype)}" if reason is not None else ""
        raise ValueError(f"attention backend {name!r} does not run on device {device} with dtype {dtype}{why}")
    return cls()


def get_backend(name: str, *, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The backend called `name` ("auto": the fastest available) for tensors on `device` of `dtype`.

    ValueError for an unknown name or a backend that does not run here. The "auto" choice is logged
    once per device type and dtype.
    """
    device = torch.device(device)
    return _resolve(name, torch.device(device.type), dtype)


__all__ = [
    "AttentionBackend",
    "BACKENDS",
    "PREFERENCE",
    "Segments",
    "available_backends",
    "get_backend",
    "grads_by_recompute",
]
