"""`megatron-hdp selftest`: check a GPU machine end to end and write one Markdown report.

Steps (each a subprocess with its own timeout; the whole fits in 30 minutes on one H100):
1. the GPU tests (`pytest -m gpu`);
2. `benchmarks/ring_bench.py` (target: the ring on one GPU within 1.25x of one varlen call);
3. `benchmarks/offload_bench.py` (target: offload ratio 0.5 saves >= 30% activation memory at <= 3%
   slowdown);
4. `megatron-hdp calibrate`;
5. two HDP training steps of a tiny bf16 GPT on 1 GPU, then on every local GPU (torchrun, NCCL).
A step whose hardware is missing is skipped, and the report says why. `--dry-run` runs nowhere: it
prints and reports every step it would run (what CI checks on a CPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@dataclass
class Step:
    """One check: a command, its time limit, how many GPUs it needs, and how to read its target."""

    name: str
    argv: list[str]
    timeout_s: int
    num_gpus: int = 1
    target: Optional[Callable[[], tuple[bool, str]]] = None
    status: str = "not run"
    detail: str = ""
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def _json_rows(path: Path) -> list[dict]:
    """Every dict in a benchmark's JSON result (rows are nested differently per benchmark); of a result
    of several runs (`--repeat`), the medians only, not each run (`runs`) nor their ranges (`spread`)."""
    rows, stack = [], [json.loads(path.read_text())]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            rows.append(item)
            stack.extend(value for key, value in item.items() if key not in ("runs", "spread"))
        elif isinstance(item, list):
            stack.extend(item)
    return rows


def ring_target(path: Path = RESULTS / "ring_bench.json") -> tuple[bool, str]:
    """Ring decomposition on one GPU against one varlen call: every measured ratio <= 1.25."""
    ratios = [v for row in _json_rows(path) for k, v in row.items()
              if k.endswith("_ratio") and isinstance(v, (int, float))]
    if not ratios:
        return False, "no ratio in ring_bench.json"
    return max(ratios) <= 1.25, f"worst ratio {max(ratios):.3f}x (target <= 1.25x)"


def offload_target(path: Path = RESULTS / "offload_bench.json") -> tuple[bool, str]:
    """Offload ratio 0.5: activation saving >= 30% at slowdown <= 3%."""
    rows = [r for r in _json_rows(path) if r.get("ratio") == 0.5 and "slowdown" in r]
    if not rows:
        return False, "no ratio-0.5 row in offload_bench.json"
    row = rows[0]
    ok = row["activation_saving"] >= 0.30 and row["slowdown"] <= 0.03
    return ok, f"saving {row['activation_saving']:.1%} (>= 30%), slowdown {row['slowdown']:.1%} (<= 3%)"


def plan_steps(num_gpus: int) -> list[Step]:
    """The selftest's steps for a machine with `num_gpus` local GPUs (time limits add up to 29 min)."""
    py = sys.executable
    train = [py, "-m", "megatron_hdp.harness.gpu_smoke"]
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={max(num_gpus, 1)}"]
    return [
        Step("GPU tests (pytest -m gpu)", [py, "-m", "pytest", "-q", "-m", "gpu"], 540),
        Step("ring_bench", [py, "benchmarks/ring_bench.py"], 360, target=ring_target),
        Step("offload_bench", [py, "benchmarks/offload_bench.py"], 360, target=offload_target),
        Step("calibrate", [py, "-m", "megatron_hdp.cli", "calibrate"], 240),
        Step("2 training steps, 1 GPU", train, 90),
        Step("2 training steps, all local GPUs (torchrun, NCCL)", torchrun + ["-m", "megatron_hdp.harness.gpu_smoke"], 150, num_gpus=max(num_gpus, 2)),
    ]


def log_name(step: Step) -> str:
    """The file name of a step's full output: its name in letters, digits and dashes."""
    return re.sub(r"[^A-Za-z0-9]+", "-", step.name).strip("-").lower() + ".log"


