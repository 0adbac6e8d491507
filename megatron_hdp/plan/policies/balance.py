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
   (`ring_shifts.shifted`, all members alike so rings stay aligned), and with virtual stages each shift
   also tried with Megatron's micro-batch group size G raised to cover every pipeline's ring
   micro-batches (`ring_shifts.group_sizes`, only where the resident activations fit,
   `ring_shifts.fits_memory`); the plan of least predicted step time kept, its G carried in the plan.

With expert parallelism (`CostModel.expert_parallel_size` e > 1) the members of an EP group run every
micro-batch together (the MoE all-to-all): steps 3-6 are also run with each EP group planned as a unit of
e lanes (`expert_units`: rings grown to whole units where that pays, lanes of one micro-batch index of
matching time, the same count on every lane): first, then rank by rank unless the unit plan is already
within `RETRY_GAP` of its mean rank time or the lower bound, and the plan of least predicted step time
under the EP coupling is kept; the alternative ring sizes are then tried in the family that planned better.
An EP-unit family whose placement's step floor (`ep_floor.ep_step_floor`, proven <= its timed step) is
already no better than the best plan so far is not timed (without PP): the same plan comes out.
A plan still that far from both is last compared with the plan made as if e = 1, timed with the coupling
and the routed expert work the all-to-all spreads (`timing.spread_expert_work`): where a micro-batch's
overhead is large, fewer micro-batches can beat matched lanes (`_with_coupling`). That pass re-times the
placements the EP pass made (`_Shared`: sharding, ring sizes and placements do not read the EP size).

Every candidate is compared by its predicted times only (`assemble.time_plan`, a `TimedPlan`); the
StepPlan of the one kept is built at the end (`TimedPlan.build`).

On pools of <= `SMALL_POOL` ranks with at most `CLIMB_LENGTHS` distinct lengths on rings, ring sizes
are also climbed a rank at a time (`neighbours`).

Without EP units or virtual stages, a plan still more than `RETRY_GAP` above both its mean rank time and
the lower bound is also compared with the static mesh's rings for the sequences longer than C only
(`_on_cp_groups`): each on the ring of a CP group of the smallest power of two that holds them all
(or of an aligned block of it), several per ring micro-batch, the groups chosen together with the whole
sequences beside them (`search.packed_rings`). Where most of a batch is longer than C (RL rollouts of
median ~5K against a C of 4K), rings of one sequence each must line up their micro-batch indices across
many sizes, which left balance 3-8% behind the frameworks' static CP; with this candidate it is level
with or ahead of it from 32 ranks on (`benchmarks/rl_rollouts.py`), up to 1.1% behind on 16.

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
from megatron_hdp.plan.search.cp_groups import group_size
from megatron_hdp.plan.search.expert_units import place_units, unit_options
from megatron_hdp.plan.search.neighbours import neighbours
from megatron_hdp.plan.search.packed_rings import pack_on_groups
from megatron_hdp.plan.search.packing import pack_for_pipelines
from megatron_hdp.plan.search.placement import fill_gaps, lpt, narrowest_first, place_rings, place_rings_by_time
from megatron_hdp.plan.search.refine import PipelineCost, refine_exact, refine_local, refine_pairs
from megatron_hdp.plan.search.ring_shifts import RING_SHIFTS, fits_memory, group_sizes, shifted
from megatron_hdp.plan.timeline.bounds import gap, step_time_lower_bound
from megatron_hdp.plan.timeline.ep_floor import ep_step_floor
from megatron_hdp.plan.cost.sharding import member_times, shard_sequences, whole_times
from megatron_hdp.plan.search.widening import widening_options
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)

PLACEMENT_MARGIN = 0.02
"""The by-time ring placement replaces the aligned one only when predicted this much faster: it couples
more ranks through rings at different indices, so a cost-model error costs it more waits (a demo step
where a 1% predicted gain measured worse than the aligned plan: benchmarks/results/observations.json,
entry "placement-margin")."""

SMALL_POOL = 64
"""Largest pool on which balance also places rings by time narrowest first (`narrowest_first`; once more
from the latest ranks ready for each ring, `place_rings_by_time(latest_ready=True)`) and climbs
ring sizes one rank at a time (`neighbours`): where a few rings decide the step (the exact planner's
worst cases); at 1,024 ranks the first alone cost 40 ms of a 65 ms plan."""

