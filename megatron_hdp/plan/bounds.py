"""A lower bound on the step time of any plan, and a plan's gap to it.

Let T_whole(s) be the cost model's time of a sequence whole on one rank, T_member(s, k) the time of a
member holding s/k tokens of a ring of k (`sharding.shard_time` with fractional tokens; the fullest
member holds at least that), and D(s) the fewest ranks memory allows (`sharding.min_ring_size`). A plan
with step time T has

- T >= T_whole(s) for every short sequence (it stays whole on one rank);
- T >= min_{D(s) <= k <= D} T_member(s, k) for every long one: the floor. The ring traffic, ~(2 + f) s
  kv-bytes per member and layer whatever k (f = 2 in bf16, whose dK/dV travel in fp32), is why a 2M-token document is slow at any ring size;
- each long sequence on k_s(T) ranks or more, the smallest k >= D(s) with T_member(s, k) <= T, and a
  ring of k members does k x T_member(s, k) work, which grows with k (the whole sequence's linear and
  attention work, or, when larger, the ring traffic, 2 (k - 1) + k f kv-bytes per token held). So
  D x T >= W(T) = sum of T_whole over short sequences + sum of k_s(T) x T_member(s, k_s(T)).

W(T) falls as T rises, so the smallest T meeting all three is found by bisection (`widening.settle_target`
with no slack, the same search the planner's ring widening uses with slack). Micro-batch overheads, waits
and the PP fill/drain only add to a plan's time, so the bound holds for every policy's plan.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost_model import CostModel
from megatron_hdp.plan.sharding import min_ring_size, whole_times
from megatron_hdp.plan.widening import RingSizer, settle_target
from megatron_hdp.plan.step_plan import StepPlan


def step_time_lower_bound(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    max_offload_ratio: float = 1.0,
) -> float:
    """The lower bound of the module docstring, in seconds.

    `max_offload_ratio` only tightens the bound (a ring has at least D(s) members, and more offloading
    allows fewer); the default 1.0 gives a bound valid for every configuration.
    """
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    lengths = np.asarray(lengths, dtype=np.int64)
    short = lengths <= capacity
    whole = whole_times(lengths[short], cost_model=cost_model, pp_size=pp_size)
    slowest = float(whole.max(initial=0.0))
    long_lengths, counts = np.unique(lengths[~short], return_counts=True)
    if not len(long_lengths):
        return max(float(whole.sum()) / num_ranks, slowest)
    fewest = {}
    for s in long_lengths.tolist():
        try:
            fewest[s], _ = min_ring_size(s, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                         max_offload_ratio=max_offload_ratio, pp_size=pp_size)
        except ValueError:
            fewest[s] = num_ranks  # no plan exists; keep the bound finite
    sizer = RingSizer(long_lengths.tolist(), fewest, widest=lambda s: num_ranks, cost_model=cost_model,
                      pp_size=pp_size, fractional=True)
    return settle_target(sizer, counts=counts.tolist(), other_work=float(whole.sum()),
                         floor=max(slowest, sizer.floor()), num_ranks=num_ranks, slack=0.0, from_below=True)


def gap(plan: StepPlan, *, cost_model: CostModel, max_offload_ratio: float = 1.0) -> float:
    """est_step_time / lower bound - 1 for a plan (0: provably optimal under the cost model)."""
    bound = step_time_lower_bound(plan.lengths, num_ranks=plan.num_ranks, capacity=plan.capacity,
                                  cost_model=cost_model, pp_size=plan.pp_size, max_offload_ratio=max_offload_ratio)
    return plan.est_step_time / bound - 1.0 if bound > 0 else 0.0
