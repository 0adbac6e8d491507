"""The simulator end to end: cluster checks, monotonicity, policies side by side, the CLI and its pictures."""

import json

import numpy as np

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.cli import main
from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.sim.cluster import ClusterSpec, format_tokens
from megatron_hdp.sim.compare import compare_policies, compute_floor, format_table
from megatron_hdp.sim.plots import plot_gantt, plot_plans, plot_throughput
from megatron_hdp.sim.simulator import simulate_step
from picture_check import assert_real_picture


def test_token_counts():
    assert format_tokens(2 * 1024 * 1024) == "2M" and format_tokens(262144) == "256K" and format_tokens(1000) == "1000"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(model="gpt-9", num_gpus=8), "unknown model 'gpt-9'"),
        (dict(model="llama-7b", num_gpus=0), "num_gpus must be positive"),
        (dict(model="llama-7b", num_gpus=12, tp_size=8), "not a multiple of tp_size x pp_size"),
        (dict(model="llama-7b", num_gpus=48, pp_size=3, tp_size=1), "does not divide"),
        (dict(model="llama-7b", num_gpus=8, hardware="tpu"), "unknown hardware"),
    ],
)
def test_bad_cluster(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**kwargs)


def test_context_above_the_pool():
    spec = ClusterSpec("llama-7b", num_gpus=16, tp_size=8, capacity=65536)  # 2 ranks x 64K = 128K tokens
    with pytest.raises(ValueError, match="exceeds the HDP pool: 2 ranks"):
        compare_policies(spec, context=256 * 1024, distribution="byted", progress=False)


def test_memory_capacity_of_llama_7b_tp8():
    """Independent arithmetic: 80 GB x 0.9 minus 16 bytes/param states leaves ~111K tokens of 614 kB."""
    spec = ClusterSpec("llama-7b", num_gpus=1024, tp_size=8)
    per_token = 32 * 2 * (6 * 4096 + 2 * 4096 + 4 * 11008) / 8  # bytes, all layers
    params = spec.shape.num_parameters() / 8
    tokens = (80e9 * 0.9 - params * (4 + 12 / 128)) / per_token
    assert 65536 <= tokens < 131072 and spec.memory_capacity() == 65536


def test_memory_capacity_of_mixtral_8x7b_shards_experts_over_ep():
    """Independent arithmetic for the Mixtral-8x7B launch example (TP 4, EP 8, 512 GPUs): the experts'
    weights and grads live on TP x EP = 32 GPUs (their Adam states over the 16 expert-data-parallel
    ranks), the rest on TP 4 (states over the 128 HDP ranks); ~28K tokens of 2.26 MB fit, the example's
    24,576 among them, C = 16K (a power of two). Without EP every expert on every TP group leaves 10.7K."""
    h, kv, ffn, layers = 4096, 1024, 14336, 32
    experts = layers * 8 * 3 * h * ffn
    dense = layers * (h * (h + 2 * kv) + h * h + 2 * h) + 2 * 32000 * h
    per_token = layers * 2 * (6 * h + 2 * kv + 4 * ffn * 2) / 4
    for ep, expert_dp, fits in ((8, 16, (24576, 32768)), (1, 128, (8192, 16384))):
        spec = ClusterSpec("mixtral-8x7b", num_gpus=512, tp_size=4, ep_size=ep)
        states = dense / 4 * (4 + 12 / 128) + experts / (4 * ep) * (4 + 12 / expert_dp)
        tokens = (80e9 * 0.9 - states) / per_token
        assert fits[0] <= tokens < fits[1]
        assert spec.memory_budget()["fits"] == int(tokens)
        assert spec.memory_capacity() == 2 ** int(np.log2(tokens))
        assert spec.cost_model().expert_parallel_size == ep
    assert ClusterSpec("mixtral-8x7b", num_gpus=512, tp_size=4, etp_size=1, ep_size=8).expert_unit == 2


