"""The planner's policy registry: plan/ holds its own policies, the Megatron layer registers its own.

plan/ names no upper layer (tests/test_layers.py reads the imports and string constants); these tests
check the other half: importing `megatron_hdp.megatron` registers `megatron-hybrid-cp`, the registered
function plans exactly what the adapter plans, and the CLI still offers and runs it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.planner import POLICIES, make_plan, policy_function, register_policy
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CM = analytic_cost_model("llama-7b")
LENGTHS = [300, 5000, 9000, 1200, 700, 2500, 16000, 90]


def test_plan_alone_registers_only_its_own_policies():
    code = ("import sys; from megatron_hdp.plan.planner import POLICIES; "
            "print(','.join(POLICIES)); sys.exit('megatron_hdp.megatron' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["balance,naive,naive-offload,static,rl-static-cp,optimal"]


def test_megatron_layer_registers_hybrid_cp_and_it_plans_as_the_adapter():
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    import megatron_hdp.megatron  # noqa: F401
    from megatron_hdp.megatron.comparison.hybrid_cp import plan_megatron_hybrid_cp

    assert "megatron-hybrid-cp" in POLICIES and "megatron-dynamic-cp" in POLICIES
    config = HDPConfig(hdp_capacity=4096, hdp_policy="megatron-hybrid-cp")
    registered = make_plan(LENGTHS, num_ranks=8, config=config, cost_model=CM)
    direct = plan_megatron_hybrid_cp(LENGTHS, num_ranks=8, config=config, cost_model=CM, pp_size=1)
    assert registered.digest() == direct.digest()


def test_an_unregistered_policy_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="unknown policy 'no-such-policy'; registered: balance"):
        policy_function("no-such-policy")
    spec = ClusterSpec("llama-7b", num_gpus=16, tp_size=8, capacity=16384)
    with pytest.raises(ValueError, match="unknown policy 'no-such-policy'"):  # not reported as "cannot plan"
        compare_policies(spec, context=16384, distribution="github", policies=["balance", "no-such-policy"],
                         progress=False)


def test_a_name_cannot_be_claimed_twice():
    register_policy("balance", POLICIES["balance"])  # the same function again: idempotent
    with pytest.raises(ValueError, match="policy 'balance' is already registered"):
        register_policy("balance", lambda lengths, **kwargs: None)
    assert POLICIES["balance"].__name__ == "plan_balance"


def test_cli_plan_offers_and_runs_megatron_hybrid_cp(tmp_path):
    pytest.importorskip("megatron.core.pipeline_parallel.hybrid_cp_schedule")
    out = tmp_path / "plan.json"
    result = subprocess.run([sys.executable, "-m", "megatron_hdp.cli", "plan", "--dist", "github", "--tokens", "64K",
                             "--ranks", "8", "--capacity", "16K", "--policy", "megatron-hybrid-cp",
                             "--compare", "megatron-hybrid-cp", "--json", str(out)],
                            capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["policy"] == "megatron-hybrid-cp"
