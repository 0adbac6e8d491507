"""The `balance` policy: ByteScale's balance scheduler (Algorithm 2) plus a refinement pass.

ByteScale (arXiv 2502.21231) Sec. 6 observes that ranks only meet at the gradient all-reduce, so they may
run *different numbers* of micro-batches: the scheduler sorts sequences by compute and gives each to the
least-loaded rank(s), so a rank holding a 1M-token shard runs one micro-batch while its neighbours run
many short ones (DP-Balance). With PP (PP-Balance) the HDP ranks are pipelines; a pipeline's time is its
micro-batches' time plus the 1F1B fill/drain, which the plan models as (pp - 1) x its mean micro-batch
time (see `assemble.py`), and the same greedy balances pipelines on that time.

This implementation, step by step:
1. sharding: D(s) and offload ratio per sequence (`sharding.py`, Eq. 3);
2. widening (beyond the paper): a ring whose member time alone exceeds the ideal per-rank time W/D is
   spread over more ranks (k in [D(s), D], no more than needed), else it alone would set the step time;
3. rings, longest first, on aligned least-loaded ranks (`placement.place_rings`); ring micro-batches
   come first on every rank, so members reach them in step;
4. whole sequences by LPT on the ranks' loads (`placement.lpt`) — Algorithm 2's "least-loaded bucket";
5. refinement (`refine.py`): local search (moves and swaps off the slowest rank), and an exact HiGHS MILP
   on small instances;
6. each rank's whole sequences packed best-fit into micro-batches of <= C tokens (`packing.py`).

Deviation from the paper: Algorithm 2 forms micro-batches first and then assigns them; we assign
sequences to ranks first and pack per rank, which gives the same "different micro-batch counts" result
with finer granularity. `step_time_lower_bound` bounds any plan from below; `gap` reports how far a
plan is from it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.assemble import assemble_plan
from megatron_hdp.plan.cost_model import CostModel
from megatron_hdp.plan.packing import best_fit
from megatron_hdp.plan.placement import lpt, place_rings
from megatron_hdp.plan.sharding import shard_sequences, shard_time
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)


def whole_times(lengths: Sequence[int], *, cost_model: CostModel, pp_size: int = 1) -> np.ndarray:
    """Seconds of each sequence computed whole on one rank (per pipeline stage), by distinct length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    unique, inverse = np.unique(lengths, return_inverse=True)
    times = np.array([shard_time(cost_model, seq_len=int(s), num_tokens=int(s), ring_size=1, pp_size=pp_size)
                      for s in unique])
    return times[inverse]


def member_times(
    lengths: Sequence[int], ring_sizes: Sequence[int], *, cost_model: CostModel, pp_size: int = 1
) -> np.ndarray:
    """Seconds one ring member spends on its shard (ceil(s/k) tokens), per sequence."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ring_sizes = np.asarray(ring_sizes, dtype=np.int64)
    out = whole_times(lengths, cost_model=cost_model, pp_size=pp_size)
    for seq in np.flatnonzero(ring_sizes > 1).tolist():
        s, k = int(lengths[seq]), int(ring_sizes[seq])
        out[seq] = shard_time(cost_model, seq_len=s, num_tokens=-(-s // k), ring_size=k, pp_size=pp_size)
    return out


def step_time_lower_bound(
    lengths: Sequence[int], *, num_ranks: int, capacity: int, cost_model: CostModel, pp_size: int = 1
) -> float:
    """A lower bound on the step time of any plan of these lengths over `num_ranks` ranks.

    max(total work / D, largest whole sequence's time, largest ring member's time): a sequence of
    s <= C runs whole on one rank; a ring of k members does at least the work of the whole sequence
    (k * ceil(s/k) >= s tokens, each seeing s/2 keys on average) and a member at least a 1/k share of it,
    with k <= min(D, s). Micro-batch overheads and the PP fill/drain only add to a plan's time.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    whole = whole_times(lengths, cost_model=cost_model, pp_size=pp_size)
    bound = max(float(whole.sum()) / num_ranks, float(whole[lengths <= capacity].max(initial=0.0)))
    for s in np.unique(lengths[lengths > capacity]).tolist():
        widest = min(num_ranks, s)
        share = shard_time(cost_model, seq_len=s, num_tokens=s / widest, ring_size=1, pp_size=pp_size)
        bound = max(bound, share)
    return bound


def gap(plan: StepPlan, *, cost_model: CostModel) -> float:
    """est_step_time / lower bound - 1 of a plan (0 means provably optimal under the cost model)."""
    bound = step_time_lower_bound(plan.lengths, num_ranks=plan.num_ranks, capacity=plan.capacity,
                                  cost_model=cost_model, pp_size=plan.pp_size)
    return plan.est_step_time / bound - 1.0 if bound > 0 else 0.0


def plan_balance(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1
) -> StepPlan:
    """Plan a global batch with ByteScale's balance scheduler plus refinement (see the module doc)."""
    capacity = config.hdp_capacity
    sharding = shard_sequences(lengths, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                               max_offload_ratio=config.max_offload_ratio)
    ring_sizes = sharding.ring_sizes
    weights = member_times(lengths, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    long_ids = np.flatnonzero(ring_sizes > 1)
    order = long_ids[np.lexsort((long_ids, -weights[long_ids], -ring_sizes[long_ids]))].tolist()
    layout = place_rings(order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks)
    short_ids = np.flatnonzero(ring_sizes == 1)
    short_order = short_ids[np.lexsort((short_ids, -weights[short_ids]))].tolist()
    loads = layout.finish.copy()
    given = lpt(short_order, weights=weights, loads=loads)
    schedule = []
    for rank in range(num_ranks):
        items = given[rank]
        bins = best_fit([lengths[i] for i in items], capacity=capacity)
        schedule.append([[seq] for seq in layout.ring_microbatches[rank]] + [[items[j] for j in b] for b in bins])
    rings = [layout.rings.get(seq, (0,)) for seq in range(len(lengths))]
    for rank in range(num_ranks):
        for b in schedule[rank][len(layout.ring_microbatches[rank]):]:
            for seq in b:
                rings[seq] = (rank,)
    plan = assemble_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=sharding.offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size)
    logger.debug("balance plan: step %.4g s, gap to lower bound %.2f%%", plan.est_step_time,
                 100 * gap(plan, cost_model=cost_model))
    return plan
