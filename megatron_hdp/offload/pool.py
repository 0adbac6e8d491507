"""Host buffers for offloaded activations, pooled across micro-batches and steps.

Pinned (page-locked) host memory is what lets a D2H/H2D copy run asynchronously on its own stream, but
allocating it (cudaHostAlloc) costs milliseconds and synchronizes the device, so buffers are kept and
reused. Keys are byte-size buckets rather than exact (shape, dtype): HDP changes sequence lengths every
step, so exact-shape keys (as in Megatron's `OffloadTensorPool`) would almost never hit, while a bucket
of one eighth of a power of two wastes at most 12.5% and a bf16 buffer can later serve an fp32 tensor.

A buffer handed back while an H2D copy may still be reading it carries that copy's event; whoever takes
it next makes its own stream wait for the event before writing (`HostBuffer.ready`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

_MIN_BUCKET_BYTES = 4096


def bucket_bytes(nbytes: int) -> int:
    """Size of the pooled buffer that holds `nbytes`: the next multiple of 1/8 of nbytes' power of two."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if nbytes <= _MIN_BUCKET_BYTES:
        return _MIN_BUCKET_BYTES
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


@dataclass
class HostBuffer:
    """A flat uint8 host buffer and the event (None when already free) its last reader recorded."""

    data: torch.Tensor
    ready: Any = None


class HostBufferPool:
    """Free lists of host buffers by byte bucket; buffers live until `clear()`."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[HostBuffer]] = {}
        self.num_allocations = 0
        """Buffers ever allocated (a step that reuses the pool leaves this unchanged)."""
        self.bytes_allocated = 0
        """Bytes of all buffers the pool has allocated and still owns."""

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least `nbytes` bytes; the caller must honour `ready` before writing to it."""
        size = bucket_bytes(nbytes)
        free = self._free.get(size)
        if free:
            return free.pop()
        self.num_allocations += 1
        self.bytes_allocated += size
        return HostBuffer(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory))

    def release(self, buffer: HostBuffer, *, ready: Any = None) -> None:
        """Return `buffer`; `ready` is the event after which nothing reads it any more (None: now)."""
        buffer.ready = ready
        self._free.setdefault(buffer.data.numel(), []).append(buffer)

    @property
    def bytes_free(self) -> int:
        """Bytes of buffers waiting in the free lists."""
        return sum(size * len(buffers) for size, buffers in self._free.items())

    def clear(self) -> None:
        """Drop the free buffers; buffers lent out now join the emptied pool when released."""
        self.bytes_allocated -= self.bytes_free
        self._free.clear()
