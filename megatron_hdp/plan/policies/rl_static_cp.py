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
- **sequences over DP ranks by Karmarkar-Karp on a workload**: `search.cp_groups.karmarkar_karp` on each sequence's
  time on its ring from the one cost model (verl balances the DP split on token counts with equal
  sequence counts per rank; the cost model's times and free counts are the baseline's better case);
- **the same micro-batch count on every DP rank**: the fewest m with which Karmarkar-Karp splits every
  DP group's sequences into m micro-batches of <= C tokens per member, then every group runs m (a
  group with fewer sequences than m runs empty, loss-free micro-batches, as the frameworks' dummies).

Planned and timed through `assemble_plan`, like every policy. No offloading.
"""

from __future__ import annotations

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.search.cp_groups import cp_group_schedule
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.assemble import assemble_plan, gc_paused

POLICY = "rl-static-cp"


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
    rings, schedule = cp_group_schedule(padded, cp=cp, num_ranks=num_ranks, capacity=capacity,
                                        cost_model=cost_model, pp_size=pp_size)
    return assemble_plan(policy=POLICY, lengths=padded, rings=rings, offload_ratios=np.zeros(len(lengths)),
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size)
