"""Megatron's Hybrid-CP as Megatron executes it (hybrid_cp_schedule.hybrid_context_parallel_forward_backward):
one forward/backward pass per sub-sample, the members of a split sub-sample together, a barrier over all
ranks after each group. `per_subsample_plan` turns the scheduler's grouped plan into that execution, and
the replay of measured times adds the group barriers."""

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.replay import dedicated_step_time

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
from megatron_hdp.megatron.comparison.hybrid_cp import megatron_schedule  # noqa: E402
from megatron_hdp.megatron.comparison.per_subsample import per_subsample_plan  # noqa: E402

CM = analytic_cost_model("llama-7b")


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_per_subsample_in_megatrons_order_with_a_barrier_per_group(seed):
    rng = np.random.default_rng(seed)
    num_ranks, capacity = 8, 256
    lengths = [int(x) for x in np.minimum(2048, rng.pareto(1.2, size=int(rng.integers(10, 60))) * 60 + 1)]
    grouped = make_plan(lengths, num_ranks=num_ranks, config=HDPConfig(hdp_capacity=capacity), cost_model=CM,
                        policy="megatron-hybrid-cp")
    split, barriers = per_subsample_plan(grouped)
    _, sample_id_groups = megatron_schedule(lengths, num_ranks=num_ranks, capacity=capacity)
    bounds = [-1, *barriers, len(split.ranks[0].microbatches) - 1]
    assert len(bounds) == len(sample_id_groups) + 1 and all(a < b for a, b in zip(bounds, bounds[1:]))
    for rank in range(num_ranks):
        mbs = split.microbatches(rank)
        assert all(len(mb.shards) <= 1 for mb in mbs)  # one sub-sample per pass
        for group, ids in enumerate(sample_id_groups):
            inside = [mb.shards[0] for mb in mbs[bounds[group] + 1: bounds[group + 1] + 1] if mb.shards]
            # Megatron's sub-samples of this group on this rank, in Megatron's order, and the same shards
            assert [sh.seq for sh in inside] == list(ids[rank])
            assert inside == list(grouped.microbatches(rank)[group].shards)
            for shard in inside:  # a pass holds <= C tokens (Megatron's CP size is the power of two >= L / C)
                assert shard.num_tokens <= capacity + 1
    # members of a split sub-sample run it at one index (validate checks it; a split plan did split)
    assert split.validate() is split and any(len(s.ring) > 1 for s in split.sequences)


def test_replay_waits_at_the_group_barriers():
    # index 0: ranks 0 and 1 alone; index 1: ranks 0 and 1 alone. Rank 0 is slow at index 0.
    plan = plan_from_rings([4, 4, 4, 4], [(0,), (1,), (0,), (1,)], [0, 0, 1, 1], num_ranks=2, capacity=4)
    kwargs = dict(before=[0.0, 0.0], forward=[[3.0, 1.0], [1.0, 1.0]], backward=[[0.0, 0.0], [0.0, 0.0]],
                  after=[0.0, 0.0])
    assert dedicated_step_time(plan, **kwargs) == pytest.approx(4.0)  # no barrier: rank 1 ends at 2
    assert dedicated_step_time(plan, **kwargs, barriers_after=(0,)) == pytest.approx(4.0)
    kwargs["forward"] = [[3.0, 1.0], [1.0, 3.0]]
    assert dedicated_step_time(plan, **kwargs) == pytest.approx(4.0)  # each rank 4 on its own
    assert dedicated_step_time(plan, **kwargs, barriers_after=(0,)) == pytest.approx(6.0)  # 3, barrier, 3
