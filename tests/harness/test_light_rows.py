"""benchmarks/light_rows.py: its plan without light rows is the plan with every free lane filled (and it
puts `critical_rows` back), on the sparse Mixtral batch of tests/plan/test_light_lead_rows.py."""

import dataclasses

from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.search import expert_units
from megatron_hdp.sim.cluster import ClusterSpec


def test_the_two_plans_are_with_and_without_light_rows(benchmark_script):
    light_rows = benchmark_script("light_rows")
    spec = ClusterSpec("mixtral-8x7b", num_gpus=96, tp_size=1)
    cost = dataclasses.replace(spec.cost_model(), expert_parallel_size=8, ranks_per_node=8)
    lengths = sample_global_batch("github", num_tokens=96 * 16384 // 2, seed=1, max_length=1 << 18)
    found = expert_units.critical_rows
    filled = light_rows.step(lengths, cost, 96, light=False)
    assert expert_units.critical_rows is found
    light = light_rows.step(lengths, cost, 96, light=True)
    assert light < 0.95 * filled
