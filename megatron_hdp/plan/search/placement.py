"""Placing rings and whole sequences on ranks: the greedy steps shared by `balance` and `naive`.

Rings go first in every rank's schedule. `validate()` requires the members of a ring to hold it at the
same micro-batch index, and the ring can only start when its slowest member is ready, so members are
chosen among ranks with the same number m of ring micro-batches so far, preferring a *class* of ranks
whose ring micro-batches so far end at the same time F (then no member waits). Rings are taken in
non-increasing ring size: the ranks that just received a ring of size k form a group of >= k ranks with
equal m, so the next ring (size <= k) always finds an aligned group — the greedy never gets stuck.

`place_rings_by_time` drops the alignment: each ring goes where it starts earliest, at any micro-batch
index, and the members with fewer micro-batches get filler slots before it, which `fill_gaps` fills with
whole sequences that fit the wait (the CPU demo's step 2: all four 2-rings on ranks {0, 1} and a
predicted balance of 1.12 aligned, 1.01 by time). `balance` builds both and keeps the faster plan; on
small pools it also places by time with the rings narrowest first (`narrowest_first`).

Whole sequences are then added after the rings by LPT (heaviest first onto the least-loaded rank).
Weights are seconds for `balance` and tokens for `naive`; the code does not care.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
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


@dataclass
class TimedLayout:
    """Rings placed by predicted start time, at any micro-batch index, with the slots that align them.

    `leading[r]` lists rank r's micro-batches up to its last ring, each a list of sequence ids: a ring's
    slot holds that one sequence; a *filler* slot (before a ring whose other members run more
    micro-batches first) holds whole sequences that `fill_gaps` put there, or nothing (an empty
    micro-batch, which the runtime runs at the micro-batch overhead). `finish[r]`: when rank r is done
    with them, waits included."""

    num_ranks: int
    rings: dict[int, tuple[int, ...]] = field(default_factory=dict)
    leading: list[list[list[int]]] = field(init=False)
    finish: np.ndarray = field(init=False)
    gaps: list[tuple[int, int, float]] = field(default_factory=list)
    """(rank, slot, seconds): filler slots and the idle time before the ring they precede."""

    def __post_init__(self) -> None:
        self.leading = [[] for _ in range(self.num_ranks)]
        self.finish = np.zeros(self.num_ranks)


def place_rings_by_time(
    order: Sequence[int],
    *,
    ring_sizes: Sequence[int],
    weights: Sequence[float],
    num_ranks: int,
    overhead: float,
    domains: Sequence[int] | None = None,
    latest_ready: bool = False,
) -> TimedLayout:
    """Each ring of `order` on the k ranks where it starts earliest, at any micro-batch index.

    The members are the k ranks of least finish time (ties: fewest micro-batches, lowest rank); with
    `domains` (a node id per rank) the k of least finish time within one node when some node has k
    ranks, so a ring stays on the fast links (`ClusterSpec`); among the nodes, the one where the ring
    starts first (ties: least summed ready time, then lowest node id). The ring takes the next index of
    its member with most micro-batches; the others get filler slots before it (each an empty micro-batch
    of `overhead` seconds until `fill_gaps` puts whole sequences there), and it starts when its last
    member is ready. Unlike `place_rings` this never waits for a group of aligned ranks to form. With
    `latest_ready` the members are instead the k that finish last among the ranks finished by then (the
    k-th earliest's finish): the same start, fewer ranks waiting, and the ranks that finished first left
    free for whole sequences (optimal_gap case 158).

    Each node keeps its ranks sorted by (finish, micro-batches, rank), so its candidate members are the
    head of its list, a node is timed again only when a ring lands on it or the ring size changes, and a
    heap of (start, summed ready time, node) finds the best node (timing every node for every ring cost
    ~1 ms a ring at 128 nodes). A ring no node holds takes the head of all ranks' entries, kept sorted
    from the first such ring on (merging every node's list for each ring cost 1.3 s of a 2.8 s plan with
    one HDP rank per node at 16,384 ranks: DeepSeek-V3 at TP 8).
    """
    layout = TimedLayout(num_ranks)
    nodes = np.zeros(num_ranks, dtype=np.int64) if domains is None else np.asarray(domains, dtype=np.int64)
    node_of = nodes.tolist()
    # each node's entries (finish, micro-batches, rank), sorted since all finish at 0; nodes in order
    by_node = np.argsort(nodes, kind="stable")  # ranks node by node, in rank order within each
    cuts = (np.flatnonzero(np.diff(nodes[by_node])) + 1).tolist()
    entries = list(zip(itertools.repeat(0.0), itertools.repeat(0), by_node.tolist()))
    queues: dict[int, list[tuple[float, int, int]]] = {
        node_of[entries[a][2]]: entries[a:b] for a, b in zip([0, *cuts], [*cuts, num_ranks]) if a < b}
    held = {n: len(queue) for n, queue in queues.items()}  # a ring takes entries off and puts them back
    widest = max(held.values(), default=0)
    # the last ring that fits in no node: past it the merged list of every rank's entry is read no more
    last_merged = max((at for at, seq in enumerate(order) if int(ring_sizes[seq]) > widest), default=-1)
    everyone = None  # every rank's entry, sorted: kept once a ring fits in no node, up to `last_merged`
    untouched = set(queues)  # nodes no ring has landed on: every entry (0.0, 0, rank), keyed (0.0, 0.0)
    size = None
    for at, seq in enumerate(order):
        k, weight = int(ring_sizes[seq]), float(weights[seq])
        if k != size:  # with one rank a node (16,384 nodes) no ring fits one: no scan
            size, fitting = k, [n for n in queues if held[n] >= k] if k <= widest else []
            keys = {}
            if len(fitting) > 1:
                timed = [n for n in fitting if n not in untouched]
                keys = {n: _UNTOUCHED for n in fitting}  # in `fitting`'s order, the timed ones replaced
                if timed:
                    keys.update(zip(timed, _start_keys([queues[n][:k] for n in timed], overhead)))
            ranking = [(*key, n) for n, key in keys.items()]  # a heap; entries of re-timed nodes go stale
            heapq.heapify(ranking)
        if fitting:
            while keys and keys[ranking[0][2]] != ranking[0][:2]:
                heapq.heappop(ranking)
            source = queues[ranking[0][2] if keys else fitting[0]]
        else:  # no node holds k ranks: the k earliest of all (the head of the nodes' merged lists)
            if everyone is None:
                everyone = sorted(itertools.chain.from_iterable(queues.values()))
            source = everyone
        group = source[:k]
        if latest_ready:  # the same start, from the latest of the ranks ready by then
            ready_by = bisect.bisect_right(source, (group[-1][0], math.inf, math.inf))
            group = source[ready_by - k:ready_by]
        slot, ready = _ready_times(group, overhead)
        start = max(ready)
        for (_, count, rank), rank_ready in zip(group, ready):
            if slot > count:
                layout.gaps.append((rank, slot - 1, start - rank_ready))
            layout.leading[rank] += [[] for _ in range(slot - count)] + [[seq]]
        members = [rank for _, _, rank in group]
        layout.rings[seq] = tuple(sorted(members))
        finish = start + overhead + weight
        layout.finish[members] = finish
        touched = collections.Counter(node_of[rank] for rank in members)
        if latest_ready:
            for entry in group:
                queue = queues[node_of[entry[2]]]
                del queue[bisect.bisect_left(queue, entry)]
        else:
            for n, taken in touched.items():  # the group is a head of the list of every node it draws from
                del queues[n][:taken]
        for rank in members:
            bisect.insort(queues[node_of[rank]], (finish, slot + 1, rank))
        untouched.difference_update(touched)
        if everyone is not None and at < last_merged:
            if source is everyone:  # the group is a slice of it
                start_at = bisect.bisect_left(everyone, group[0])
                del everyone[start_at:start_at + k]
            else:
                for entry in group:
                    del everyone[bisect.bisect_left(everyone, entry)]
            for rank in members:
                bisect.insort(everyone, (finish, slot + 1, rank))
        for n in touched.keys() & keys.keys():
            keys[n] = _start_key(queues[n][:k], overhead)
            heapq.heappush(ranking, (*keys[n], n))
    return layout


_UNTOUCHED = (0.0, 0.0)
"""`_start_key` of a node's k first entries while no ring has landed on it (all ready at 0.0: 0.0 + 0 x
overhead each, their maximum and numpy's sum 0.0), for any k."""


def _ready_times(group: list[tuple[float, int, int]], overhead: float) -> tuple[int, list[float]]:
    """The micro-batch index a ring on `group` ((finish, micro-batches, rank) per member) takes, and when
    each member is ready for it: after its filler slots of `overhead` seconds."""
    slot = max(count for _, count, _ in group)
    return slot, [finish + (slot - count) * overhead for finish, count, _ in group]


def _start_key(group: list[tuple[float, int, int]], overhead: float) -> tuple[float, float]:
    """(start, summed ready time) of a ring on `group`, earliest members first. The sum is numpy's (a
    pairwise sum from 8 terms on, not Python's left-to-right one), as it has always been."""
    ready = _ready_times(group, overhead)[1]
    return max(ready), float(np.add.reduce(np.array(ready)))


def _start_keys(groups: list[list[tuple[float, int, int]]], overhead: float) -> list[tuple[float, float]]:
    """`_start_key` of each of `groups` (all of one size), a numpy step for all of them: the ring sizes
    change a few times a plan, and each change times every node (2,048 of them at 16,384 ranks, 8 a node).
    The same floats: the same IEEE operations per element, and numpy's sum along a row of a contiguous
    array is the one it makes of that row alone (tests/plan/test_plan_placement_by_time.py)."""
    finish = np.array([[entry[0] for entry in group] for group in groups], dtype=np.float64)
    counts = np.array([[entry[1] for entry in group] for group in groups], dtype=np.int64)
    ready = finish + (counts.max(axis=1, keepdims=True) - counts) * overhead
    return list(zip(ready.max(axis=1).tolist(), np.add.reduce(ready, axis=1).tolist()))


def fill_gaps(
    layout: TimedLayout, order: Sequence[int], *, weights: Sequence[float], tokens: Sequence[int], capacity: int
) -> list[int]:
    """Put whole sequences of `order` (heaviest first) into filler slots whose idle time they fit (best
    fit; <= `capacity` tokens per slot), so they run while the rank waits for a ring's other members and
    delay nothing. Returns the sequences left over, in order.

    Best fit is the slot of least idle time left (ties: the first gap) among those with the time and the
    tokens: the slots wait in a list sorted by (time left, gap), so it is the first from the sequence's
    time on with the tokens (a scan of every slot per sequence cost ~20 ms at 1,024 ranks)."""
    room = {g: [seconds, capacity] for g, (_, _, seconds) in enumerate(layout.gaps) if seconds > 0}
    ranked = sorted((seconds, g) for g, (seconds, _) in room.items())
    seconds_of = np.asarray(weights, dtype=np.float64).tolist() if len(order) else []
    tokens_of = np.asarray(tokens, dtype=np.int64).tolist() if len(order) else []
    most = max((free for _, free in room.values()), default=0)  # the most tokens any slot has left
    left = []
    for at, seq in enumerate(order):
        if not room:
            left += order[at:]
            break
        weight, size = seconds_of[seq], tokens_of[seq]
        if size > most:  # no slot has the room (most of a large batch's sequences)
            left.append(seq)
            continue
        place = bisect.bisect_left(ranked, (weight, -1))  # the first slot with at least `weight` left
        while place < len(ranked) and room[ranked[place][1]][1] < size:
            place += 1
        if place == len(ranked):
            left.append(seq)
            continue
        g = ranked.pop(place)[1]
        rank, slot, _ = layout.gaps[g]
        layout.leading[rank][slot].append(seq)
        room[g][0] -= weight
        room[g][1] -= size
        if room[g][0] <= 0 or room[g][1] <= 0:
            del room[g]
        else:
            bisect.insort(ranked, (room[g][0], g))
        most = max((free for _, free in room.values()), default=0)
    return left


def narrowest_first(order: Sequence[int], *, ring_sizes: Sequence[int]) -> list[int]:
    """`order` (rings widest first) with the ring sizes taken narrowest first, each size's rings in their
    order: for `place_rings_by_time`, narrow rings side by side first and the wide one after them leave
    the ranks it does not take free for whole sequences from the start (optimal_gap case 156 of the
    4-rank run: two rings of 2, then one of 3 on 4 ranks)."""
    return sorted(order, key=lambda seq: int(ring_sizes[seq]))
