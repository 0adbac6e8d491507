"""Surviving a dead rank: `megatron.training.pretrain` with --hdp on 4 gloo ranks (examples/pretrain_gpt_hdp.py)
saves a checkpoint every 2 iterations; one rank's process is killed (SIGKILL) in the middle of iteration 3,
after its forward and before its backward, while its ring peers wait on it. Every other rank must stop with
an error naming the failure within a bounded time (no hang); a restart from the last checkpoint must then
train iterations 3 and 4 on the same documents (the HDP loader's sample ids) with the same losses as a run
that was never interrupted, and save the same weights and optimizer state at iteration 4 (`--ckpt-format
torch` without the distributed optimizer; the other formats: tests/megatron/test_checkpoints.py)."""

import os
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_hdp.comm.launch import gloo_reports
from pretrain_harness import ROOT, TINY

HDP = ["--seq-length", "64", "--train-iters", "4", "--hdp", "--hdp-capacity", "24",
       "--hdp-global-batch-tokens", "512", "--global-batch-size", "4"]
"""Documents cut at 64 tokens, 512 tokens a step, capacity 24: pieces longer than 24 tokens run on rings."""


KILLED_RANK, KILL_ITERATION = 3, 3
TIMEOUT_MINUTES = 1
"""--distributed-timeout-minutes: HDP's ring exchanges and every collective run in Megatron's process
groups, whose waits end after this long (the default group's too: the harness creates it with it, as
Megatron's initialize does under torchrun)."""
BOUND_S = 60 * TIMEOUT_MINUTES + 45
"""Seconds within which every surviving rank must have stopped after the kill (the timeout plus slack for
a host whose cores are shared)."""


def _pretrain(rank: int, world_size: int, argv: list[str], kill_at: int) -> dict:
    """examples/pretrain_gpt_hdp.main(argv), recording each iteration's loss and documents; rank
    KILLED_RANK SIGKILLs itself in iteration `kill_at` (0: never) after its first forward. An exception is
    returned (not raised) with the time it took to come after the kill, so that every rank reports."""
    import signal

    os.environ["RANK"] = str(rank)
    sys.path.insert(0, str(ROOT / "examples"))
    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.training import training

    import pretrain_gpt_hdp

    from megatron_hdp.megatron.core_api import forward_step
    from megatron_hdp.megatron.pretrain import runtime as hdp_runtime

    losses, sample_ids = {}, {}
    original_log = training.training_log

    def recording_training_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs):
        losses[iteration] = float(loss_dict["lm loss"])
        sample_ids[iteration] = hdp_runtime.installed().last_step.sample_ids.tolist()
        return original_log(loss_dict, total_loss_dict, learning_rate, iteration, *args, **kwargs)

    training.training_log = recording_training_log
    original_loss = forward_step.token_loss

    def token_loss(*args, **kwargs):
        if rank == KILLED_RANK and training.get_args().curr_iteration + 1 == kill_at:
            with open(os.environ["HDP_FAULT_MARK"], "w") as mark:
                mark.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return original_loss(*args, **kwargs)

    forward_step.token_loss = token_loss
    try:
        pretrain_gpt_hdp.main(argv)
    except BaseException as error:  # noqa: BLE001 - what a surviving rank saw is the point of the test
        return {"error": f"{type(error).__name__}: {error}", "at": time.time(), "losses": losses, "ids": sample_ids}
    return {"error": None, "at": time.time(), "losses": losses, "ids": sample_ids}


def _launch(world_size: int, argv: list[str], *, kill_at: int, timeout_s: float, env: dict) -> dict:
    """Run `world_size` gloo ranks of `_pretrain`; collect what each reports (its return value; a rank that
    raised or died without a result reports that) until all have reported or `timeout_s` passes (then the
    rest are killed and are missing: hung)."""
    reports = {}
    for report in gloo_reports(_pretrain, world_size, argv, kill_at, timeout_s=timeout_s, env=env,
                               group_timeout_s=60 * TIMEOUT_MINUTES):
        reports[report.rank] = report.value if report.error is None else {"error": report.error, "at": report.at}
    return reports


