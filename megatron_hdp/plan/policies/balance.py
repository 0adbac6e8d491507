"""The `balance` policy: ByteScale's balance scheduler (Algorithm 2) plus a refinement pass.

ByteScale (arXiv 2502.21231) Sec. 6 observes that ranks only meet at the gradient all-reduce, so they may
run *different numbers* of micro-batches. Algorithm 2 sorts sequences by length, groups them into
buckets of similar compute, and greedily gives each bucket to the rank with the most idle time, so a
rank holding a 1M-token shard runs one micro-batch while its neighbours run many short ones
(DP-Balance); ranks that compute together (a ring) should run micro-batches of similar time. With PP
(PP-Balance) the HDP ranks are pipelines and a pipeline's micro-batches should take similar times, or
the 1F1B bubbles grow; the plan times a pipeline by its exact 1F1B makespan (`pipeline.py`), which a
heavy micro-batch dominates.

This implementation, step by step:
1. sharding: D(s) and offload ratio per sequence (`sharding.py`, Eq. 3);
2. widening (beyond the paper, `widening.py`): a ring whose member time would set the step time gets
   more than D(s) ranks — the fewest that meet a step-time target settled against the total work;
   with PP the target is also capped at one full micro-batch's time, so micro-batches stay comparable.
   Alternative ring sizes (lower targets; with PP lower caps) are planned too when the first plan leaves
   ranks idle (ring members share a micro-batch index, which can strand ranks) or PP is on, and the
   plan of least predicted step time is kept;
3. rings, most ranks first, placed two ways and the plan of least predicted step time kept:
   on aligned least-loaded ranks with rings first (`placement.place_rings`), and by predicted start time
   at any micro-batch index (`placement.place_rings_by_time`), whole sequences filling the filler slots
   before a ring while the rank waits for the ring's other members (`placement.fill_gaps`) — the latter
   when the aligned plan's step exceeds both the mean rank time and its heaviest micro-batch by more than
   `RETRY_GAP`, or the cost model knows the nodes, and never when it could not win by `PLACEMENT_MARGIN`
   (the aligned step within that margin of the heaviest micro-batch, which no placement beats);
4. whole sequences, heaviest first, each to the least-loaded rank (`placement.lpt`);
5. refinement (`refine.py`): local search (moves and swaps off the slowest rank; with PP on the
   pipeline time), and on request (`exact=True`) an exact HiGHS MILP on small instances;
6. each rank's whole sequences packed best-fit into micro-batches of <= C tokens (`packing.py`); with PP
   the token budget (C / n, and with virtual stages the one that fills the count the interleaved
   schedule pads to) and order (heaviest or lightest first) whose makespan in Megatron's pipeline order
   is smallest; then the rings of every pipeline moved by 0-3 indices behind its lightest micro-batches
   (`shifted`, all members alike so rings stay aligned), and with virtual stages each shift also tried
   with Megatron's micro-batch group size G raised to cover every pipeline's ring micro-batches
   (`group_sizes`, only where the resident activations fit, `fits_memory`); the plan of least predicted
   step time kept, its G carried in the plan for the runtime.

With expert parallelism (`CostModel.expert_parallel_size` e > 1) the members of an EP group run every
micro-batch together (the MoE all-to-all): steps 3-6 are also run with each EP group planned as a unit of
e lanes (`expert_units`: rings grown to whole units where that pays, lanes of one micro-batch index of
matching time, the same count on every lane): first, then rank by rank unless the unit plan is already
within `RETRY_GAP` of its mean rank time or the lower bound, and the plan of least predicted step time
under the EP coupling is kept; the alternative ring sizes are then tried in the family that planned better.
A plan still that far from both is last compared with the plan made as if e = 1, timed with the coupling
and the routed expert work the all-to-all spreads (`timing.spread_expert_work`): where a micro-batch's
overhead is large, fewer micro-batches can beat matched lanes (`_with_coupling`).

Deviations from the paper: Algorithm 2 forms buckets (micro-batches) first and then assigns them; we
assign sequences to ranks first and pack per rank, which gives the same "different micro-batch counts"
result at finer granularity. PP-Balance clusters similar lengths into one pipeline; here each pipeline's
micro-batches are made alike by ring widening (ring micro-batches no heavier than a full one, lighter
caps tried) and by packing to the budget that minimises the exact 1F1B makespan. `bounds.step_time_lower_bound` bounds any plan from below; `bounds.gap`
reports how far a plan is from it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.timeline.assemble import TimedPlan, TimingCache, gc_paused, time_plan
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.search.expert_units import place_units, unit_options
from megatron_hdp.plan.timeline.interleaved import pipelines_fit
from megatron_hdp.plan.search.neighbours import neighbours
from megatron_hdp.plan.search.packing import pack_for_pipelines
from megatron_hdp.plan.search.placement import fill_gaps, lpt, narrowest_first, place_rings, place_rings_by_time
from megatron_hdp.plan.search.refine import PipelineCost, refine_exact, refine_local
from megatron_hdp.plan.timeline.bounds import gap, step_time_lower_bound
from megatron_hdp.plan.cost.sharding import member_times, shard_sequences, whole_times
from megatron_hdp.plan.search.widening import widening_options
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.timing import runtime_microbatch_counts

logger = logging.getLogger(__name__)

PLACEMENT_MARGIN = 0.02
"""The by-time ring placement replaces the aligned one only when predicted this much faster: it couples
more ranks through rings at different indices, so a cost-model error costs it more waits (a demo step
where a 1% predicted gain measured worse than the aligned plan: benchmarks/results/observations.json,
entry "placement-margin")."""

SMALL_POOL = 64
"""Largest pool on which balance also places rings by time narrowest first (`narrowest_first`) and climbs
ring sizes one rank at a time (`neighbours`): where a few rings decide the step (the exact planner's
worst cases); at 1,024 ranks the first alone cost 40 ms of a 65 ms plan."""

CLIMB_ROUNDS = 4
"""Most rounds of the ring-size climb (each builds at most two plans per distinct long length). Without
PP only: with PP every plan is `improvable`, and all rounds took an 8-rank byted plan from 11 to 125 ms."""

RETRY_GAP = 1.02
"""A plan whose step exceeds both the mean rank time and the lower bound by more than this factor tries
the alternative ring sizes (an imbalance the bound shows to be inherent is not worth the extra plans)."""


def assign_whole(
    order: Sequence[int],
    *,
    weights: np.ndarray,
    tokens: np.ndarray,
    base: np.ndarray,
    cost: PipelineCost,
    exact: bool = False,
    exact_limit: int = 256,
) -> list[list[int]]:
    """Whole sequences to ranks: LPT, then local search, then (if `exact`, no PP, at most `exact_limit`
    variables) the MILP — skipped when the assignment already meets a simple lower bound."""
    loads = base.copy()
    given = lpt(order, weights=weights, loads=loads)
    given = refine_local(given, weights=weights, base=base, tokens=tokens, cost=cost)
    num_ranks = len(base)
    if exact and cost.pp_size == 1 and 1 < num_ranks and len(order) * num_ranks <= exact_limit:
        totals = base + np.array([weights[r].sum() for r in given])
        bound = max(float(base.max()), float(totals.sum()) / num_ranks,
                    float(weights[list(order)].max(initial=0.0)) + float(base.min()))
        if totals.max() > bound * (1 + 1e-9):
            given = refine_exact(given, weights=weights, base=base)
    return given


def plan_balance(
    lengths: list[int],
    *,
    num_ranks: int,
    config: HDPConfig,
    cost_model: CostModel,
    pp_size: int = 1,
    vpp_size: int = 1,
    exact: bool = False,
) -> StepPlan:
    """Plan a global batch with ByteScale's balance scheduler plus refinement (see the module doc).

    `exact=True` adds the MILP on small instances (<= 256 sequence-rank pairs): it often shaves a few
    percent off a tiny batch's step but can take a second, so the per-step runtime leaves it off.
    """
    with gc_paused():  # the whole build allocates ~100K short-lived objects (see `assemble.gc_paused`)
        plan = _plan_balance(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model,
                             pp_size=pp_size, vpp_size=vpp_size, exact=exact).build()
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("balance plan: step %.4g s, gap to the lower bound %.2f%%", plan.est_step_time,
                     100 * gap(plan, cost_model=cost_model))
    return plan


def _plan_balance(
    lengths: list[int],
    *,
    num_ranks: int,
    config: HDPConfig,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
) -> TimedPlan:
    """`plan_balance`'s plan, timed but not built: every candidate is compared as a `TimedPlan`."""
    capacity = config.hdp_capacity
    tokens = np.asarray(lengths, dtype=np.int64)  # once: the array steps below would each convert the list
    sharding = shard_sequences(tokens, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                               max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
    options = widening_options(
        tokens, sharding.ring_sizes, sharding.offload_ratios, num_ranks=num_ranks, capacity=capacity,
        cost_model=cost_model, max_offload_ratio=config.max_offload_ratio, pp_size=pp_size, alternatives=True)
    common = dict(tokens=tokens, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                  vpp_size=vpp_size, exact=exact)
    ranks = [(_build, option) for option in options]
    units = []
    if cost_model.expert_parallel_size > 1:  # EP groups planned as units; plans rank by rank stay candidates
        units = [(_build_units, option) for option in unit_options(options, lengths=tokens, capacity=capacity,
                                                                   cost_model=cost_model, pp_size=pp_size)]
    bound = functools.cache(lambda: step_time_lower_bound(tokens, num_ranks=num_ranks, capacity=capacity,
                                                          cost_model=cost_model,
                                                          max_offload_ratio=config.max_offload_ratio))

    def improvable(plan: TimedPlan) -> bool:  # with PP always; else above both its mean rank time and the bound
        mean = sum(plan.rank_times) / num_ranks
        return pp_size > 1 or (plan.est_step_time > RETRY_GAP * mean and plan.est_step_time > RETRY_GAP * bound())

    plan, family = _best(lengths, (units or ranks)[:1], None, **common)
    if units and improvable(plan):  # the plan rank by rank, when the units' leaves room
        plan, family = _best(lengths, ranks[:1], (plan, family), **common)
    if improvable(plan):  # the alternatives of the family that planned better (both when rank by rank did)
        plan, _ = _best(lengths, units[1:] + (ranks[1:] if family is _build else []), (plan, family), **common)
    if not units and pp_size == 1 and num_ranks <= SMALL_POOL:  # ring sizes no one target gives, a rank at a time
        for _ in range(CLIMB_ROUNDS):
            if not improvable(plan):
                break
            sizes = np.array([len(ring) for ring in plan.rings])
            ratios = np.asarray(plan.offload_ratios, dtype=np.float64)
            steps = neighbours(tokens, sizes, ratios, fewest=sharding.ring_sizes, num_ranks=num_ranks,
                               capacity=capacity, cost_model=cost_model, max_offload_ratio=config.max_offload_ratio,
                               pp_size=pp_size)
            climbed = _best(lengths, [(_build, option) for option in steps], (plan, family), **common)
            if climbed[0] is plan:
                break
            plan, family = climbed
    if units and improvable(plan):  # still room: the plan made as if EP 1, timed with the coupling
        plan = min(plan, _with_coupling(_plan_balance(lengths, num_ranks=num_ranks, config=config,
                                                      cost_model=dataclasses.replace(cost_model, expert_parallel_size=1),
                                                      pp_size=pp_size, vpp_size=vpp_size, exact=exact), cost_model),
                   key=lambda p: p.est_step_time)
    return plan


def _with_coupling(plan: TimedPlan, cost_model: CostModel) -> TimedPlan:
    """`plan`'s placement timed under `cost_model` (its EP coupling, the all-to-all's spread expert work)."""
    return time_plan(**plan.decisions(), cost_model=cost_model)


def _best(lengths: list[int], builds: list, best: tuple | None, **common) -> tuple[TimedPlan, object]:
    """(plan, builder) of least predicted step time among `best` and the plans `builds` make, each a
    (builder, option) pair: `_build` plans rank by rank, `_build_units` EP groups as units."""
    for build, (ring_sizes, offload_ratios) in builds:
        candidate = build(lengths, ring_sizes, offload_ratios, **common)
        if best is None or candidate.est_step_time < best[0].est_step_time * (1 - 1e-9):
            best = (candidate, build)
    return best


def _build(
    lengths: list[int],
    ring_sizes: np.ndarray,
    offload_ratios: np.ndarray,
    *,
    tokens: np.ndarray,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
) -> TimedPlan:
    """Steps 3-6 of the module doc for one choice of ring sizes (`tokens`: the lengths as an array)."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    long_ids = np.flatnonzero(ring_sizes > 1)
    order = long_ids[np.lexsort((long_ids, -weights[long_ids], -ring_sizes[long_ids]))].tolist()
    whole_ids = np.flatnonzero(ring_sizes == 1)
    whole_order = whole_ids[np.lexsort((whole_ids, -weights[whole_ids]))].tolist()
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    common = dict(lengths=lengths, weights=weights, tokens=tokens, offload_ratios=offload_ratios, capacity=capacity,
                  cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size, exact=exact, overhead=overhead)
    aligned = place_rings(order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks)
    plan = _finish([[[seq] for seq in ring_mbs] for ring_mbs in aligned.ring_microbatches], aligned.rings,
                   aligned.finish, whole_order, **common)
    nodes = None if cost_model.ranks_per_node is None else np.arange(num_ranks) // cost_model.ranks_per_node
    mean = sum(plan.rank_times) / num_ranks
    floor = overhead + float(weights.max(initial=0.0))  # no placement beats the heaviest micro-batch
    can_replace = plan.est_step_time * (1 - PLACEMENT_MARGIN) > floor
    # rings that leave ranks idle, or a topology the aligned placement ignores: also place them by time
    if order and can_replace and ((plan.est_step_time > RETRY_GAP * max(mean, floor)) or nodes is not None):
        narrow = narrowest_first(order, ring_sizes=ring_sizes) if num_ranks <= SMALL_POOL else order
        for ring_order in [order] + ([narrow] if narrow != order else []):
            timed = place_rings_by_time(ring_order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks,
                                        overhead=overhead, domains=nodes)
            left = fill_gaps(timed, whole_order, weights=weights, tokens=tokens, capacity=capacity)
            candidate = _finish(timed.leading, timed.rings, timed.finish, left, **common)
            if candidate.est_step_time < plan.est_step_time * (1 - PLACEMENT_MARGIN):
                plan = candidate
    return plan


def _build_units(
    lengths: list[int],
    ring_sizes: np.ndarray,
    offload_ratios: np.ndarray,
    *,
    tokens: np.ndarray,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
) -> TimedPlan:
    """The plan of one choice of ring sizes with expert parallelism: EP groups planned as units of lanes
    (`expert_units.place_units`); with PP each unit's rows are tried heaviest first and lightest first.
    `exact` is for the signature of `_build` (no MILP here)."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    full = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    placed = place_units(ring_sizes=ring_sizes, weights=weights, tokens=tokens, num_ranks=num_ranks,
                         ep_size=cost_model.expert_parallel_size, capacity=capacity,
                         overhead=cost_model.microbatch_time([], pp_size=pp_size), fine_work=num_ranks * full)
    best = None
    rings = placed.rings(len(lengths))
    shared = TimingCache()
    for schedule in placed.schedules(lightest_first=(False, True) if pp_size > 1 else (False,)):
        plan = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size, shared=shared)
        if best is None or plan.est_step_time < best.est_step_time * (1 - 1e-9):
            best = plan
    return best


