"""Byte counters of ring point-to-point traffic, for the step statistics and the benchmarks.

Every message posted by `megatron_hdp.comm.p2p.shift` is counted at post time: once in a process-wide
total (`total_traffic`, `reset_traffic`) and once in every `count_traffic()` block that is open, so a
caller measures one call, one micro-batch or one step by wrapping it:

    with count_traffic() as traffic:
        out = ring_attention(...)
        out.backward(grad)
    traffic.bytes_sent, traffic.bytes_received
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator


@dataclasses.dataclass
class Traffic:
    """Point-to-point traffic of this process."""

    bytes_sent: int = 0
    """Bytes of all tensors this process sent."""
    bytes_received: int = 0
    """Bytes of all tensors this process received."""
    num_messages_sent: int = 0
    """Number of sends (empty tensors are never sent and never counted)."""
    num_messages_received: int = 0
    """Number of receives."""

    def add(self, *, bytes_sent: int, bytes_received: int, num_sent: int, num_received: int) -> None:
        """Count one exchange."""
        self.bytes_sent += bytes_sent
        self.bytes_received += bytes_received
        self.num_messages_sent += num_sent
        self.num_messages_received += num_received


_TOTAL = Traffic()
_OPEN: list[Traffic] = []


def record(*, bytes_sent: int, bytes_received: int, num_sent: int, num_received: int) -> None:
    """Count one exchange in the total and in every open `count_traffic()` block."""
    for counter in (_TOTAL, *_OPEN):
        counter.add(
            bytes_sent=bytes_sent, bytes_received=bytes_received, num_sent=num_sent, num_received=num_received
        )


def total_traffic() -> Traffic:
    """A copy of the process-wide counters since start or the last `reset_traffic()`."""
    return dataclasses.replace(_TOTAL)


def reset_traffic() -> None:
    """Zero the process-wide counters."""
    _TOTAL.bytes_sent = _TOTAL.bytes_received = 0
    _TOTAL.num_messages_sent = _TOTAL.num_messages_received = 0


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the traffic of the enclosed code (nested blocks each count everything inside them).

    The backward of a ring call counts too when it runs inside the block.
    """
    counter = Traffic()
    _OPEN.append(counter)
    try:
        yield counter
    finally:
        _OPEN[:] = [c for c in _OPEN if c is not counter]  # by identity: equal counters are distinct blocks