@pytest.mark.timeout(900)  # three 4-rank pretrain runs and one timeout; ~2 min on an idle 2-core host
def test_a_dead_rank_stops_the_others_and_a_restart_repeats_no_data(demo_data_prefix, tmp_path):
    data = ["--data-path", demo_data_prefix, "--data-cache-path", str(tmp_path / "cache")]
    save = ["--save-interval", "2", "--ckpt-format", "torch", "--distributed-timeout-minutes", str(TIMEOUT_MINUTES)]
    env = {"LOCAL_RANK": "0", "WORLD_SIZE": "4", "HDP_FAULT_MARK": str(tmp_path / "killed")}
    argv = TINY + data + HDP + save

    whole = _launch(4, argv + ["--save", str(tmp_path / "whole")], kill_at=0, timeout_s=240, env=env)
    assert [whole[rank]["error"] for rank in range(4)] == [None] * 4, whole
    reference = whole[0]
    assert sorted(reference["losses"]) == [1, 2, 3, 4]

    ckpt = str(tmp_path / "faulty")
    faulty = _launch(4, argv + ["--save", ckpt], kill_at=KILL_ITERATION, timeout_s=240, env=env)
    assert Path(env["HDP_FAULT_MARK"]).exists(), f"rank {KILLED_RANK} never reached iteration {KILL_ITERATION}: {faulty}"
    killed_at = float(Path(env["HDP_FAULT_MARK"]).read_text())
    assert faulty[KILLED_RANK]["error"] == "died without a result, exit code -9", faulty[KILLED_RANK]
    for rank in set(range(4)) - {KILLED_RANK}:
        report = faulty.get(rank)
        assert report is not None, f"rank {rank} hung after rank {KILLED_RANK} died: {faulty}"
        assert report["error"], f"rank {rank} finished training without rank {KILLED_RANK}"
        assert report["at"] - killed_at < BOUND_S, f"rank {rank} took {report['at'] - killed_at:.0f} s to stop"
        assert sorted(report["losses"]) == [1, 2]  # iteration 3 never completed anywhere
        print(f"rank {rank} stopped {report['at'] - killed_at:.1f} s after the kill: {report['error'][:200]}")

    # --no-load-rng: the CPU shims' RNG tracker keeps no CUDA states, so Megatron cannot restore them (no
    # dropout here; the HDP loader's order comes from the seed and the consumed-sample count, not an RNG)
    resumed = _launch(4, argv + ["--save", ckpt, "--load", ckpt, "--no-load-rng"], kill_at=0, timeout_s=240, env=env)
    assert [resumed[rank]["error"] for rank in range(4)] == [None] * 4, resumed
    for rank, report in resumed.items():
        assert sorted(report["losses"]) == [3, 4]  # resumed after the checkpoint of iteration 2
        for iteration in (3, 4):
            assert report["ids"][iteration] == whole[rank]["ids"][iteration], f"rank {rank} it {iteration}"
            assert report["losses"][iteration] == pytest.approx(reference["losses"][iteration], rel=1e-6)
    # and the interrupted run's first two iterations were the uninterrupted run's
    for iteration in (1, 2):
        assert faulty[0]["ids"][iteration] == reference["ids"][iteration]
    # both saved iteration 4: the same weights and optimizer state, to the bit
    saved = [_tensors(torch.load(Path(run) / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt",
                                 weights_only=False)) for run in (tmp_path / "whole", ckpt)]
    assert saved[0].keys() == saved[1].keys() and any(".self_attention." in key for key in saved[0])
    assert all(torch.equal(saved[0][key], saved[1][key]) for key in saved[0])


def _tensors(checkpoint: dict) -> dict:
    """Every tensor of a `torch`-format checkpoint's model and optimizer, by its path in the file."""
    found = {}

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            found[path] = value
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}.{key}")
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, f"{path}.{index}")

    walk({"model": checkpoint["model"], "optimizer": checkpoint["optimizer"]}, "")
    return found
