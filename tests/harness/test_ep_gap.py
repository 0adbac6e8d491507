"""benchmarks/ep_gap.py: its parts of step - floor, worked from the plan's micro-batch times row by row,
add up to the step the timeline predicts (`StepPlan.est_step_time`, timed with the EP coupling by
`timeline.timing`), on a DeepSeek-V3 batch planned as EP units; and its exposure threshold against a
scan of ring sizes written here."""


import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.sharding import member_time, whole_times
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import MICROBATCHES_PER_RANK, step_floors



@pytest.fixture
def ep_gap(benchmark_script):
    return benchmark_script("ep_gap")


@pytest.fixture(scope="module")
def deepseek():
    spec = ClusterSpec(model="deepseek-v3", num_gpus=512, tp_size=8, ep_size=32)  # 64 ranks, 2 units
    cost, capacity, ranks = spec.cost_model(), spec.rank_capacity, spec.num_ranks
    lengths = np.asarray(sample_global_batch("github", num_tokens=MICROBATCHES_PER_RANK * capacity * ranks, seed=3,
                                             max_length=131072))
    plan = make_plan(lengths, num_ranks=ranks, config=HDPConfig(hdp_capacity=capacity), cost_model=cost,
                     policy="balance")
    return plan, lengths, cost, step_floors(lengths, cost, num_ranks=ranks, pp_size=1)["work_s"]


def test_the_parts_add_up_to_the_timed_step(ep_gap, deepseek):
    plan, lengths, cost, floor = deepseek
    assert any(len(s.ring) > 1 for s in plan.sequences)  # rings, so that inflation and ring rows count
    parts = ep_gap.decompose(plan, lengths, cost, floor)
    assert set(parts) == set(ep_gap.PARTS)
    assert abs(parts["rest"]) < 1e-9 * plan.est_step_time  # no ring spans units here: nothing is left over
    assert all(parts[p] >= -1e-12 for p in ep_gap.PARTS if p != "rest")
    assert floor + sum(parts.values()) == pytest.approx(plan.est_step_time, rel=1e-12)


def test_a_part_left_out_shows_as_rest(ep_gap, deepseek, monkeypatch):
    """Planted: the micro-batch overhead counted as nothing, so the rows' times fall short of the step."""
    plan, lengths, cost, floor = deepseek
    monkeypatch.setattr(type(cost), "microbatch_time", lambda self, shards, pp_size=1: 0.0)
    assert ep_gap.decompose(plan, lengths, cost, floor)["rest"] > 1e-6


def test_exposure_threshold_against_a_scan_of_ring_sizes(ep_gap):
    cost = ClusterSpec(model="deepseek-v3", num_gpus=2048, tp_size=8, ep_size=32).cost_model()
    for length in (40_000, 131_072):
        whole = float(whole_times([length], cost_model=cost)[0])
        hidden = [k for k in range(1, 40) if k * member_time(length, k, cost_model=cost) <= 1.001 * whole]
        # the ring sizes that hide their traffic are 1..m: the threshold is the fullest member at m
        assert hidden == list(range(1, len(hidden) + 1))
        assert ep_gap.exposure_threshold(cost, length) == -(-length // hidden[-1])
