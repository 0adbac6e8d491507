"""Topology: ranks per node, a fast link inside a node and a slow one between nodes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies, format_table
from megatron_hdp.sim.simulator import PolicyRules, simulate_step

FLAT = CostModel.from_dict({**analytic_cost_model("llama-7b", tp_size=8).to_dict(), "ring_bandwidth": 1e9})
NODES = CostModel.from_dict({**FLAT.to_dict(), "ranks_per_node": 4, "intra_node_bandwidth": 400e9})


def test_a_ring_runs_at_its_slowest_link():
    assert not NODES.crosses_nodes((0, 1, 2, 3)) and NODES.crosses_nodes((2, 3, 4, 5))
    assert NODES.ring_link_bandwidth((0, 3)) == 400e9 and NODES.ring_link_bandwidth((3, 4)) == 1e9
    inside = NODES.microbatch_time([(8000, 4000, (4, 5))])
    across = NODES.microbatch_time([(8000, 4000, (3, 4))])
    per_layer = NODES.layer_ring_bytes(num_tokens=4000, ring_size=2) / 1e9 + 4 * NODES.ring_latency
    assert across == pytest.approx((NODES.g + NODES.b1 * 4000 + max(NODES.a1 * 8000 * 4000, per_layer))
                                   * NODES.num_layers)
    assert inside < across
    assert FLAT.microbatch_time([(8000, 4000, (3, 4))]) == pytest.approx(across)  # no topology: inter-node link


def test_rings_that_fit_a_node_are_placed_inside_one():
    rng = np.random.default_rng(0)
    lengths = [16000, 15000, 9000, 8000] + rng.integers(200, 4000, size=40).tolist()
    config = HDPConfig(hdp_capacity=4096, hdp_offload=False)
    plan = make_plan(lengths, num_ranks=8, config=config, cost_model=NODES, policy="balance")
    rings = [seq.ring for seq in plan.sequences if len(seq.ring) > 1]
    assert rings and all(not NODES.crosses_nodes(r) for r in rings), rings
    summary = plan.summary(NODES)
    assert summary.rings_across_nodes == 0 and summary.network_bytes == 0.0
    # the simulator times the same plan with the same links
    timeline = simulate_step(plan, NODES, rules=PolicyRules())
    np.testing.assert_allclose(timeline.busy, [r.est_time for r in plan.ranks], rtol=1e-9)
    # a ring over all 8 ranks must cross: two of its hops go between nodes
    wide = make_plan([30000] + [100] * 8, num_ranks=8, config=config, cost_model=NODES, policy="balance")
    summary = wide.summary(NODES)
    assert summary.rings_across_nodes == 1
    member = NODES.ring_bytes(num_tokens=-(-30000 // 8), ring_size=8)
    assert summary.network_bytes == pytest.approx(2 * member)


def test_old_cost_model_json_loads(tmp_path):
    old = {k: v for k, v in FLAT.to_dict().items()
           if k not in ("ranks_per_node", "intra_node_bandwidth", "activation_dtype_bytes")}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    loaded = CostModel.from_json(path)
    assert loaded.ranks_per_node is None and loaded.intra_node_bandwidth is None
    assert loaded.activation_dtype_bytes == 2  # bf16, the GPU case
    with pytest.raises(ValueError, match="ranks_per_node"):
        CostModel.from_dict({**old, "ranks_per_node": 0})


def test_simulate_shows_rings_across_nodes():
    spec = ClusterSpec(model="llama-7b", num_gpus=16, tp_size=2)
    assert spec.cost_model().ranks_per_node == 4  # 8 GPUs per node, TP 2: four HDP ranks per node
    comparison = compare_policies(spec, context=65536, distribution="byted", steps=1,
                                  policies=("static", "balance"), progress=False)
    table = format_table(comparison)
    assert "rings across nodes" in table and "network GB/GPU" in table
    balance = comparison.stats["balance"]
    assert balance.network_gb_per_rank <= balance.attention_gb_per_rank
