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
    if order == "decreasing":  # a stable sort: equal sizes keep their input order, reverse=True included
        items = sorted(items, key=sizes.__getitem__, reverse=True)
    bins: list[list[int]] = []
    # Each open bin as one int, free room * scale + bin index: sorted by room, then by index, and cheaper
    # to bisect than (room, index) tuples (a 32M-token plan packs ~35K items).
    scale = len(sizes) + 1
    free: list[int] = []
    for item in items:
        size = sizes[item]
        if size >= capacity:
            bins.append([item])
            continue
        at = bisect.bisect_left(free, size * scale)  # the bin of least room >= size, lowest index first
        if at == len(free):
            if capacity > size:
                bisect.insort(free, (capacity - size) * scale + len(bins))
            bins.append([item])
            continue
        key = free[at] - size * scale
        bins[key % scale].append(item)
        if key < scale:  # the bin is full
            del free[at]
        elif at and free[at - 1] > key:  # it now has less room than a bin before it
            del free[at]
            bisect.insort(free, key)
        else:
            free[at] = key
    return bins


PIPELINE_BUDGETS = (1, 2, 3, 4, 6, 8, 12, 16)
"""With PP, the token budgets tried for whole-sequence micro-batches: C divided by these."""


def pack_for_pipeline(
    sizes: Sequence[int],
    times: Sequence[float],
    *,
    capacity: int,
    leading: Sequence[float],
    overhead: float,
    pp_size: int,
) -> list[list[int]]:
    """Bins of whole sequences for one pipeline rank: the packing whose 1F1B makespan is smallest.

    ByteScale's PP-Balance: a pipeline's bubble is set by its heaviest micro-batches, so its micro-batches
    should be small and alike. Best-fit decreasing is tried with token budgets C / n for n in
    PIPELINE_BUDGETS (more, smaller micro-batches shrink the fill/drain at `overhead` seconds each); the
    micro-batches run after the rank's `leading` ones (its ring micro-batches, times given). `times` are
    the sequences' stage times. With pp_size = 1 it is plain best-fit decreasing at C.
    """
    if pp_size == 1 or not sizes:
        return best_fit(sizes, capacity=capacity)
    from megatron_hdp.plan.pipeline import pipeline_time  # packing stays importable on its own

    best: tuple[float, list[list[int]]] | None = None
    tried = set()
    for parts in PIPELINE_BUDGETS:
        budget = max(1, capacity // parts)
        if budget in tried:
            continue
        tried.add(budget)
        bins = best_fit(sizes, capacity=budget)
        bin_times = [overhead + sum(times[i] for i in b) for b in bins]
        bin_times.sort(reverse=True)  # heaviest first: the light ones fill the drain
        makespan = pipeline_time(list(leading) + bin_times, pp_size=pp_size)
        if best is None or makespan < best[0] * (1 - 1e-12):
            best = (makespan, sorted(bins, key=lambda b: -sum(times[i] for i in b)))
    return best[1]
