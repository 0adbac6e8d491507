"""Turn a policy's decisions (rings, offload ratios, per-rank micro-batches) into a timed StepPlan.

Every policy (balance, naive, static) ends here, so their plans are timed by the one cost model the same
way and can be compared side by side. Timing and building are two steps (`assemble_plan` is `time_plan`
then `TimedPlan.build`), so a policy that compares many candidates (balance) times each and builds one;
calls that share lengths and rings share a `TimingCache`. The timing:

- a micro-batch's own time is `cost_model.microbatch_time` of its shards on one pipeline stage, and each
  ring call's kind (K/V or latent) is decided once for all its members (`microbatch_times`); the plan
  records the kind (`SequencePlacement.ring_kind`), and the simulator prices each ring by it;
- a rank's `est_time` is its busy time, the sum of its micro-batch times, the runtime's padding
  micro-batches included (`timing.runtime_microbatch_counts`: 1F1B pipelines run their own counts, with
  virtual stages the least counts the interleaved schedule and the ring rule allow); with PP it is
  the makespan of its pipeline alone in Megatron's order (`pipeline.pipelines_finish`, all pipelines at
  once: (m + pp - 1) t for m equal micro-batches of time t in 1F1B, (m + (pp - 1) / v) t interleaved,
  set by the heaviest micro-batches when they differ);
- `est_step_time` is the time the last rank reaches the gradient all-reduce, from the timeline of
  `timing.py` (the one step-time model): a ring micro-batch starts only when every member has finished
  its previous micro-batch and ends for all of them when the slowest is done; with PP op by op through
  the pipeline order, so waits that fall in a pipeline's bubbles cost nothing (the simulator's timeline,
  to 1e-9). A plan whose rings start in step with equal member times has est_step_time = max est_time.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.flat_ids import flat_ids
from megatron_hdp.plan.zigzag import zigzag_chunks
from megatron_hdp.plan.timeline.microbatch_times import TimingCache, distinct_sorted, microbatch_times
from megatron_hdp.plan.timeline.pipeline import pipelines_finish
from megatron_hdp.plan.timeline.timing import (coupled_finish, expert_coupled_finish, expert_links, link_groups,
                                               pipeline_step_finish, runtime_microbatch_counts)
from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan, build_many


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a plan is built, restoring its previous state after.

    A 32M-token plan is ~100K small objects (shards, micro-batches, placements, heap entries) created in
    one go; with the collector on, every 700 allocations trigger a scan and the older generations are
    rescanned as the plan grows — a third of the planning time. None of these objects form reference
    cycles, so reference counting frees them all without the collector.

    On the way out the objects allocated meanwhile are promoted to the oldest generation (`gc.freeze()`
    then `gc.unfreeze()`: a few list splices, O(1)) instead of being left in generation 0, where the first
    allocation after `gc.enable()` would scan all of them (~20 ms for a 32M-token plan). The trade-off:
    every object young at that moment — the plan's and any other code's — is only examined by the next
    full collection, so cyclic garbage among them is reclaimed later (memory, not correctness); objects
    that die first (a step's plan) are freed by reference counting and are never scanned at all. The
    promotion is skipped when the application has frozen objects itself (`gc.get_freeze_count()`), whose
    freeze `unfreeze()` would undo.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()


@dataclass(frozen=True)
class TimedPlan:
    """A policy's decisions and their predicted times, without the StepPlan's objects: `time_plan`'s
    result. Building the shards, micro-batches and placements of ~8,600 documents costs about as much as
    timing them, so `balance` compares its candidates as TimedPlans and builds only the one it keeps
    (`build`); `assemble_plan` is `time_plan(...).build()`, so every policy's plan is timed the same way.

    The decisions are `time_plan`'s arguments (`decisions()` gives them back, to re-time the placement
    under another cost model); the times are every micro-batch's own time (`flat_times`, rank by rank,
    before padding and the EP coupling; rank r's are `flat_times[bounds[r]:bounds[r + 1]]`, `times[r]`),
    the tokens each holds (`flat_held`, `held[r]`), each sequence's ring kind, each rank's `rank_times`
    (its StepPlan `est_time`) and `est_step_time`. The per-rank lists are made only where read (with PP):
    at 16,384 ranks slicing them cost ~8 ms a timing."""

    policy: str
    lengths: list[int]
    rings: Sequence[tuple[int, ...]]
    offload_ratios: Sequence[float]
    schedule: Sequence[Sequence[Sequence[int]]]
    capacity: int
    pp_size: int
    vpp_size: int
    group_size: int | None
    flat_times: list[float]
    flat_held: list[int]
    bounds: list[int]
    kinds: list[str]
    rank_times: list[float]
    est_step_time: float

    @functools.cached_property
    def times(self) -> list[list[float]]:
        """Each rank's micro-batches' own times."""
        return _per_rank(self.flat_times, self.bounds)

    @functools.cached_property
    def held(self) -> list[list[int]]:
        """The tokens each rank's micro-batches hold."""
        return _per_rank(self.flat_held, self.bounds)

    def decisions(self) -> dict:
        """The keyword arguments of `time_plan` that made this plan, less the cost model."""
        return dict(policy=self.policy, lengths=self.lengths, rings=self.rings, offload_ratios=self.offload_ratios,
                    schedule=self.schedule, capacity=self.capacity, pp_size=self.pp_size, vpp_size=self.vpp_size,
                    group_size=self.group_size)

    @gc_paused()
    def build(self) -> StepPlan:
        """The StepPlan of these decisions and times: a ring member at ring position p holds zigzag chunks
        p and 2k-1-p, a whole sequence one shard of all its tokens."""
        lengths, rings = self.lengths, self.rings
        in_ring = np.fromiter(map(len, rings), dtype=np.int64, count=len(rings)) > 1
        # Every ring member's shard, built in one go by (sequence, rank), and each whole sequence's one shard
        # indexed by sequence (see `build_many`).
        members = [(seq, rank, p) for seq in np.flatnonzero(in_ring).tolist() for p, rank in enumerate(rings[seq])]
        ring_shards = dict(zip([(seq, rank) for seq, rank, _ in members], build_many(
            Shard, [seq for seq, _, _ in members],
            [zigzag_chunks(lengths[seq], len(rings[seq]), p) for seq, _, p in members])))
        whole_ids = np.flatnonzero(~in_ring).tolist()
        whole_chunks = list(zip(zip(itertools.repeat(0), map(lengths.__getitem__, whole_ids))))  # ((0, s),) each
        whole_shards = build_many(Shard, whole_ids, whole_chunks)
        if len(whole_ids) < len(lengths):  # by sequence id, in a list (numpy would probe every Shard for
            by_seq: list[Shard | None] = [None] * len(lengths)  # an array interface, ~8x the time)
            for seq, shard in zip(whole_ids, whole_shards):
                by_seq[seq] = shard
            whole_shards = by_seq
        # Every micro-batch's shards, rank by rank; then the micro-batches and ranks built column by column.
        flat = list(itertools.chain.from_iterable(self.schedule))
        shards = [tuple(map(whole_shards.__getitem__, seqs)) for seqs in flat]
        sizes, seqs = flat_ids(flat)
        per_mb = np.repeat(np.arange(len(flat)), sizes)
        rank_of = np.repeat(np.arange(len(self.schedule)), np.diff(np.asarray(self.bounds, dtype=np.int64)))
        at_ring = distinct_sorted(per_mb[in_ring[seqs]]).tolist()  # micro-batches holding ring shards
        for at, rank in zip(at_ring, rank_of[at_ring].tolist()):
            shards[at] = tuple(ring_shards.get((seq, rank)) or whole_shards[seq] for seq in flat[at])
        held = np.asarray(self.flat_held, dtype=np.int64)
        microbatches = tuple(build_many(MicroBatch, shards, np.maximum(held, self.capacity).tolist(), self.flat_times))
        bounds = self.bounds
        ranks = build_many(RankSchedule, range(len(self.schedule)),
                           [microbatches[a:b] for a, b in zip(bounds, bounds[1:])], self.rank_times)
        ratios = np.asarray(self.offload_ratios, dtype=np.float64).tolist()
        sequences = tuple(build_many(SequencePlacement, range(len(lengths)), lengths, rings, ratios, self.kinds))
        return StepPlan(policy=self.policy, num_ranks=len(ranks), capacity=self.capacity, sequences=sequences,
                        ranks=tuple(ranks), est_step_time=self.est_step_time, pp_size=self.pp_size,
                        vpp_size=self.vpp_size, group_size=self.group_size)


