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
    vpp_size: int = 1,
) -> list[list[int]]:
    """Bins of whole sequences for one pipeline rank, in the order to run them: the packing and order
    whose makespan in Megatron's pipeline order (`pipeline.pipeline_time`, `vpp_size` chunks per stage)
    is smallest.

    ByteScale's PP-Balance: a pipeline's bubble is set by its heaviest micro-batches, so its micro-batches
    should be small and alike. Best-fit decreasing is tried with token budgets C / n for n in
    PIPELINE_BUDGETS (more, smaller micro-batches shrink the fill/drain at `overhead` seconds each; C is
    an upper bound, not a target), and with virtual stages also the budget that fills the count the
    interleaved schedule pads to anyway (`interleaved.padded_counts`: a multiple of pp_size) with real
    micro-batches instead of empty ones. Each packing is tried heaviest first (the light ones fill the
    drain) and lightest first (the heavy ones run in the steady state, the light ones fill the warm-up).
    The micro-batches run after the rank's `leading` ones (its ring micro-batches, times given), and the
    runtime's padding micro-batches (at `overhead`) after them. `times` are the sequences' stage times.
    With pp_size = 1 it is plain best-fit decreasing at C.
    """
    if pp_size == 1 or not sizes:
        return best_fit(sizes, capacity=capacity)
    # packing stays importable on its own
    from megatron_hdp.plan.timeline.interleaved import padded_counts
    from megatron_hdp.plan.timeline.pipeline import pipeline_time

    def makespan(bin_times: list[float]) -> float:
        count = len(leading) + len(bin_times)
        padding = padded_counts([count], pp_size=pp_size, vpp_size=vpp_size)[0] - count
        return pipeline_time(list(leading) + bin_times + [overhead] * padding, pp_size=pp_size, vpp_size=vpp_size)

    budgets = [max(1, capacity // parts) for parts in PIPELINE_BUDGETS]
    if vpp_size > 1:
        natural = len(leading) + len(best_fit(sizes, capacity=capacity))
        room = padded_counts([natural], pp_size=pp_size, vpp_size=vpp_size)[0] - len(leading)  # real bins that fit
        budgets += [max(1, -(-sum(sizes) // (room + extra * pp_size))) for extra in range(2)]
    best: tuple[float, list[list[int]]] | None = None
    for budget in sorted(set(budgets), reverse=True):
        bins = sorted(best_fit(sizes, capacity=budget), key=lambda b: -sum(times[i] for i in b))
        for order in (bins, bins[::-1]):  # heaviest first, lightest first
            time = makespan([overhead + sum(times[i] for i in b) for b in order])
            if best is None or time < best[0] * (1 - 1e-12):
                best = (time, order)
    return best[1]
