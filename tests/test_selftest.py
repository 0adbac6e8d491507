"""`megatron-hdp selftest`: the dry run lists every GPU step and writes its report on a CPU machine; the
targets are read from the benchmarks' JSON results (checked here on small hand-written results)."""

import argparse
import json

from megatron_hdp.commands import selftest


def test_dry_run_lists_every_gpu_step(tmp_path, capsys):
    report = tmp_path / "selftest.md"
    assert selftest.run(argparse.Namespace(dry_run=True, report=str(report))) == 0
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
