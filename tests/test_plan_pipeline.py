"""The planner's PP time model (`plan.pipeline`): exact 1F1B makespan, checked against the closed form for
equal micro-batches and against the simulator's event loop for unequal ones; PP-aware packing."""

import numpy as np
import pytest

from megatron_hdp.plan.assemble import assemble_plan
from megatron_hdp.plan.packing import best_fit, pack_for_pipeline
from megatron_hdp.plan.pipeline import pipeline_time
from megatron_hdp.plan.presets import analytic_cost_model
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