CLIMB_ROUNDS = 4
"""Most rounds of the ring-size climb (each builds at most two plans per distinct long length). Without
PP only: with PP every plan is `improvable`, and all rounds took an 8-rank byted plan from 11 to 125 ms."""

CLIMB_LENGTHS = 12
"""Most distinct lengths on rings in the plan for which balance climbs ring sizes: a round builds two plans per length, and
a 64-rank RL batch with ~60 of them took 4-6 s to plan (against 0.14 s without the climb); the cases the
climb is for have a few rings (the exact planner's, <= 12 documents)."""

UNIT_PATIENCE = 4
"""Without PP, the EP-unit plans of the alternative ring sizes (lower targets, ever wider rings) stop after
this many in a row that do not beat the best: their step times fall and rise again along the ladder
(DeepSeek-V3 at EP 32: 15 families of ~20 ms, the best the 6th). Not proven: a line search, checked on
the EP cells of benchmarks/README.md (plan_bench EP) against running them all."""

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
    overhead: float = 0.0,
) -> list[list[int]]:
    """Whole sequences to ranks: LPT, then local search (on small pools without PP also exchanges of two
    sequences, `refine_pairs`), then (if `exact`, no PP, at most `exact_limit`
    variables) the MILP — skipped when the assignment already meets a simple lower bound. `overhead`: a
    micro-batch's own time (`refine_pairs` counts the micro-batches an exchange adds)."""
    loads = base.copy()
    given = lpt(order, weights=weights, loads=loads)
    given = refine_local(given, weights=weights, base=base, tokens=tokens, cost=cost)
    num_ranks = len(base)
    if cost.pp_size == 1 and num_ranks <= SMALL_POOL:
        given = refine_pairs(given, weights=weights, base=base, tokens=tokens, capacity=cost.capacity,
                             overhead=overhead)
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
    shared: _Shared | None = None,
) -> TimedPlan:
    """`plan_balance`'s plan, timed but not built: every candidate is compared as a `TimedPlan`. `shared`:
    what the plan made as if EP 1 takes from the EP plan's (`_Shared`)."""
    capacity = config.hdp_capacity
    tokens = np.asarray(lengths, dtype=np.int64)  # once: the array steps below would each convert the list
    shared = _Shared() if shared is None else shared
    if shared.options is None:
        shared.sharding = shard_sequences(tokens, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                          max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
        shared.options = widening_options(
            tokens, shared.sharding.ring_sizes, shared.sharding.offload_ratios, num_ranks=num_ranks,
            capacity=capacity, cost_model=cost_model, max_offload_ratio=config.max_offload_ratio, pp_size=pp_size,
            alternatives=True)
    sharding, options = shared.sharding, shared.options
    common = dict(tokens=tokens, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                  vpp_size=vpp_size, exact=exact, shared=shared)
    ranks = [(_build, option) for option in options]
    units = []
    if cost_model.expert_parallel_size > 1:  # EP groups planned as units; plans rank by rank stay candidates
        units = [(_build_units, option) for option in unit_options(options, lengths=tokens, capacity=capacity,
                                                                   cost_model=cost_model, pp_size=pp_size)]
    bound = functools.partial(shared.bound, tokens, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model,
                              max_offload_ratio=config.max_offload_ratio)

    def improvable(plan: TimedPlan) -> bool:  # with PP always; else above both its mean rank time and the bound
        mean = sum(plan.rank_times) / num_ranks
        return pp_size > 1 or (plan.est_step_time > RETRY_GAP * mean and plan.est_step_time > RETRY_GAP * bound())

    plan, family = _best(lengths, (units or ranks)[:1], None, **common)
    if units and improvable(plan):  # the plan rank by rank, when the units' leaves room
        plan, family = _best(lengths, ranks[:1], (plan, family), **common)
    if improvable(plan):  # the alternatives of the family that planned better (both when rank by rank did)
        best = _best(lengths, units[1:], (plan, family), patience=UNIT_PATIENCE if pp_size == 1 else None, **common)
        plan, _ = _best(lengths, ranks[1:] if family is _build else [], best, **common)
    if not units and pp_size == 1 and num_ranks <= SMALL_POOL and len(
            {length for length, ring in zip(lengths, plan.rings) if len(ring) > 1}) <= CLIMB_LENGTHS:
        for _ in range(CLIMB_ROUNDS):  # ring sizes no one target gives, a rank at a time
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
    if not units and vpp_size == 1 and improvable(plan):  # the static mesh's rings for the sequences beyond C
        plan = min([plan, *_on_cp_groups(lengths, **common)], key=lambda p: p.est_step_time)
    if units and improvable(plan):  # still room: the plan made as if EP 1, timed with the coupling
        plan = min(plan, _with_coupling(_plan_balance(lengths, num_ranks=num_ranks, config=config,
                                                      cost_model=dataclasses.replace(cost_model, expert_parallel_size=1),
                                                      pp_size=pp_size, vpp_size=vpp_size, exact=exact,
                                                      shared=shared), cost_model, shared),
                   key=lambda p: p.est_step_time)
    return plan


def _on_cp_groups(
    lengths: list[int],
    *,
    tokens: np.ndarray,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
    shared: _Shared,
) -> list[TimedPlan]:
    """The sequences longer than C packed on CP groups' rings, the others whole beside them
    (`search.packed_rings`, groups of the smallest power of two whose ring holds each of them), then steps
    4-6 as in `_build` from there; [] where nothing is longer than C or no group holds them all."""
    long_ids = np.flatnonzero(tokens > capacity)
    cp = group_size(tokens[long_ids].tolist(), capacity=capacity, num_ranks=num_ranks) if len(long_ids) else None
    if cp is None:
        return []
    whole_ids = np.flatnonzero(tokens <= capacity)
    rings, leading, finish, whole = pack_on_groups(
        tokens, long_ids=long_ids, whole_ids=whole_ids, cp=cp, num_ranks=num_ranks, capacity=capacity,
        whole_seconds=whole_times(tokens[whole_ids], cost_model=cost_model, pp_size=pp_size),
        cost_model=cost_model, pp_size=pp_size)
    sizes = np.ones(len(tokens), dtype=np.int64)
    sizes[list(rings)] = [len(ring) for ring in rings.values()]  # some run on a block of a group
    weights = member_times(tokens, sizes, cost_model=cost_model, pp_size=pp_size)
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    prepared = _schedules(leading, rings, finish, [], given=whole, lengths=lengths, weights=weights, tokens=tokens,
                          capacity=capacity, pp_size=pp_size, vpp_size=vpp_size, exact=exact, overhead=overhead,
                          contents=shared.contents)
    return [_finish(prepared, lengths=lengths, offload_ratios=np.zeros(len(lengths)), capacity=capacity,
                    cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size)]


@dataclasses.dataclass
class _Shared:
    """What balance's plans of one batch share between cost models that differ only in the EP size (the
    plan made as if EP 1 beside the EP plan): the sharding and ring-size options, each placement's
    schedules with their `TimingCache`, by (ring sizes, offload ratios, placement), and the lower bound.
    None of these read the EP size (it enters only where a plan is timed: the coupling, the spread expert
    work, the all-to-all; the bound only through the all-to-all's time per token, its key), so the EP-1
    pass re-times the placements the EP pass made instead of making them again."""

    sharding: object = None
    options: list | None = None
    schedules: dict = dataclasses.field(default_factory=dict)
    contents: dict = dataclasses.field(default_factory=dict)
    """Ring micro-batch times by content (`TimingCache.contents`), shared by every placement's cache."""

    bounds: dict = dataclasses.field(default_factory=dict)
    """`step_time_lower_bound` by the all-to-all's seconds per token (`bound`)."""

    def bound(self, tokens: np.ndarray, *, cost_model: CostModel, **limits) -> float:
        """`step_time_lower_bound(tokens, cost_model=cost_model, **limits)`, computed once per batch for
        cost models of one all-to-all time per token: the bound reads the EP size only there (0 at EP 1,
        where the EP-1 pass of a model without the all-to-all's transfers reuses the EP pass's bound)."""
        key = cost_model.expert_alltoall_seconds_per_token()
        if key not in self.bounds:
            self.bounds[key] = step_time_lower_bound(tokens, cost_model=cost_model, **limits)
        return self.bounds[key]

    def get(self, key: tuple, make):
        """`make()`'s schedules (`_schedules`) for placement `key`, made once."""
        if key not in self.schedules:
            self.schedules[key] = make()
        return self.schedules[key]


def _with_coupling(plan: TimedPlan, cost_model: CostModel, shared: _Shared) -> TimedPlan:
    """`plan`'s placement timed under `cost_model` (its EP coupling, the all-to-all's spread expert work),
    with the `TimingCache` of the placement it came from (found by its schedule among `shared`'s)."""
    cache = next((cache for _, candidates, cache in shared.schedules.values()
                  if any(schedule is plan.schedule for schedule, _ in candidates)), None)
    return time_plan(**plan.decisions(), cost_model=cost_model, shared=cache)


def _best(lengths: list[int], builds: list, best: tuple | None, *, patience: int | None = None,
          **common) -> tuple[TimedPlan, object]:
    """(plan, builder) of least predicted step time among `best` and the plans `builds` make, each a
    (builder, option) pair: `_build` plans rank by rank, `_build_units` EP groups as units. With `patience`,
    stop after that many plans in a row that do not beat the best (`UNIT_PATIENCE`). An EP-unit family is
    told the step to beat, and skips its timing where it provably cannot (`_build_units`: None); it counts
    as a plan that did not beat the best, as its timed plan would have."""
    worse = 0
    for build, (ring_sizes, offload_ratios) in builds:
        beat = {} if best is None or build is not _build_units else {"beat": best[0].est_step_time * (1 - 1e-9)}
        candidate = build(lengths, ring_sizes, offload_ratios, **common, **beat)
        if candidate is not None and (best is None or candidate.est_step_time < best[0].est_step_time * (1 - 1e-9)):
            best, worse = (candidate, build), 0
        elif patience is not None and (worse := worse + 1) >= patience:
            break
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
    shared: _Shared,
) -> TimedPlan:
    """Steps 3-6 of the module doc for one choice of ring sizes (`tokens`: the lengths as an array); each
    placement's schedules are made once per batch (`shared`) and timed under `cost_model`."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    long_ids = np.flatnonzero(ring_sizes > 1)
    order = long_ids[np.lexsort((long_ids, -weights[long_ids], -ring_sizes[long_ids]))].tolist()
    whole_ids = np.flatnonzero(ring_sizes == 1)
    whole_order = whole_ids[np.lexsort((whole_ids, -weights[whole_ids]))].tolist()
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    common = dict(lengths=lengths, weights=weights, tokens=tokens, capacity=capacity, pp_size=pp_size,
                  vpp_size=vpp_size, exact=exact, overhead=overhead, contents=shared.contents)
    timing = dict(lengths=lengths, offload_ratios=offload_ratios, capacity=capacity, cost_model=cost_model,
                  pp_size=pp_size, vpp_size=vpp_size)
    key = (ring_sizes.tobytes(), offload_ratios.tobytes())

    def aligned():
        layout = place_rings(order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks)
        return _schedules([[[seq] for seq in ring_mbs] for ring_mbs in layout.ring_microbatches], layout.rings,
                          layout.finish, whole_order, **common)

    def by_time(ring_order: list[int], latest_ready: bool = False):
        timed = place_rings_by_time(ring_order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks,
                                    overhead=overhead, domains=nodes, latest_ready=latest_ready)
        left = fill_gaps(timed, whole_order, weights=weights, tokens=tokens, capacity=capacity)
        return _schedules(timed.leading, timed.rings, timed.finish, left, **common)

    plan = _finish(shared.get(key + ("aligned",), aligned), **timing)
    nodes = None if cost_model.ranks_per_node is None else np.arange(num_ranks) // cost_model.ranks_per_node
    mean = sum(plan.rank_times) / num_ranks
    floor = overhead + float(weights.max(initial=0.0))  # no placement beats the heaviest micro-batch
    can_replace = plan.est_step_time * (1 - PLACEMENT_MARGIN) > floor
    # rings that leave ranks idle, or a topology the aligned placement ignores: also place them by time
    if order and can_replace and ((plan.est_step_time > RETRY_GAP * max(mean, floor)) or nodes is not None):
        variants = [(order, False)]
        if num_ranks <= SMALL_POOL:  # narrow rings first, and then also from the latest ranks ready
            narrow = narrowest_first(order, ring_sizes=ring_sizes)
            variants += ([(narrow, False)] if narrow != order else []) + [(narrow, True)]
        for tag, (ring_order, latest_ready) in enumerate(variants):
            candidate = _finish(shared.get(key + ("by time", tag), lambda: by_time(ring_order, latest_ready)),
                                **timing)
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
    shared: _Shared,
    beat: float | None = None,
) -> TimedPlan | None:
    """The plan of one choice of ring sizes with expert parallelism: EP groups planned as units of lanes
    (`expert_units.place_units`); with PP each unit's rows are tried heaviest first and lightest first.
    `exact` is for the signature of `_build` (no MILP here); `shared` gives the batch's ring micro-batch
    times by content. Without PP, None (not timed) when the placement's step floor
    (`ep_floor.ep_step_floor`, <= its timed step) is at least `beat`: it could not beat the best plan."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    full = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    placed = place_units(ring_sizes=ring_sizes, weights=weights, tokens=tokens, num_ranks=num_ranks,
                         ep_size=cost_model.expert_parallel_size, capacity=capacity,
                         overhead=cost_model.microbatch_time([], pp_size=pp_size), full=full,
                         fine_work=num_ranks * full,
                         alltoall=cost_model.expert_alltoall_seconds_per_token(pp_size=pp_size))
    best = None
    rings = placed.rings(len(lengths))
    schedules = list(placed.schedules(lightest_first=(False, True) if pp_size > 1 else (False,)))
    if beat is not None and pp_size == 1 and ep_step_floor(schedules[0], rings=rings, lengths=lengths,
                                                           cost_model=cost_model) >= beat:
        return None
    cache = TimingCache(contents=shared.contents)
    for schedule in schedules:
        plan = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size, shared=cache)
        if best is None or plan.est_step_time < best.est_step_time * (1 - 1e-9):
            best = plan
    return best


