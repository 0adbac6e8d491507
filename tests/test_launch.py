"""The gloo harness itself: results come back by rank, failures and hangs end the run with a reason."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_hdp.comm.launch import RankFailed, run_gloo


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return rank, t.item()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad value on rank one")
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


def test_hang_ends_with_timeout():
    with pytest.raises(TimeoutError, match=r"ranks \[0\]"):
        run_gloo(_hang_on_rank_zero, 2, timeout_s=10)


def _return_tensor(rank, world_size):
    return torch.full((1000,), float(rank))


def test_tensors_come_back_by_value():
    for _ in range(3):
        out = run_gloo(_return_tensor, 2)
        assert [t.sum().item() for t in out] == [0.0, 1000.0]