def test_static_throughput_grows_with_ranks_at_fixed_per_rank_load():
    """Equal documents, two per micro-batch and two micro-batches per rank whatever the pool: the compute
    part of the step stays the same, and from 2 ranks on (where the all-reduce appears) tokens/s grows
    with the pool, since the all-reduce's 2(n-1)/n grows less than the tokens do."""
    spec = ClusterSpec("llama-7b", num_gpus=8, tp_size=8)
    cost = spec.cost_model()
    config = HDPConfig(hdp_capacity=8192)
    throughputs, compute_ends = [], []
    for n in (2, 4, 8, 16):
        plan = make_plan([4096] * 4 * n, num_ranks=n, config=config, cost_model=cost, policy="static")
        timeline = simulate_step(plan, cost, grad_bytes=spec.grad_bytes, allreduce_bandwidth=1e10)
        throughputs.append(timeline.tokens_per_second)
        compute_ends.append(timeline.compute_end)
    assert compute_ends == pytest.approx([compute_ends[0]] * 4)
    assert all(a < b for a, b in zip(throughputs, throughputs[1:])), throughputs


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(1, 4000), st.integers(0, 3))
def test_more_work_is_never_faster(docs, extra_length, extra_rank):
    """Adding a whole document to a rank (as its last micro-batch) never shortens the step; a faster ring
    link never lengthens it."""
    num_ranks = 4
    lengths = [d[0] for d in docs]
    rings = [(d[1],) if d[2] == 0 else tuple(sorted({d[1], (d[1] + 1) % num_ranks})) for d in docs]
    slots = list(range(len(docs)))  # one micro-batch index per document keeps rings aligned
    cost = ClusterSpec("llama-7b", num_gpus=8, tp_size=8).cost_model()
    base = plan_from_rings(lengths, rings, slots, num_ranks=num_ranks, capacity=4000)
    more = plan_from_rings(lengths + [extra_length], rings + [(extra_rank,)], slots + [len(docs)],
                           num_ranks=num_ranks, capacity=4000)
    before = simulate_step(base, cost).step_time
    assert simulate_step(more, cost).step_time >= before * (1 - 1e-12)
    faster = type(cost)(**{**cost.to_dict(), "ring_bandwidth": cost.ring_bandwidth * 4})
    assert simulate_step(base, faster).step_time <= before * (1 + 1e-12)


def test_compare_policies_same_batches_and_reports_unsupported():
    import megatron_hdp.megatron  # noqa: F401  (registers megatron-hybrid-cp)

    spec = ClusterSpec("llama-7b", num_gpus=64, tp_size=8, pp_size=2, capacity=16384)
    result = compare_policies(spec, context=65536, distribution="github", policies=["static", "balance", "megatron-hybrid-cp"],
                              steps=2, progress=False)
    stats = result.stats
    assert stats["static"].speedup == pytest.approx(1.0)
    assert "pipeline parallelism" in stats["megatron-hybrid-cp"].error and stats["megatron-hybrid-cp"].speedup is None
    assert result.plans["static"].num_tokens == result.plans["balance"].num_tokens  # the same global batch
    assert stats["balance"].speedup == pytest.approx(stats["balance"].tokens_per_second / stats["static"].tokens_per_second)
    assert json.loads(json.dumps(result.to_dict()))["setup"]["num_ranks"] == 4
    # no policy beats 1/n of the batch's compute (each shard of L tokens on a ring costs a1 L t + b1 t, and
    # a ring's shards sum to the whole sequence's a1 L^2 + b1 L)
    assert all(s.tokens_per_second <= result.floor_tokens_per_second for s in stats.values() if not s.error)
    # nor the critical-path floor, which is never above the work floor in throughput (tests of the bound
    # itself: test_critical_path_floor.py); both ratios are reported per policy and in the JSON
    critical = result.critical_path_floor_tokens_per_second
    assert critical <= result.floor_tokens_per_second
    for s in stats.values():
        if not s.error:
            assert s.of_critical_path_floor == pytest.approx(s.tokens_per_second / critical) and s.of_critical_path_floor <= 1
            assert s.of_work_floor == pytest.approx(s.tokens_per_second / result.floor_tokens_per_second)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["critical_path_floor_speedup"] == pytest.approx(critical / stats["static"].tokens_per_second)
    assert [f["critical_path_s"] for f in data["floor_steps"]] == [max(f["work_s"], f["crossing_s"])
                                                                    for f in data["floor_steps"]]
    assert "(critical-path floor)" in format_table(result) and "of critical-path floor" in format_table(result)


