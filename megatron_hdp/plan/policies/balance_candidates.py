"""The candidate plans `balance` compares (`policies.balance`, whose module doc describes the steps).

Each builder takes one choice of ring sizes and offload ratios and returns a `TimedPlan` (predicted times,
not yet built): `build_ranks` places rings and whole sequences rank by rank (steps 3-6), `build_units`
plans each EP group as a unit of lanes (`search.expert_units`), `build_on_cp_groups` puts the sequences
longer than C on the static mesh's CP groups, and `with_coupling` re-times a plan made as if EP 1 under
the EP coupling. `BatchShare` holds what they share within one batch (sharding, placements' schedules,
the lower bound), so no placement is made or timed twice.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import member_time, member_times, ring_offload_ratio, whole_times
from megatron_hdp.plan.search.cp_groups import group_size
from megatron_hdp.plan.search.expert_units import place_units
from megatron_hdp.plan.search.packed_rings import pack_on_groups
from megatron_hdp.plan.search.packing import pack_for_pipelines
from megatron_hdp.plan.search.placement import fill_gaps, lpt, narrowest_first, place_rings, place_rings_by_time
from megatron_hdp.plan.search.refine import PipelineCost, refine_exact, refine_local, refine_pairs
from megatron_hdp.plan.search.ring_shifts import RING_SHIFTS, fits_memory, group_sizes, shifted
from megatron_hdp.plan.search.widening import LazyOptions
from megatron_hdp.plan.timeline.assemble import TimedPlan, time_plan
from megatron_hdp.plan.timeline.microbatch_times import TimingCache
from megatron_hdp.plan.timeline.bounds import step_time_lower_bound
from megatron_hdp.plan.timeline.ep_floor import ep_prefix_floor, ep_step_floor

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


def build_on_cp_groups(
    lengths: list[int],
    *,
    tokens: np.ndarray,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
    exact: bool,
    shared: BatchShare,
) -> list[TimedPlan]:
    """The sequences longer than C packed on CP groups' rings, the others whole beside them
    (`search.packed_rings`, groups of the smallest power of two whose ring holds each of them), then steps
    4-6 as in `build_ranks` from there; [] where nothing is longer than C or no group holds them all."""
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
    prepared = rank_schedules(leading, rings, finish, [], given=whole, lengths=lengths, weights=weights, tokens=tokens,
                              capacity=capacity, pp_size=pp_size, vpp_size=vpp_size, exact=exact, overhead=overhead,
                              contents=shared.contents)
    return [fastest(prepared, lengths=lengths, offload_ratios=np.zeros(len(lengths)), capacity=capacity,
                    cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size)]


@dataclasses.dataclass
class BatchShare:
    """What balance's plans of one batch share between cost models that differ only in the EP size (the
    plan made as if EP 1 beside the EP plan): the sharding and ring-size options, each placement's
    schedules with their `TimingCache`, by (ring sizes, offload ratios, placement), and the lower bound.
    None of these read the EP size (it enters only where a plan is timed: the coupling, the spread expert
    work, the all-to-all; the bound only through the all-to-all's time per token, its key), so the EP-1
    pass re-times the placements the EP pass made instead of making them again."""

    sharding: object = None
    options: LazyOptions | None = None
    schedules: dict = dataclasses.field(default_factory=dict)
    contents: dict = dataclasses.field(default_factory=dict)
    """Ring micro-batch times by content (`TimingCache.contents`), shared by every placement's cache."""

    bounds: dict = dataclasses.field(default_factory=dict)
    """`step_time_lower_bound` by the all-to-all's seconds per token (`bound`)."""

    sizers: dict = dataclasses.field(default_factory=dict)
    """The bound's member times (`step_time_lower_bound`'s `sizers`), shared by the EP and EP-1 passes."""

    placements: dict = dataclasses.field(default_factory=dict)
    """By-time ring placements with the whole sequences left after their gaps, by the same keys."""

    def bound(self, tokens: np.ndarray, *, cost_model: CostModel, **limits) -> float:
        """`step_time_lower_bound(tokens, cost_model=cost_model, **limits)`, computed once per batch for
        cost models of one all-to-all time per token: the bound reads the EP size only there (0 at EP 1,
        where the EP-1 pass of a model without the all-to-all's transfers reuses the EP pass's bound)."""
        key = cost_model.expert_alltoall_seconds_per_token()
        if key not in self.bounds:
            self.bounds[key] = step_time_lower_bound(tokens, cost_model=cost_model, sizers=self.sizers, **limits)
        return self.bounds[key]

    def schedules_of(self, key: tuple, make):
        """`make()`'s schedules (`rank_schedules`) of placement `key`, made once."""
        if key not in self.schedules:
            self.schedules[key] = make()
        return self.schedules[key]

    def placement_of(self, key: tuple, make):
        """`make()`'s by-time ring placement (`placement.place_rings_by_time` and its left-overs) `key`, made once."""
        if key not in self.placements:
            self.placements[key] = make()
        return self.placements[key]


def with_coupling(plan: TimedPlan, cost_model: CostModel, shared: BatchShare) -> TimedPlan:
    """`plan`'s placement timed under `cost_model` (its EP coupling, the all-to-all's spread expert work),
    with the `TimingCache` of the placement it came from (found by its schedule among `shared`'s)."""
    cache = next((cache for _, candidates, cache in shared.schedules.values()
                  if any(schedule is plan.schedule for schedule, _ in candidates)), None)
    return time_plan(**plan.decisions(), cost_model=cost_model, shared=cache)


def build_ranks(
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
    shared: BatchShare,
    beat: float | None = None,
) -> TimedPlan:
    """Steps 3-6 of the module doc for one choice of ring sizes (`tokens`: the lengths as an array); each
    placement's schedules are made once per batch (`shared`) and timed under `cost_model`. With EP and
    without PP a by-time placement is not completed where its rings alone (`ep_floor.ep_prefix_floor`)
    show it could not replace the aligned plan, nor reach `beat` (the step a plan must be under to win):
    the plan returned may then differ, but only where neither could have won."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    order, whole_order = placement_orders(ring_sizes, weights)
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    nodes = node_domains(cost_model, num_ranks)
    common = dict(lengths=lengths, weights=weights, tokens=tokens, capacity=capacity, pp_size=pp_size,
                  vpp_size=vpp_size, exact=exact, overhead=overhead, contents=shared.contents)
    timing = dict(lengths=lengths, offload_ratios=offload_ratios, capacity=capacity, cost_model=cost_model,
                  pp_size=pp_size, vpp_size=vpp_size)
    key = (ring_sizes.tobytes(), offload_ratios.tobytes())

    def aligned():
        layout = place_rings(order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks)
        return rank_schedules([[[seq] for seq in ring_mbs] for ring_mbs in layout.ring_microbatches], layout.rings,
                              layout.finish, whole_order, **common)

    def placed(ring_order: list[int], latest_ready: bool):
        return place_by_time(ring_order, latest_ready=latest_ready, ring_sizes=ring_sizes, weights=weights,
                             whole_order=whole_order, tokens=tokens, num_ranks=num_ranks, capacity=capacity,
                             overhead=overhead, domains=nodes)

    def by_time(placement: tuple):
        timed, left = placement
        return rank_schedules(timed.leading, timed.rings, timed.finish, left, **common)

    plan = fastest(shared.schedules_of(key + ("aligned",), aligned), **timing)
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
            placement = shared.placement_of(key + ("by time", tag), lambda: placed(ring_order, latest_ready))
            if pp_size == 1 and cost_model.expert_parallel_size > 1 and ep_prefix_floor(
                    placement[0].leading, ring_of=placement[0].rings, lengths=lengths,
                    cost_model=cost_model) >= min(plan.est_step_time * (1 - PLACEMENT_MARGIN),
                                                  np.inf if beat is None else beat):
                continue  # whatever follows its rings, it would not replace the plan nor win (`ep_floor`)
            candidate = fastest(shared.schedules_of(key + ("by time", tag), lambda: by_time(placement)), **timing)
            if candidate.est_step_time < plan.est_step_time * (1 - PLACEMENT_MARGIN):
                plan = candidate
    return plan


def placement_orders(ring_sizes: np.ndarray, weights: np.ndarray) -> tuple[list[int], list[int]]:
    """The orders `build_ranks` places one choice of ring sizes in: the rings widest first (within a width
    the heaviest members first, then by id), and the whole sequences heaviest first (then by id)."""
    long_ids = np.flatnonzero(ring_sizes > 1)
    whole_ids = np.flatnonzero(ring_sizes == 1)
    return (long_ids[np.lexsort((long_ids, -weights[long_ids], -ring_sizes[long_ids]))].tolist(),
            whole_ids[np.lexsort((whole_ids, -weights[whole_ids]))].tolist())


def node_domains(cost_model: CostModel, num_ranks: int) -> np.ndarray | None:
    """Each rank's node, where the cost model knows the nodes (None where it does not)."""
    return None if cost_model.ranks_per_node is None else np.arange(num_ranks) // cost_model.ranks_per_node


def place_by_time(ring_order: Sequence[int], *, latest_ready: bool, ring_sizes: np.ndarray, weights: np.ndarray,
                  whole_order: list[int], tokens: np.ndarray, num_ranks: int, capacity: int, overhead: float,
                  domains: np.ndarray | None) -> tuple:
    """The rings of `ring_order` placed by time (`placement.place_rings_by_time`) and the whole sequences of
    `whole_order` in the gaps they leave (`placement.fill_gaps`): (the placement, the whole sequences left
    for after the rings)."""
    timed = place_rings_by_time(ring_order, ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks,
                                overhead=overhead, domains=domains, latest_ready=latest_ready)
    return timed, fill_gaps(timed, whole_order, weights=weights, tokens=tokens, capacity=capacity)


def build_units(
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
    shared: BatchShare,
    beat: float | None = None,
) -> TimedPlan | None:
    """The plan of one choice of ring sizes with expert parallelism: EP groups planned as units of lanes
    (`expert_units.place_units`); with PP each unit's rows are tried heaviest first and lightest first.
    `exact` is for the signature of `build_ranks` (no MILP here); `shared` gives the batch's ring micro-batch
    times by content. Without PP, None (not timed) when the placement's step floor
    (`ep_floor.ep_step_floor`, <= its timed step) is at least `beat`: it could not beat the best plan."""
    weights = member_times(tokens, ring_sizes, cost_model=cost_model, pp_size=pp_size)
    full = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    placed = place_units(ring_sizes=ring_sizes, weights=weights, tokens=tokens, num_ranks=num_ranks,
                         ep_size=cost_model.expert_parallel_size, capacity=capacity,
                         overhead=cost_model.microbatch_time([], pp_size=pp_size), full=full,
                         fine_work=num_ranks * full,
                         alltoall=cost_model.expert_alltoall_seconds_per_token(pp_size=pp_size),
                         expert=cost_model.expert_seconds_per_token(pp_size=pp_size),
                         member_seconds=lambda length, size: member_time(length, size, cost_model=cost_model,
                                                                         pp_size=pp_size))
    if placed.widened:  # rings widened into their rows' free lanes hold fewer tokens a member
        offload_ratios = offload_ratios.copy()
        for seq, size in placed.widened.items():
            offload_ratios[seq] = ring_offload_ratio(cost_model, length=int(tokens[seq]), ring_size=size,
                                                     capacity=capacity)
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


def rank_schedules(
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
    (`fastest` times them) and the `TimingCache` they share (with the batch's `contents`)."""
    num_ranks = len(leading)
    counts = np.fromiter(map(len, leading), dtype=np.int64, count=num_ranks)
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
    # Most ranks of a large pool lead with nothing and hold at most one whole sequence: the per-rank steps
    # below skip empty lists without a call (at 16,384 ranks each pass over every rank costs milliseconds).
    wholes = list(zip(range(num_ranks)))  # (rank,): one tuple shared by all the rank's whole sequences
    for rank in np.flatnonzero(counts).tolist():
        for mb in leading[rank]:  # filler slots' whole sequences
            for seq in mb:
                if seq not in ring_of:
                    rings[seq] = wholes[rank]
    for rank in np.flatnonzero(np.fromiter(map(len, given), dtype=np.int64, count=num_ranks)).tolist():
        for seq in given[rank]:
            rings[seq] = wholes[rank]
    if pp_size > 1:  # the packer times pipelines; without PP it reads the sizes alone
        jobs = [(list(map(lengths.__getitem__, items)), list(map(seconds.__getitem__, items)),
                 [overhead + sum(map(seconds.__getitem__, mb)) for mb in lead]) for items, lead in zip(given, leading)]
    else:
        nothing = ((), (), ())
        jobs = [(list(map(lengths.__getitem__, items)), (), ()) if items else nothing for items in given]
    leads = [[list(mb) for mb in lead] if lead else [] for lead in leading]
    packed = [[[items[j] for j in b] for b in bins] if bins else [] for items, bins in zip(
        given, pack_for_pipelines(jobs, capacity=capacity, overhead=overhead, pp_size=pp_size, vpp_size=vpp_size))]
    most_rings = max(map(len, leads), default=0)
    candidates = []
    for shift in RING_SHIFTS if pp_size > 1 else (0,):
        schedule = [shifted(lead, bins, shift, weight=lambda mb: sum(map(seconds.__getitem__, mb)))
                    for lead, bins in zip(leads, packed)] if shift else list(map(list.__add__, leads, packed))
        candidates += [(schedule, group) for group in group_sizes(pp_size, vpp_size, shift + most_rings)]
    return rings, candidates, TimingCache(contents=contents)  # every shift and group size has the same rings


def fastest(
    prepared: tuple[list[tuple[int, ...]], list[tuple[list, int | None]], TimingCache],
    *,
    lengths: list[int],
    offload_ratios: np.ndarray,
    capacity: int,
    cost_model: CostModel,
    pp_size: int,
    vpp_size: int,
) -> TimedPlan:
    """The candidate of `rank_schedules`' `prepared` of least predicted step time under `cost_model` (a group
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
