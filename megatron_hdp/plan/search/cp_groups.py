"""Sequences over equal CP groups, the static DP x CP mesh's way to place a batch, which the RL frameworks
run (`policies.rl_static_cp`): the ranks split into groups of `cp`, each sequence goes to a group by
Karmarkar-Karp on its time on the group's ring, and each group's sequences are split into micro-batches,
every member holding 1/cp of every sequence of a micro-batch, at most C tokens in all. Balance packs
only the sequences longer than C this way (`packed_rings`).
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import max_member_tokens


def karmarkar_karp(weights: Sequence[float], num_parts: int) -> list[list[int]]:
    """Karmarkar-Karp's largest differencing method for `num_parts`-way number partitioning, as verl's
    `seqlen_balancing.karmarkar_karp` runs it: every item starts as a partial solution (itself in one
    part, the other parts empty); the two partial solutions with the largest spread (largest part sum -
    smallest) are merged, the largest part of one with the smallest of the other, until one is left.

    Returns the indices of `weights` in each part (parts ordered by sum, largest first); every index is in
    exactly one part, and parts may be empty. Deterministic: ties keep the input order.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for index, weight in enumerate(weights):
        parts = [(float(weight), [index])] + [(0.0, []) for _ in range(num_parts - 1)]
        heap.append((-float(weight), index, parts))
    if not heap:
        return [[] for _ in range(num_parts)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = [(a + b, ids_a + ids_b) for (a, ids_a), (b, ids_b) in zip(first, reversed(second))]
        merged.sort(key=lambda part: -part[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return [sorted(ids) for _, ids in heap[0][2]]


def cp_group_schedule(
    lengths: Sequence[int], *, cp: int, num_ranks: int, capacity: int, cost_model: CostModel, pp_size: int = 1,
) -> tuple[list[tuple[int, ...]], list[list[list[int]]]]:
    """(rings, schedule) of `lengths` (each a multiple of 2 cp, as Megatron's zigzag needs, and at most
    cp x `capacity`) over `num_ranks // cp` groups of `cp` consecutive ranks (module doc): the fewest
    micro-batch count with which Karmarkar-Karp splits every group's sequences into micro-batches of <=
    `capacity` tokens per member, which every group then runs (empty micro-batches where a group has
    fewer sequences)."""
    held = np.asarray(lengths, dtype=np.int64) // cp  # tokens each CP member holds of each sequence
    ring = tuple(range(cp)) if cp > 1 else ()
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    work = [cost_model.microbatch_time([(n, n // cp, ring)], pp_size=pp_size) - overhead for n in lengths]
    groups = karmarkar_karp(work, num_ranks // cp)
    count = max(1, max(-(-int(held[g].sum()) // capacity) for g in groups))
    while True:  # the fewest equal count with which every group's Karmarkar-Karp split fits C per member
        splits = [[[g[i] for i in part] for part in karmarkar_karp([work[s] for s in g], count)] for g in groups]
        if all(int(held[part].sum()) <= capacity for split in splits for part in split):
            break
        count += 1
        assert count <= len(lengths), "with a part per sequence every part fits: Karmarkar-Karp gives singletons"
    schedule: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    rings: list[tuple[int, ...]] = [()] * len(lengths)
    for g, parts in enumerate(splits):
        members = tuple(range(g * cp, (g + 1) * cp))
        for part in parts:
            for rank in members:
                schedule[rank].append(part)
            for seq in part:
                rings[seq] = members
    return rings, schedule


def group_size(lengths: Sequence[int], *, capacity: int, num_ranks: int) -> int | None:
    """The smallest power of two dividing `num_ranks` whose ring holds each of `lengths` at <= `capacity`
    tokens per member (powers of two keep the groups inside nodes and EP groups), or None. Each length
    is checked: a zigzag member's share is not monotone in the length (at C = 1, a ring of 4 holds 4
    tokens but not 3)."""
    distinct = sorted(set(int(n) for n in lengths))
    cp = 1
    while cp <= num_ranks and (num_ranks % cp or any(max_member_tokens(n, cp) > capacity for n in distinct)):
        cp *= 2
    return cp if cp <= num_ranks else None
