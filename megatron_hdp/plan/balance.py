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
with finer granularity. `bounds.step_time_lower_bound` bounds any plan from below; `bounds.gap` reports
how far a plan is from it.
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
from megatron_hdp.plan.refine import PipelineCost, refine_exact, refine_local
from megatron_hdp.plan.bounds import gap
from megatron_hdp.plan.sharding import (
    fastest_ring_size,
    fits,
    max_member_tokens,
    member_times,
    needed_offload_ratio,
    shard_sequences,
    shard_time,
    whole_times,
)
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)


WIDEN_SLACK = 0.02
"""Rings are widened until their member time is within this fraction of the step-time target."""


def widen_rings(
    lengths: Sequence[int],
    ring_sizes: np.ndarray,
    offload_ratios: np.ndarray,
    *,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    max_offload_ratio: float,
    pp_size: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Spread long sequences whose member time would set the step time over more ranks.

    Target: (1 + WIDEN_SLACK) x max(total work / D, slowest short sequence, slowest long sequence at its
    fastest ring size). With PP (ByteScale's PP-Balance: micro-batches of a pipeline should take about
    the same time, else the 1F1B bubbles grow) the work term is capped at the time of one full
    micro-batch, a whole sequence of C tokens. A sequence above it gets the smallest k >= D(s) whose member time meets it; the
    target moves with the work the wider rings add, so this repeats until the ring sizes settle (three
    rounds at most). The slack matters: ring traffic makes a member's time flat near its minimum, and
    e.g. a 2M-token document reaches within 1% of its fastest time on 131 ranks where the exact minimum
    needs 314. Ring sizes stay <= min(D, s // 2) so chunks are non-empty. Returns new
    (ring_sizes, offload_ratios); offloading is re-decided for the smaller shards.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    long_lengths = np.unique(lengths[lengths > capacity]).tolist()
    if not long_lengths:
        return ring_sizes, offload_ratios
    first = {s: int(np.flatnonzero(lengths == s)[0]) for s in long_lengths}
    base_of = {s: int(ring_sizes[first[s]]) for s in long_lengths}

    def member(s: int, k: int) -> float:
        return shard_time(cost_model, seq_len=s, num_tokens=-(-s // k), ring_size=k, pp_size=pp_size)

    fastest: dict[int, int] = {}

    def fastest_of(s: int) -> int:
        if s not in fastest:
            fastest[s] = fastest_ring_size(lambda k: member(s, k), lo=base_of[s],
                                           hi=max(base_of[s], min(num_ranks, s // 2)))
        return fastest[s]

    # A longer sequence is slower at every ring size, so the longest one sets the floor.
    longest = long_lengths[-1]
    short_times = whole_times(lengths[lengths <= capacity], cost_model=cost_model, pp_size=pp_size)
    floor = max(float(short_times.max(initial=0.0)), member(longest, fastest_of(longest)))
    full_microbatch = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    sizes = ring_sizes.copy()
    chosen = dict(base_of)
    for _ in range(3):
        work = float((member_times(lengths, sizes, cost_model=cost_model, pp_size=pp_size) * sizes).sum())
        spread = work / num_ranks if pp_size == 1 else min(work / num_ranks, full_microbatch)
        target = (1 + WIDEN_SLACK) * max(spread, floor)
        previous = dict(chosen)
        for s in long_lengths:
            lo = base_of[s]
            if member(s, lo) <= target:
                chosen[s] = lo
                continue
            hi = fastest_of(s)  # the member time decreases on [D(s), fastest]
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if member(s, mid) > target else (lo, mid)
            chosen[s] = lo
        if chosen == previous:
            break
        sizes = ring_sizes.copy()
        for s, k in chosen.items():
            if k != base_of[s]:
                sizes[lengths == s] = k
    ratios = offload_ratios.copy()
    for s, k in chosen.items():
        if k == base_of[s]:
            continue
        held = max_member_tokens(s, k)
        if fits(cost_model, seq_len=s, ring_size=k, num_tokens=held, capacity=capacity,
                max_offload_ratio=max_offload_ratio, pp_size=pp_size):
            ratios[lengths == s] = needed_offload_ratio(cost_model, num_tokens=held, capacity=capacity)
        else:
            sizes[lengths == s] = base_of[s]
    return sizes, ratios


def assign_whole(
    order: Sequence[int],
    *,
    weights: np.ndarray,
    tokens: np.ndarray,
    base: np.ndarray,
    cost: PipelineCost,
    exact_limit: int = 256,
) -> list[list[int]]:
    """Whole sequences to ranks: LPT, then local search, then (small instances, no PP) the exact MILP."""
    loads = base.copy()
    given = lpt(order, weights=weights, loads=loads)
    given = refine_local(given, weights=weights, base=base, tokens=tokens, cost=cost)
    num_ranks = len(base)
    if cost.pp_size == 1 and 1 < num_ranks and len(order) * num_ranks <= exact_limit:
        totals = base + np.array([weights[r].sum() for r in given])
        bound = max(float(base.max()), float(totals.sum()) / num_ranks,
                    float(weights[list(order)].max(initial=0.0)) + float(base.min()))
        if totals.max() > bound * (1 + 1e-9):
            given = refine_exact(given, weights=weights, base=base)
    return given


def plan_balance(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1
) -> StepPlan:
    """Plan a global batch with ByteScale's balance scheduler plus refinement (see the module doc)."""
    capacity = config.hdp_capacity
    sharding = shard_sequences(lengths, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                               max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
    ring_sizes, offload_ratios = widen_rings(
        lengths, sharding.ring_sizes, sharding.offload_ratios, num_ranks=num_ranks, capacity=capacity,
        cost_model=cost_model, max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
    weights = member_times(lengths, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    long_ids = np.flatnonzero(ring_sizes > 1)
    order = long_ids[np.lexsort((long_ids, -weights[long_ids], -ring_sizes[long_ids]))].tolist()
    layout = place_rings(order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks)
    whole_ids = np.flatnonzero(ring_sizes == 1)
    whole_order = whole_ids[np.lexsort((whole_ids, -weights[whole_ids]))].tolist()
    ring_counts = np.array([len(m) for m in layout.ring_microbatches], dtype=np.int64)
    given = assign_whole(whole_order, weights=weights, tokens=np.asarray(lengths, dtype=np.int64),
                         base=layout.finish, cost=PipelineCost(pp_size, capacity, ring_counts))
    rings: list[tuple[int, ...]] = [layout.rings.get(seq, ()) for seq in range(len(lengths))]
    schedule = []
    for rank in range(num_ranks):
        items = given[rank]
        for seq in items:
            rings[seq] = (rank,)
        bins = best_fit([lengths[i] for i in items], capacity=capacity)
        schedule.append([[seq] for seq in layout.ring_microbatches[rank]] + [[items[j] for j in b] for b in bins])
    plan = assemble_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size)
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("balance plan: step %.4g s, gap to the lower bound %.2f%%", plan.est_step_time,
                     100 * gap(plan, cost_model=cost_model))
    return plan