def _schedules(
    leading: list[list[list[int]]],
    ring_of: dict[int, tuple[int, ...]],
    finish: np.ndarray,
    whole_order: list[int],
    *,
    given: list[list[int]] | None = None,
    lengths: list[int],
    weights: np.ndarray,
    tokens: np.ndarray,
    capacity: int,
    pp_size: int,
    vpp_size: int,
    exact: bool,
    overhead: float,
    contents: dict,
) -> tuple[list[tuple[int, ...]], list[tuple[list, int | None]], TimingCache]:
    """Steps 4-6 after a ring placement, up to the timing: `leading[r]` are rank r's micro-batches up to its
    last ring (sequence ids per micro-batch), `finish[r]` when it is done with them; the whole sequences of
    `whole_order` go after them (`assign_whole`), or those `given` per rank, which local search
    (`refine_local`) starts from. Returns every sequence's ring, the (schedule, group size) candidates
    (`_finish` times them) and the `TimingCache` they share (with the batch's `contents`)."""
    num_ranks = len(leading)
    counts = np.array([len(mbs) for mbs in leading], dtype=np.int64)
    cost = PipelineCost(pp_size, capacity, counts, vpp_size)
    if given is not None:
        given = refine_local(given, weights=weights, base=finish, tokens=tokens, cost=cost)
    else:
        given = assign_whole(whole_order, weights=weights, tokens=tokens, base=finish, cost=cost, exact=exact,
                             overhead=overhead)
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
    most_rings = max(map(len, leads), default=0)
    candidates = []
    for shift in RING_SHIFTS if pp_size > 1 else (0,):
        schedule = [shifted(lead, bins, shift, weight=lambda mb: sum(map(seconds.__getitem__, mb)))
                    for lead, bins in zip(leads, packed)]
        candidates += [(schedule, group) for group in group_sizes(pp_size, vpp_size, shift + most_rings)]
    return rings, candidates, TimingCache(contents=contents)  # every shift and group size has the same rings


def _finish(
    prepared: tuple[list[tuple[int, ...]], list[tuple[list, int | None]], TimingCache],
    *,
    lengths: list[int],
    offload_ratios: np.ndarray,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
) -> TimedPlan:
    """The candidate of `_schedules`' `prepared` of least predicted step time under `cost_model` (a group
    size above Megatron's default only where the activations fit, `fits_memory`)."""
    rings, candidates, shared = prepared
    best = None
    for schedule, group in candidates:
        plan = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size, group_size=group, shared=shared)
        better = best is None or plan.est_step_time < best.est_step_time * (1 - 1e-9)
        if better and (group is None or fits_memory(plan)):
            best = plan
    return best
