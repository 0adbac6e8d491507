"""One builder for a mesh's cost model (`plan.cost.mesh`), named hardware, and the refit's resume onto the
resuming run's flags."""

import dataclasses
import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_hdp.config import HARDWARE_NAMES
from megatron_hdp.plan.cost.mesh import hardware_for_device, mesh_cost_model, resolve_hardware
from megatron_hdp.plan.cost.presets import HARDWARE, analytic_cost_model, hardware_profile, model_shape

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_hdp"

# Published figures per GPU, typed from the datasheets (not read from presets.py): dense BF16 FLOP/s,
# HBM bytes, NVLink bytes/s one direction (half the bidirectional figure), NIC bytes/s, NVLink domain.
DATASHEETS = {
    "a100": (312e12, 80e9, 600e9 / 2, 200e9 / 8, 8),
    "h100": (989e12, 80e9, 900e9 / 2, 400e9 / 8, 8),
    "h200": (989e12, 141e9, 900e9 / 2, 400e9 / 8, 8),
    "b200": (18e15 / 8, 1.44e12 / 8, 1.8e12 / 2, 400e9 / 8, 8),  # HGX B200: 36 PF BF16 with sparsity, 18 dense
    "b300": (2.25e15, 288e9, 1.8e12 / 2, 800e9 / 8, 8),  # dense BF16 as B200 (the uplift is FP4)
    "gb200": (180e15 / 72, 186e9, 1.8e12 / 2, 400e9 / 8, 72),
}


def test_the_mesh_cost_model_has_one_builder():
    """No module of the package but the presets and the builder calls the analytic model: every door
    (install, Core API, plan, simulate, calibrate, ClusterSpec) goes through `mesh_cost_model`."""
    callers = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if re.search(r"\banalytic_cost_model\(", path.read_text()))
    assert callers == ["plan/cost/mesh.py", "plan/cost/presets.py"]


@pytest.mark.parametrize("name", sorted(DATASHEETS))
def test_presets_hold_the_published_figures(name):
    flops, memory, nvlink, nic, domain = DATASHEETS[name]
    hw = hardware_profile(name)
    assert (hw.peak_flops, hw.memory_bytes, hw.intra_node_bandwidth, hw.ring_bandwidth, hw.nvlink_domain) == \
        pytest.approx((flops, memory, nvlink, nic, domain), rel=1e-2)
    assert set(HARDWARE_NAMES) == set(HARDWARE)  # --hdp-hardware's choices are the presets


@pytest.mark.parametrize("device,preset", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"), ("NVIDIA B300 SXM6 AC", "b300"), ("NVIDIA GB200", "gb200"),
    ("NVIDIA GH200 480GB", None), ("NVIDIA GB300", None), ("Tesla V100-SXM2-32GB", None), ("NVIDIA L40S", None),
])
def test_the_device_name_picks_the_preset(device, preset):
    assert hardware_for_device(device) == preset


def test_an_unknown_gpu_is_refused_without_a_flag_or_a_measured_file():
    with pytest.raises(ValueError, match=r"^GPU 'NVIDIA L40S' has no hardware preset: name the closest with "
                                         r"--hdp-hardware"):
        resolve_hardware(flag=None, device_name="NVIDIA L40S", measured=False)
    assert resolve_hardware(flag="b200", device_name="NVIDIA L40S", measured=False) == "b200"
    assert resolve_hardware(flag=None, device_name="NVIDIA L40S", measured=True) is None
    assert resolve_hardware(flag=None, device_name=None, measured=False) == "h100"  # CPU runs: as before
    assert resolve_hardware(flag=None, device_name="NVIDIA GB200", measured=False) == "gb200"


def test_ranks_per_node_follow_the_nvlink_domain_unless_given():
    for hardware, tp, expected in (("h100", 1, 8), ("h100", 2, 4), ("gb200", 1, 72), ("gb200", 4, 18), ("b200", 16, 1)):
        assert mesh_cost_model(model="llama3-8b", hardware=hardware, tp_size=tp).ranks_per_node == expected
    assert mesh_cost_model(model="llama3-8b", hardware="gb200", ranks_per_node=3).ranks_per_node == 3


