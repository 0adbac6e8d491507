"""Sequences longer than C packed on CP groups' rings, the others whole beside them: balance's placement
for batches most of whose tokens need rings (`policies.balance_candidates.build_on_cp_groups`).

Where most of a batch is longer than C (RL rollouts of median ~5K against a C of 4K), rings of one
sequence each must line up their micro-batch indices across many sizes, and ranks wait. The static DP x
CP mesh does better there by packing several sequences per ring micro-batch on a group's ring
(`cp_groups`), but it puts every sequence on a ring, also those that fit one rank, which the design
forbids (a sequence that fits C stays whole, DESIGN.md). This placement keeps the mesh's packing for the
sequences longer than C only:

1. groups of `cp` consecutive ranks (the smallest power of two whose ring holds each); the sequences
   longer than C over the groups, the whole ones over the ranks, chosen together (`groups_beside_whole`):
   the groups that host whole sequences take less ring work;
2. inside each group, a sequence that fits a smaller ring (an aligned block of 2, 4, ... of its members)
   may run there instead, where that evens out the members' loads (`_GroupLayout`): with few whole
   sequences per group, the group-wide ring alone cannot;
3. each block's sequences split into micro-batches of <= C tokens per member (Karmarkar-Karp on their
   times, `cp_groups.karmarkar_karp`), a rank running its blocks' micro-batches widest block first, so
   that every ring's members reach it at the same micro-batch index;
4. moves and exchanges of sequences between groups, timed by the cost model on the groups' new
   micro-batches (`_refine_groups`): sequences packed on one ring share its exchange, which the summed
   times of steps 1-2 do not see.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import max_member_tokens
from megatron_hdp.plan.search.cp_groups import karmarkar_karp

HOST_PATIENCE = 2
"""`groups_beside_whole` stops adding host groups after this many in a row that do not improve."""

MOVE_TARGETS = 2
"""`_refine_groups` tries moves to the groups that finish first, this many..."""

MOVE_TRIES = 8
"""...and per target group the moves or exchanges whose summed times shift closest to half the two groups'
difference, this many."""


def pack_on_groups(
    tokens: np.ndarray, *, long_ids: np.ndarray, whole_ids: np.ndarray, whole_seconds: np.ndarray, cp: int,
    num_ranks: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
) -> tuple[dict[int, tuple[int, ...]], list[list[list[int]]], np.ndarray, list[list[int]]]:
    """(rings, leading, finish, whole) of the module doc's placement: each ring sequence's ring (`long_ids`,
    each held by a ring of `cp` at <= `capacity` tokens per member, `cp_groups.group_size`), each rank's
    ring micro-batches in order (sequence ids) and their predicted seconds, and the whole sequences
    (`whole_ids`, of `whole_seconds` each on one rank) each rank runs after them."""
    groups = _GroupLayout(tokens, long_ids, cp=cp, capacity=capacity, cost_model=cost_model, pp_size=pp_size)
    ring_work = np.array([groups.work(i, cp) for i in range(len(long_ids))])
    members, on_rank = groups_beside_whole(ring_work, whole_seconds, cp=cp, num_ranks=num_ranks)
    beside = np.array([float(whole_seconds[items].sum()) for items in on_rank])
    laid = _refine_groups(groups, members, beside.reshape(-1, cp), rounds=num_ranks // cp)
    rings: dict[int, tuple[int, ...]] = {}
    leading: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    for g, (group_blocks, _) in enumerate(laid):
        for (offset, size), parts in group_blocks:  # widest first (`_GroupLayout.layout`)
            ring = tuple(range(g * cp + offset, g * cp + offset + size))
            for part in parts:
                ids = [int(long_ids[i]) for i in part]
                for rank in ring:
                    leading[rank].append(ids)
                rings.update((seq, ring) for seq in ids)
    finish = np.concatenate([ring for _, ring in laid])
    return rings, leading, finish, [[int(whole_ids[i]) for i in items] for items in on_rank]


class _GroupLayout:
    """Where a group's ring sequences run inside it (module doc, steps 2-3), and the members' times.

    A sequence of `need` k (the smallest power of two whose ring holds it at <= C per member) may run on
    any aligned block of k' >= k members whose ring holds it (a zigzag member's share is not monotone);
    `layout` places them heaviest first, each on the block where the busiest member after it is least
    loaded (the group-wide ring first among equals), then times every block's micro-batches with the cost
    model on the block's own ranks."""

    def __init__(self, tokens: np.ndarray, long_ids: np.ndarray, *, cp: int, capacity: int, cost_model: CostModel,
                 pp_size: int):
        self.lengths = [int(tokens[s]) for s in long_ids]
        self.cp, self.capacity, self.cost_model, self.pp_size = cp, capacity, cost_model, pp_size
        self.overhead = cost_model.microbatch_time([], pp_size=pp_size)
        self._held: dict[tuple[int, int], int] = {}
        self._work: dict[tuple[int, int], float] = {}
        self.need = [next(k for k in _sizes(cp) if self.held(i, k) <= capacity) for i in range(len(self.lengths))]

    def held(self, i: int, size: int) -> int:
        """Tokens the fullest member of a ring of `size` holds of ring sequence i."""
        if (i, size) not in self._held:
            self._held[i, size] = max_member_tokens(self.lengths[i], size)
        return self._held[i, size]

    def work(self, i: int, size: int) -> float:
        """Seconds ring sequence i alone adds to a micro-batch of each member of a ring of `size`."""
        if (i, size) not in self._work:
            self._work[i, size] = self.cost_model.microbatch_time(
                [(self.lengths[i], self.held(i, size), tuple(range(size)))], pp_size=self.pp_size) - self.overhead
        return self._work[i, size]

    def layout(self, group: list[int], beside: np.ndarray, first: int) -> tuple[list, np.ndarray]:
        """(blocks, ring) of the ring sequences `group` on the members (ranks `first`, `first` + 1, ...) with
        `beside` seconds of whole sequences: blocks as ((offset, size), micro-batches), widest first; ring
        each member's predicted seconds of ring micro-batches, summed one micro-batch at a time."""
        loads = beside.astype(np.float64).copy()
        placed: dict[tuple[int, int], list[int]] = {}
        for i in sorted(group, key=lambda i: (-self.need[i], -self.work(i, self.need[i]), i)):
            options = [(offset, size) for size in _sizes(self.cp)[::-1]
                       if size >= self.need[i] and self.held(i, size) <= self.capacity
                       for offset in range(0, self.cp, size)]
            offset, size = min(options, key=lambda o: loads[o[0]:o[0] + o[1]].max() + self.work(i, o[1]))
            loads[offset:offset + size] += self.work(i, size)
            placed.setdefault((offset, size), []).append(i)
        ring = np.zeros(self.cp)
        blocks = []
        for (offset, size), items in sorted(placed.items(), key=lambda b: (-b[0][1], b[0][0])):
            parts = self.split(sorted(items), size)
            members = tuple(range(first + offset, first + offset + size))
            for part in parts:
                ring[offset:offset + size] += self.cost_model.microbatch_time(
                    [(self.lengths[i], self.held(i, size), members) for i in part], pp_size=self.pp_size)
            blocks.append(((offset, size), parts))
        return blocks, ring

    def split(self, items: list[int], size: int) -> list[list[int]]:
        """`items` in micro-batches of <= C tokens per member of a ring of `size`: Karmarkar-Karp on their
        times at the fewest count that could hold them, else at the count first-fit decreasing needs, else
        first-fit decreasing's own."""
        held = {i: self.held(i, size) for i in items}

        def by_time(count: int) -> list[list[int]] | None:
            parts = [[items[j] for j in part] for part in karmarkar_karp([self.work(i, size) for i in items], count)]
            return parts if all(sum(held[i] for i in part) <= self.capacity for part in parts) else None

        if (parts := by_time(max(1, -(-sum(held.values()) // self.capacity)))) is not None:
            return parts
        bins: list[list[int]] = []
        room: list[int] = []
        for i in sorted(items, key=lambda i: (-held[i], i)):
            b = next((b for b, free in enumerate(room) if free >= held[i]), len(bins))
            if b == len(bins):
                bins.append([])
                room.append(self.capacity)
            bins[b].append(i)
            room[b] -= held[i]
        return by_time(len(bins)) or [sorted(b) for b in bins]


def _sizes(cp: int) -> list[int]:
    """The block sizes of a group of `cp` (a power of two): 1, 2, 4, ..., cp."""
    return [1 << p for p in range(cp.bit_length())]


def _refine_groups(groups: _GroupLayout, members: list[list[int]], beside: np.ndarray, *, rounds: int) -> list:
    """Each group's (blocks, ring seconds) (`_GroupLayout.layout`) after up to `rounds` moves of one ring
    sequence out of the group whose busiest member finishes last, to one of the `MOVE_TARGETS` groups that
    finish first, or exchanges of it for a lighter one there (per target the `MOVE_TRIES` whose summed
    times shift closest to half the two groups' difference), each the one that most lowers the later of
    the two (`beside`: groups x members, the seconds of whole sequences)."""
    cp = groups.cp
    members = [sorted(group) for group in members]
    laid = [groups.layout(group, beside[g], g * cp) for g, group in enumerate(members)]
    finish = np.array([(beside[g] + ring).max() for g, (_, ring) in enumerate(laid)])
    work = [groups.work(i, cp) for i in range(len(groups.lengths))]
    for _ in range(rounds if len(members) > 1 else 0):
        hi = int(finish.argmax())
        best = None
        for g in [int(g) for g in np.argsort(finish, kind="stable")[:MOVE_TARGETS] if g != hi]:
            want = (finish[hi] - finish[g]) / 2  # the time to shift from hi to g
            pairs = [(i, None) for i in members[hi]] + [(i, j) for i in members[hi] for j in members[g]
                                                       if work[i] > work[j]]
            pairs.sort(key=lambda pair: abs(work[pair[0]] - (0.0 if pair[1] is None else work[pair[1]]) - want))
            for i, j in pairs[:MOVE_TRIES]:
                mine = sorted([q for q in members[hi] if q != i] + ([] if j is None else [j]))
                theirs = sorted([q for q in members[g] if q != j] + [i])
                new_hi, new_g = groups.layout(mine, beside[hi], hi * cp), groups.layout(theirs, beside[g], g * cp)
                later = max((beside[hi] + new_hi[1]).max(), (beside[g] + new_g[1]).max())
                if later < finish[hi] * (1 - 1e-9) and (best is None or later < best[0]):
                    best = (later, g, mine, theirs, new_hi, new_g)
        if best is None:
            break
        _, g, members[hi], members[g], laid[hi], laid[g] = best
        finish[hi], finish[g] = (beside[hi] + laid[hi][1]).max(), (beside[g] + laid[g][1]).max()
    return laid


def groups_beside_whole(ring_work: Sequence[float], whole: Sequence[float], *, cp: int, num_ranks: int,
                        rounds: int = 64) -> tuple[list[list[int]], list[list[int]]]:
    """(groups, ranks): the indices of `ring_work` (each sequence's time on every member of a ring of `cp`)
    in each of the `num_ranks // cp` groups, and those of `whole` (times of sequences that run whole on one
    rank) on each rank, chosen together so that every rank's total is as low as the model of summed times
    makes it. Karmarkar-Karp's equal ring loads per group leave no room for whole sequences heavier than
    the groups' spread; here the groups that host whole sequences take less ring work. For each number k
    of host groups (while every member can get one): the whole sequences split into k x `cp` bins
    (`even_bins`), the 1st to `cp`-th heaviest bin to the 1st group, and so on (a group's members alike);
    then the ring sequences, heaviest first, each to the group whose busiest member is least loaded, and up
    to `rounds` moves of one out of the group of the busiest rank (or exchanges of two) while that lowers
    it. The k of the lowest busiest rank is kept, searched upwards from the fewest groups whose members'
    mean load holds the whole sequences, until `HOST_PATIENCE` in a row do not improve (more hosts than
    needed only split the whole sequences into more, less even bins: on RL rollouts the first or the
    next one won in every case tried)."""
    num_groups = num_ranks // cp
    weight = np.asarray(ring_work, dtype=np.float64)
    whole = np.asarray(whole, dtype=np.float64)
    order = np.lexsort((np.arange(len(weight)), -weight)).tolist()
    mean = (weight.sum() * cp + whole.sum()) / num_ranks
    most = max(1, min(num_groups, len(whole) // cp)) if len(whole) else 0
    hosts = min(most, max(1, math.ceil(whole.sum() / (cp * mean) - 1e-9))) if len(whole) else 0
    best, worse = None, 0
    while hosts <= most and worse < HOST_PATIENCE:  # from the fewest groups whose members' mean holds them
        bins = sorted(even_bins(whole, hosts * cp), key=lambda b: -float(whole[b].sum())) if hosts else []
        loads = np.zeros((num_groups, cp))
        loads.flat[:len(bins)] = [float(whole[b].sum()) for b in bins]
        group_of = _ring_groups(weight, order, loads, rounds=rounds)
        if best is None or loads.max() < best[0] * (1 - 1e-9):
            best, worse = (float(loads.max()), group_of, bins), 0
        else:
            worse += 1
        hosts += 1
    _, group_of, bins = best
    ranks = [sorted(b) for b in bins] + [[] for _ in range(num_ranks - len(bins))]
    return [np.flatnonzero(group_of == g).tolist() for g in range(num_groups)], ranks


def even_bins(weights: np.ndarray, num_bins: int, rounds: int = 256) -> list[list[int]]:
    """The indices of `weights` in `num_bins` bins of sums as even as local search makes them:
    Karmarkar-Karp's, then up to `rounds` moves of one item out of the heaviest bin, or exchanges of one
    there for a lighter one of another bin, each the one that most lowers the sum of squared bin sums
    (a shift s between bins of difference d lowers it by 2 s (d - s)). Karmarkar-Karp alone left a
    spread of a fifth of the mean bin on 20 items in 8 bins."""
    bins = [list(b) for b in karmarkar_karp(weights.tolist(), num_bins)]
    sums = np.array([weights[b].sum() for b in bins])
    owner = np.empty(len(weights), dtype=np.int64)
    for b, items in enumerate(bins):
        owner[items] = b
    for _ in range(rounds if num_bins > 1 else 0):
        hi = int(sums.argmax())
        mine = np.asarray(bins[hi], dtype=np.int64)
        others = np.flatnonzero(owner != hi)
        # columns: every item of another bin (an exchange), then every other bin (a move)
        to = np.concatenate([owner[others], np.delete(np.arange(num_bins), hi)])
        shift = weights[mine][:, None] - np.concatenate([weights[others], np.zeros(num_bins - 1)])[None, :]
        gain = shift * ((sums[hi] - sums[to])[None, :] - shift)
        if not len(mine) or gain.max() <= 1e-12 * sums[hi] ** 2:
            break
        i, j = np.unravel_index(int(gain.argmax()), gain.shape)
        item, target = int(mine[i]), int(to[j])
        bins[hi].remove(item)
        bins[target].append(item)
        owner[item] = target
        if j < len(others):
            back = int(others[j])
            bins[target].remove(back)
            bins[hi].append(back)
            owner[back] = hi
        sums[hi] -= shift[i, j]
        sums[target] += shift[i, j]
    return [sorted(b) for b in bins]


def _ring_groups(weight: np.ndarray, order: list[int], loads: np.ndarray, *, rounds: int) -> np.ndarray:
    """Each ring sequence's group (`groups_beside_whole`, steps after the bins), adding to `loads` (groups x
    members, the whole sequences' times on entry)."""
    num_groups = len(loads)
    group_of = np.zeros(len(weight), dtype=np.int64)
    for index in order:
        group_of[index] = g = int(loads.max(axis=1).argmin())
        loads[g] += weight[index]
    for _ in range(rounds if num_groups > 1 else 0):
        busiest = loads.max(axis=1)
        hi = int(busiest.argmax())
        mine = np.flatnonzero(group_of == hi)
        others = np.delete(np.arange(num_groups), hi)
        best, move = busiest[hi] * (1 - 1e-9), None
        # moving i to g: the busier of the two groups' busiest members after it must beat the old step
        after = np.maximum(busiest[hi] - weight[mine][:, None], busiest[others][None, :] + weight[mine][:, None])
        if after.size and after.min() < best:
            i, g = np.unravel_index(int(after.argmin()), after.shape)
            best, move = float(after[i, g]), (int(mine[i]), None, int(others[g]))
        theirs = np.flatnonzero(group_of != hi)  # exchanges: i of the busiest group for a lighter j elsewhere
        if len(theirs) and len(mine):
            delta = weight[mine][:, None] - weight[theirs][None, :]
            swapped = np.where(delta > 0, np.maximum(busiest[hi] - delta, busiest[group_of[theirs]][None, :] + delta),
                               np.inf)
            if swapped.min() < best:
                i, j = np.unravel_index(int(swapped.argmin()), swapped.shape)
                best, move = float(swapped[i, j]), (int(mine[i]), int(theirs[j]), int(group_of[theirs[j]]))
        if move is None:
            break
        i, j, g = move
        loads[hi] -= weight[i]
        loads[g] += weight[i]
        group_of[i] = g
        if j is not None:
            loads[g] -= weight[j]
            loads[hi] += weight[j]
            group_of[j] = hi
    return group_of