def assemble_plan(
    *,
    policy: str,
    lengths: Sequence[int],
    rings: Sequence[tuple[int, ...]],
    offload_ratios: Sequence[float],
    schedule: Sequence[Sequence[Sequence[int]]],
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    vpp_size: int = 1,
    group_size: int | None = None,
) -> StepPlan:
    """Build the timed StepPlan: `schedule[rank]` lists that rank's micro-batches, each a list of sequence
    ids (`time_plan`, then `TimedPlan.build`). `group_size`: the microbatch_group_size_per_vp_stage G the
    plan carries and is timed with (None: Megatron's default, pp_size).

    A sequence with a ring of k > 1 ranks must appear in one micro-batch of each member; the member at
    ring position p holds zigzag chunks p and 2k-1-p. The micro-batch capacity is C, or the tokens held
    when offloading lets a member hold more.
    """
    return time_plan(policy=policy, lengths=lengths, rings=rings, offload_ratios=offload_ratios, schedule=schedule,
                     capacity=capacity, cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size,
                     group_size=group_size).build()


def time_plan(
    *,
    policy: str,
    lengths: Sequence[int],
    rings: Sequence[tuple[int, ...]],
    offload_ratios: Sequence[float],
    schedule: Sequence[Sequence[Sequence[int]]],
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    vpp_size: int = 1,
    group_size: int | None = None,
    shared: TimingCache | None = None,
) -> TimedPlan:
    """The predicted times of `assemble_plan`'s decisions (same arguments) without building the StepPlan:
    each micro-batch's time, each rank's busy time and the step time (module doc). `shared`: what calls
    with the same lengths, rings and cost model reuse (`TimingCache`)."""
    lengths = list(map(int, lengths))
    shared = TimingCache() if shared is None else shared
    basis = dataclasses.replace(cost_model, expert_parallel_size=1)
    if shared.basis is None:
        shared.basis = basis
    assert shared.basis == basis, "a TimingCache shared by cost models that differ beyond the EP size"
    timed = shared.plans.get((id(schedule), group_size, cost_model.expert_parallel_size))
    if timed is not None and timed.schedule is schedule and timed.offload_ratios is offload_ratios and (
            timed.policy, timed.capacity, timed.pp_size, timed.vpp_size) == (policy, capacity, pp_size, vpp_size):
        return timed
    loop = shared.loops.get((id(schedule), pp_size))
    if loop is None or loop[0] is not schedule:
        loop = shared.loops[(id(schedule), pp_size)] = (schedule, *microbatch_times(
            lengths=lengths, rings=rings, schedule=schedule, cost_model=cost_model, pp_size=pp_size, shared=shared))
    _, flat_times, flat_tokens, bounds, kinds, ring_index = loop
    overhead = cost_model.microbatch_time([], pp_size=pp_size)
    ep_size = cost_model.expert_parallel_size
    if pp_size == 1 and (ep_size > 1 or not cost_model.jitter):
        alone, step = _grid_timeline(flat_times, flat_tokens, bounds, rings=rings, ring_index=ring_index,
                                     overhead=overhead, cost_model=cost_model)
    else:
        times, tokens = _per_rank(flat_times, bounds), _per_rank(flat_tokens, bounds)
        counts = runtime_microbatch_counts(list(map(len, times)), pp_size=pp_size, ep_size=ep_size,
                                           vpp_size=vpp_size, rings={rings[seq] for seq in ring_index},
                                           group_size=group_size)
        padded = [t + [overhead] * (count - len(t)) for t, count in zip(times, counts)]  # the runtime's padding
        if ep_size > 1:  # at EP 1 the spread is the identity (`spread_expert_work`'s copy of float lists)
            padded_tokens = [t + [0] * (count - len(t)) for t, count in zip(tokens, counts)]
            padded = cost_model.expert_coupled_times(padded, padded_tokens, pp_size=pp_size)
        alone = pipelines_finish(padded, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size).tolist()
        step = step_time(padded, rings=rings, ring_index=ring_index, pp_size=pp_size, ep_size=ep_size,
                         jitter=cost_model.jitter, vpp_size=vpp_size, group_size=group_size)
    timed = TimedPlan(policy=policy, lengths=lengths, rings=rings, offload_ratios=offload_ratios, schedule=schedule,
                      capacity=capacity, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size,
                      flat_times=flat_times, flat_held=flat_tokens, bounds=bounds, kinds=kinds, rank_times=alone,
                      est_step_time=step)
    shared.plans[(id(schedule), group_size, cost_model.expert_parallel_size)] = timed
    return timed


