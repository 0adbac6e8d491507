"""benchmarks/share_whatif.py: its member times at equal shares are the cost model's micro-batch times, its
"today" step rebuilt row by row is the timeline's step, and on a hand-made row (one ring of four members,
one of them also busy with other work) its re-chosen shares level the lanes as a brute force over the
busy lane's share, timed by `CostModel.microbatch_time`, does."""

from dataclasses import replace

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import MICROBATCHES_PER_RANK

SPEC = ClusterSpec(model="deepseek-v3", num_gpus=512, tp_size=8, ep_size=32)  # 64 ranks, 2 units


@pytest.fixture
def whatif(benchmark_script):
    return benchmark_script("share_whatif")


@pytest.mark.parametrize("length,ring_size", [(131072, 4), (131072, 8), (97200, 7), (24309, 2)])
def test_equal_shares_are_the_cost_models_member_time(whatif, length, ring_size):
    cost = SPEC.cost_model()
    share = whatif.ShareCost(cost, SPEC.rank_capacity, 1.0)
    t = -(-length // ring_size)
    for kind in share.kinds:
        shard = (length, t, tuple(range(ring_size)), kind)
        expected = cost.microbatch_time([shard]) - cost.microbatch_time([]) - cost.expert_seconds_per_token() * t
        assert share.piece(length, t, t, ring_size, cost.ring_bandwidth, kind) == pytest.approx(expected, rel=1e-12)


def test_today_rebuilt_is_the_timed_step(whatif):
    cost, capacity, ranks = SPEC.cost_model(), SPEC.rank_capacity, SPEC.num_ranks
    lengths = np.asarray(sample_global_batch("github", num_tokens=MICROBATCHES_PER_RANK * capacity * ranks, seed=3,
                                             max_length=131072))
    config = HDPConfig(hdp_capacity=capacity)
    plan = make_plan(lengths, num_ranks=ranks, config=config, cost_model=cost, policy="balance")
    steps = whatif.whatif(plan, cost, config)
    assert steps["today"] == pytest.approx(plan.est_step_time, rel=1e-9)
    assert steps["error"] < 1e-3  # the rows in the what-if's terms (traffic of the largest share, not each member's)
    assert steps["ideal_mean"] <= steps["today"] and steps["lanes"] <= steps["today"]


def test_shares_level_a_busy_member_as_a_brute_force_does(whatif):
    # a K/V ring of a 131,072-token document on 4 members at ~32K tokens each (offloaded) is work-bound:
    # its traffic hides whatever the share within the range searched, so the cost model's own member time
    # (traffic of its own tokens) is the true one there and serves as the reference.
    cost = replace(SPEC.cost_model(), ring_kind="kv")
    share = whatif.ShareCost(cost, SPEC.rank_capacity, 1.0)
    length, ring = 131072, (0, 1, 2, 3)
    overhead, spt = cost.microbatch_time([]), cost.expert_seconds_per_token()

    def lane(tokens: float) -> float:
        return cost.microbatch_time([(length, tokens, ring, "kv")]) - spt * tokens

    busy = 1.0
    brute = min(max(busy + lane(x), lane((length - x) / 3)) for x in range(20000, 32769, 4))
    base, held = np.full(4, overhead), np.zeros(4)
    base[0] += busy
    today = max(busy + lane(32768), lane(32768))
    rings = [whatif.Ring(length, list(ring), cost.ring_bandwidth, 32768)]
    placed = None
    lo, hi = brute - 0.05, today
    for _ in range(30):
        mid = 0.5 * (lo + hi)
        found = whatif.place_rings(rings, base, held, 40000.0, mid, share, False)
        lo, hi, placed = (lo, mid, found) if found is not None else (mid, hi, placed)
    assert placed is not None and today - brute > 0.2
    assert placed[0].max() == pytest.approx(brute, rel=2e-3)
    assert placed[1].sum() == length
