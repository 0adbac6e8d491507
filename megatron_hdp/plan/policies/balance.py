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
within `RETRY_GAP` of its mean rank time or the lower bound (or, on a large pool without PP, the batch
holds `UNITS_ONLY_DEPTH` C-token micro-batches a rank or more: units alone plan it), and the plan of
least predicted step time under the EP coupling is kept; the alternative ring sizes are then tried in the
family that planned better (EP units: only where no family of rings within capacity beat the first,
`expert_units.unit_options`).
An EP-unit family whose placement's step floor (`ep_floor.ep_step_floor`, proven <= its timed step) is
already no better than the best plan so far is not timed (without PP): the same plan comes out. Likewise a
by-time placement rank by rank whose rings alone bound every completion (`ep_floor.ep_prefix_floor`, the
rings' coupling included) at or above what it must beat (the aligned plan less `PLACEMENT_MARGIN`, or the
best plan so far) is not assigned, packed nor timed.
A plan still that far from both (and not planned by units alone) is last compared with the plan made as
if e = 1, timed with the coupling and the routed expert work the all-to-all spreads
(`timing.spread_expert_work`): where a micro-batch's overhead is large, fewer micro-batches can beat
matched lanes (`with_coupling`). That pass re-times the placements the EP pass made (`BatchShare`:
sharding, ring sizes and placements do not read the EP size).

Every candidate is compared by its predicted times only (`assemble.time_plan`, a `TimedPlan`); the
StepPlan of the one kept is built at the end (`TimedPlan.build`).

On pools of <= `SMALL_POOL` ranks with at most `CLIMB_LENGTHS` distinct lengths on rings, ring sizes
are also climbed a rank at a time (`neighbours`). On pools of <= `balance_orders.ORDER_POOL` ranks without
PP, a plan still `RETRY_GAP` above the lower bound has its rings placed by time in other orders than
widest and narrowest first (`balance_orders.reorder_rings`: optimal_gap case 8, 6.3% faster).

Without EP units or virtual stages, a plan still more than `RETRY_GAP` above both its mean rank time and
the lower bound is also compared with the static mesh's rings for the sequences longer than C only
(`build_on_cp_groups`): each on the ring of a CP group of the smallest power of two that holds them all
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

The candidate builders, and the margins they decide by (`PLACEMENT_MARGIN`, `RETRY_GAP`, `SMALL_POOL`),
are in `balance_candidates`; this module searches among them.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import shard_sequences
from megatron_hdp.plan.policies.balance_candidates import (
    RETRY_GAP, SMALL_POOL, BatchShare, build_on_cp_groups, build_ranks, build_units, with_coupling)
from megatron_hdp.plan.policies.balance_orders import ORDER_POOL, reorder_rings
from megatron_hdp.plan.search.expert_units import unit_options
from megatron_hdp.plan.search.neighbours import neighbours
from megatron_hdp.plan.search.widening import LazyOptions
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.assemble import TimedPlan, gc_paused
from megatron_hdp.plan.timeline.bounds import gap

logger = logging.getLogger(__name__)

CLIMB_ROUNDS = 4
"""Most rounds of the ring-size climb (each builds at most two plans per distinct long length). Without
PP only: with PP every plan is `improvable`, and all rounds took an 8-rank byted plan from 11 to 125 ms.
The climb goes on while the plan is `RETRY_GAP` above the lower bound, however level its ranks: narrower
rings can cut a level plan's work (optimal_gap case 172: 5.1% above the optimum when the climb stopped
at the plan's own mean)."""

CLIMB_LENGTHS = 12
"""Most distinct lengths on rings in the plan for which balance climbs ring sizes: a round builds two plans per length, and
a 64-rank RL batch with ~60 of them took 4-6 s to plan (against 0.14 s without the climb); the cases the
climb is for have a few rings (the exact planner's, <= 12 documents)."""

UNIT_PATIENCE = 4
"""Without PP, the EP-unit plans of the alternative ring sizes (lower targets, ever wider rings) stop after
this many in a row that do not beat the best: their step times fall and rise again along the ladder
(DeepSeek-V3 at EP 32: 15 families of ~20 ms, the best the 6th). Not proven: a line search, checked on
the EP cells of benchmarks/README.md (plan_bench EP) against running them all."""