def test_compute_floor_with_pp_is_set_by_one_long_document():
    cost = ClusterSpec("llama-7b", num_gpus=64, tp_size=8).cost_model()
    whole_model = [cost.num_layers * (cost.a1 * n * n + cost.b1 * n) for n in (200_000, 1_000, 1_000)]
    # PP = 1: 1/n of the whole batch's compute; PP = 4: the long document alone, spread over all 8 pipelines
    assert compute_floor([200_000, 1_000, 1_000], cost, num_ranks=8, pp_size=1) == pytest.approx(sum(whole_model) / 8)
    assert compute_floor([200_000, 1_000, 1_000], cost, num_ranks=8, pp_size=4) == pytest.approx(whole_model[0] / 8)
    assert whole_model[0] / 8 > sum(whole_model) / 32  # the PP limit is the binding one here
    # many equal documents: the PP term is 1/pp of the batch term and never binds
    assert compute_floor([1_000] * 64, cost, num_ranks=8, pp_size=4) == pytest.approx(64 * whole_model[1] / 32)


def test_compute_floor_under_expert_parallelism_holds_the_all_to_all_every_token_waits_for():
    """Mixtral-8x7B at TP 4 with EP 8 (the group over 4 nodes: the NIC): each token adds 4 x 2 h top-k / TP
    bytes x 7/8 over 50 GB/s per layer to the floor, and balance's predicted step stays above it."""
    spec = ClusterSpec("mixtral-8x7b", num_gpus=64, tp_size=4, ep_size=8)
    cost = spec.cost_model()
    lengths = [3_000] * 40 + [20_000] * 4
    compute = sum(cost.num_layers * (cost.a1 * n * n + cost.b1 * n) for n in lengths)
    transfers = 4 * (2 * 4096 * 2 / 4) * 7 / 8 / 50e9 * cost.num_layers * sum(lengths)
    assert compute_floor(lengths, cost, num_ranks=16, pp_size=1) == pytest.approx((compute + transfers) / 16, rel=1e-9)
    plan = make_plan(lengths, num_ranks=16, config=HDPConfig(hdp_capacity=spec.rank_capacity), cost_model=cost)
    assert plan.est_step_time >= compute_floor(lengths, cost, num_ranks=16, pp_size=1)


def _check_png(path):
    assert_real_picture(path)


def test_pictures(tmp_path):
    cost = ClusterSpec("llama-7b", num_gpus=8, tp_size=8).cost_model()
    config = HDPConfig(hdp_capacity=4096)
    lengths = [12000, 3000, 2500, 800, 700, 4000, 100, 5000]
    plans = {p: make_plan(lengths, num_ranks=4, config=config, cost_model=cost, policy=p) for p in ("static", "balance")}
    plot_plans(plans, str(tmp_path / "plans.png"))
    plot_gantt({p: simulate_step(plan, cost) for p, plan in plans.items()}, str(tmp_path / "gantt.png"))
    plot_throughput([262144, 524288], {"static": [1.0, 2.0], "balance": [2.0, 3.0]}, str(tmp_path / "tp.png"))
    for name in ("plans.png", "gantt.png", "tp.png"):
        _check_png(tmp_path / name)


def test_cli_simulate(tmp_path, capsys):
    out = tmp_path / "sim.png"
    code = main(["simulate", "--model", "llama-7b", "--gpus", "32", "--tp", "8", "--capacity", "64K", "--context", "256K",
                 "--dist", "byted", "--policies", "static,naive,balance", "--steps", "2", "--global-batch-tokens", "1M",
                 "--json", str(tmp_path / "sim.json"), "--plot", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| balance |" in printed and "speedup vs static" in printed
    result = json.loads((tmp_path / "sim.json").read_text())
    assert set(result["policies"]) == {"static", "naive", "balance"}
    assert result["throughput_vs_context"]["contexts"] == [262144]  # 4 ranks x 64K: 512K and up exceed the pool
    _check_png(out)
    _check_png(tmp_path / "sim-throughput.png")


def test_cli_rejects_bad_inputs(capsys):
    # one line on stderr naming the flag, exit code 2 (tests/commands/test_cli.py covers every command's error paths)
    for argv, message in (
        (["simulate", "--context", "2 megatokens"], "not a count such as 4096, 256K or 32M"),
        (["simulate", "--model", "gpt-9", "--gpus", "8"], "argument --model: unknown model 'gpt-9'"),
        (["simulate", "--gpus", "0"], "argument --gpus: must be a positive integer, got 0"),
        (["simulate", "--gpus", "16", "--tp", "8", "--capacity", "64K", "--context", "2M"], "exceeds the HDP pool"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