def run_step(step: Step, num_gpus: int, log_dir: Optional[Path] = None) -> None:
    """Run `step` (or skip it, saying why), recording pass/fail, the time and its result against a target;
    its whole output goes to `log_dir` when given (the report keeps only the last line)."""
    if num_gpus < step.num_gpus:
        step.status, step.detail = "skipped", f"needs {step.num_gpus} GPUs, this machine has {num_gpus}"
        return
    start = time.perf_counter()
    output = ""
    try:
        result = subprocess.run(step.argv, cwd=ROOT, capture_output=True, text=True, timeout=step.timeout_s)
        output = result.stdout + result.stderr
        ok = result.returncode == 0
        lines = output.strip().splitlines()
        step.detail = lines[-1][:200] if lines else ""
        if ok and step.target is not None:
            ok, step.detail = step.target()
        step.status = "pass" if ok else "FAIL"
    except subprocess.TimeoutExpired as timeout:
        output = "".join(part.decode() if isinstance(part, bytes) else (part or "")
                         for part in (timeout.stdout, timeout.stderr))
        step.status, step.detail = "FAIL", f"timed out after {step.timeout_s} s"
    step.seconds = time.perf_counter() - start
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / log_name(step)).write_text(output)


def report(steps: list[Step], *, dry_run: bool, device: str) -> str:
    """The Markdown report: one row per step, with its status, time, result and command."""
    lines = [f"# megatron-hdp selftest ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)", "",
             f"Device: {device}{' (dry run: nothing executed)' if dry_run else ''}", "",
             "| step | status | seconds | result / reason | command |", "|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s.name} | {s.status} | {s.seconds:.0f} | {s.detail} | `{' '.join(s.argv[1:])}` |")
    return "\n".join(lines) + "\n"


def _chosen_steps(only: str, count: int) -> set[int]:
    """The step numbers `--only` names; a number outside 1..count is refused, naming it."""
    try:
        chosen = {int(part) for part in only.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--only {only!r}: give step numbers 1-{count}, comma-separated") from None
    bad = sorted(n for n in chosen if not 1 <= n <= count)
    if bad or not chosen:
        raise ValueError(f"--only {only!r}: no step {bad[0] if bad else ''} (steps are 1-{count})")
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="list every step and write the report, run nothing")
    parser.add_argument("--report", default=None, help="Markdown report (default benchmarks/results/selftest.md)")
    parser.add_argument("--only", default=None,
                        help="comma-separated step numbers (1-6) to run, e.g. 1,5 (a machine lent for less than "
                             "the whole selftest's 29 minutes runs it in parts)")
    parser.add_argument("--log-dir", default=None, help="write each step's whole output there, one file a step")


def run(args: argparse.Namespace) -> int:
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.cuda.get_device_name(0) if num_gpus else "no CUDA device"
    steps = plan_steps(num_gpus)
    if args.only:
        chosen = _chosen_steps(args.only, len(steps))
        steps = [step for number, step in enumerate(steps, start=1) if number in chosen]
    log_dir = Path(args.log_dir) if args.log_dir else None
    path = Path(args.report) if args.report else RESULTS / "selftest.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    for step in steps:
        if args.dry_run:
            step.status = "would run" if num_gpus >= step.num_gpus else "would skip"
            step.detail = "" if num_gpus >= step.num_gpus else f"needs {step.num_gpus} GPUs, found {num_gpus}"
            if num_gpus == 0:
                step.status, step.detail = "would run on a GPU", "no CUDA device here"
        elif num_gpus == 0:
            step.status, step.detail = "skipped", "no CUDA device"
        else:
            run_step(step, num_gpus, log_dir)
        print(f"[{step.status}] {step.name}: {' '.join(step.argv)}{' — ' + step.detail if step.detail else ''}")
        path.write_text(report(steps, dry_run=args.dry_run, device=device))  # after every step: a cut-off run keeps its report
    print(f"report: {path}")
    return 0 if all(s.status in ("pass", "skipped") or args.dry_run for s in steps) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