def _finish(
    leading: list[list[list[int]]],
    ring_of: dict[int, tuple[int, ...]],
    finish: np.ndarray,
    whole_order: list[int],
    *,
    lengths: list[int],
    weights: np.ndarray,
    tokens: np.ndarray,
    offload_ratios: np.ndarray,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
    overhead: float,
) -> TimedPlan:
    """Steps 4-6 after a ring placement: `leading[r]` are rank r's micro-batches up to its last ring
    (sequence ids per micro-batch), `finish[r]` when it is done with them; the whole sequences of
    `whole_order` go after them."""
    num_ranks = len(leading)
    counts = np.array([len(mbs) for mbs in leading], dtype=np.int64)
    given = assign_whole(whole_order, weights=weights, tokens=tokens,
                         base=finish, cost=PipelineCost(pp_size, capacity, counts, vpp_size), exact=exact)
    rings: list[tuple[int, ...]] = [()] * len(lengths)
    for seq, ring in ring_of.items():
        rings[seq] = ring
    seconds = weights.tolist()  # Python floats: indexing them per item is far cheaper than the array
    leads, jobs = [], []
    for rank in range(num_ranks):
        whole = (rank,)  # one tuple shared by all the rank's whole sequences
        for mb in leading[rank]:
            for seq in mb:
                if seq not in ring_of:
                    rings[seq] = whole
        items = given[rank]
        for seq in items:
            rings[seq] = whole
        times = [overhead + sum(map(seconds.__getitem__, mb)) for mb in leading[rank]]
        jobs.append((list(map(lengths.__getitem__, items)), list(map(seconds.__getitem__, items)), times))
        leads.append([list(mb) for mb in leading[rank]])
    packed = [[[items[j] for j in b] for b in bins] for items, bins in zip(
        given, pack_for_pipelines(jobs, capacity=capacity, overhead=overhead, pp_size=pp_size, vpp_size=vpp_size))]
    best = None
    most_rings = max(map(len, leads), default=0)
    shared = TimingCache()  # every shift and group size has the same rings
    for shift in RING_SHIFTS if pp_size > 1 else (0,):
        schedule = [shifted(lead, bins, shift, weight=lambda mb: sum(map(seconds.__getitem__, mb)))
                    for lead, bins in zip(leads, packed)]
        for group in group_sizes(pp_size, vpp_size, shift + most_rings):
            plan = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=offload_ratios,
                             schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                             vpp_size=vpp_size, group_size=group, shared=shared)
            better = best is None or plan.est_step_time < best.est_step_time * (1 - 1e-9)
            if better and (group is None or fits_memory(plan)):
                best = plan
    return best


