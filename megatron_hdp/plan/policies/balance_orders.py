"""balance's ring orders on small pools: its plan's rings placed by time in orders other than two.

`build_ranks` places rings by time widest first and narrowest first (the latter also from the latest
ranks ready); `reorder_rings` climbs from those orders to others (`search.ring_orders`), each order
built to a timed plan as `build_ranks` builds its by-time placements (whole sequences in the filler
slots, then after the rings), and keeps the fastest where it beats the plan. Only on pools of <=
`ORDER_POOL` ranks with 2-`ORDER_RINGS` rings, without PP: where a few rings decide the step (the
exact planner's cases, optimal_gap.py); each order is a full plan (~1 ms at 8 ranks).
"""

from __future__ import annotations

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import member_times
from megatron_hdp.plan.policies.balance_candidates import (PLACEMENT_MARGIN, BatchShare, fastest, node_domains,
                                                            place_by_time, placement_orders, rank_schedules)
from megatron_hdp.plan.search.placement import narrowest_first
from megatron_hdp.plan.search.ring_orders import climb_orders
from megatron_hdp.plan.timeline.assemble import TimedPlan

ORDER_POOL = 16
"""Largest pool on which balance searches ring orders (`reorder_rings`): a plan's cost grows with the pool."""

ORDER_RINGS = 12
"""Most rings for which balance searches their orders (the exact planner's cases have at most 12)."""

ORDER_BUDGET = 48
"""Most plans one search builds (~1 ms each at 8 ranks). On optimal_gap's 200 cases 48 find all that 64
find (case 8 at the exact planner's best plan), 32 leave case 8 2.6% above it, 24 3.3%
(benchmarks/README.md, optimal_gap section, session 20)."""


def reorder_rings(plan: TimedPlan, lengths: list[int], *, tokens: np.ndarray, num_ranks: int, capacity: int,
                  cost_model: CostModel, pp_size: int, vpp_size: int, exact: bool,
                  shared: BatchShare) -> TimedPlan:
    """Without PP (`pp_size` 1; the caller keeps to pools of <= `ORDER_POOL` ranks): `plan`, or the plan
    of its ring sizes and offload ratios with the rings placed by time in the order the climb finds
    (module doc) where that is faster: by any amount where `plan` is itself one of the by-time placements
    the climb starts from, else (its rings aligned, `place_rings`) by the `PLACEMENT_MARGIN` that
    `build_ranks` asks of a by-time placement."""
    ring_sizes = np.fromiter(map(len, plan.rings), dtype=np.int64, count=len(plan.rings))
    long_ids = np.flatnonzero(ring_sizes > 1)
    if not 2 <= len(long_ids) <= ORDER_RINGS:
        return plan
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    widest, whole_order = placement_orders(ring_sizes, weights)
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    nodes = node_domains(cost_model, num_ranks)
    offload_ratios = plan.offload_ratios
    built: dict[tuple[bool, tuple[int, ...]], TimedPlan] = {}

    def evaluate(latest_ready: bool, order: tuple[int, ...]) -> float:
        timed, left = place_by_time(order, latest_ready=latest_ready, ring_sizes=ring_sizes, weights=weights,
                                    whole_order=whole_order, tokens=tokens, num_ranks=num_ranks, capacity=capacity,
                                    overhead=overhead, domains=nodes)
        prepared = rank_schedules(timed.leading, timed.rings, timed.finish, left, lengths=lengths, weights=weights,
                                  tokens=tokens, capacity=capacity, pp_size=pp_size, vpp_size=vpp_size, exact=exact,
                                  overhead=overhead, contents=shared.contents)
        built[latest_ready, order] = fastest(prepared, lengths=lengths, offload_ratios=offload_ratios,
                                             capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                                             vpp_size=vpp_size)
        return built[latest_ready, order].est_step_time

    narrow = narrowest_first(widest, ring_sizes=ring_sizes)
    orders = [tuple(widest)] + ([tuple(narrow)] if narrow != widest else [])
    starts = [(latest_ready, order) for latest_ready in (False, True) for order in orders]
    step, latest_ready, order = climb_orders(starts, evaluate, budget=ORDER_BUDGET)
    # a start as fast as `plan` (its own by-time placement, or another of the same step): the climb then
    # weighs by-time placements against each other, by any gain; else `plan`'s aligned rings keep
    # `build_ranks`' margin. (Asking for `plan`'s own schedule among the starts instead loses 0.5-2% on
    # optimal_gap's seeds 1, 28, 58 and 63, whose plans reach a start's step with other whole documents.)
    by_time = any(abs(built[start].est_step_time - plan.est_step_time) <= 1e-12 * plan.est_step_time
                  for start in starts)
    margin = 1e-9 if by_time else PLACEMENT_MARGIN
    return built[latest_ready, order] if step < plan.est_step_time * (1 - margin) else plan
