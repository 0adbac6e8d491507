"""What activation offloading moved and how long compute waited for it: per micro-batch and per step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OffloadStats:
    """Transfers of one micro-batch, or the sum over the micro-batches of one step."""

    num_microbatches: int = 0
    """Micro-batches counted (offloading or not)."""
    num_tensors: int = 0
    """Copies moved to host memory: one per saved storage (views of one storage travel together)."""
    bytes_offloaded: int = 0
    """Bytes copied device -> host during forward."""
    bytes_prefetched: int = 0
    """Bytes copied host -> device for backward (equals bytes_offloaded once every backward ran)."""
    num_late_fetches: int = 0
    """Layer groups no backward hook prefetched, fetched only when the backward first read them (their
    layer's output gave no gradient hook, e.g. it did not require grad). 0 when prefetching works."""
    exposed_wait_s: float = 0.0
    """Seconds compute stood still waiting for a transfer. On CUDA: how long after the compute stream
    needed a layer's tensors their H2D copy finished (CUDA event timing). On CPU the copies are
    synchronous, so all their time is exposed."""

    def __add__(self, other: "OffloadStats") -> "OffloadStats":
        return OffloadStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    def summary(self) -> str:
        """One line for the step log."""
        return (
            f"offload: {self.num_microbatches} micro-batches, {self.num_tensors} tensors, "
            f"{self.bytes_offloaded / 2**20:.1f} MiB out, {self.bytes_prefetched / 2**20:.1f} MiB back, "
            f"{self.exposed_wait_s * 1e3:.2f} ms exposed"
        )


@dataclass
class StatsRecord:
    """The stats of one micro-batch and the CUDA event pairs whose exposed time is not yet known.

    Reading a CUDA event's time needs the event to have completed, so the wait is timed afterwards:
    `resolve()` (called once per step by the offloader) turns each (needed, arrived) pair into seconds.
    """

    stats: OffloadStats
    pending: list[tuple[Any, Any]] = field(default_factory=list)

    def add_wait(self, needed: Any, arrived: Any) -> None:
        """Compute recorded `needed` and then waited for the transfer that records `arrived`."""
        self.pending.append((needed, arrived))

    def resolve(self) -> OffloadStats:
        """Fold the pending waits into the stats (synchronizing on their events) and return them."""
        for needed, arrived in self.pending:
            arrived.synchronize()
            needed.synchronize()
            self.stats.exposed_wait_s += max(0.0, needed.elapsed_time(arrived)) / 1e3
        self.pending.clear()
        return self.stats
