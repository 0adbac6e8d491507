"""Best-fit packing of whole sequences into micro-batches of at most C tokens.

Best-fit decreasing: items in decreasing size, each into the open bin whose free room is smallest but
sufficient, a new bin when none has room. It uses at most 11/9 OPT + 1 bins, so micro-batches come out
nearly full (fewer micro-batches means less per-micro-batch overhead and, with PP, smaller bubbles).
"""

from __future__ import annotations

import bisect
from typing import Sequence


def best_fit(sizes: Sequence[int], *, capacity: int, order: str = "decreasing") -> list[list[int]]:
    """Pack items of these `sizes` into bins of `capacity`; returns bins of item indices.

    An item larger than the capacity (a whole sequence that offloading lets one rank hold) gets a bin of
    its own.

    `order="decreasing"` is best-fit decreasing; `order="given"` keeps the input order (online best fit,
    what a streaming data loader would do). Bins are returned in creation order.
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if order not in ("decreasing", "given"):
        raise ValueError(f"order must be 'decreasing' or 'given', got {order!r}")
    items = range(len(sizes))
    if order == "decreasing":
        items = sorted(items, key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free room, bin index), sorted
    for item in items:
        size = sizes[item]
        if size >= capacity:
            bins.append([item])
            continue
        at = bisect.bisect_left(free, (size, -1))
        if at < len(free):
            room, index = free.pop(at)
        else:
            room, index = capacity, len(bins)
            bins.append([])
        bins[index].append(item)
        if room - size > 0:
            bisect.insort(free, (room - size, index))
    return bins
