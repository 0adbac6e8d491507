"""benchmarks/mla_ring_bench.py end to end on a tiny layer: its CPU path, which is the GPU script's path too
(the simulated section runs the same code on `--device cuda`), and what its JSON says."""

import json

import pytest

TINY = ["--heads", "2", "--qk-head-dim", "4", "--rope-dim", "2", "--v-head-dim", "4", "--kv-lora-rank", "3",
        "--repeats", "1"]


@pytest.fixture
def bench(benchmark_script):
    return benchmark_script("mla_ring_bench")


def test_both_sections_on_the_cpu(bench, tmp_path):
    out = tmp_path / "bench.json"
    bench.main([*TINY, "--seqlens", "10", "6", "--lengths", "12", "--ranks", "2", "--device", "cpu",
                "--output", str(out)])
    result = json.loads(out.read_text())
    (row,) = result["gloo"]["rows"]
    # 8 tokens per rank, k = 2, fp32: (2 x 1 + 2 x 1) buffers of 2 x (6 + 4) K/V or 3 + 2 latent values
    assert row["kv_MB_sent_per_rank"] * 2**20 == 4 * 8 * 2 * (6 + 4) * 4
    assert row["latent_MB_sent_per_rank"] * 2**20 == 4 * 8 * (3 + 2) * 4
    assert row["latent_over_kv_bytes"] == pytest.approx(5 / 20)
    (simulated,) = result["simulated"]["rows"]
    assert simulated["L"] == 12 and simulated["k"] == 2 and "error" not in simulated
    assert simulated["latent_model_MB_per_rank_layer"] * 2**20 == 4 * 6 * (3 + 2) * 4  # the cost model's count
    assert all(simulated[f"{name}_step_s"] > 0 for name in ("local", "kv", "latent"))
    assert result["command"].startswith("python benchmarks/mla_ring_bench.py") and result["repeat"] == 1


def test_time_budget_skips_what_it_cannot_start(bench, tmp_path):
    out = tmp_path / "skipped.json"
    bench.main([*TINY, "--sections", "simulated", "--lengths", "12", "16", "--ranks", "2", "--device", "cpu",
                "--time-budget", "0", "--output", str(out)])
    result = json.loads(out.read_text())["simulated"]
    assert result["rows"] == [] and result["skipped_lengths"] == [12, 16]