UNITS_ONLY_DEPTH = 2.0
"""With EP units, without PP and on pools above `SMALL_POOL` ranks, a batch of at least this many C-token
micro-batches a rank (its tokens over C x ranks) is planned by EP units only: the plan rank by rank, and
the plan made as if EP 1 (which re-times its placements), are not made. They cost 50-80 ms of a 160-250 ms
Mixtral-8x7B EP 8 plan at 1,024 ranks (issue 41's budget: 100). Not proven: in benchmarks/ep_families.py's
sweeps (`results/ep_families*.json`: Mixtral-8x7B and qwen3-30B-A3B at EP 8, 32M tokens at C = 16K on
256-16,384 ranks, seeds 0-7 at 1.9, 2 and 2.25 micro-batches a rank; llama-7b at EP 8; DeepSeek-V3 at
EP 32, 4 a rank on 128-1,024 ranks) neither won any of the 113 batches at 2 or more where they ran (of
144), by any margin; below 2 they win often: at 1.9 micro-batches a rank 2 of 32 batches, by up to 4.9%
of the step, at 1.75 1 of 12, at 1 9 of the 12 where they ran (`ep_families.py --table`). At 2 or more
every lane has rows to fill, and a unit's matched lanes beat the free counts of a plan made rank by
rank, which the coupling pads. On small pools, and where a micro-batch's own overhead is large
(tests/plan/test_plan_expert_units.py's CPU MoE model: 8 ranks, 4 micro-batches a rank), fewer
micro-batches can still win, and there they are cheap to try."""


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
    shared: BatchShare | None = None,
) -> TimedPlan:
    """`plan_balance`'s plan, timed but not built: every candidate is compared as a `TimedPlan`. `shared`:
    what the plan made as if EP 1 takes from the EP plan's (`BatchShare`)."""
    capacity = config.hdp_capacity
    tokens = np.asarray(lengths, dtype=np.int64)  # once: the array steps below would each convert the list
    shared = BatchShare() if shared is None else shared
    if shared.options is None:
        shared.sharding = shard_sequences(tokens, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                          max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
        shared.options = LazyOptions(  # the alternatives made where a plan asks for them (`improvable`)
            tokens, shared.sharding.ring_sizes, shared.sharding.offload_ratios, num_ranks=num_ranks,
            capacity=capacity, cost_model=cost_model, max_offload_ratio=config.max_offload_ratio, pp_size=pp_size)
    sharding, options = shared.sharding, shared.options
    common = dict(tokens=tokens, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                  vpp_size=vpp_size, exact=exact, shared=shared)
    ranks = [(build_ranks, options[0])]  # the alternatives' builds below, where asked for
    units, alternatives = [], []
    if cost_model.expert_parallel_size > 1:  # EP groups planned as units; plans rank by rank stay candidates
        first, rest = unit_options(options, lengths=tokens, capacity=capacity, cost_model=cost_model,
                                   pp_size=pp_size)
        units, alternatives = [(build_units, option) for option in first], ((build_units, option) for option in rest)
    fewest = None  # D(s) of the sequences beyond C for the bound, taken at PP 1: the sharding's where it was too
    if pp_size == 1:
        long = tokens > capacity
        fewest = dict(zip(tokens[long].tolist(), sharding.ring_sizes[long].tolist()))
    bound = functools.partial(shared.bound, tokens, num_ranks=num_ranks, capacity=capacity, cost_model=cost_model,
                              max_offload_ratio=config.max_offload_ratio, fewest=fewest)

    def above_bound(plan: TimedPlan) -> bool:
        return plan.est_step_time > RETRY_GAP * bound()

    def improvable(plan: TimedPlan) -> bool:  # with PP always; else above both its mean rank time and the bound
        # (with EP units the bound alone: a rank's time holds its rows' waits for their fullest all-to-all)
        mean = 0.0 if units else sum(plan.rank_times) / num_ranks
        return pp_size > 1 or (plan.est_step_time > RETRY_GAP * mean and above_bound(plan))

    plan, family = _best(lengths, (units or ranks)[:1], None, **common)
    units_only = (units and pp_size == 1 and num_ranks > SMALL_POOL  # (`UNITS_ONLY_DEPTH`)
                  and tokens.sum() >= UNITS_ONLY_DEPTH * capacity * num_ranks)
    if units and not units_only and improvable(plan):  # the plan rank by rank, when the units' leaves room
        plan, family = _best(lengths, ranks[:1], (plan, family), **common)
    if improvable(plan):  # the alternatives of the family that planned better (both when rank by rank did)
        patience = UNIT_PATIENCE if pp_size == 1 else None
        best = _best(lengths, units[1:], (plan, family), patience=patience, **common)
        if best[0] is plan:  # no family within capacity beat it: the alternatives' (`unit_options`)
            best = _best(lengths, alternatives, best, patience=patience, **common)
        plan, _ = _best(lengths, [(build_ranks, option) for option in options[1:]] if family is build_ranks else [],
                        best, **common)
    if not units and pp_size == 1 and num_ranks <= SMALL_POOL and len(
            {length for length, ring in zip(lengths, plan.rings) if len(ring) > 1}) <= CLIMB_LENGTHS:
        for _ in range(CLIMB_ROUNDS):  # ring sizes no one target gives, a rank at a time
            if not above_bound(plan):  # not its mean rank time (`CLIMB_ROUNDS`)
                break
            sizes = np.array([len(ring) for ring in plan.rings])
            ratios = np.asarray(plan.offload_ratios, dtype=np.float64)
            steps = neighbours(tokens, sizes, ratios, fewest=sharding.ring_sizes, num_ranks=num_ranks,
                               capacity=capacity, cost_model=cost_model, max_offload_ratio=config.max_offload_ratio,
                               pp_size=pp_size)
            climbed = _best(lengths, [(build_ranks, option) for option in steps], (plan, family), **common)
            if climbed[0] is plan:
                break
            plan, family = climbed
    if not units and pp_size == 1 and num_ranks <= ORDER_POOL and above_bound(plan):  # other ring orders
        plan = reorder_rings(plan, lengths, **common)  # (`balance_orders`)
    if not units and vpp_size == 1 and improvable(plan):  # the static mesh's rings for the sequences beyond C
        plan = min([plan, *build_on_cp_groups(lengths, **common)], key=lambda p: p.est_step_time)
    if units and not units_only and improvable(plan):  # still room: the plan made as if EP 1, with the coupling
        plan = min(plan, with_coupling(_plan_balance(lengths, num_ranks=num_ranks, config=config,
                                                      cost_model=dataclasses.replace(cost_model, expert_parallel_size=1),
                                                      pp_size=pp_size, vpp_size=vpp_size, exact=exact,
                                                      shared=shared), cost_model, shared),
                   key=lambda p: p.est_step_time)
    return plan


def _best(lengths: list[int], builds: list, best: tuple | None, *, patience: int | None = None,
          **common) -> tuple[TimedPlan, object]:
    """(plan, builder) of least predicted step time among `best` and the plans `builds` make, each a
    (builder, option) pair: `build_ranks` plans rank by rank, `build_units` EP groups as units. With `patience`,
    stop after that many plans in a row that do not beat the best (`UNIT_PATIENCE`). Each builder is told
    the step to beat: an EP-unit family skips its timing where it provably cannot (`build_units`: None; it
    counts as a plan that did not beat the best, as its timed plan would have), a plan rank by rank its
    by-time placements that cannot (`build_ranks`)."""
    worse = 0
    for build, (ring_sizes, offload_ratios) in builds:
        beat = {} if best is None else {"beat": best[0].est_step_time * (1 - 1e-9)}
        candidate = build(lengths, ring_sizes, offload_ratios, **common, **beat)
        if candidate is not None and (best is None or candidate.est_step_time < best[0].est_step_time * (1 - 1e-9)):
            best, worse = (candidate, build), 0
        elif patience is not None and (worse := worse + 1) >= patience:
            break
    return best
