"""Rows of rings of several EP units that outlast a lane's mean work, planned light (`expert_units`, step 2).

Such a row keeps its units busy past the pool's mean whatever else it holds, and every lane of it waits
for the all-to-all of its fullest lane and for the routed expert work the all-to-all spreads over its
lanes. Filling its free lanes with whole documents up to C tokens, or with lane rings, lengthens it; on a
pool with lanes to spare the documents are better placed elsewhere. `place_units` plans such rows light
too and keeps whichever arrangement's slowest unit is faster.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.policies.balance import plan_balance
from megatron_hdp.plan.search import expert_units
from megatron_hdp.plan.search.expert_units import critical_rows
from megatron_hdp.sim.cluster import ClusterSpec

RANKS, EP, CAPACITY = 96, 8, 16384


def test_critical_rows_take_the_slowest_rows_while_the_pool_can_spare_their_free_lanes():
    """16 ranks, a lane's mean work 5 s: the pool can spare 16 x (10 - 5) = 80 lane-seconds; the 10 s row's
    4 free lanes take 40 of them, the 9 s row's 6 would take 54 more, so it stays open; the 3 s row is below
    the mean. A dense pool (mean 9.9 s) spares 1.6 lane-seconds: no row."""
    times, free = [9.0, 10.0, 3.0], [6, 4, 2]
    assert critical_rows(times, free, mean_lane=5.0, num_ranks=16) == [1]
    assert critical_rows(times, free, mean_lane=9.9, num_ranks=16) == []
    assert critical_rows(times, [0, 4, 2], mean_lane=2.0, num_ranks=16) == [1, 2]  # a full row: nothing to keep


@pytest.fixture(scope="module")
def sparse_batch():
    """Mixtral-8x7B at EP 8 on nodes of 8, 96 ranks, half a C-token micro-batch a rank (github seed 1): a
    141,244-token document on a ring of several units, and lanes to spare."""
    spec = ClusterSpec("mixtral-8x7b", num_gpus=RANKS, tp_size=1)
    cost = dataclasses.replace(spec.cost_model(), expert_parallel_size=EP, ranks_per_node=8)
    lengths = sample_global_batch("github", num_tokens=RANKS * CAPACITY // 2, seed=1, max_length=1 << 18)
    return lengths, cost


def _plan(lengths, cost):
    return plan_balance(lengths, num_ranks=RANKS, cost_model=cost, config=HDPConfig(hdp=True, hdp_capacity=CAPACITY))


def test_a_slow_ring_row_with_lanes_to_spare_is_planned_light_and_the_step_is_faster(sparse_batch, monkeypatch):
    """The timed step (the timeline's, not the layout's estimate the choice is made by) is over 5% below
    the plan made with every row's free lanes filled, and the lanes beside the longest ring's members in
    its row hold no more tokens than its fullest member."""
    lengths, cost = sparse_batch
    light = _plan(lengths, cost)
    monkeypatch.setattr(expert_units, "critical_rows", lambda *args, **kwargs: [])
    filled = _plan(lengths, cost)
    assert light.est_step_time < 0.95 * filled.est_step_time, (light.est_step_time, filled.est_step_time)

    longest = max(range(len(lengths)), key=lengths.__getitem__)
    ring = light.sequences[longest].ring
    assert len(ring) > EP  # a ring of several units
    last_unit = ring[-1] // EP
    index = next(i for i, mb in enumerate(light.ranks[ring[-1]].microbatches)
                 if any(shard.seq == longest for shard in mb.shards))
    member_tokens = max(shard.num_tokens for rank in ring for mb in light.ranks[rank].microbatches
                        for shard in mb.shards if shard.seq == longest)
    for rank in range(last_unit * EP, (last_unit + 1) * EP):
        microbatches = light.ranks[rank].microbatches
        if rank not in ring and index < len(microbatches):
            assert microbatches[index].num_tokens <= member_tokens, (rank, microbatches[index].num_tokens)
