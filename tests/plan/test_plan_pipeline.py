"""The planner's PP time model (`plan.timeline.pipeline`): exact 1F1B makespan, checked against the closed form for
equal micro-batches and against the simulator's event loop for unequal ones; PP-aware packing."""

import numpy as np
import pytest

from megatron_hdp.plan.timeline.assemble import assemble_plan, time_plan
from megatron_hdp.plan.search import packing
from megatron_hdp.plan.search.packing import best_fit, pack_for_pipeline
from megatron_hdp.plan.timeline.pipeline import pipeline_time, pipelines_finish
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.simulator import simulate_step

CM = analytic_cost_model("llama-7b", tp_size=8)


@pytest.mark.parametrize("num, pp", [(1, 1), (1, 4), (3, 2), (4, 4), (9, 4), (6, 8)])
def test_equal_microbatches_take_m_plus_p_minus_one(num, pp):
    assert pipeline_time([0.5] * num, pp_size=pp) == pytest.approx((num + pp - 1) * 0.5)


def test_unequal_microbatches_match_the_simulator():
    """One rank, whole sequences of very different lengths: no rings, so the simulator's 1F1B event loop
    and the planner's makespan must agree exactly; the old (pp - 1) x mean bubble did not."""
    rng = np.random.default_rng(0)
    for pp in (2, 4):
        for _ in range(3):
            lengths = rng.integers(100, 8000, size=int(rng.integers(2, 9))).tolist()
            schedule = [[[i] for i in range(len(lengths))]]
            plan = assemble_plan(policy="balance", lengths=lengths, rings=[(0,)] * len(lengths),
                                 offload_ratios=[0.0] * len(lengths), schedule=schedule, capacity=8000,
                                 cost_model=CM, pp_size=pp)
            timeline = simulate_step(plan, CM)
            assert plan.ranks[0].est_time == pytest.approx(timeline.finish[0], rel=1e-9)
            assert plan.est_step_time == pytest.approx(timeline.compute_end, rel=1e-9)


def test_heavy_microbatch_sets_the_bubble():
    """One micro-batch of 10 among nine of 1 on 4 stages: the heavy one alone needs p x 10 = 40 (its forward
    and backward cross all stages), far above sum + 3 x mean = 19 + 5.7."""
    times = [10.0] + [1.0] * 9
    assert pipeline_time(times, pp_size=4) >= 40.0
    assert pipeline_time(times, pp_size=4) <= sum(times) + 3 * max(times)


def test_pipeline_packing_never_worse_than_full_microbatches():
    rng = np.random.default_rng(1)
    sizes = rng.integers(50, 3000, size=40).tolist()
    times = [float(CM.layer_compute_time(seq_len=s, num_tokens=s)) for s in sizes]
    overhead = CM.g

    def makespan(bins):
        return pipeline_time([0.3] + sorted((overhead + sum(times[i] for i in b) for b in bins), reverse=True),
                             pp_size=4)

    bins = pack_for_pipeline(sizes, times, capacity=4096, leading=[0.3], overhead=overhead, pp_size=4)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 4096 for b in bins)
    assert makespan(bins) <= makespan(best_fit(sizes, capacity=4096)) * (1 + 1e-12)
    assert len(bins) > len(best_fit(sizes, capacity=4096))  # smaller micro-batches shrink the bubble here


@pytest.mark.parametrize("num, pp, vpp", [(2, 2, 2), (4, 2, 4), (4, 4, 2), (8, 4, 4), (12, 4, 5), (8, 8, 2)])
def test_interleaved_equal_microbatches_take_m_plus_bubble_over_v(num, pp, vpp):
    """Narayanan et al. 2021 (Megatron-LM, Sec. 2.2.2): the interleaved schedule's bubble is (p - 1) / v
    micro-batch times, so m equal micro-batches of time t take (m + (p - 1) / v) t."""
    assert pipeline_time([0.5] * num, pp_size=pp, vpp_size=vpp) == pytest.approx((num + (pp - 1) / vpp) * 0.5)


