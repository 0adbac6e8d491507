"""Measured telemetry of a 4-rank CPU `pretrain` run with --hdp, read back from its TensorBoard event files.

One run (module fixture) of examples/pretrain_gpt_hdp.py on 4 gloo ranks, every rank its own
"node" (--hdp-ranks-per-node 1) on one host of LOCAL_WORLD_SIZE=4, so the cross-node bytes are those of
the plan's nodes, not the launcher's host, TensorBoard on, throughput logged. Its plans are saved per step as
`--hdp-save-plans` writes them (iter_0000001.json ...), so `megatron-hdp report` can read the run too.
"""

import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.run_logs import read_scalars

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: the shared helpers
from picture_check import assert_real_picture  # noqa: E402
from pretrain_harness import TINY, pretrain_rank  # noqa: E402

STEPS = 4
WORLD = 4
NODE = 1
"""HDP ranks per node the plan prices and the telemetry counts by (module docstring)."""
HDP = ["--seq-length", "64", "--train-iters", str(STEPS), "--hdp", "--hdp-capacity", "24",
       "--hdp-global-batch-tokens", "512", "--global-batch-size", "4"]
"""Documents cut at 64 tokens, 512 tokens a step, capacity 24: pieces longer than 24 tokens run on rings."""


def _pretrain_recording(rank: int, world_size: int, argv: list[str]) -> dict:
    """`pretrain_rank` that also returns the ring bytes this rank sent, as the traffic counters of
    `comm.traffic` (independent of the telemetry's own counting) saw them."""
    from megatron_hdp.comm.traffic import total_traffic

    result = pretrain_rank(rank, world_size, argv)
    result["bytes_sent"] = total_traffic().bytes_sent
    return result