def group_sizes(pp_size: int, vpp_size: int, ring_span: int) -> list[int | None]:
    """The microbatch group sizes G a plan is tried with: Megatron's default (None: G = pp), and with
    virtual stages G = `ring_span` (the indices up to a pipeline's last ring micro-batch) when that is
    more than pp: then all its heavy ring micro-batches share the first group, and each one's chunks
    interleave with the others' instead of crossing the stages alone beside light ones (a heavy
    micro-batch alone in its group costs nearly its 1F1B crossing, pp x its time)."""
    if vpp_size == 1 or ring_span <= pp_size:
        return [None]
    return [None, ring_span]


def fits_memory(plan: TimedPlan) -> bool:
    """Whether every pipeline of `plan`, run with its group size, keeps no more activations than the
    capacity was sized for (`interleaved.pipelines_fit`; a micro-batch's resident tokens are those it
    holds up to C, offloading keeping the rest on the host; padding micro-batches hold none)."""
    counts = runtime_microbatch_counts([len(held) for held in plan.held], pp_size=plan.pp_size,
                                       vpp_size=plan.vpp_size, group_size=plan.group_size,
                                       rings={ring for ring in plan.rings if len(ring) > 1})
    tokens = [[min(num, plan.capacity) for num in held] + [0] * (count - len(held))
              for held, count in zip(plan.held, counts)]
    return pipelines_fit(tokens, capacity=plan.capacity, pp_size=plan.pp_size, vpp_size=plan.vpp_size,
                         group_size=plan.group_size)


