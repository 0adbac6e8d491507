"""A process's first plan pays no lazy import: NumPy 2's `np.unique` imports `numpy.ma` on its first call
(~25 ms, as much as a quarter of a 1,024-rank plan's budget), so the timeline's micro-batch lookups take the
first of each run of an already sorted array instead (`microbatch_times.distinct_sorted`), held here to
`np.unique` itself."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from megatron_hdp.plan.timeline.microbatch_times import distinct_sorted


def test_distinct_sorted_is_np_unique_of_a_sorted_array():
    rng = np.random.default_rng(0)
    cases = [np.array([], dtype=np.int64), np.array([7]), np.array([3, 3, 3]), np.arange(5)]
    cases += [np.sort(rng.integers(0, n, size=n)) for n in (2, 10, 1000) for _ in range(5)]
    for values in cases:
        assert np.array_equal(distinct_sorted(values), np.unique(values)), values
        assert distinct_sorted(values).dtype == values.dtype


def test_a_first_plan_with_rings_imports_no_numpy_ma():
    """Plans a batch with rings, with and without EP units, in a fresh process (balance, validate) on a
    pool above `SMALL_POOL` (the small pools' ring-size climb, `neighbours`, still calls `np.unique`) and
    checks that `numpy.ma` was not imported along the way."""
    code = """
import dataclasses, sys
from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.planner import make_plan
assert "numpy.ma" not in sys.modules
cm = dataclasses.replace(analytic_cost_model("llama-7b"), expert_parallel_size=4)
lengths = [40000, 9000, 30000, 500, 700, 16000, 1200, 2048] * 64
make_plan(lengths, num_ranks=128, config=HDPConfig(hdp=True, hdp_capacity=8192), cost_model=cm, policy="balance")
make_plan(lengths, num_ranks=128, config=HDPConfig(hdp=True, hdp_capacity=8192),
          cost_model=dataclasses.replace(cm, expert_parallel_size=1), policy="balance")
print("numpy.ma" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
