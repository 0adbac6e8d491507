"""`assemble.time_plan` prices its whole-sequence micro-batches all at once (`np.bincount`): each must be the
float a micro-batch loop gives (the overhead plus its whole times added left to right from 0.0), each ring micro-batch
the cost model's `microbatch_time`, and the tokens, kinds and times of a schedule timed under one EP size
reused under another.

References: a left-to-right loop of additions per micro-batch (not Python's `sum`, which compensates from
3.12 on), and `CostModel.microbatch_time` of every micro-batch's shards
(the whole-sequence micro-batches to 1e-12: the model sums per layer, the timing per sequence).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import whole_times
from megatron_hdp.plan.timeline.assemble import time_plan
from megatron_hdp.plan.timeline.microbatch_times import TimingCache
from megatron_hdp.plan.zigzag import zigzag_num_tokens



def _left_to_right(values) -> float:
    """Plain float additions in order from 0.0 (Python 3.11's `sum`; 3.12's compensates, so not that)."""
    total = 0.0
    for value in values:
        total += value
    return total

def _schedule(rng: np.random.Generator, num_ranks: int):
    """Rings at one index of their members (several rings may share a micro-batch), whole sequences beside
    them or in micro-batches of their own, some ranks with nothing."""
    schedule: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    lengths, rings = [], []
    for seq in range(int(rng.integers(1, 6 * num_ranks))):
        k = int(rng.integers(2, num_ranks + 1)) if num_ranks > 1 and rng.random() < 0.25 else 1
        members = sorted(rng.choice(num_ranks, size=k, replace=False).tolist())
        lengths.append(int(rng.integers(2 * k, 60_000)) if k > 1 else int(rng.integers(1, 16_384)))
        rings.append(tuple(members))
        if rng.random() < 0.4 and all(schedule[r] for r in members):  # beside what its members run last
            index = min(len(schedule[r]) for r in members) - 1
            if all(len(schedule[r]) - 1 == index for r in members):
                for r in members:
                    schedule[r][index].append(seq)
                continue
        index = max(len(schedule[r]) for r in members)
        for r in members:
            schedule[r] += [[] for _ in range(index - len(schedule[r]))] + [[seq]]
    return lengths, rings, schedule


@pytest.mark.parametrize("seed", range(12))
def test_microbatch_times_are_the_loops_floats(seed):
    rng = np.random.default_rng(seed)
    base = analytic_cost_model(["mixtral-8x7b", "deepseek-v3"][seed % 2], "h100", tp_size=[1, 8][seed % 2])
    for trial in range(4):
        ep = [1, 2, 4][trial % 3]
        cost_model = dataclasses.replace(base, ranks_per_node=[None, 2, 4][trial % 3], expert_parallel_size=ep)
        pp = 2 if trial == 3 else 1
        lengths, rings, schedule = _schedule(rng, ep * int(rng.integers(1, 5)))
        cache = TimingCache()
        timed = time_plan(policy="t", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                          schedule=schedule, capacity=60_000, cost_model=cost_model, pp_size=pp, shared=cache)
        whole = whole_times(lengths, cost_model=cost_model, pp_size=pp).tolist()
        overhead = cost_model.microbatch_time([], pp_size=pp)
        for rank, microbatches in enumerate(schedule):
            assert timed.held[rank] == [sum(lengths[s] if len(rings[s]) == 1 else
                                            zigzag_num_tokens(lengths[s], len(rings[s]), rings[s].index(rank))
                                            for s in mb) for mb in microbatches]
            for index, mb in enumerate(microbatches):
                got = timed.times[rank][index]
                if all(len(rings[s]) == 1 for s in mb):
                    assert got == overhead + _left_to_right(whole[s] for s in mb), (seed, trial, rank, index)
                shards = [(lengths[s], lengths[s], (rank,)) if len(rings[s]) == 1 else
                          (lengths[s], zigzag_num_tokens(lengths[s], len(rings[s]), rings[s].index(rank)), rings[s],
                           timed.kinds[s]) for s in mb]
                assert got == pytest.approx(cost_model.microbatch_time(shards, pp_size=pp), rel=1e-12, abs=0)
        other = dataclasses.replace(cost_model, expert_parallel_size=1 if ep > 1 else len(schedule))
        again = time_plan(policy="t", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                          schedule=schedule, capacity=60_000, cost_model=other, pp_size=pp, shared=cache)
        fresh = time_plan(policy="t", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                          schedule=schedule, capacity=60_000, cost_model=other, pp_size=pp)
        assert (again.times, again.held, again.kinds, again.est_step_time, again.rank_times) == (
            fresh.times, fresh.held, fresh.kinds, fresh.est_step_time, fresh.rank_times)


@pytest.mark.parametrize("seed", range(6))
def test_build_is_the_plan_made_object_by_object(seed):
    """`TimedPlan.build` makes its micro-batches and ranks column by column (`build_many`): the StepPlan
    must equal the one made by calling the classes per micro-batch, zigzag chunks for ring members."""
    from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan
    from megatron_hdp.plan.zigzag import zigzag_chunks

    rng = np.random.default_rng(100 + seed)
    cost_model = dataclasses.replace(analytic_cost_model("mixtral-8x7b", "h100"), expert_parallel_size=2)
    lengths, rings, schedule = _schedule(rng, 2 * int(rng.integers(1, 5)))
    ratios = rng.random(len(lengths)).round(2).tolist()
    timed = time_plan(policy="t", lengths=lengths, rings=rings, offload_ratios=ratios, schedule=schedule,
                      capacity=20_000, cost_model=cost_model)
    ranks = tuple(RankSchedule(rank, tuple(
        MicroBatch(tuple(Shard(s, ((0, lengths[s]),)) if len(rings[s]) == 1 else
                         Shard(s, zigzag_chunks(lengths[s], len(rings[s]), rings[s].index(rank))) for s in mb),
                   max(20_000, held), time)
        for mb, held, time in zip(microbatches, timed.held[rank], timed.times[rank])), timed.rank_times[rank])
        for rank, microbatches in enumerate(schedule))
    expected = StepPlan(policy="t", num_ranks=len(schedule), capacity=20_000, ranks=ranks,
                        sequences=tuple(SequencePlacement(s, lengths[s], rings[s], ratios[s], timed.kinds[s])
                                        for s in range(len(lengths))),
                        est_step_time=timed.est_step_time, pp_size=1, vpp_size=1, group_size=None)
    assert timed.build() == expected
    assert timed.build().digest() == expected.digest()