def test_interleaved_unequal_microbatches_match_the_simulator():
    """One pipeline with virtual stages and no rings: the planner's makespan and the simulator's event loop
    agree exactly; a count Megatron's interleaved schedule does not run is refused."""
    rng = np.random.default_rng(5)
    for pp, vpp in ((2, 2), (4, 2), (4, 4)):
        for num in (pp, 2 * pp):
            lengths = rng.integers(100, 8000, size=num).tolist()
            plan = assemble_plan(policy="balance", lengths=lengths, rings=[(0,)] * num, offload_ratios=[0.0] * num,
                                 schedule=[[[i] for i in range(num)]], capacity=8000, cost_model=CM, pp_size=pp,
                                 vpp_size=vpp)
            timeline = simulate_step(plan, CM)
            assert plan.ranks[0].est_time == pytest.approx(timeline.finish[0], rel=1e-9)
            assert plan.est_step_time == pytest.approx(timeline.compute_end, rel=1e-9)
            assert {op.chunk for op in timeline.ops[0][0]} == set(range(vpp))
    with pytest.raises(ValueError, match="Megatron needs"):
        pipeline_time([1.0] * 6, pp_size=4, vpp_size=2)


def test_virtual_stages_cannot_hide_a_heavy_microbatchs_own_crossing():
    """One heavy micro-batch H among light ones: its forward and backward cross every stage one after
    the other, pp x H, whatever the chunking, so with little other work virtual stages hardly help (only
    a lighter H does: wider rings)."""
    times = [10.0] + [1.0] * 7
    for vpp in (1, 2, 4):
        assert pipeline_time(times, pp_size=4, vpp_size=vpp) >= 4 * 10.0
    assert pipeline_time(times, pp_size=4, vpp_size=4) < pipeline_time(times, pp_size=4)


def test_vpp_packing_fills_the_padded_count():
    """With virtual stages a pipeline runs a multiple of pp micro-batches anyway (Megatron's constraint
    with the default group size): packing makes real micro-batches of the padding slots when that is
    faster, never slower than packing at C and padding."""
    rng = np.random.default_rng(2)
    sizes = rng.integers(200, 3000, size=30).tolist()
    times = [float(CM.layer_compute_time(seq_len=s, num_tokens=s)) for s in sizes]

    def makespan(bins):
        bin_times = [CM.g + sum(times[i] for i in b) for b in bins]
        padding = -len(bin_times) % 4
        return pipeline_time(bin_times + [CM.g] * padding, pp_size=4, vpp_size=2)

    bins = pack_for_pipeline(sizes, times, capacity=8192, leading=[], overhead=CM.g, pp_size=4, vpp_size=2)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert makespan(bins) <= makespan(best_fit(sizes, capacity=8192)) * (1 + 1e-12)
    assert len(bins) % 4 == 0


def test_ring_shift_keeps_rings_aligned_and_moves_them_after_light_work():
    """`ring_shifts.shifted`: every ring member moves its rings by the same number of indices (the lightest
    whole micro-batches first, empty ones where a pipeline has fewer), so a ring stays on one index;
    a pipeline without rings keeps its order. Five heavy micro-batches on every pipeline (a ring over
    the whole pool, as byted's 2M documents get) run faster after three empty ones with 10 virtual stages
    than first (the fifth heavy one would be alone in its group of pp)."""
    from megatron_hdp.plan.search.ring_shifts import shifted

    weight = {0: 5.0, 1: 1.0, 2: 3.0}.get
    a = shifted([[9]], [[0], [1], [2]], 2, weight=lambda mb: sum(map(weight, mb)))
    b = shifted([[9]], [[1]], 2, weight=lambda mb: sum(map(weight, mb)))
    assert a == [[1], [2], [9], [0]] and b == [[1], [], [9]]
    assert shifted([], [[0], [1]], 2, weight=len) == [[0], [1]]
    heavy, empty = 2.45, 0.0004
    first = pipeline_time([heavy] * 5 + [empty] * 3, pp_size=4, vpp_size=10)
    after = pipeline_time([empty] * 3 + [heavy] * 5, pp_size=4, vpp_size=10)
    assert after < first * 0.96


