"""Host buffers for offloaded activations, pooled across micro-batches and steps.

Pinned (page-locked) host memory is what lets a D2H/H2D copy run asynchronously on its own stream, but
allocating it (cudaHostAlloc) costs milliseconds and synchronizes the device, so buffers are kept and
reused. Keys are byte-size buckets rather than exact (shape, dtype): HDP changes sequence lengths every
step, so exact-shape keys (as in Megatron's `OffloadTensorPool`) would almost never hit.

What is pinned is what is counted. PyTorch pins through its caching host allocator, which rounds every
request up to the next power of two (`CachingHostAllocatorImpl::allocate` in
aten/src/ATen/core/CachingHostAllocator.h: `c10::llvm::PowerOf2Ceil(size)`; torch 2.13 skips it above
`pinned_max_round_threshold_mb` of PYTORCH_ALLOC_CONF, unlimited by default), so one buffer of
9/8 x 2^n bytes pins 2^(n+1). A buffer here is therefore a list of pieces, each a power of two (the allocator pins
exactly that) and none above `MAX_PIECE_BYTES`: the binary digits of the buffer's bucket, a multiple of
1/8 of the request's power of two and of a page. So the pinned bytes of a buffer are its bucket, at
most 12.5% (or one page) above the request, and `bytes_allocated` is what the allocator really pinned.
The planner's host-memory budget uses the same bound (`plan.cost.model.HOST_BUFFER_OVERHEAD`).

A piece handed back while an H2D copy may still be reading it carries that copy's event; whoever takes
it next makes its own stream wait for the event before writing (`HostBuffer.ready`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

PAGE_BYTES = 4096
"""Pinned memory is locked in pages: no piece is smaller."""
MAX_PIECE_BYTES = 1 << 26
"""Largest piece (64 MiB): a large span moves as several copies of this size."""


def bucket_bytes(nbytes: int) -> int:
    """Host bytes pinned for a span of `nbytes`: the next multiple of 1/8 of nbytes' power of two, and
    of a page."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    step = max(PAGE_BYTES, 1 << max(0, nbytes.bit_length() - 4))
    return max(PAGE_BYTES, -(-nbytes // step) * step)


def piece_sizes(nbytes: int) -> list[int]:
    """`bucket_bytes(nbytes)` as powers of two, largest first, none above `MAX_PIECE_BYTES` (at most
    four below it: a bucket has at most four binary digits)."""
    total = bucket_bytes(nbytes)
    rest = total % MAX_PIECE_BYTES
    return [MAX_PIECE_BYTES] * (total // MAX_PIECE_BYTES) + [
        1 << bit for bit in reversed(range(rest.bit_length())) if rest >> bit & 1
    ]


@dataclass
class HostBuffer:
    """Flat uint8 host pieces holding one span, and the event (None when already free) each piece's last
    reader recorded."""

    pieces: list[torch.Tensor]
    ready: list[Any]

    def views(self, nbytes: int) -> list[torch.Tensor]:
        """Consecutive views of the pieces that hold exactly `nbytes` bytes (the span's copies)."""
        views, left = [], nbytes
        for piece in self.pieces:
            if left == 0:
                break
            views.append(piece[: min(left, piece.numel())])
            left -= views[-1].numel()
        assert left == 0, f"a buffer of {sum(p.numel() for p in self.pieces)} bytes cannot hold {nbytes}"
        return views


class HostBufferPool:
    """Free lists of host pieces by size; pieces live until `clear()`."""

    def __init__(self, *, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.num_allocations = 0
        """Pieces ever allocated (a step that reuses the pool leaves this unchanged)."""
        self.bytes_allocated = 0
        """Bytes of all pieces the pool has allocated and still owns: what is pinned for it."""

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least `nbytes` bytes; the caller must honour `ready` before writing to it."""
        pieces, ready = [], []
        for size in piece_sizes(nbytes):
            free = self._free.get(size)
            if free:
                piece, event = free.pop()
            else:
                self.num_allocations += 1
                self.bytes_allocated += size
                piece, event = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory), None
            pieces.append(piece)
            ready.append(event)
        return HostBuffer(pieces, ready)

    def release(self, buffer: HostBuffer, *, ready: Any = None) -> None:
        """Return `buffer`; `ready` is the event after which nothing reads it any more (None: now)."""
        for piece in buffer.pieces:
            self._free.setdefault(piece.numel(), []).append((piece, ready))

    @property
    def bytes_free(self) -> int:
        """Bytes of pieces waiting in the free lists."""
        return sum(size * len(pieces) for size, pieces in self._free.items())

    def clear(self) -> None:
        """Drop the free pieces; pieces lent out now join the emptied pool when released."""
        self.bytes_allocated -= self.bytes_free
        self._free.clear()
