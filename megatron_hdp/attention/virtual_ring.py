"""A ring's k positions in one process: what the simulated drivers of both rings share.

`simulated_ring_attention` (K/V ring) and `simulated_latent_ring_attention` (latent ring) run the k ring
programs of one ring in lockstep in this process (`comm.ring_program.run_in_process`). Both cut whole
packed documents into each position's zigzag rows, plan each position, and put the positions' outputs
back in packed order; that layout is written once here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_hdp.attention.layout import zigzag_token_indices
from megatron_hdp.attention.ring_plan import RingPlan, ring_plan


@dataclass(frozen=True)
class VirtualRing:
    """Each position's plan and rows of the packed documents (int64, in the position's local order)."""

    plans: tuple[RingPlan, ...]
    rows: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, lengths: Sequence[int], ring_size: int, *, causal: bool, device: torch.device,
           window: int | None) -> "VirtualRing":
        """The ring of `ring_size` positions over documents of `lengths` (validated by the caller)."""
        if ring_size < 1:
            raise ValueError(f"ring_size must be >= 1, got {ring_size}")
        lengths = tuple(lengths)
        return cls(
            plans=tuple(ring_plan(lengths, ring_size, p, causal, device, window) for p in range(ring_size)),
            rows=tuple(zigzag_token_indices(lengths, ring_size, p).to(device) for p in range(ring_size)),
        )

    def shards(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Every position's rows of each tensor: tensor by tensor, position by position."""
        return [x.index_select(0, r) for x in tensors for r in self.rows]

    def packed(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The positions' outputs (in position order) back in packed order."""
        return torch.cat(tuple(outs)).index_select(0, torch.argsort(torch.cat(self.rows)))
