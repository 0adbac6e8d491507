"""Policy `rl-static-cp`: what the RL post-training frameworks built on Megatron-Core run today (issue 39).

verl, slime, NeMo RL and SkyRL pack their rollouts into THD micro-batches themselves and hand them to
Megatron's `get_forward_backward_func()` on a static DP x CP mesh. Read from their code (issue 39):

- **one CP size for the run, sized for the longest sequence**: here the smallest power of two cp whose
  members each hold <= C tokens of the batch's longest (padded) sequence (a run configures CP for its
  response cap; the batch's longest is never more, so this is the baseline's best case), DP = ranks / cp,
  CP group g = HDP ranks [g cp, (g + 1) cp) as in `static`;
- **every sequence on the CP ring, padded to a multiple of 2 cp** (Megatron's zigzag needs 2 cp equal
  chunks): the plan holds each sequence at its padded length, which is what the framework hands
  Megatron (the pad tokens carry no loss); each member holds padded / cp tokens. Frameworks pad to
  2 cp x TP under sequence parallelism; the planner does not know TP (an HDP rank is a TP group), so
  the extra (TP - 1) x 2 cp pad tokens at most per sequence are not counted here;
- **sequences over DP ranks by Karmarkar-Karp on a workload**: `karmarkar_karp` on each sequence's
  time on its ring from the one cost model (verl balances the DP split on token counts with equal
  sequence counts per rank; the cost model's times and free counts are the baseline's better case);
- **the same micro-batch count on every DP rank**: the fewest m with which Karmarkar-Karp splits every
  DP group's sequences into m micro-batches of <= C tokens per member, then every group runs m (a
  group with fewer sequences than m runs empty, loss-free micro-batches, as the frameworks' dummies).

Planned and timed through `assemble_plan`, like every policy. No offloading.
"""

from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.assemble import assemble_plan, gc_paused

POLICY = "rl-static-cp"


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


def rl_cp_size(max_length: int, *, capacity: int, num_ranks: int) -> int:
    """The frameworks' static CP size: the smallest power of two cp with the longest sequence, padded to a
    multiple of 2 cp, at <= `capacity` tokens per member; ValueError when the ranks cannot hold it."""
    cp = 1
    while cp <= num_ranks and padded_length(max_length, cp) // cp > capacity:
        cp *= 2
    if cp > num_ranks or num_ranks % cp:
        raise ValueError(f"policy {POLICY}: the longest sequence ({max_length} tokens) needs a static CP group of "
                         f"{cp} ranks of capacity {capacity}, which {num_ranks} ranks do not divide into; raise the "
                         "capacity or the ranks")
    return cp


def padded_length(length: int, cp: int) -> int:
    """`length` padded to a multiple of 2 cp (Megatron's zigzag chunks); unpadded without CP."""
    return length if cp == 1 else -(-length // (2 * cp)) * 2 * cp


@gc_paused()
def plan_rl_static_cp(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1,
) -> StepPlan:
    """The RL frameworks' static-CP scheme (see the module doc)."""
    capacity = config.hdp_capacity
    cp = rl_cp_size(max(lengths), capacity=capacity, num_ranks=num_ranks)
    padded = [padded_length(n, cp) for n in lengths]
    held = np.array(padded, dtype=np.int64) // cp  # tokens each CP member holds of each sequence
    ring = tuple(range(cp)) if cp > 1 else ()
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    work = [cost_model.microbatch_time([(n, n // cp, ring)], pp_size=pp_size) - overhead for n in padded]
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
    for g, split in enumerate(splits):
        members = tuple(range(g * cp, (g + 1) * cp))
        for part in split:
            for rank in members:
                schedule[rank].append(part)
            for seq in part:
                rings[seq] = members
    return assemble_plan(policy=POLICY, lengths=padded, rings=rings, offload_ratios=np.zeros(len(lengths)),
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size)
