"""`all_gather_flat` on torch releases with and without `all_gather_single` (torch < 2.13, the torch of NGC
containers): 3 gloo ranks, checked against the values each rank put in."""

import torch
import torch.distributed as dist

from megatron_hdp.comm.collectives import all_gather_flat
from megatron_hdp.comm.launch import run_gloo


def _gather(rank, world, hide_new_name):
    if hide_new_name and hasattr(dist, "all_gather_single"):
        del dist.all_gather_single  # this child's torch looks like torch 2.11
    mine = torch.tensor([rank * 10.0, rank + 0.5], dtype=torch.float64)
    out = torch.empty(world * 2, dtype=torch.float64)
    all_gather_flat(out, mine)
    return out.tolist()


def test_all_gather_flat_with_and_without_all_gather_single():
    expected = [v for r in range(3) for v in (r * 10.0, r + 0.5)]
    for hide in (False, True):
        assert run_gloo(_gather, 3, hide, timeout_s=60) == [expected] * 3
