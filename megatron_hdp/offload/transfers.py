"""Copies of saved activations between the compute device and host buffers.

On CUDA, D2H copies run on a dedicated stream that first waits for the compute that produced the tensors,
and H2D copies on a second stream; each batch of copies records an event, and compute waits on the H2D
event before it reads a prefetched tensor, so compute never reads a tensor still in flight. The caching
allocator is told about the cross-stream uses (`record_stream`): a tensor being copied out is not reused
before the D2H copy ends, and a prefetched tensor is not reused before compute has consumed it.

On CPU the same calls are plain synchronous copies into (and out of) distinct host buffers, so the
numerics and bookkeeping of offloading are exercised in CI without a GPU.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class Transfers:
    """D2H/H2D copies for one device: streams and events on CUDA, synchronous copies on CPU."""

    def __init__(self, device: torch.device) -> None:
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"activation offloading supports cuda and cpu devices, got {device}")
        self.device = device
        self.is_async = device.type == "cuda"
        if self.is_async:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)
        self.sync_seconds = 0.0
        """Seconds spent in synchronous (CPU) copies: exposed by definition."""

    def to_host(self, copies: list[tuple[torch.Tensor, torch.Tensor, Any]]) -> Any:
        """Copy each (device tensor, host view, host view's ready event) pair; return the D2H event.

        The host view must have the device tensor's size and stride. Returns None on CPU.
        """
        if not self.is_async:
            start = time.perf_counter()
            for tensor, host, _ in copies:
                host.copy_(tensor)
            self.sync_seconds += time.perf_counter() - start
            return None
        self._d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h):
            for tensor, host, ready in copies:
                if ready is not None:
                    self._d2h.wait_event(ready)
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._d2h)
            return self._d2h.record_event()

    def to_device(self, hosts: list[list[torch.Tensor]], *, after: Any) -> tuple[list[torch.Tensor], Any]:
        """Copy each list of flat uint8 host pieces back into one new device tensor (the pieces one after
        the other).

        `after` is the D2H event that filled the host pieces (None on CPU). Returns the new tensors and
        the H2D event (timed, so that the wait for it can be measured); None on CPU.
        """
        if not self.is_async:
            start = time.perf_counter()
            tensors = [self._gather(pieces, non_blocking=False) for pieces in hosts]
            self.sync_seconds += time.perf_counter() - start
            return tensors, None
        with torch.cuda.stream(self._h2d):
            if after is not None:
                self._h2d.wait_event(after)
            tensors = [self._gather(pieces, non_blocking=True) for pieces in hosts]
            arrived = torch.cuda.Event(enable_timing=True)
            arrived.record(self._h2d)
        return tensors, arrived

    def wait(self, arrived: Any, tensors: list[torch.Tensor]) -> Any:
        """Make compute wait for the H2D event `arrived` before it reads `tensors`.

        Returns a timed event recorded on the compute stream just before the wait when the transfer was
        still running (so the stall can be measured later), else None.
        """
        if arrived is None:
            return None
        compute = torch.cuda.current_stream(self.device)
        needed = None
        if not arrived.query():
            needed = torch.cuda.Event(enable_timing=True)
            needed.record(compute)
        compute.wait_event(arrived)
        for tensor in tensors:
            tensor.record_stream(compute)
        return needed

    def _gather(self, pieces: list[torch.Tensor], *, non_blocking: bool) -> torch.Tensor:
        tensor = torch.empty(sum(p.numel() for p in pieces), dtype=torch.uint8, device=self.device)
        offset = 0
        for piece in pieces:
            tensor[offset : offset + piece.numel()].copy_(piece, non_blocking=non_blocking)
            offset += piece.numel()
        return tensor