RING_SHIFTS = (0, 1, 2, 3)
"""With PP, the micro-batch indices the rings are moved down by (`shifted`); the plan of least predicted
step time is kept."""


def shifted(lead: list[list[int]], bins: list[list[int]], shift: int, *, weight) -> list[list[int]]:
    """A pipeline's micro-batches with its rings `shift` indices later (PP-Balance: heavy micro-batches
    where the pipeline hides them). A heavy ring micro-batch crosses every stage one after the other;
    run first, the other stages wait through it with only the warm-up's forwards to do, and in the
    interleaved schedule a heavy micro-batch alone in its group of G has no other chunks to interleave
    with, while light micro-batches before it fill those waits. Every ring member moves its rings
    (`lead`, aligned on one index across members) by the same `shift`, so they stay aligned: the
    lightest `shift` of its whole-sequence `bins` go first, empty micro-batches where it has fewer (each
    costs the micro-batch overhead; with virtual stages they often replace padding that runs anyway). A
    pipeline without rings keeps its packing's order."""
    if not lead or not shift:
        return lead + bins
    by_weight = sorted(range(len(bins)), key=lambda i: weight(bins[i]))
    first = set(by_weight[:shift])
    before = [bins[i] for i in by_weight[:shift]] + [[] for _ in range(shift - len(first))]
    return before + lead + [b for i, b in enumerate(bins) if i not in first]
