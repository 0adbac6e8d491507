"""`naive` is ByteScale's Algorithm 1 (dynamic communication: D(s) = ceil(s / C), no offload, token-balanced
placement), and `naive-offload` is the same placement on selective-offload sharding.

The reference is an example worked by hand from that description (comments below), not the planner's code.
"""

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model

COST = analytic_cost_model("llama-7b", tp_size=8)


def _microbatches(plan):
    return [[[shard.seq for shard in mb.shards] for mb in rank.microbatches] for rank in plan.ranks]


def test_algorithm_1_by_hand():
    # C = 1000, 4 ranks, offload allowed by the config (Algorithm 1 does not use it).
    # 2500 tokens: D = ceil(2500 / 1000) = 3 ranks, zigzag of 6 chunks at floor(j * 2500 / 6) =
    # 0, 416, 833, 1250, 1666, 2083, 2500: position 0 holds [0, 416) and [2083, 2500), 833 tokens;
    # the ring goes on the first 3 ranks, each then holding ceil(2500 / 3) = 834 tokens.
    # Whole sequences in loader order, each to the rank with fewest tokens (ties: lowest rank):
    # 900 -> rank 3 (0); 600 -> rank 0 (834); 400 -> rank 1 (834); 300 -> rank 2 (834); 100 -> rank 3 (900).
    # Each rank packs its whole sequences into micro-batches of <= 1000 tokens after its ring micro-batch:
    # rank 3 holds 900 + 100 = 1000 in one.
    config = HDPConfig(hdp_capacity=1000, hdp_offload=True)
    plan = make_plan([2500, 900, 600, 400, 300, 100], num_ranks=4, config=config, cost_model=COST, policy="naive")
    assert [s.ring for s in plan.sequences] == [(0, 1, 2), (3,), (0,), (1,), (2,), (3,)]
    assert _microbatches(plan) == [[[0], [2]], [[0], [3]], [[0], [4]], [[1, 5]]]
    assert plan.ranks[0].microbatches[0].shards[0].chunks == ((0, 416), (2083, 2500))
    assert all(s.offload_ratio == 0.0 for s in plan.sequences)


def test_naive_never_offloads_and_naive_offload_does():
    # The 7B / 1,024-GPU / 2M setting's shape: C = 64K, 128 HDP ranks, one 2M document among short ones.
    config = HDPConfig(hdp_capacity=65536, hdp_offload=True)
    lengths = [2 << 20] + [4096] * 400
    naive = make_plan(lengths, num_ranks=128, config=config, cost_model=COST, policy="naive")
    offload = make_plan(lengths, num_ranks=128, config=config, cost_model=COST, policy="naive-offload")
    assert len(naive.sequences[0].ring) == 32 and naive.sequences[0].offload_ratio == 0.0  # ceil(2M / 64K)
    assert len(offload.sequences[0].ring) < 32 and offload.sequences[0].offload_ratio > 0.0
    # why naive-offload loses without the balance scheduler: the document's members now hold more of its
    # quadratic attention, and the token-balanced placement does not give them less of anything else
    assert offload.est_step_time > 2 * naive.est_step_time
