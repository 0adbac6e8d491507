"""Calibration: `megatron-hdp calibrate` on CPU writes a cost model the planner loads whose T(s) and Act(s)
reproduce what was measured (the fits themselves: tests/plan/test_fit.py)."""

import json

import numpy as np
import pytest
import torch

from megatron_hdp.cli import main
from megatron_hdp.plan.cost.model import CostModel


def _relative_error(coef, samples) -> float:
    s = np.array([x["seq_len"] for x in samples], dtype=float)
    t = np.array([x["seconds"] for x in samples], dtype=float)
    return float(np.sum(((coef[0] * s * s + coef[1] * s + coef[2]) / t - 1) ** 2))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cli_on_cpu_writes_a_cost_model_that_fits_its_measurements(tmp_path, one_thread):
    output = tmp_path / "cost_model.json"
    argv = ["calibrate", "--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--ffn-hidden-size", "128", "--seq-lens", "128,256,512,1024",
            "--repeats", "10", "--bandwidth-mib", "8", "--output", str(output)]
    assert main(argv) == 0
    model = CostModel.from_json(output)
    report = json.loads((tmp_path / "cost_model.measurements.json").read_text())
    assert report["bandwidth_source"] == "host-memcpy" and model.num_layers == 2 and model.host_memory_bytes > 0
    assert model.kv_bytes_per_token == 4 * 2 * 32  # fp32, K and V, 2 groups of 16 channels
    assert model.expert_share == 0 and model.latent_bytes_per_token == 0 and model.up_projection_time == 0  # dense
    for sample in report["samples"]:
        s = sample["seq_len"]
        assert model.activation_bytes(s) == pytest.approx(sample["activation_bytes"], rel=1e-9)
        assert sample["predicted_seconds"] == pytest.approx(model.a1 * s * s + model.b1 * s + model.g)
    # The written T(s) is the best non-negative fit of what was measured (timings on a shared CPU are
    # noisy, the fit is not): no point of a bounded solver's search, from another start, fits better.
    from scipy.optimize import minimize

    scale = np.array([1e-9, 1e-6, 1e-4])
    fitted = np.array([model.a1, model.b1, model.g])
    best = minimize(lambda x: _relative_error(x * scale, report["samples"]), x0=np.ones(3), method="L-BFGS-B",
                    bounds=[(0, None)] * 3, options={"ftol": 1e-15, "gtol": 1e-12})
    assert _relative_error(fitted, report["samples"]) <= best.fun * (1 + 1e-4) + 1e-12
    # and it tracks every point within 35% (a sanity bound only: one point of a loaded host may be off;
    # the checks above are the exact ones)
    for sample in report["samples"]:
        assert sample["predicted_seconds"] == pytest.approx(sample["seconds"], rel=0.35)


def test_cli_names_bad_lengths(tmp_path, capsys):
    assert main(["calibrate", "--device", "cpu", "--seq-lens", "128,abc", "--output", str(tmp_path / "x.json")]) == 2
    assert "argument --seq-lens: 'abc' is not a count" in capsys.readouterr().err


def test_the_file_of_a_moe_mla_model_carries_its_expert_share_and_latent_ring_fields(tmp_path, one_thread):
    """A MoE model with multi-latent attention (Moonlight's shape, narrowed): the JSON carries the measured
    expert share and up-projection time and the latent's bytes (kv_lora_rank 512 + RoPE 64 values in
    fp32), so a run with --hdp-cost-model spreads expert work and can pick latent rings."""
    output = tmp_path / "cost_model.json"
    argv = ["calibrate", "--device", "cpu", "--model", "moonlight-16b-a3b", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "2", "--num-query-groups", "2", "--ffn-hidden-size", "64",
            "--seq-lens", "32,64,128", "--repeats", "1", "--bandwidth-mib", "1", "--output", str(output)]
    assert main(argv) == 0
    saved = json.loads(output.read_text())
    assert 0.0 < saved["expert_share"] <= 1.0
    assert saved["latent_bytes_per_token"] == 4 * (512 + 64)
    assert saved["up_projection_time"] > 0
    assert saved["kv_bytes_per_token"] == 4 * 2 * (128 + 64 + 128)  # K (nope + RoPE) and V of 2 heads, fp32
