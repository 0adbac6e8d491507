"""Local attention kernels behind one interface, and the choice of one by name or automatically.

"auto" takes the first backend in `PREFERENCE` that supports the device and dtype. The order is the
expected speed on current NVIDIA GPUs (flash-attn's own varlen kernels, then the same FlashAttention-2
built into PyTorch, then compiled flex attention, the only one of them for fp32); on CPU there is one.
`benchmarks/ring_bench.py` measures every available backend on a GPU, which is how to revisit the order.
Transformer Engine's fused attention is not wrapped: its low-level API (fused_attn_fwd/bwd, backend
selection, and a softmax-stats layout that depends on the cuDNN version) changes between releases and
cannot be checked without a GPU; the interface makes it one more file when it can be.
"""

from __future__ import annotations

import functools
import logging

import torch

from megatron_hdp.attention.backends.base import AttentionBackend, Segments, grads_by_recompute
from megatron_hdp.attention.backends.cpu_flash import CpuFlashBackend
from megatron_hdp.attention.backends.flash_attn_varlen import FlashAttnVarlenBackend
from megatron_hdp.attention.backends.flex import FlexBackend
from megatron_hdp.attention.backends.torch_varlen import TorchVarlenBackend

logger = logging.getLogger(__name__)

PREFERENCE: tuple[type[AttentionBackend], ...] = (
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
        raise ValueError(f"attention backend {name!r} does not run on device {device} with dtype {dtype}")
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
