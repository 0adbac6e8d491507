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


VECTOR_MIN_CANDIDATES = 64
"""From this many candidate packings on, `pack_for_pipelines` times them all in numpy passes over
pipelines (`pipeline.pipelines_finish`) instead of one Python pass each (`pipeline.pipeline_time`):
the same recurrence with the same float operations, so the same makespans to the bit."""

VECTOR_COLUMNS = 1024
"""Candidate packings timed per numpy pass (bounds its op-by-pipeline array's memory)."""


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
    return pack_for_pipelines([(sizes, times, leading)], capacity=capacity, overhead=overhead, pp_size=pp_size,
                              vpp_size=vpp_size)[0]


def pack_for_pipelines(
    ranks: Sequence[tuple[Sequence[int], Sequence[float], Sequence[float]]],
    *,
    capacity: int,
    overhead: float,
    pp_size: int,
    vpp_size: int = 1,
) -> list[list[list[int]]]:
    """`pack_for_pipeline` of many pipeline ranks, each given as (sizes, times, leading): the same bins,
    with every rank's candidate packings timed together (`VECTOR_MIN_CANDIDATES`)."""
    if pp_size == 1:  # most ranks of a large pool hold at most one whole sequence: its own bin, if any
        return [best_fit(sizes, capacity=capacity) if len(sizes) > 1 else [[0]] * len(sizes) for sizes, _, _ in ranks]
    # packing stays importable on its own
    from megatron_hdp.plan.timeline.interleaved import padded_counts

    padded: dict[int, int] = {}  # count -> the count Megatron runs (padded_counts, per count once)

    def pad(run: list[float]) -> list[float]:
        count = len(run)
        if count not in padded:
            padded[count] = padded_counts([count], pp_size=pp_size, vpp_size=vpp_size)[0]
        return run + [overhead] * (padded[count] - count)

    candidates: list[list[tuple[list[list[int]], list[float]]]] = []
    for sizes, times, leading in ranks:
        mine: list[tuple[list[list[int]], list[float]]] = []
        candidates.append(mine)
        if not sizes:
            continue
        budgets = [max(1, capacity // parts) for parts in PIPELINE_BUDGETS]
        if vpp_size > 1:
            natural = len(leading) + len(best_fit(sizes, capacity=capacity))
            room = padded_counts([natural], pp_size=pp_size, vpp_size=vpp_size)[0] - len(leading)  # real bins that fit
            budgets += [max(1, -(-sum(sizes) // (room + extra * pp_size))) for extra in range(2)]
        for budget in sorted(set(budgets), reverse=True):
            work = [(sum(map(times.__getitem__, b)), b) for b in best_fit(sizes, capacity=budget)]
            work.sort(key=lambda item: -item[0])  # stable: heaviest first, ties in packing order
            bins = [b for _, b in work]
            seconds = [overhead + w for w, _ in work]
            # each order's run: the pipeline's stage times, padded as the runtime runs them
            mine.append((bins, pad(list(leading) + seconds)))  # heaviest first
            mine.append((bins[::-1], pad(list(leading) + seconds[::-1])))  # lightest first
    makespans = iter(_makespans([run for mine in candidates for _, run in mine], pp_size=pp_size, vpp_size=vpp_size))
    out = []
    for (sizes, _, _), mine in zip(ranks, candidates):
        best: tuple[float, list[list[int]]] | None = None
        for order, _ in mine:
            time = next(makespans)
            if best is None or time < best[0] * (1 - 1e-12):
                best = (time, order)
        out.append(best[1] if best else best_fit(sizes, capacity=capacity))
    return out


def _makespans(runs: list[list[float]], *, pp_size: int, vpp_size: int) -> list[float]:
    """`pipeline.pipeline_time` of each run (stage times of one pipeline), in numpy passes over many."""
    from megatron_hdp.plan.timeline.pipeline import pipeline_time, pipelines_finish

    if len(runs) < VECTOR_MIN_CANDIDATES:
        return [pipeline_time(run, pp_size=pp_size, vpp_size=vpp_size) for run in runs]
    by_count = sorted(range(len(runs)), key=lambda i: len(runs[i]))  # a pass's length is its longest count
    out = [0.0] * len(runs)
    for at in range(0, len(runs), VECTOR_COLUMNS):
        chunk = by_count[at:at + VECTOR_COLUMNS]
        for i, end in zip(chunk, pipelines_finish([runs[i] for i in chunk], pp_size=pp_size,
                                                  vpp_size=vpp_size).tolist()):
            out[i] = end
    return out