def test_a_measured_file_supplies_what_it_measured_and_is_completed_in_one_line(tmp_path, caplog):
    """A file without the MoE / MLA fields (as calibrate wrote them before) keeps its a1, b1, g and links;
    the expert share and the latent's bytes come from the shape, the up-projection at the file's speed
    (the analytic up-projection / b1 ratio times its b1), the NVLink bandwidth from the hardware; ring
    kind, ranks per node and the expert unit from the run."""
    shape = model_shape("deepseek-v3")
    path = tmp_path / "measured.json"
    measured = {"a1": 1e-9, "b1": 3e-6, "g": 1e-4, "a2": 5e4, "b2": 0.0, "kv_bytes_per_token": 100.0,
                "num_layers": 61, "ring_bandwidth": 40e9, "ring_kind": "kv", "ranks_per_node": 2}
    path.write_text(json.dumps(measured))
    with caplog.at_level(logging.WARNING, logger="megatron_hdp.plan.cost.mesh"):
        model = mesh_cost_model(model=shape, hardware="b200", tp_size=8, ep_size=8, ring_kind="latent", measured=path)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"cost model {path} lacks expert_share, expert_alltoall_bytes_per_token, latent_bytes_per_token, "
        "up_projection_time, intra_node_bandwidth, which this run needs (a MoE model's expert-work spread; the "
        "MoE all-to-all's transfers; the latent ring; rings inside an NVLink domain)"]
    assert model.expert_alltoall_bytes_per_token == pytest.approx(2 * 7168 * 8 * 59 / 61 / 8)  # bytes: unscaled
    assert (model.a1, model.b1, model.g, model.ring_bandwidth, model.kv_bytes_per_token) == (1e-9, 3e-6, 1e-4, 40e9, 100.0)
    # DeepSeek-V3 at TP 8: latent 512 + RoPE 64 values in bf16; up-projection 2 x 512 x 16 heads x 256 FLOPs
    # per token, the linear FLOPs per token counted by hand below, 3x for the backward
    assert model.latent_bytes_per_token == 2 * (512 + 64)
    h, vocab, layers = 7168, 129280, 61
    attention = h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256 + 128 * 128 * h
    moe_layers = layers - 3 + 1  # the MTP layer's experts count among the routed ones
    mlp = (3 * 18432 + (layers - 3) * (8 * 2048 + 2048)) / layers
    linear = 2 * (attention + 3 * h * mlp) + (2 * (attention + 3 * h * (8 * 2048 + 2048) + 2 * h * h + 3 * h)
                                              + 2 * 2 * h * vocab) / layers
    routed = 2 * 3 * h * 8 * 2048 * moe_layers / layers
    assert model.expert_share == pytest.approx(routed / linear, rel=1e-12)
    assert model.up_projection_time == pytest.approx(3e-6 * (2 * 512 * 128 * 256 / 8) / (3 * linear / 8), rel=1e-12)
    assert model.intra_node_bandwidth == 900e9
    assert (model.ring_kind, model.ranks_per_node, model.expert_parallel_size) == ("latent", 1, 8)
    caplog.clear()  # a complete file: nothing to say
    complete = tmp_path / "complete.json"
    model.to_json(complete)
    with caplog.at_level(logging.WARNING, logger="megatron_hdp.plan.cost.mesh"):
        again = mesh_cost_model(model=shape, hardware="b200", tp_size=8, ep_size=8, ring_kind="latent", measured=complete)
    assert not caplog.records and again == model


def test_plan_cli_plans_with_the_named_hardware(tmp_path, capsys):
    """`plan --hardware gb200` plans with GB200's preset: 72 / TP ranks per node, its faster GEMMs."""
    from megatron_hdp.cli import main
    from megatron_hdp.plan.step_plan import StepPlan

    times = {}
    for hardware in ("h100", "gb200"):
        out = tmp_path / f"{hardware}.json"
        argv = ["plan", "--dist", "github", "--ranks", "16", "--capacity", "8K", "--model", "llama3-8b", "--tp", "2",
                "--hardware", hardware, "--compare", "balance", "--json", str(out)]
        assert main(argv) == 0
        header = capsys.readouterr().out.splitlines()[0]
        assert f"hardware {hardware} ({4 if hardware == 'h100' else 36} HDP ranks per node)" in header
        times[hardware] = StepPlan.from_dict(json.loads(out.read_text())).est_step_time
    assert times["gb200"] < times["h100"] * 989e12 / 2.5e15 * 1.5


def _moe_mla_args(extra: list[str]):
    from megatron_hdp.megatron.pretrain.args import parse_and_check

    tiny = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 "
            "--micro-batch-size 1 --global-batch-size 8 --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type "
            "NullTokenizer --vocab-size 128 --attention-dropout 0.0 --hdp --calculate-per-token-loss --multi-latent-attention "
            "--kv-lora-rank 16 --qk-head-dim 12 --qk-pos-emb-head-dim 8 --v-head-dim 8 --num-experts 4 "
            "--moe-token-dispatcher-type alltoall --hdp-online-refit").split()
    return parse_and_check(tiny + extra, world_size=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})


@pytest.mark.parametrize("hardware,ranks_per_node", [("b200", 8), ("gb200", 72)])
def test_install_plans_with_the_named_hardware(hardware, ranks_per_node):
    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model

    args, config = _moe_mla_args(["--hdp-hardware", hardware])
    h100, _ = _moe_mla_args([])
    model, reference = _cost_model(args, config), _cost_model(h100, _)
    assert model.ranks_per_node == ranks_per_node and reference.ranks_per_node == 8
    assert model.b1 == pytest.approx(reference.b1 * 989e12 / hardware_profile(hardware).peak_flops, rel=1e-12)
    assert model.intra_node_bandwidth == 900e9


