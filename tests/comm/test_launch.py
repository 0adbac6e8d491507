"""The gloo harness itself: results come back by rank, failures and hangs end the run with a reason."""

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.comm.launch import RankFailed, gloo_reports, run_gloo


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad value on rank one")
    return rank


def _die_on_rank_one(rank, world_size):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # no traceback, no result: only the exit code tells
    return rank


def _hang_on_rank_zero(rank, world_size):
    if rank == 0:
        time.sleep(3600)  # never returns: the harness must kill it
    return rank


def test_results_by_rank():
    assert run_gloo(_sum_of_ranks, 3) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_child_traceback_surfaces():
    with pytest.raises(RankFailed, match="bad value on rank one"):
        run_gloo(_raise_on_rank_one, 2, timeout_s=60)


def test_a_rank_that_dies_fails_the_run_and_the_others_are_stopped():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed:\ndied without a result, exit code -9"):
        run_gloo(_die_on_rank_one, 2, timeout_s=60)
    assert time.monotonic() - start < 30
    with pytest.raises(RankFailed, match="bad value on rank one"):
        run_gloo(_raise_on_rank_one_while_zero_hangs, 2, timeout_s=60)
    assert mp.active_children() == []  # rank 0, still sleeping when rank 1 failed, was killed


def _raise_on_rank_one_while_zero_hangs(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    raise ValueError("bad value on rank one")


def test_gloo_reports_every_outcome_of_a_run_where_a_rank_dies():
    reports = {report.rank: report for report in gloo_reports(_die_on_rank_one, 3, timeout_s=60)}
    assert reports[1].error == "died without a result, exit code -9"
    assert [(reports[r].value, reports[r].error) for r in (0, 2)] == [(0, None), (2, None)]


def _start_a_manager(rank, world_size):
    with mp.get_context("spawn").Manager() as manager:  # what Megatron's torch_dist checkpoint writer starts
        return manager.list([rank])[0]


def test_a_rank_may_start_processes_of_its_own():
    assert run_gloo(_start_a_manager, 2, timeout_s=120) == [0, 1]  # a daemonic rank may not


def test_hang_ends_with_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_gloo(_hang_on_rank_zero, 2, timeout_s=10)


def _return_tensor(rank, world_size):
    return torch.full((1000,), float(rank))


def test_tensors_come_back_by_value():
    for _ in range(3):
        out = run_gloo(_return_tensor, 2)
        assert [t.sum().item() for t in out] == [0.0, 1000.0]
