"""A lower bound on the step time of any plan, and a plan's gap to it.

No plan of a batch over D ranks, whatever its ring sizes and assignment, can take less than

    max( sum_s T_whole(s) / D,                      the whole work spread perfectly;
         max_{s <= C} T_whole(s),                   a short sequence stays whole on one rank;
         max_{s > C} min_{1<=k<=D} T_member(s, k) ) a ring member's shard of >= s/k tokens

where T_whole(s) is the cost model's time of the sequence whole on one rank and T_member(s, k) the time
of a member holding s/k tokens of a ring of k (`sharding.shard_time` with fractional tokens). The first
term holds because a ring does at least the whole sequence's work: k * T_member(s, k) >= T_whole(s)
(each member's s/k queries see s/2 keys on average, plus linear work on its tokens). The third includes
the ring traffic: a member's K/V exchange of ~3 s kv-bytes per layer does not shrink with k, which is
what makes a 2M-token document expensive at any ring size. Micro-batch overheads, waits and the PP
fill/drain only add to a plan's time, so the bound holds for every policy's plan.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost_model import CostModel
from megatron_hdp.plan.sharding import fastest_ring_size, shard_time, whole_times
from megatron_hdp.plan.step_plan import StepPlan


def step_time_lower_bound(
    lengths: Sequence[int], *, num_ranks: int, capacity: int, cost_model: CostModel, pp_size: int = 1
) -> float:
    """The lower bound of the module docstring, in seconds."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    lengths = np.asarray(lengths, dtype=np.int64)
    whole = whole_times(lengths, cost_model=cost_model, pp_size=pp_size)
    bound = max(float(whole.sum()) / num_ranks, float(whole[lengths <= capacity].max(initial=0.0)))
    for s in np.unique(lengths[lengths > capacity]).tolist():

        def member(k: int, s: int = s) -> float:
            return shard_time(cost_model, seq_len=s, num_tokens=s / k, ring_size=k, pp_size=pp_size)

        bound = max(bound, member(fastest_ring_size(member, lo=1, hi=num_ranks)))
    return bound


def gap(plan: StepPlan, *, cost_model: CostModel) -> float:
    """est_step_time / lower bound - 1 for a plan (0: provably optimal under the cost model)."""
    bound = step_time_lower_bound(plan.lengths, num_ranks=plan.num_ranks, capacity=plan.capacity,
                                  cost_model=cost_model, pp_size=plan.pp_size)
    return plan.est_step_time / bound - 1.0 if bound > 0 else 0.0
