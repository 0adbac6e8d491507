"""The small integer tables a micro-batch's layers need on the device, moved there in one asynchronous copy.

cu_seqlens of the local kernel call, cu_seqlens and row indices of each ring step, per-document lengths:
each is a few hundred integers known on the host when the micro-batch is collated. Made one at a time
with `torch.tensor(values, device="cuda")` each is a synchronous copy from pageable memory, which drains
the GPU's queue before the next micro-batch can be enqueued. Gathered here they become one host tensor,
pinned, copied once with `non_blocking=True`; every consumer gets a view of the device copy.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class HostTables:
    """Collects integer tables (`add`), then moves them all to the device in one copy (`transfer`)."""

    def __init__(self) -> None:
        self._values: list[int] = []
        self._sinks: list[tuple[int, int, torch.dtype, Callable[[torch.Tensor], None]]] = []

    def add(self, values: Sequence[int], sink: Callable[[torch.Tensor], None], *, dtype: torch.dtype) -> None:
        """Schedule `values`: after `transfer`, `sink` receives them as a 1-D `dtype` tensor on the device."""
        self._sinks.append((len(self._values), len(values), dtype, sink))
        self._values.extend(int(v) for v in values)

    def transfer(self, device: torch.device) -> None:
        """One host-to-device copy of every table added (pinned and asynchronous on CUDA), then the sinks."""
        if not self._sinks:
            return
        host = torch.tensor(self._values, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        moved = host.to(device, non_blocking=True)
        for start, length, dtype, sink in self._sinks:
            sink(moved[start : start + length].to(dtype))  # a device-side cast: no copy from the host
        self._values, self._sinks = [], []
