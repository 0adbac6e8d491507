"""Placing rings and whole sequences on ranks: the greedy steps shared by `balance` and `naive`.

Rings go first in every rank's schedule. `validate()` requires the members of a ring to hold it at the
same micro-batch index, and the ring can only start when its slowest member is ready, so members are
chosen among ranks with the same number m of ring micro-batches so far, preferring a *class* of ranks
whose ring micro-batches so far end at the same time F (then no member waits). Rings are taken in
non-increasing ring size: the ranks that just received a ring of size k form a group of >= k ranks with
equal m, so the next ring (size <= k) always finds an aligned group — the greedy never gets stuck.

Whole sequences are then added after the rings by LPT (heaviest first onto the least-loaded rank).
Weights are seconds for `balance` and tokens for `naive`; the code does not care.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass
class RingLayout:
    """Per-rank state after placing rings: ring micro-batches, finish time (waits included), busy time."""

    num_ranks: int
    finish: np.ndarray = field(init=False)
    busy: np.ndarray = field(init=False)
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    ring_microbatches: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.finish = np.zeros(self.num_ranks)
        self.busy = np.zeros(self.num_ranks)
        self.ring_microbatches = [[] for _ in range(self.num_ranks)]


def place_rings(
    order: Sequence[int], *, ring_sizes: Sequence[int], weights: Sequence[float], num_ranks: int
) -> RingLayout:
    """Place each sequence of `order` (non-increasing ring size) on ring_sizes[seq] aligned ranks.

    Among the groups of ranks with equal ring count m that have enough ranks, the ring goes where it can
    start earliest: on the k ranks of smallest finish time F in that group (classes of equal F first).
    """
    layout = RingLayout(num_ranks)
    classes: dict[int, list[int]] = {0: list(range(num_ranks))}
    groups: dict[int, list[tuple[float, int]]] = {0: [(0.0, 0)]}  # m -> sorted (F, class id)
    sizes: dict[int, int] = {0: num_ranks}
    next_id = 1
    previous = num_ranks
    for seq in order:
        k, weight = int(ring_sizes[seq]), float(weights[seq])
        assert 1 < k <= previous, "rings must come in non-increasing ring size"
        previous = k
        best = None
        for m, group in groups.items():
            if sizes[m] < k:
                continue
            taken = 0
            for j, (start, cid) in enumerate(group):
                taken += len(classes[cid])
                if taken >= k:
                    break
            if best is None or (start, m) < best[:2]:
                best = (start, m, j)
        assert best is not None, "an aligned group always exists when ring sizes do not increase"
        start, m, last = best
        group = groups[m]
        members: list[int] = []
        for _, cid in group[: last + 1]:
            ranks = classes[cid]
            take = min(k - len(members), len(ranks))
            members.extend(ranks[:take])
            del ranks[:take]
        emptied = last + 1 if not classes[group[last][1]] else last
        for _, cid in group[:emptied]:
            del classes[cid]
        del group[:emptied]
        sizes[m] -= k
        members.sort()
        layout.rings[seq] = tuple(members)
        layout.finish[members] = start + weight
        layout.busy[members] += weight
        for rank in members:
            layout.ring_microbatches[rank].append(seq)
        classes[next_id] = members[:]
        bisect.insort(groups.setdefault(m + 1, []), (start + weight, next_id))
        sizes[m + 1] = sizes.get(m + 1, 0) + k
        next_id += 1
    return layout


def lpt(order: Sequence[int], *, weights: Sequence[float], loads: np.ndarray) -> list[list[int]]:
    """Longest-processing-time greedy: each item of `order` to the currently least-loaded rank (ties: the
    lowest rank).

    `loads` (per rank) is updated in place; returns the items given to each rank, in the order given.
    Exactly the one-item-at-a-time greedy, computed in rounds: with the ranks sorted by (load, rank), the
    next m items go to the first m ranks in that order as long as every rank served in the round ends
    strictly above the next rank's load (so each item still meets the least-loaded rank; an exact tie
    ends the round). A round is one sort and a few array operations, and heaviest-first items over a
    32M-token batch take ~40 rounds for ~33K items. When a round serves few ranks (items light against
    the spread of the loads) the next `len(loads)` items go through the heap (~0.5 us an item), so the
    rounds never cost much more than the heap alone.
    (Vectorised shortcuts that do *not* reproduce the greedy overfill the ranks already loaded with
    rings and cost more in refinement than they save.)
    """
    num_ranks, num_items = len(loads), len(order)
    assert num_ranks > 0 or not num_items, "items but no ranks"
    items = np.asarray(order, dtype=np.int64)
    w = np.asarray(weights, dtype=np.float64)[items]
    current = np.asarray(loads, dtype=np.float64).copy()
    owner = np.empty(num_items, dtype=np.int64)  # the rank each item goes to
    rank_ids = np.arange(num_ranks)
    done = 0
    while done < num_items:
        by_load = np.lexsort((rank_ids, current))
        m = min(num_ranks, num_items - done)
        start = current[by_load[:m]]
        end = start + w[done : done + m]
        stays_least = np.minimum.accumulate(end[:-1]) > start[1:]
        if not stays_least.all():
            m = int(np.argmin(stays_least)) + 1
        current[by_load[:m]] = end[:m]
        owner[done : done + m] = by_load[:m]
        done += m
        if m < num_ranks // 4 and done < num_items:
            done = _lpt_heap(current, w, owner, done, min(num_items, done + num_ranks))
    loads[:] = current
    by_rank = items[np.argsort(owner, kind="stable")].tolist()
    bounds = np.cumsum(np.bincount(owner, minlength=num_ranks)).tolist()
    return [by_rank[a:b] for a, b in zip([0] + bounds[:-1], bounds)]


def _lpt_heap(current: np.ndarray, w: np.ndarray, owner: np.ndarray, first: int, stop: int) -> int:
    """Items first..stop-1 (weights `w`) by the heap greedy from the loads `current` (both updated)."""
    heap = [(load, rank) for rank, load in enumerate(current.tolist())]
    heapq.heapify(heap)
    replace = heapq.heapreplace
    served = []
    for weight in w[first:stop].tolist():
        load, rank = heap[0]
        replace(heap, (load + weight, rank))
        served.append(rank)
    owner[first:stop] = served
    for load, rank in heap:
        current[rank] = load
    return stop
