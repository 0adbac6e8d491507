"""examples/posttrain/grpo_cpu.py runs to the end on 2 ranks against its one-process reference (synthetic
rollouts, 2 steps): every step puts a sample on a ring and matches the reference to 1e-5; bad flags are
refused on stderr with exit 2."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "posttrain" / "grpo_cpu.py"


def _run(*flags, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=timeout)


def test_two_ranks_two_steps_match_the_reference():
    result = _run("--ranks", "2", "--steps", "2", "--rollouts", "synthetic", "--reference")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.split() and line.split()[0].isdigit()]
    assert len(rows) == 2 and all(int(row[2]) > 0 and float(row[-1]) <= 1e-5 and float(row[-2]) <= 1e-5 for row in rows)


def test_a_capacity_that_cannot_hold_the_longest_sample_is_refused():
    result = _run("--ranks", "2", "--capacity", "16", "--max-length", "96", timeout=120)
    assert result.returncode == 2 and "--max-length 96" in result.stderr.splitlines()[-1]