def _per_rank(flat: list, bounds: list[int]) -> list[list]:
    """`flat`'s items rank by rank: rank r's are flat[bounds[r]:bounds[r + 1]]."""
    return [flat[a:b] for a, b in zip(bounds, bounds[1:])]


def _grid_timeline(times: list[float], tokens: list[int], bounds: list[int], *, rings: Sequence[tuple[int, ...]],
                   ring_index: dict[int, int], overhead: float, cost_model: CostModel) -> tuple[list[float], float]:
    """Each rank's busy time and the step time without PP, with EP or (at EP 1) without jitter, as
    `time_plan`'s general path computes them (`runtime_microbatch_counts`, `expert_coupled_times`,
    `pipelines_finish`, `step_time`), the same floats, on [rank, index] arrays instead of per-rank lists (at
    16,384 ranks the lists' padding, spread, counts and sums and the union-find over every ring member's
    key cost more than the micro-batch loop): every rank runs its EP group's largest count (at least 1;
    without PP and VPP no other padding), padding micro-batches the overhead with 0 tokens; a rank's time
    sums its spread times left to right (the zeros past its count add nothing). At EP 1 the spread is the
    identity and every rank its own group (`expert_coupled_finish`: maxima, as `coupled_finish`; with
    jitter its lead would sum members in another order, so the general path times that). `times` and
    `tokens`: every micro-batch's, rank by rank (rank r's from `bounds[r]` to `bounds[r + 1]`)."""
    ep_size = cost_model.expert_parallel_size
    own = np.diff(np.asarray(bounds, dtype=np.int64))
    counts = np.asarray(runtime_microbatch_counts(own, ep_size=ep_size), dtype=np.int64)
    index = np.arange(int(counts.max(initial=0)))
    filled = index < own[:, None]
    grid = np.where(index < counts[:, None], overhead, 0.0)
    grid[filled] = times
    held = np.zeros(grid.shape)
    held[filled] = tokens
    grid = cost_model.expert_coupled_grid(grid, held)
    busy = np.zeros(len(own))
    for column in grid.T:
        busy = busy + column
    links = [(at, rings[seq]) for seq, at in ring_index.items()]
    finish = expert_coupled_finish(grid, counts, links, ep_size=ep_size, jitter=cost_model.jitter)
    return busy.tolist(), float(finish.max(initial=0.0))


def step_time(
    times: Sequence[Sequence[float]],
    *,
    rings: Sequence[tuple[int, ...]],
    ring_index: dict[int, int],
    pp_size: int = 1,
    ep_size: int = 1,
    jitter: float = 0.0,
    vpp_size: int = 1,
    group_size: int | None = None,
) -> float:
    """Time the last rank finishes when ring micro-batches (and, with `ep_size` > 1, every micro-batch
    of an expert-parallel group; `times` padded as the runtime runs them) wait for all their members and
    release them together, with the cost model's `jitter` (`timing.coupled_finish`; with PP every op of
    Megatron's pipeline order coupled the same way, `timing.pipeline_step_finish`, with `vpp_size` model
    chunks per stage and groups of `group_size`). `time_plan` times EP without PP a whole index at a time
    instead (`_grid_timeline`, the same floats)."""
    links = [(index, rings[seq]) for seq, index in ring_index.items()]
    groups = link_groups(links + expert_links([len(t) for t in times], ep_size))
    if pp_size > 1:
        end = pipeline_step_finish(times, groups, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size,
                                   jitter=jitter)
    else:
        end = coupled_finish([times], groups, jitter=jitter)
    return float(end.max(initial=0.0))
