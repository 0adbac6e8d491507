"""`megatron-hdp` as a user meets it: one-line errors naming the flag, quiet output, bounded defaults.

The subprocess tests run the real entry point (`python -m megatron_hdp.cli`) and capture what a user
would see on stdout and stderr.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hdp.cli import COMMANDS, main

REPO = Path(__file__).resolve().parents[2]

# (argv, what the one line must name: the flag and the offending value)
BAD_INPUT = [
    (["plan", "--dist", "github", "--ranks", "0", "--capacity", "4K"], ["--ranks", "0"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "0"], ["--capacity", "0"]),
    (["plan", "--dist", "nope", "--ranks", "8", "--capacity", "4K"], ["--dist", "nope"]),
    (["plan", "--dist", "github", "--capacity", "4K"], ["--ranks", "--dist"]),
    (["plan", "--lengths", "/no/such/lengths.txt", "--ranks", "8", "--capacity", "4K"],
     ["--lengths", "/no/such/lengths.txt"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--compare", "balance,foo"], ["--compare", "foo"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--max-offload-ratio", "2"],
     ["--max-offload-ratio", "2"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--model", "gpt-9"], ["--model", "gpt-9"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--tokens", "lots"], ["--tokens", "lots"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--pp", "-1"], ["--pp", "-1"]),
    (["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K", "--cost-model", "/no/cm.json"],
     ["--cost-model", "/no/cm.json"]),
    (["plan", "--from", "/no/such/plans"], ["--from", "/no/such/plans"]),
    (["simulate", "--gpus", "0"], ["--gpus", "0"]),
    (["simulate", "--gpus", "12", "--tp", "8"], ["--gpus 12", "--tp 8"]),
    (["simulate", "--pp", "3", "--gpus", "24"], ["--pp 3", "32 layers"]),
    (["simulate", "--context", "64M", "--gpus", "8", "--tp", "8"], ["--context", "64M"]),
    (["simulate", "--policies", "x"], ["--policies", "x"]),
    (["simulate", "--steps", "0"], ["--steps", "0"]),
    (["simulate", "--vpp", "2"], ["--vpp 2", "--pp"]),
    (["simulate", "--pp", "4", "--vpp", "3", "--gpus", "32"], ["--pp 4", "--vpp 3", "32 layers"]),
    (["plan", "--dist", "byted", "--ranks", "4", "--capacity", "4K", "--vpp", "2"], ["--vpp 2", "--pp"]),
    (["simulate", "--ring-bandwidth", "-5"], ["--ring-bandwidth", "-5"]),
    (["simulate", "--model", "mixtral-8x7b", "--gpus", "96", "--tp", "4", "--ep", "16"],
     ["--gpus 96", "--ep 16", "--etp 4"]),
    (["plan", "--dist", "github", "--ranks", "12", "--capacity", "4K", "--ep", "8"], ["12 ranks", "--ep 8"]),
    (["calibrate", "--seq-lens", "128,abc"], ["--seq-lens", "abc"]),
    (["calibrate", "--device", "tpu"], ["--device", "tpu"]),
    (["calibrate", "--repeats", "0"], ["--repeats", "0"]),
    (["calibrate", "--dtype", "int8"], ["--dtype", "int8"]),
    (["demo", "--ranks", "1"], ["--ranks", "1"]),
    (["demo", "--policies", "foo"], ["--policies", "foo"]),
    (["demo", "--capacity", "0"], ["--capacity", "0"]),
    (["demo", "--timing-repeats", "0"], ["--timing-repeats", "0"]),
    (["nosuch"], ["nosuch"]),
]


def _run_main(argv, capsys):
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("argv,named", BAD_INPUT, ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_flag_and_exit_2(argv, named, capsys):
    code, _, err = _run_main(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert "Traceback" not in err and "error:" in err
    for word in named:
        assert word in err, (word, err)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_registered_command_refuses_bad_flags_in_one_line(command, capsys):
    # (a command with a required flag may name that one first: either way one line, exit 2)
    code, _, err = _run_main([command, "--no-such-flag"], capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("megatron-hdp") and "error: " in err


def test_an_error_raised_while_running_is_one_line_and_the_traceback_needs_verbose(tmp_path, capsys):
    empty = tmp_path / "lengths.txt"
    empty.write_text("\n")
    argv = ["plan", "--lengths", str(empty), "--ranks", "8", "--capacity", "4K"]
    code, _, err = _run_main(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and str(empty) in err and "Traceback" not in err
    code, _, err = _run_main(argv + ["--verbose"], capsys)
    assert code == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("megatron-hdp plan: error:")


def _cli(*argv, timeout=240):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "megatron_hdp.cli", *argv], capture_output=True, text=True,
                            timeout=timeout, env=env, cwd=REPO)
    return result, time.perf_counter() - started


def test_plan_output_has_no_third_party_warnings_unless_verbose():
    # megatron-hybrid-cp imports Megatron-Core, which warns about missing TE / Apex and logs INFO lines
    argv = ["plan", "--dist", "github", "--tokens", "64K", "--ranks", "8", "--capacity", "16K",
            "--compare", "balance,megatron-hybrid-cp"]
    quiet, _ = _cli(*argv)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""
    assert "Warning" not in quiet.stdout and "INFO" not in quiet.stdout
    assert "\nmegatron-hybrid-cp " in quiet.stdout and "\nbalance " in quiet.stdout
    verbose, _ = _cli(*argv, "--verbose")
    assert verbose.returncode == 0 and "UserWarning" in verbose.stderr  # the same run, shown when asked for


def test_plan_with_default_batch_at_16384_ranks_stays_bounded():
    # before: 4 x ranks x C = 1B tokens and a static plan of millions of shards, 12 minutes and 13 GB
    result, seconds = _cli("plan", "--dist", "github", "--ranks", "16384", "--capacity", "16384", timeout=300)
    assert result.returncode == 0, result.stderr
    assert seconds < 30, f"took {seconds:.1f} s"
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[3:] if line.strip()}
    batch = result.stdout.splitlines()[0]  # "batch: N sequences, T tokens (default: capped at 128M ...), longest L; ..."
    tokens, longest = (int(batch.split(word)[0].split()[-1].replace(",", "")) for word in (" tokens", ";"))
    assert 128 << 20 <= tokens < (128 << 20) + longest and "capped at 128M" in batch  # whole documents overshoot
    assert "skipped:" in lines["static"] and "--max-shards" in lines["static"]
    assert "skipped:" in lines["rl-static-cp"] and "--max-shards" in lines["rl-static-cp"]
    assert "skipped:" in lines["megatron-hybrid-cp"] and "--max-plan-seconds" in lines["megatron-hybrid-cp"]
    assert "n/a" not in lines["balance"] and "n/a" not in lines["naive"]


def test_plan_imports_megatron_and_torch_only_for_megatron_hybrid_cp():
    code = ("import sys; from megatron_hdp.cli import main; "
            "assert main(['plan', '--dist', 'github', '--tokens', '64K', '--ranks', '8', '--capacity', '16K', "
            "'--compare', 'balance,naive,static']) == 0; "
            "sys.exit(any(m.split('.')[0] in ('megatron', 'torch') for m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert result.returncode == 0, result.stderr


def test_a_bug_of_ours_is_one_line_naming_its_type(monkeypatch, capsys):
    import megatron_hdp.commands.plan as plan_command

    def broken(args):
        raise RuntimeError("something we did not foresee")

    monkeypatch.setattr(plan_command, "run", broken)
    code, _, err = _run_main(["plan", "--dist", "github", "--ranks", "8", "--capacity", "4K"], capsys)
    assert code == 1 and err.count("\n") == 1
    assert "internal error (RuntimeError): something we did not foresee" in err and "--verbose" in err


def test_the_plan_table_counts_the_padding_micro_batches_the_runtime_adds():
    """Rank 0 runs two micro-batches, rank 1 none, ranks 2 and 3 one each. Without EP only the idle rank 1
    pads (one micro-batch); in EP groups of 2 it runs its partner rank 0's two."""
    import dataclasses

    from megatron_hdp.commands.plan import summary_row
    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.plan.hand_plan import plan_from_rings

    plan = plan_from_rings([100, 50, 30, 20], [(0,), (0,), (2,), (3,)], [0, 1, 0, 0], num_ranks=4, capacity=128)
    cost_model = analytic_cost_model("mixtral-8x7b")
    rows = [summary_row(plan, cost_model=dataclasses.replace(cost_model, expert_parallel_size=ep), wall_s=0.0,
                        bound=1.0, critical=1.0) for ep in (1, 2)]
    assert [row["padding"] for row in rows] == [1, 2]


def test_a_solver_s_native_output_stays_out_of_the_plan_table(tmp_path, monkeypatch, capfd):
    """SciPy's HiGHS writes a debug line to file descriptor 1 from C, at random (ERGO-Code/HiGHS#2783):
    `plan --compare ... optimal` keeps it out of the table. Reference: an `optimal` that writes it from C
    (os.write) before planning as balance does; the table must show both rows and not the line."""
    from megatron_hdp.plan import planner

    def noisy(lengths, **kwargs):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return planner.POLICIES["balance"](lengths, **kwargs)

    monkeypatch.setitem(planner.POLICIES, "optimal", noisy)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("1300\n900\n900\n300\n")
    assert main(["plan", "--lengths", str(lengths), "--ranks", "4", "--capacity", "512", "--model", "llama-7b",
                 "--no-offload", "--compare", "balance,optimal"]) == 0
    out = capfd.readouterr().out
    assert "Highs" not in out
    assert out.count("\nbalance ") == 2  # both rows planned (the stand-in's plan is balance's, named so)
