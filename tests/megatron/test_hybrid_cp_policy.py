"""Policy megatron-hybrid-cp: Megatron-Core's BalancedCPScheduler, converted to a valid StepPlan.

The reference is the scheduler's own answer, asked directly: each plan micro-batch j must hold exactly the
sub-samples Megatron put in group j on that rank, in its order, each on a ring of the ranks that share it.
"""

import math
import random

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.megatron.comparison.hybrid_cp import megatron_schedule
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.planner import make_plan

pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")

COST = analytic_cost_model("llama-7b", tp_size=8)


def _plan(lengths, num_ranks, capacity, pp_size=1):
    config = HDPConfig(hdp_capacity=capacity, hdp_policy="megatron-hybrid-cp")
    return make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=COST, pp_size=pp_size)


def _mixes():
    rng = random.Random(7)
    for num_ranks in (1, 2, 4, 8, 16):
        capacity = 1000
        for _ in range(6):
            n = rng.randint(1, 40)
            lengths = [max(1, min(int(rng.paretovariate(0.9) * 150), capacity * num_ranks)) for _ in range(n)]
            yield lengths, num_ranks, capacity


@pytest.mark.parametrize("lengths, num_ranks, capacity", list(_mixes()))
def test_plan_matches_megatron_schedule(lengths, num_ranks, capacity):
    plan = _plan(lengths, num_ranks, capacity)  # validated by make_plan
    _, groups = megatron_schedule(lengths, num_ranks=num_ranks, capacity=capacity)
    assert all(len(rank.microbatches) == len(groups) for rank in plan.ranks)
    for j, per_rank in enumerate(groups):
        for rank, ids in enumerate(per_rank):
            assert [sh.seq for sh in plan.ranks[rank].microbatches[j].shards] == list(ids)
    for seq in plan.sequences:
        k = len(seq.ring)
        assert k & (k - 1) == 0, f"ring size {k} is not a power of two"
        # at least Megatron's gpus_needed = next power of two of L / C; never more than the pool
        assert k >= 2 ** max(0, math.ceil(math.log2(seq.length / capacity))) and k <= num_ranks
        j = next(j for j, per_rank in enumerate(groups) if seq.id in per_rank[seq.ring[0]])
        assert list(seq.ring) == [r for r in range(num_ranks) if seq.id in groups[j][r]]


def test_hand_case():
    """4 ranks, C=1000: the 4000-token sequence needs CP4 (group 0); then Megatron puts 1000, 1000, 500 on
    CP1 groups and, with one rank left idle, widens the first 1000 to CP2 (its fill_empty_gpus)."""
    plan = _plan([4000, 1000, 1000, 500], 4, 1000)
    assert [s.ring for s in plan.sequences] == [(0, 1, 2, 3), (0, 1), (2,), (3,)]
    assert [len(r.microbatches) for r in plan.ranks] == [2, 2, 2, 2]
    assert plan.ranks[0].microbatches[0].shards[0].chunks == ((0, 500), (3500, 4000))
    whole_4000 = COST.microbatch_time([(4000, 1000, (0, 1, 2, 3))])
    group_1 = max(COST.microbatch_time([(1000, 500, (0, 1))]), COST.microbatch_time([(1000, 1000, (2,))]))
    assert plan.est_step_time == pytest.approx(whole_4000 + group_1)


def test_group_tokens_may_exceed_capacity_but_each_subsample_fits():
    plan = _plan([1000] * 8, 4, 1000)
    for rank in plan.ranks:
        (mb,) = rank.microbatches
        assert mb.num_tokens == 2000 and mb.capacity == 2000
        assert all(sh.num_tokens <= 1000 for sh in mb.shards)


@pytest.mark.parametrize(
    "lengths, num_ranks, pp_size, message",
    [
        ([100, 200], 4, 2, "pipeline parallelism"),
        ([100, 200], 6, 1, "power-of-two"),
        ([100, 5000], 4, 1, "exceeds the pool"),
    ],
)
def test_bad_inputs(lengths, num_ranks, pp_size, message):
    with pytest.raises(ValueError, match=message):
        _plan(lengths, num_ranks, 1000, pp_size=pp_size)
