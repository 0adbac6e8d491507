"""`megatron-hdp selftest`: the dry run lists every GPU step and writes its report on a CPU machine; the
targets are read from the benchmarks' JSON results (checked here on small hand-written results)."""

import argparse
import json

from megatron_hdp.commands import selftest


def test_dry_run_lists_every_gpu_step(tmp_path, capsys):
    report = tmp_path / "selftest.md"
    assert selftest.run(argparse.Namespace(dry_run=True, report=str(report), only=None, log_dir=None)) == 0
    printed = capsys.readouterr().out
    text = report.read_text()
    names = [step.name for step in selftest.plan_steps(0)]
    assert len(names) == 6
    for name in names:
        assert name in printed and f"| {name} |" in text
    assert "ring_bench.py" in text and "offload_bench.py" in text and "torch.distributed.run" in text
    assert sum(step.timeout_s for step in selftest.plan_steps(8)) <= 30 * 60


def test_targets_read_from_benchmark_results(tmp_path):
    ring = tmp_path / "ring.json"
    ring.write_text(json.dumps({"gpu": {"rows": [{"k": 2, "fwd_ratio": 1.1}, {"k": 4, "fwd_bwd_ratio": 1.3}]}}))
    ok, detail = selftest.ring_target(ring)
    assert not ok and "1.300" in detail
    offload = tmp_path / "offload.json"
    rows = [{"ratio": 0.0, "slowdown": 0.0}, {"ratio": 0.5, "slowdown": 0.02, "activation_saving": 0.35}]
    offload.write_text(json.dumps({"rows": rows}))
    assert selftest.offload_target(offload)[0]
    rows[1]["slowdown"] = 0.05
    offload.write_text(json.dumps({"rows": rows}))
    assert not selftest.offload_target(offload)[0]


def test_only_runs_the_named_steps_and_refuses_a_missing_one(tmp_path, capsys):
    report = tmp_path / "selftest.md"
    assert selftest.run(argparse.Namespace(dry_run=True, report=str(report), only="2,5", log_dir=None)) == 0
    text = report.read_text()
    names = [step.name for step in selftest.plan_steps(0)]
    assert f"| {names[1]} |" in text and f"| {names[4]} |" in text
    assert all(f"| {name} |" not in text for i, name in enumerate(names) if i not in (1, 4))
    for bad in ("7", "0", "x"):
        try:
            selftest.run(argparse.Namespace(dry_run=True, report=str(report), only=bad, log_dir=None))
        except ValueError as error:
            assert repr(bad) in str(error)
        else:
            raise AssertionError(f"--only {bad} accepted")


def test_a_step_writes_its_whole_output_to_the_log_dir(tmp_path):
    step = selftest.Step("echo twice", ["python", "-c", "print('first'); print('second')"], 30)
    selftest.run_step(step, num_gpus=1, log_dir=tmp_path)
    assert step.status == "pass" and step.detail == "second"
    assert (tmp_path / "echo-twice.log").read_text().split() == ["first", "second"]
