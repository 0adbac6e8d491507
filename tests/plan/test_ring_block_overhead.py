"""CostModel.ring_block_overhead: each split document's extra kernel calls, in the planner and the simulator."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.sim.simulator import PolicyRules, simulate_step

BASE = CostModel(a1=1e-9, b1=1e-6, g=1e-3, a2=1.0, b2=0.0, kv_bytes_per_token=256.0, num_layers=4,
                 ring_bandwidth=1e9, ring_latency=1e-4)


@pytest.mark.parametrize("num_docs,ring_size", [(1, 2), (5, 4), (3, 3)])
def test_overhead_adds_two_calls_per_extra_ring_step_per_document(num_docs: int, ring_size: int) -> None:
    # num_docs documents on one ring plus one whole document on every member, all in micro-batch 0
    lengths = [64 * ring_size] * num_docs + [32] * ring_size
    rings = [tuple(range(ring_size))] * num_docs + [(r,) for r in range(ring_size)]
    plan = plan_from_rings(lengths, rings, [0] * len(lengths), num_ranks=ring_size, capacity=64 * num_docs + 64)
    overhead = 3e-4
    with_overhead = dataclasses.replace(BASE, ring_block_overhead=overhead)
    extra = BASE.num_layers * 2 * (ring_size - 1) * num_docs * overhead  # counted by hand
    before = simulate_step(plan, BASE, rules=PolicyRules())
    after = simulate_step(plan, with_overhead, rules=PolicyRules())
    assert after.busy - before.busy == pytest.approx([extra] * ring_size)
    # the planner's micro-batch time carries the same term (whole documents pay none)
    mb = plan.microbatches(0)[0]
    shards = [(plan.lengths[sh.seq], sum(b - a for a, b in sh.chunks), plan.sequences[sh.seq].ring) for sh in mb.shards]
    assert with_overhead.microbatch_time(shards) - BASE.microbatch_time(shards) == pytest.approx(extra)
    assert with_overhead.microbatch_time(shards) == pytest.approx(float(after.busy[0]))


def test_negative_overhead_rejected() -> None:
    with pytest.raises(ValueError, match="ring_block_overhead"):
        dataclasses.replace(BASE, ring_block_overhead=-1.0)
