"""The EP coupling computed a whole micro-batch index at a time must give the floats of its definition,
and times shared across EP sizes must be a fresh call's.

`timing.expert_coupled_finish` (the planner's step time without PP and with EP) against the general
union-find over (rank, index) keys and `coupled_finish` it replaces in `assemble.step_time`, and
`experts.spread_expert_work` (numpy over groups and indices) against a loop written out here, on random
padded times with rings that merge EP groups at their index."""

import numpy as np
import pytest

from megatron_hdp.plan.cost.experts import spread_expert_work
from megatron_hdp.plan.timeline.timing import coupled_finish, expert_coupled_finish, expert_links, link_groups


def _random_case(rng, ep_size):
    """Times padded alike inside each EP group, and rings (at an index every member has) of 2-12 ranks."""
    num_ranks = ep_size * int(rng.integers(1, 7))
    group_counts = rng.integers(1, 6, size=num_ranks // ep_size)
    counts = np.repeat(group_counts, ep_size)
    times = [rng.uniform(0.1, 3.0, size=int(c)).tolist() for c in counts]
    links = []
    for _ in range(int(rng.integers(0, 8))):
        k = int(rng.integers(2, min(12, num_ranks) + 1)) if num_ranks > 1 else 1
        members = sorted(rng.choice(num_ranks, size=k, replace=False).tolist())
        index = int(rng.integers(0, counts[members].min()))
        links.append((index, tuple(members)))
    return times, links


@pytest.mark.parametrize("jitter", [0.0, 0.07])
def test_a_whole_index_at_a_time_is_the_union_find_over_rank_index_keys(jitter):
    rng = np.random.default_rng(41)
    for trial in range(200):
        ep_size = [1, 2, 4, 8][trial % 4]
        times, links = _random_case(rng, ep_size)
        groups = link_groups(links + expert_links([len(t) for t in times], ep_size))
        expected = coupled_finish([times], groups, jitter=jitter)
        counts = np.array([len(t) for t in times])
        matrix = np.zeros((len(times), int(counts.max())))
        for rank, rank_times in enumerate(times):
            matrix[rank, : len(rank_times)] = rank_times
        got = expert_coupled_finish(matrix, counts, links, ep_size=ep_size, jitter=jitter)
        if jitter:  # the lead's mean sums the members in another order
            np.testing.assert_allclose(got, expected, rtol=1e-13, err_msg=f"trial {trial}")
        else:
            assert got.tolist() == expected.tolist(), f"trial {trial}"


def test_spread_expert_work_is_the_loop_over_groups_indices_and_members():
    rng = np.random.default_rng(7)
    for trial in range(100):
        ep_size = [2, 3, 8][trial % 3]
        times, _ = _random_case(rng, ep_size)
        integer = trial % 2 == 0  # the planner's token counts, or the refit's float times as tokens
        tokens = [(rng.integers(0, 20_000, size=len(t)) if integer else rng.uniform(0, 2e4, size=len(t))).tolist()
                  for t in times]
        per_token, alltoall = float(rng.uniform(0, 1e-5)), float(rng.uniform(0, 1e-6)) * (trial % 4 != 1)
        expected = [list(t) for t in times]
        for first in range(0, len(times), ep_size):
            members = range(first, first + ep_size)
            for index in range(len(times[first])):
                held = [tokens[r][index] for r in members]
                mean, largest = sum(held) / ep_size, max(held)
                for r in members:
                    expected[r][index] = times[r][index] + (per_token * (mean - tokens[r][index])
                                                            + alltoall * largest)
        got = spread_expert_work(times, tokens, ep_size=ep_size, seconds_per_token=per_token,
                                 alltoall_seconds_per_token=alltoall)
        assert got == expected, f"trial {trial}"


def test_a_timing_cache_shared_across_ep_sizes_gives_the_fresh_times():
    """`microbatch_times.TimingCache` (balance's EP-1 pass re-timing the EP pass's placements): timing a schedule
    with a cache warmed under another EP size, or again under the same one, gives the times of a fresh
    call; a cost model that differs beyond the EP size is refused."""
    import dataclasses

    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.plan.timeline.assemble import time_plan
    from megatron_hdp.plan.timeline.microbatch_times import TimingCache

    ep2 = dataclasses.replace(analytic_cost_model("mixtral-8x7b", "h100"), expert_parallel_size=2)
    ep1 = dataclasses.replace(ep2, expert_parallel_size=1)
    lengths = [9000, 3000, 2500, 800, 700, 4000]
    rings = [(0, 1, 2), (0,), (1,), (2,), (3,), (3,)]
    schedule = [[[0], [1]], [[0], [2]], [[0], [3]], [[4], [5]]]  # the ring at index 0 of ranks 0-2
    args = dict(policy="hand", lengths=lengths, rings=rings, offload_ratios=[0.0] * 6, schedule=schedule,
                capacity=16384)
    cache = TimingCache()
    for cost_model in (ep2, ep1, ep2):
        cached, fresh = time_plan(**args, cost_model=cost_model, shared=cache), time_plan(**args, cost_model=cost_model)
        assert (cached.est_step_time, cached.rank_times, cached.times, cached.kinds) == (
            fresh.est_step_time, fresh.rank_times, fresh.times, fresh.kinds)
    assert time_plan(**args, cost_model=ep2, shared=cache) is time_plan(**args, cost_model=ep2, shared=cache)
    with pytest.raises(AssertionError, match="beyond the EP size"):
        time_plan(**args, cost_model=dataclasses.replace(ep2, b1=2 * ep2.b1), shared=cache)


@pytest.mark.parametrize("jitter", [0.0, 0.05])
def test_time_plan_with_ep_without_pp_is_the_general_timeline_on_lists(jitter):
    """`assemble.time_plan` times EP without PP on [rank, index] arrays (`_grid_timeline`; at EP 1 too,
    without jitter); its rank times and step must be those of the general path on per-rank lists:
    `runtime_microbatch_counts`, the padding, `CostModel.expert_coupled_times`, per-rank sums, and
    `coupled_finish` over the union-find of the rings' and EP groups' (rank, index) keys (to 1e-13 with
    jitter, whose lead sums members in another order)."""
    import dataclasses

    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.plan.timeline.assemble import time_plan
    from megatron_hdp.plan.timeline.timing import runtime_microbatch_counts

    rng = np.random.default_rng(3)
    base = analytic_cost_model("mixtral-8x7b", "h100")
    for trial in range(60):
        ep_size = [1, 2, 4, 8][trial % 4]
        cost_model = dataclasses.replace(base, expert_parallel_size=ep_size, jitter=jitter,
                                         ranks_per_node=[None, 4][trial % 2],
                                         expert_alltoall_bytes_per_token=[0.0, 7168.0][trial % 4 // 2])
        num_ranks = ep_size * int(rng.integers(1, 5))
        schedule = [[] for _ in range(num_ranks)]
        lengths, rings = [], []
        for seq in range(int(rng.integers(1, 5 * num_ranks))):
            length = int(rng.integers(64, 30_000))
            k = int(rng.integers(2, num_ranks + 1)) if num_ranks > 1 and rng.random() < 0.3 else 1
            members = sorted(rng.choice(num_ranks, size=k, replace=False).tolist())
            index = max(len(schedule[r]) for r in members)
            for r in members:  # a ring at one index of every member; some ranks keep none at all
                schedule[r] += [[] for _ in range(index - len(schedule[r]))] + [[seq]]
            lengths.append(length)
            rings.append(tuple(members))
        timed = time_plan(policy="t", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                          schedule=schedule, capacity=32768, cost_model=cost_model)
        ring_index = {seq: schedule[ring[0]].index([seq]) for seq, ring in enumerate(rings) if len(ring) > 1}
        counts = runtime_microbatch_counts([len(t) for t in timed.times], ep_size=ep_size,
                                           rings={rings[seq] for seq in ring_index})
        overhead = cost_model.microbatch_time([])
        padded = [t + [overhead] * (c - len(t)) for t, c in zip(timed.times, counts)]
        tokens = [t + [0] * (c - len(t)) for t, c in zip(timed.held, counts)]
        padded = cost_model.expert_coupled_times(padded, tokens)
        assert timed.rank_times == [float(sum(t)) for t in padded], trial
        links = [(at, rings[seq]) for seq, at in ring_index.items()]
        expected = float(coupled_finish([padded], link_groups(links + expert_links(counts, ep_size)),
                                        jitter=jitter).max())
        if jitter:
            assert timed.est_step_time == pytest.approx(expected, rel=1e-13), trial
        else:
            assert timed.est_step_time == expected, trial
