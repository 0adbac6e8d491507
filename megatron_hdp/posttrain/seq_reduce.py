"""Per-sample sums over every token of a sample, across the ring that holds it, differentiable.

A `loss_fn` may need a sample-level quantity (GSPO's sequence ratio exp(mean_t(log p - log p_old))): the
sum of a per-token value over the whole sample, whose tokens a ring spreads over several ranks.
`SampleSums` sums locally per sample, then, for each split sample's ring (the micro-batch's attention
groups, in the packed order every member takes: `data.collate`, so no two members wait on each other),
gathers the members' partial sums by `comm.p2p.shift` and adds them in ring-position order: every member
gets the same bits. Its backward is the same exchange on the gradients (d total / d part = 1 on every
member). One autograd node per call for all rings of the micro-batch, so the backward takes the rings in
the same order too. Every member must call it the same number of times, in the same order.

Each ring's samples take consecutive slots (slices, no index tensors on the device), and the one per-token
table (each token's slot) reaches the device in one pinned, asynchronous copy (`attention.host_tables`),
made on the first call: no blocking copy inside a micro-batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import AttentionGroup
from megatron_hdp.comm.p2p import current_ring, shift


def _ring_total(parts: torch.Tensor, ring_ranks: tuple[int, ...]) -> torch.Tensor:
    """The sum of `parts` over the members of the ring `ring_ranks` (global ranks), added in ring order."""
    ring = current_ring(ring_ranks)
    held = [None] * ring.size
    held[ring.position] = parts
    block = parts.contiguous()
    for hop in range(1, ring.size):
        received = torch.empty_like(block)
        shift(ring, send=block, recv=received).wait()
        held[(ring.position - hop) % ring.size] = received
        block = received
    return torch.stack(held).sum(dim=0)


class _RingSums(torch.autograd.Function):
    """Per-sample partial sums -> totals over each split sample's ring (module docstring)."""

    @staticmethod
    def forward(ctx, sums: torch.Tensor, ranges: list, rings: list) -> torch.Tensor:
        ctx.ranges, ctx.rings = ranges, rings
        return _exchange(sums, ranges, rings)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.ranges, ctx.rings), None, None


def _exchange(values: torch.Tensor, ranges: list, rings: list) -> torch.Tensor:
    """`values` with each ring's slots (`ranges[i]`, [start, end)) replaced by their ring totals."""
    out = values.clone()
    for (start, end), ring in zip(ranges, rings):
        out[start:end] = _ring_total(values[start:end], ring)
    return out


class SampleSums:
    """`sums(x)`: per token, the sum of `x` over all tokens of that token's sample (0 on padding)."""

    def __init__(self, sample: torch.Tensor, groups: Sequence[AttentionGroup], hdp_global_ranks: Sequence[int],
                 device: torch.device):
        """`sample`: the host copy of each token's sample index (-1 padding); `groups`: the micro-batch's
        attention groups; `hdp_global_ranks`: global rank of each HDP rank; `device`: the model's."""
        split = [group for group in groups if len(group.ring) > 1]
        order = [s for group in split for s in group.seq_ids]  # each ring's samples in consecutive slots
        order += sorted({s for group in groups for s in group.seq_ids} - set(order))
        self.num_slots = len(order)
        self.ranges, self.rings, start = [], [], 0
        for group in split:
            self.ranges.append((start, start + len(group.seq_ids)))
            self.rings.append(tuple(hdp_global_ranks[r] for r in group.ring))
            start += len(group.seq_ids)
        slot_of = {s: i for i, s in enumerate(order)}
        self._host_slots = [slot_of.get(s, self.num_slots) for s in sample.tolist()]  # the last slot: padding
        self._device = device
        self._slot: torch.Tensor | None = None

    def _set_slot(self, slot: torch.Tensor) -> None:
        self._slot = slot

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._slot is None:
            tables = HostTables()
            tables.add(self._host_slots, self._set_slot, dtype=torch.int64)
            tables.transfer(self._device)
        partial = torch.zeros(self.num_slots + 1, dtype=x.dtype, device=x.device).index_add(0, self._slot, x)
        total = _RingSums.apply(partial, self.ranges, self.rings) if self.rings else partial
        return torch.cat([total[:-1], total.new_zeros(1)])[self._slot]