def _crossing_hops(run_dir: Path, step: int) -> list[bool]:
    """For every hop of every ring of a step's plan: does it go from one node (of NODE ranks) to another?"""
    plan = json.loads((run_dir / "plans" / f"iter_{step:07d}.json").read_text())
    rings = [s["ring"] for s in plan["sequences"] if len(s["ring"]) > 1]
    return [ring[p] // NODE != ring[(p + 1) % len(ring)] // NODE for ring in rings for p in range(len(ring))]


@pytest.fixture(scope="module")
def hdp_run(tmp_path_factory):
    """Run directory of the 4-rank HDP run: tensorboard/ and plans/; plus what each rank returned."""
    from megatron_hdp.harness.build_dataset import build_demo_dataset

    run_dir = tmp_path_factory.mktemp("run")
    prefix = build_demo_dataset(run_dir / "data", num_docs=256, vocab_size=256, max_length=256)
    argv = TINY + HDP + ["--hdp-save-plans", str(run_dir / "plans"),
        "--data-path", prefix, "--data-cache-path", str(run_dir / "cache"),
        "--tensorboard-dir", str(run_dir / "tensorboard"), "--log-throughput", "--log-timers-to-tensorboard",
        "--hdp-log-interval", "1", "--hdp-online-refit", "--hdp-refit-warmup-steps", "1",
        "--hdp-ranks-per-node", str(NODE),
    ]
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": str(WORLD), "LOCAL_WORLD_SIZE": str(WORLD)}
    ranks = run_gloo(_pretrain_recording, WORLD, argv, timeout_s=480, env=env)
    return run_dir, ranks, argv


@pytest.mark.timeout(600)  # the module's one 4-rank pretrain run is set up here
def test_telemetry_is_written_to_tensorboard_and_adds_up(hdp_run):
    run_dir, ranks, _ = hdp_run
    scalars = read_scalars(run_dir / "tensorboard")
    measured = {tag: values for tag, values in scalars.items() if tag.startswith("hdp/measured/")}
    assert measured, sorted(scalars)
    for tag in ("compute-s", "ring-wait-s", "offload-exposed-s", "idle-before-allreduce-s"):
        for stat in ("max", "mean", "min"):
            assert sorted(scalars[f"hdp/measured/{tag}-{stat}"]) == list(range(1, STEPS + 1)), tag
    for step in range(1, STEPS + 1):
        value = {tag[len("hdp/measured/"):]: values[step] for tag, values in measured.items()}
        computes = [scalars[f"hdp/rank/compute-s/{r}"][step] for r in range(WORLD)]
        idles = [scalars[f"hdp/rank/idle-s/{r}"][step] for r in range(WORLD)]
        # the summaries are those of the per-rank values
        assert value["compute-s-max"] == pytest.approx(max(computes), rel=1e-6)
        assert value["compute-s-min"] == pytest.approx(min(computes), rel=1e-6)
        assert value["compute-s-mean"] == pytest.approx(sum(computes) / WORLD, rel=1e-5)
        assert value["balance"] == pytest.approx(max(computes) / (sum(computes) / WORLD), rel=1e-5)
        assert min(computes) > 0 and value["allreduce-s"] > 0 and value["step-s"] > 0
        assert min(idles) == 0.0 and value["idle-before-allreduce-s-max"] == pytest.approx(max(idles), rel=1e-6)
        # every sample is split over a ring (see test_pretrain): ring waits happen, offload is exposed on CPU
        assert value["ring-wait-s-max"] > 0 and value["offload-exposed-s-min"] > 0
        assert value["ring-GB"] > 0
        crossing = _crossing_hops(run_dir, step)
        if all(crossing) or not any(crossing):
            assert value["cross-node-GB"] == pytest.approx(all(crossing) * value["ring-GB"])
        else:
            assert 0 < value["cross-node-GB"] < value["ring-GB"]
        assert "hdp/balance" in scalars and step in scalars["hdp/balance"]  # the prediction, next to it
    # ring bytes: the telemetry's count equals comm.traffic's count of every message the ranks posted
    total = sum(scalars["hdp/measured/ring-GB"].values()) * 1e9
    assert total == pytest.approx(sum(r["bytes_sent"] for r in ranks), rel=1e-6)


def test_megatron_throughput_counts_the_documents_of_the_plan(hdp_run):
    """Megatron's TFLOP/s line uses the plan's real tokens and sum of s^2, not batch x --seq-length."""
    from megatron_hdp.megatron.pretrain.args import parse_and_check
    from megatron_hdp.megatron.pretrain.install import install  # noqa: F401  (megatron.training importable)
    from megatron.training.training import num_floating_point_operations

    run_dir, _, argv = hdp_run
    scalars = read_scalars(run_dir / "tensorboard")
    args, _ = parse_and_check(argv, world_size=WORLD)
    args.padded_vocab_size = 256  # set by the tokenizer at start-up: --vocab-size 256 is a multiple of 128
    logged_steps = sorted(set(scalars["throughput"]) & set(scalars["iteration-time"]))  # not the first one
    assert logged_steps == list(range(2, STEPS + 1))
    for step in logged_steps:
        plan = json.loads((run_dir / "plans" / f"iter_{step:07d}.json").read_text())
        lengths = [s["length"] for s in plan["sequences"]]
        expected = num_floating_point_operations(
            args, len(lengths), seqlen_squared_sum_in_batch=sum(n * n for n in lengths),
            total_real_tokens_in_batch=sum(lengths),
        )
        logged = scalars["throughput"][step] * scalars["iteration-time"][step] * 1e12 * WORLD
        assert logged == pytest.approx(expected, rel=1e-4)
        # Megatron's own default would count Megatron's nominal batch (--global-batch-size 4) of --seq-length
        assert expected != pytest.approx(num_floating_point_operations(args, 4), rel=1e-3)


def _summary_value(summary: str, quantity: str) -> float:
    """The number in the summary table's row for `quantity`."""
    (row,) = [line for line in summary.splitlines() if line.startswith(f"| {quantity} |")]
    return float(re.search(r"\| ([-0-9.e+]+)", row[len(quantity) + 3:]).group(1))


def test_report_renders_the_run_and_its_numbers_match_the_logs(hdp_run, tmp_path):
    from megatron_hdp.cli import main

    run_dir, _, _ = hdp_run
    assert main(["report", str(run_dir), "--output-dir", str(tmp_path)]) == 0
    assert_real_picture(tmp_path / "dashboard.png")
    summary = (tmp_path / "summary.md").read_text()
    scalars = read_scalars(run_dir / "tensorboard")

    def mean(tag: str) -> float:
        return sum(scalars[tag].values()) / len(scalars[tag])

    assert f"{STEPS} steps with telemetry" in summary
    assert _summary_value(summary, "measured step time") == pytest.approx(mean("hdp/measured/step-s") * 1e3, abs=1e-3)
    assert _summary_value(summary, "predicted step time") == pytest.approx(mean("hdp/est-step-time-s") * 1e3, abs=1e-3)
    assert _summary_value(summary, "measured balance (max/mean compute)") == pytest.approx(
        mean("hdp/measured/balance"), abs=1e-4)
    assert _summary_value(summary, "idle before all-reduce (mean over ranks)") == pytest.approx(
        mean("hdp/measured/idle-before-allreduce-s-mean") * 1e3, abs=1e-3)
    assert _summary_value(summary, "ring bytes per step") == pytest.approx(mean("hdp/measured/ring-GB"), rel=1e-5)
    # ring sizes come from the saved plans
    sizes = Counter(len(s["ring"]) for p in sorted((run_dir / "plans").glob("iter_*.json"))
                    for s in json.loads(p.read_text())["sequences"])
    listed = ", ".join(f"{k}: {n}" for k, n in sorted(sizes.items()))
    assert f"Ring sizes over {sum(sizes.values())} sequences of the saved plans (size: count): {listed};" in summary


def test_online_refit_changes_the_cost_model_after_its_warm_up(hdp_run):
    """--hdp-online-refit --hdp-refit-warmup-steps 1: step 1 only measures; from step 2 on every step moves
    the coefficients (toward this CPU's, far from the analytic H100 model) by at most x2 each."""
    run_dir, _, _ = hdp_run
    scalars = read_scalars(run_dir / "tensorboard")
    series = {name: scalars[f"hdp/cost-model/{name}"] for name in ("a1", "b1", "g")}
    assert all(sorted(values) == list(range(1, STEPS + 1)) for values in series.values())
    for step in range(2, STEPS + 1):
        ratios = [values[step] / values[step - 1] for values in series.values() if values[step - 1] > 0]
        assert all(0.5 * (1 - 1e-6) <= r <= 2.0 * (1 + 1e-6) for r in ratios), (step, series)
        assert any(abs(r - 1) > 0.01 for r in ratios), (step, series)


def test_calibrate_from_run_fits_the_measured_compute(hdp_run, tmp_path):
    """`calibrate --from-run RUN_DIR` fits (a1, b1, g) to the run's per-rank compute: its predictions of
    those measured times are closer than the analytic model's the run started from."""
    import numpy as np

    from megatron_hdp.cli import main
    from megatron_hdp.plan.cost.model import CostModel
    from megatron_hdp.plan.cost.online_refit import compute_features
    from megatron_hdp.plan.cost.presets import ModelShape, analytic_cost_model

    run_dir, _, _ = hdp_run
    shape = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "4",
             "--ffn-hidden-size", "256"]
    assert main(["calibrate", "--from-run", str(run_dir), *shape, "--output", str(tmp_path / "cm.json")]) == 0
    fitted = CostModel.from_json(tmp_path / "cm.json")
    analytic = analytic_cost_model(ModelShape(2, 64, 4, 4, 256, 32000), "h100")
    scalars = read_scalars(run_dir / "tensorboard")

    def error(model: CostModel) -> float:
        errors = []
        for step in range(1, STEPS + 1):
            plan = json.loads((run_dir / "plans" / f"iter_{step:07d}.json").read_text())
            predicted = compute_features(plan, num_layers=2) @ [model.a1, model.b1, model.g]
            measured = np.array([scalars[f"hdp/rank/compute-s/{r}"][step] for r in range(WORLD)])
            errors.append(np.mean(np.abs(predicted - measured) / measured))
        return float(np.mean(errors))

    assert error(fitted) < 0.5 < error(analytic)