def test_an_unknown_gpu_stops_install_in_one_line(monkeypatch):
    import torch

    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model

    args, config = _moe_mla_args([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L40S")
    with pytest.raises(ValueError, match="^GPU 'NVIDIA L40S' has no hardware preset"):
        _cost_model(args, config)


def test_a_refit_resume_keeps_the_resuming_runs_flags(tmp_path):
    """Built as install() builds it: a run (K/V rings, 2 ranks per node, EP 1) saves its refit; the resume
    (latent rings, 4 ranks per node, EP 2 with expert TP 1) plans with its own flags and the learned a1, b1,
    g only."""
    from megatron_hdp.megatron.pretrain.cost_setup import run_cost_model as _cost_model, run_online_refit as _online_refit
    from megatron_hdp.plan.cost.online_refit import OnlineRefit, save_refit

    old, old_config = _moe_mla_args(["--hdp-ring-kind", "kv", "--hdp-ranks-per-node", "2"])
    learned = dataclasses.replace(_cost_model(old, old_config), a1=7e-10, b1=3e-7, g=2e-5)
    save_refit(OnlineRefit(learned), tmp_path, iteration=10)
    new, new_config = _moe_mla_args(["--hdp-ring-kind", "latent", "--hdp-ranks-per-node", "4",
                                     "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
                                     "--load", str(tmp_path)])
    fresh = _cost_model(new, new_config)
    resumed = _online_refit(new, new_config, fresh).model
    assert (resumed.ring_kind, resumed.ranks_per_node, resumed.expert_parallel_size) == ("latent", 4, 2)
    assert (resumed.a1, resumed.b1, resumed.g) == (7e-10, 3e-7, 2e-5)
    assert dataclasses.replace(resumed, a1=fresh.a1, b1=fresh.b1, g=fresh.g) == fresh


def test_refit_features_spread_the_expert_work_over_the_ep_group():
    """Ranks 0 and 1 form an EP group: rank 0 runs micro-batches of 100 and 50 tokens, rank 1 one of 30
    (and a padding one). With half the linear work routed experts', each runs half its own tokens' and
    half the group's mean at each index: 0.5 x 150 + 0.5 x (65 + 25) = 120 and 0.5 x 30 + 0.5 x 90 = 60."""
    from megatron_hdp.plan.hand_plan import plan_from_rings
    from megatron_hdp.plan.cost.online_refit import compute_features

    plan = plan_from_rings([100, 50, 30], [(0,), (0,), (1,)], [0, 1, 0], num_ranks=2, capacity=128)
    features = compute_features(plan, num_layers=1, expert_parallel_size=2, expert_share=0.5)
    np.testing.assert_allclose(features[:, 1], [120.0, 60.0])
    np.testing.assert_allclose(compute_features(plan, num_layers=1)[:, 1], [150.0, 30.0])


def test_the_moe_all_to_all_costs_its_bytes_over_the_ep_groups_link():
    """The all-to-all's own time, from the published shapes: Mixtral-8x7B (hidden 4096, top-2, every layer
    MoE) sends 2 x 4096 x 2 bytes per token per layer in bf16 at TP 1; DeepSeek-V3 (hidden 7168, top-8,
    58 of 61 layers MoE plus one MTP layer) 2 x 7168 x 8 x 59 / 61 over TP 8. With EP e, 7/8 of it leaves
    a rank of an EP 8 group, four times a layer, over NVLink (the group inside an 8-GPU node: 450 GB/s on
    an H100) or the NIC (EP 32 spans 4 nodes: 50 GB/s); dense models and EP 1 pay nothing. The refit
    takes that known term off the measured times: the rank with 100 + 50 tokens in an EP 2 group where
    its partner holds 30 (and a padding micro-batch) waits 100 + 50 token-times, and so does its partner."""
    from megatron_hdp.plan.cost.online_refit import alltoall_seconds
    from megatron_hdp.plan.hand_plan import plan_from_rings

    assert analytic_cost_model("mixtral-8x7b").expert_alltoall_bytes_per_token == 2 * 4096 * 2
    deepseek = analytic_cost_model("deepseek-v3", tp_size=8).expert_alltoall_bytes_per_token
    assert deepseek == pytest.approx(2 * 7168 * 8 * 59 / 61 / 8, rel=1e-12)
    assert analytic_cost_model("llama-7b").expert_alltoall_bytes_per_token == 0
    ep8 = mesh_cost_model(model="mixtral-8x7b", hardware="h100", ep_size=8)
    assert ep8.expert_alltoall_seconds_per_token() == pytest.approx(4 * 16384 * 7 / 8 / 450e9 * 32, rel=1e-12)
    ep32 = mesh_cost_model(model="mixtral-8x7b", hardware="h100", ep_size=32)
    assert ep32.expert_alltoall_seconds_per_token(pp_size=2) == pytest.approx(4 * 16384 * 31 / 32 / 50e9 * 16, rel=1e-12)
    assert mesh_cost_model(model="mixtral-8x7b", hardware="h100").expert_alltoall_seconds_per_token() == 0
    plan = plan_from_rings([100, 50, 30], [(0,), (0,), (1,)], [0, 1, 0], num_ranks=2, capacity=128)
    ep2 = dataclasses.replace(ep8, expert_parallel_size=2)
    np.testing.assert_allclose(alltoall_seconds(plan, ep2), [150 * ep2.expert_alltoall_seconds_per_token()] * 2)
