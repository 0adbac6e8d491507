"""Rows of an EP unit (`expert_units`): formed (`ring_rows`, `fill_holes`, `whole_rows`), levelled, and
their rings widened into the lanes they leave free.

A row is one micro-batch index of a unit of e lanes: every lane of it waits at each MoE layer for the
row's slowest lane. Lane rings (rings of at most e ranks) are grouped into rows of alike member time
(`ring_rows`), and the lanes their sizes leave free take whole sequences. But whole
sequences of at most C tokens take at most a C-token document's time on a lane, while the members of the
rings of long documents take several times that: the free lanes of such a row idle. `widen_rings` gives
those lanes to the row's rings as extra members instead, each to the ring whose members are slowest then
(lowering the row's time, as processors go to the longest job): a ring of k + 1 members does the k
members' work in less time each, at the cost of more ring traffic its attention may no longer hide (and
where that traffic makes the members slower, the ring stays as it is).

On DeepSeek-V3 at EP 32 rows of rings of 75K-130K-token documents, sized within capacity for C = 16K,
left 2-6 lanes of 32 that a lighter ring took (members at 50-60% of the row's time, benchmarks/README.md).
Widened instead (and rings joining only rows within `JOIN_TOLERANCE` of their time), the
plans at 2,048 GPUs gain 0.04-1.0 points of the work floor (github and byted, seeds 0-3), at 1,024 GPUs
1.5-2.0, at 512 GPUs -0.6 to +2.4.

Before the widening, `level_rows` moves and swaps rings between rows adjacent in time while that lowers
their summed time once widened: `ring_rows` forms rows heaviest first, ring by ring, and rings of
different lengths in one row wait for the slowest (attention per token grows with the length, member
counts are whole numbers). DeepSeek-V3 at EP 32, 2,048 GPUs, seeds 0-7: 0.0 to +0.64 points of the
work floor on github, +0.17 to +0.91 on byted, no batch worse (benchmarks/README.md, round 2).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from megatron_hdp.plan.flat_ids import flat_ids
JOIN_TOLERANCE = 0.2
"""`ring_rows`: a lane ring joins a row whose time is at most this fraction above its member time without
weighing the lane-seconds it idles there. Wider than `expert_units.ROW_TOLERANCE` since `fill_holes` fills the rows
to their rings' time apart from the routed expert work: against 0.1, DeepSeek-V3 at EP 32 (2,048 GPUs,
github and byted, seeds 0-7) gains up to 0.34 points of the work floor on 14 of 16 batches and loses 0.15
on one; 0.05 loses on all of seeds 0-3, 0.3 and 0.5 plan as 0.2 does. The 12 Mixtral / qwen3 EP cells
of benchmarks/README.md: -0.2 to +0.2 points."""

FINE_PARTS = 4
"""The light rows of the last `fine_work` lane-seconds hold C / FINE_PARTS tokens a lane."""

LEVEL_ROUNDS = 3
"""`level_rows`' passes over the rows (10 on DeepSeek-V3's EP 32 cell, before `level_rows` moved only
slowest rings: -0.04 to +0.35 points on seeds 0-3, at more plan time)."""


@dataclass
class Row:
    """One micro-batch index of a unit: what each of its lanes runs, the time of the rings in it (0 for a
    row of whole sequences; member seconds while `ring_rows` forms the rows, then the slowest lane's
    seconds apart from the routed expert work for `fill_holes`), and the lanes still free."""

    lanes: list[list[int]]
    time: float
    free: list[int]


def widen_rings(rows: Sequence[Row], *, lengths: np.ndarray, own: Callable[[int, int], float],
                fill: float) -> dict[int, int]:
    """The free lanes of each row of lane rings given to its rings, one at a time, to the ring whose
    members' `own` time (length, size) -> seconds is the largest (ties: the lowest sequence id), while that
    time is above `fill` (the most a free lane's whole sequences would take), one more member lowers it
    (over slow ring links the traffic of a wider ring can outweigh its smaller shards) and the document
    allows it (zigzag chunks of >= 1 token: size <= length / 2). Changes `rows` in place; returns every
    widened ring's new size by sequence id. Rows must hold lane rings only (whole sequences come later)."""
    widened: dict[int, int] = {}
    for row in rows:
        if not row.free:
            continue
        size: dict[int, int] = {}
        for lane in row.lanes:
            for seq in lane:
                size[seq] = size.get(seq, 0) + 1
        for seq in _growth(size, len(row.free), lengths=lengths, own=own, fill=fill)[0]:
            row.lanes[row.free.pop(0)].append(seq)
            widened[seq] = size[seq]
    return widened


def _growth(size: dict[int, int], free: int, *, lengths: Sequence[int], own: Callable[[int, int], float],
            fill: float) -> tuple[list[int], dict[int, float]]:
    """`widen_rings`' steps for one row of rings of `size` (by sequence; grown in place) and `free` lanes:
    the ring each free lane goes to, in order, and every ring's member seconds after them."""
    times = {seq: own(int(lengths[seq]), k) for seq, k in size.items()}
    steps = []
    slowest = [(-seconds, seq) for seq, seconds in times.items()]  # a heap: the slowest ring, then the lowest id
    heapq.heapify(slowest)
    while free and slowest:
        seconds, seq = -slowest[0][0], slowest[0][1]
        length, k = int(lengths[seq]), size[seq]
        if 2 * (k + 1) > length or seconds <= fill:
            break
        wider = own(length, k + 1)
        if wider >= seconds:
            break
        size[seq], times[seq] = k + 1, wider
        heapq.heapreplace(slowest, (-wider, seq))
        free -= 1
        steps.append(seq)
    return steps, times


def widened_time(size: dict[int, int], free: int, *, lengths: Sequence[int], own: Callable[[int, int], float],
                 fill: float) -> tuple[float, int | None]:
    """(seconds, sequence) of the slowest ring member of a row of rings of `size` (by sequence) and `free`
    lanes once `widen_rings` has widened them ((0, None) for no rings; ties: the lowest sequence id)."""
    if not size:
        return 0.0, None
    if not free:  # nothing to widen into: the slowest member of the rings as they are
        seconds, neg_seq = max((own(int(lengths[seq]), k), -seq) for seq, k in size.items())
        return seconds, -neg_seq
    _, times = _growth(dict(size), free, lengths=lengths, own=own, fill=fill)
    seq = max(times, key=lambda s: (times[s], -s))
    return times[seq], seq


def level_rows(rows: Sequence[Row], *, lengths: np.ndarray, own: Callable[[int, int], float], fill: float,
               rounds: int = LEVEL_ROUNDS) -> list[Row]:
    """Lane rings moved and swapped between rows adjacent in time, before `widen_rings`: rows in order of
    time, each with the next, take the move of one ring, or swap of two, that lowers their summed
    `widened_time` the most (where the lanes allow), among those that move the slowest ring of either row
    (the rest could lower a row's time only through the lanes they free), for up to `rounds` passes. Every
    lane of a row waits for its slowest ring member, so a row's time counts for all its lanes. Rows must
    hold lane rings only (each ring's members in one row); changes them in place, the rings of a row on
    its first lanes, slowest first, and returns those still holding rings (a move can empty one), in order."""
    if not rows:
        return []
    ep_size = len(rows[0].lanes)
    lengths = lengths.tolist()  # list items: the hot loop indexes them tens of thousands of times
    sets = []
    for row in rows:
        size: dict[int, int] = {}
        for lane in row.lanes:
            for seq in lane:
                size[seq] = size.get(seq, 0) + 1
        sets.append(size)
    memo: dict[frozenset, tuple[float, int | None]] = {}  # by a row's (ring, size) pairs

    def time(key: frozenset, free: int) -> tuple[float, int | None]:  # `free`: the lanes `key` leaves free
        known = memo.get(key)
        if known is None:  # (`widened_time` does not depend on the rings' order)
            known = memo[key] = widened_time(dict(key), free, lengths=lengths, own=own, fill=fill)
        return known

    keys = [frozenset(size.items()) for size in sets]
    used = [sum(size.values()) for size in sets]  # lanes the rings of each row take
    times = [time(key, ep_size - lanes) for key, lanes in zip(keys, used)]
    settled: set[tuple[frozenset, frozenset]] = set()  # pairs of rows no move or swap improves
    for _ in range(rounds):
        changed = False
        order = sorted(range(len(rows)), key=lambda r: (-times[r][0], r))
        for a, b in zip(order, order[1:]):
            if (keys[a], keys[b]) in settled:
                continue
            best = None
            (time_a, slowest_a), (time_b, slowest_b) = times[a], times[b]
            free_a, free_b = ep_size - used[a], ep_size - used[b]
            now = time_a + time_b
            for i in [*sets[a], None]:
                # the moves and swaps of a slowest ring of either row, in the order of all pairs (i, j)
                for j in ([*sets[b], None] if i == slowest_a else [slowest_b]):
                    ki, kj = sets[a].get(i, 0), sets[b].get(j, 0)
                    if (i, j) == (None, None) or free_a + ki < kj or free_b + kj < ki:
                        continue
                    key_a, key_b = keys[a], keys[b]
                    if i is not None:
                        key_a, key_b = key_a - {(i, ki)}, key_b | {(i, ki)}
                    if j is not None:
                        key_a, key_b = key_a | {(j, kj)}, key_b - {(j, kj)}
                    ta, tb = time(key_a, free_a + ki - kj), time(key_b, free_b + kj - ki)
                    gain = now - ta[0] - tb[0]
                    if gain > 1e-9 * now and (best is None or gain > best[0]):
                        best = (gain, i, j, key_a, key_b, ta, tb)
            if best is None:
                settled.add((keys[a], keys[b]))
                continue
            _, i, j, keys[a], keys[b], times[a], times[b] = best
            ki, kj = sets[a].get(i, 0), sets[b].get(j, 0)
            sets[a] = {s: k for s, k in sets[a].items() if s != i} | ({j: kj} if j is not None else {})
            sets[b] = {s: k for s, k in sets[b].items() if s != j} | ({i: ki} if i is not None else {})
            used[a], used[b] = used[a] - ki + kj, used[b] - kj + ki
            changed = True
        if not changed:
            break
    for row, size in zip(rows, sets):
        row.lanes = [[] for _ in range(ep_size)]
        lane = 0
        for seq, k in sorted(size.items(), key=lambda item: (-own(int(lengths[item[0]]), item[1]), item[0])):
            for _ in range(k):
                row.lanes[lane].append(seq)
                lane += 1
        row.free = list(range(lane, ep_size))
        row.time = max((own(int(lengths[seq]), k) for seq, k in size.items()), default=0.0)
    return [row for row, size in zip(rows, sets) if size]


def ring_rows(rows: list[Row], order: Sequence[int], *, ring_sizes: np.ndarray, weights: np.ndarray,
              ep_size: int, closed: set[int] = frozenset()) -> None:
    """The lane rings of `order` (heaviest first) into `rows` (those there: rows of rings of several units,
    some lanes of their last unit free). A ring joins the row of least time T >= its member time w with
    lanes free when T is within `JOIN_TOLERANCE` of w, else opens a new row: the lanes a heavy row leaves
    free go to its own rings as extra members (`unit_rows.widen_rings`), not to a lighter ring whose
    members would idle there (before the widening: the row that idled fewer lane-seconds, counting what
    whole sequences could fill, DeepSeek-V3 0.05-1.0 points of the work floor behind).

    The rows with lanes free wait in a list sorted by (time, row), so that a ring scans only those of
    times in its range, least first. Rows of `closed` (indices into `rows`) take no ring."""
    open_rows = sorted((row.time, i) for i, row in enumerate(rows) if row.free and i not in closed)
    for seq in order:
        k, w = int(ring_sizes[seq]), float(weights[seq])
        start = bisect.bisect_left(open_rows, (w, -1))
        at = next((i for time, i in itertools.islice(open_rows, start, None) if len(rows[i].free) >= k
                   or time > w * (1 + JOIN_TOLERANCE)), None)
        if at is None or rows[at].time > w * (1 + JOIN_TOLERANCE):
            rows.append(Row([[] for _ in range(ep_size)], w, list(range(ep_size))))
            at = len(rows) - 1
            bisect.insort(open_rows, (w, at))
        row = rows[at]
        for lane in row.free[:k]:
            row.lanes[lane].append(seq)
        del row.free[:k]
        if not row.free:
            open_rows.remove((row.time, at))


def lane_sums(rows: Sequence[Row], values: Sequence[np.ndarray], ep_size: int) -> list[np.ndarray]:
    """For each array of `values` (by sequence), its [row, lane] sums over each lane's sequences of `rows`
    (of `ep_size` lanes): np.bincount adds them in lane order from 0.0, the floats of Python's `sum` (3.11:
    left to right) of each lane, in one pass. The lanes are flattened once for all of them (at 1,024
    ranks ~10K lanes, much of the sums' time)."""
    lanes = [lane for row in rows for lane in row.lanes]
    sizes, seqs = flat_ids(lanes)
    cell = np.repeat(np.arange(len(lanes)), sizes)
    return [np.bincount(cell, weights=value[seqs], minlength=len(lanes)).astype(np.float64, copy=False)
            .reshape(len(rows), ep_size) for value in values]  # (int zeros where no pieces)


def fill_holes(rows: list[Row], order: Sequence[int], *, weights: np.ndarray, tokens: np.ndarray,
               held: Sequence[int], capacity: int, lane_totals: Sequence[np.ndarray] | None = None,
               capped: Sequence[int] = ()) -> list[int]:
    """Whole sequences of `order` (heaviest first, and so longest first: a whole sequence's time grows with
    its length) into the holes of the ring rows `rows`, each into the hole of least time left that takes
    it: they run while the lane waits for the row's rings. A hole is a free lane (the row's time, C tokens)
    or a ring member's micro-batch with time and tokens to spare: the row's time less the member's, and
    up to the tokens of the row's fullest lane less the `held` tokens of its shard (C where the row has free
    lanes, which whole sequences fill up to C), so that the row's all-to-all, which waits for its fullest
    lane, does not grow. A ring within capacity leaves its members that room. Returns the sequences left,
    in order. `lane_totals`: the rows' `lane_sums` of `held` and `weights`, where the caller has them.
    `capped` (indices into `rows`): rows whose free lanes take no more tokens than their fullest lane holds.

    Both the times and the lengths of `order` fall, so a hole takes every sequence from some position on
    (`first`: where both its time left and its room suffice); holes wait in a heap on that position and
    join the holes open to the current sequence, a heap on time left, when it is reached. While no hole is
    open, the sequences up to the first waiting hole's position are left at once (most of them, on the
    EP 8 cells of benchmarks/README.md)."""
    order = list(order)
    if not rows:
        return order
    at_order = np.asarray(order, dtype=np.int64)
    neg_weight_array, neg_token_array = -weights[at_order], -tokens[at_order]
    neg_weights = neg_weight_array.tolist()  # lists: `bisect_left` on them is `np.searchsorted` without
    neg_tokens = neg_token_array.tolist()    # its ~10 us a scalar call (thousands of calls a family)

    def first(seconds: float, room: int) -> int:
        return max(bisect.bisect_left(neg_weights, -seconds), bisect.bisect_left(neg_tokens, -room))

    ep_size = len(rows[0].lanes)
    if lane_totals is None:
        lane_totals = lane_sums(rows, [np.asarray(held, dtype=np.float64), weights], ep_size)
    lane_tokens, lane_seconds = lane_totals
    free = np.zeros(len(rows) * ep_size, dtype=bool)
    free[[i * ep_size + lane for i, row in enumerate(rows) for lane in row.free]] = True
    free = free.reshape(len(rows), ep_size)
    fullest = np.where(free.any(axis=1), capacity, np.minimum(capacity, lane_tokens.max(axis=1)))
    if len(capped):
        fullest[capped] = np.minimum(capacity, lane_tokens[capped].max(axis=1))
    spare_time = np.array([row.time for row in rows])[:, None] - lane_seconds
    spare_tokens = fullest[:, None] - lane_tokens  # (a free lane holds nothing: C, or its row's fullest)
    at_row, at_lane = np.nonzero((spare_time > 0) & (spare_tokens > 0))  # row by row, lane by lane
    hole_seconds, hole_room = spare_time[at_row, at_lane], spare_tokens[at_row, at_lane].astype(np.int64)
    holes = [list(hole) for hole in zip(hole_seconds.tolist(), at_row.tolist(), at_lane.tolist())]
    room = hole_room.tolist()
    starts = np.maximum(np.searchsorted(neg_weight_array, -hole_seconds, side="left"),  # `first` of every hole
                        np.searchsorted(neg_token_array, -hole_room, side="left"))
    waiting = list(zip(starts.tolist(), range(len(holes))))
    heapq.heapify(waiting)
    open_holes: list[tuple[float, int]] = []
    left = []
    at, end = 0, len(order)
    while at < end:
        while waiting and waiting[0][0] <= at:
            h = heapq.heappop(waiting)[1]
            heapq.heappush(open_holes, (holes[h][0], h))
        if not open_holes:  # no hole takes a sequence before the first waiting hole's position
            stop = waiting[0][0] if waiting else end
            left += order[at:stop]
            at = stop
            continue
        _, h = heapq.heappop(open_holes)
        rows[holes[h][1]].lanes[holes[h][2]].append(order[at])
        holes[h][0] += neg_weights[at]  # less the sequence's seconds (negation is exact)
        room[h] += neg_tokens[at]
        at += 1
        if room[h] > 0 and holes[h][0] > 0:
            heapq.heappush(waiting, (max(at, first(holes[h][0], room[h])), h))
    return left


def whole_rows(order: Sequence[int], *, weights: np.ndarray, tokens: np.ndarray, ep_size: int, capacity: int,
               fine_work: float) -> list[Row]:
    """Rows of the whole sequences of `order` (heaviest first): each into the bin of least time with room
    in the open row (an empty bin takes a sequence longer than C, which offloading lets one rank hold), a
    new row when none has room: of bins of `capacity` tokens while `fine_work` lane-seconds or more are
    left, else of capacity / FINE_PARTS. The open row's bins are a heap on (time, bin)."""
    rows: list[Row] = []
    order = list(order)
    left = float(weights[order].sum()) if order else 0.0
    bins: list[list[int]] = []
    room: list[int] = []
    heap: list[tuple[float, int]] = []  # (time, bin): bins are distinct, so any valid heap pops alike
    for seq, w, t in zip(order, weights[order].tolist(), tokens[order].tolist()):
        full = []  # bins set aside: no room for this sequence
        while heap and room[heap[0][1]] < t and bins[heap[0][1]]:
            full.append(heapq.heappop(heap))
        if not heap:
            if bins:
                rows.append(Row(bins, 0.0, []))
            budget = capacity if left >= fine_work else max(1, capacity // FINE_PARTS)
            bins, room, full = [[] for _ in range(ep_size)], [budget] * ep_size, []
            heap = [(0.0, b) for b in range(ep_size)]
        time, b = heap[0]  # the least bin with room takes it
        bins[b].append(seq)
        room[b] -= t
        heapq.heapreplace(heap, (time + w, b))
        for entry in full:
            heapq.heappush(heap, entry)
        left -= w
    if bins:
        rows.append(Row(bins, 0.0, []))
    return rows