def test_a_group_holding_all_heavy_microbatches_shrinks_the_bubble_and_the_planner_may_choose_it():
    """Five heavy micro-batches (rings over both pipelines, as byted's 2M documents get) and three light
    ones per pipeline, PP 4 x 10 virtual stages: with Megatron's default G = pp the fifth heavy one shares
    its group with light ones and crosses the stages nearly alone; G = 5 puts all five in the first group.
    The planner's time and the simulator's event loop agree that G = 5 is faster; `ring_shifts.group_sizes`
    offers it and `fits_memory` allows it (ring shards hold a quarter of C) but refuses it for full
    micro-batches, whose extra in-flight activations C was not sized for."""
    import dataclasses

    from megatron_hdp.plan.search.ring_shifts import fits_memory, group_sizes

    assert group_sizes(4, 10, 5) == [None, 5] and group_sizes(4, 1, 5) == [None] and group_sizes(4, 10, 4) == [None]
    lengths = [400_000] * 5 + [2000] * 6
    rings = [(0, 1)] * 5 + [(0,)] * 3 + [(1,)] * 3
    schedule = [[[i] for i in range(5)] + [[5 + j + 3 * r] for j in range(3)] for r in range(2)]
    timed = {group: time_plan(policy="hand", lengths=lengths, rings=rings, offload_ratios=[0.0] * 11,
                              schedule=schedule, capacity=800_000, cost_model=CM, pp_size=4, vpp_size=10,
                              group_size=group) for group in (None, 5)}
    plans = {group: plan.build() for group, plan in timed.items()}
    simulated = {group: simulate_step(plan, CM).compute_end for group, plan in plans.items()}
    assert plans[5].est_step_time < plans[None].est_step_time * 0.97
    assert simulated[5] < simulated[None] * 0.97
    assert simulated[5] == pytest.approx(plans[5].est_step_time, rel=1e-9)  # rings aligned, equal members
    assert fits_memory(timed[5])
    assert not fits_memory(dataclasses.replace(timed[5], capacity=2000))


def test_many_pipelines_at_once_are_each_pipeline_alone():
    """`pipelines_finish` (numpy over pipelines, the op order of the largest count shared by the others)
    without coupling gives each pipeline's `pipeline_time` exactly, for uneven counts (1F1B: any; with
    virtual stages: multiples of G beside counts with a longer last group, which get their own order)."""
    rng = np.random.default_rng(2)
    for pp, vpp, group, counts in [(2, 1, None, [1, 3, 7, 2]), (4, 1, None, [5, 1, 9, 4, 9]),
                                   (4, 2, None, [4, 8, 12, 4]), (4, 2, 8, [8, 12, 16, 13, 12]), (2, 3, 4, [4, 6, 8])]:
        times = [rng.uniform(0.1, 2.0, size=n).tolist() for n in counts]
        together = pipelines_finish(times, pp_size=pp, vpp_size=vpp, group_size=group)
        alone = [pipeline_time(t, pp_size=pp, vpp_size=vpp, group_size=group) for t in times]
        assert together.tolist() == alone, (pp, vpp, group, counts)
    with pytest.raises(ValueError, match="break the ring rule"):
        pipelines_finish([[1.0] * 8, [1.0] * 12, [1.0] * 13], pp_size=4, vpp_size=2, group_size=8,
                         groups={(1, 0): 0, (2, 0): 0})


@pytest.mark.parametrize("pp, vpp", [(4, 1), (4, 2)])
def test_packing_many_pipelines_at_once_picks_what_each_alone_picks(pp, vpp, monkeypatch):
    """`pack_for_pipelines` times every rank's candidate packings in numpy passes (`pipelines_finish`);
    each rank must get the very bins it gets alone, timed one candidate at a time by `pipeline_time`."""
    rng = np.random.default_rng(7)
    ranks = []
    for _ in range(12):  # 12 ranks x >= 8 candidates each: past VECTOR_MIN_CANDIDATES
        sizes = rng.integers(50, 3000, size=int(rng.integers(1, 30))).tolist()
        times = [float(CM.layer_compute_time(seq_len=s, num_tokens=s)) for s in sizes]
        ranks.append((sizes, times, [0.3] * int(rng.integers(0, 3))))
    ranks.append(([], [], [0.3]))  # a rank with only its rings
    assert 12 * 8 >= packing.VECTOR_MIN_CANDIDATES
    together = packing.pack_for_pipelines(ranks, capacity=4096, overhead=CM.g, pp_size=pp, vpp_size=vpp)
    monkeypatch.setattr(packing, "VECTOR_MIN_CANDIDATES", 10**9)  # one Python pass per candidate
    alone = [pack_for_pipeline(s, t, capacity=4096, leading=lead, overhead=CM.g, pp_size=pp, vpp_size=vpp)
             for s, t, lead in ranks]
    assert together == alone
