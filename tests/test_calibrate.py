"""Calibration: `megatron-hdp calibrate` on CPU writes a cost model the planner loads whose T(s) and Act(s)
reproduce what was measured (the fits themselves: tests/test_fit.py)."""

import json

import pytest
import torch

from megatron_hdp.cli import main
from megatron_hdp.plan.cost_model import CostModel


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
    for sample in report["samples"]:
        s = sample["seq_len"]
        assert model.activation_bytes(s) == pytest.approx(sample["activation_bytes"], rel=1e-9)
        # Timings on a shared CPU are noisy; the fit must still track every point.
        assert sample["predicted_seconds"] == pytest.approx(sample["seconds"], rel=0.5)
        assert sample["predicted_seconds"] == pytest.approx(model.a1 * s * s + model.b1 * s + model.g)


def test_cli_names_bad_lengths(tmp_path, capsys):
    assert main(["calibrate", "--device", "cpu", "--seq-lens", "128,abc", "--output", str(tmp_path / "x.json")]) == 2
    assert "argument --seq-lens: 'abc' is not a count" in capsys.readouterr().err
