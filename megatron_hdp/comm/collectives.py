"""Collectives whose name moved between torch releases, called the same way on every supported torch."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, tensor: torch.Tensor, group=None) -> None:
    """Gather every rank's `tensor` into `output` (world x numel, rank order): `all_gather_single` where
    torch has it (2.13 deprecates the older name with a FutureWarning), `all_gather_into_tensor` before it
    (the torch of NGC containers and TE/flash-attn builds)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)
