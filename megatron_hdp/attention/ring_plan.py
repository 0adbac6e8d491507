"""Which local rows attend to which received rows at each step of a per-document zigzag ring.

Ring position p holds, of every document, chunk p and chunk 2k-1-p of 2k chunks. At step s it holds the
KV of position src = (p - s) mod k (KV travels forward one hop per step). Causal attention then needs:
* step 0 (src = p): the local diagonal block, causal, per document;
* src < p: every local q row attends to the received chunk src (all of it; chunk 2k-1-src comes after
  both local chunks);
* src > p: only the local chunk 2k-1-p attends, to both received chunks (chunk p comes before both).
All of this is per document: the rows of one kernel call are the documents' pieces, packed. A document
whose piece is empty on either side (possible when its length is below 2k) is left out of that call;
every local row still sees its own document at step 0, so no row ends with an empty softmax.
Without the causal mask every step is every local row over all received rows.

Plans are pure functions of (lengths, k, p, causal) and cached: every layer of a micro-batch reuses them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from megatron_hdp.attention.backends.base import Segments
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import zigzag_chunk_lengths


class Rows:
    """A set of rows (ascending half-open ranges) of a THD tensor: a slice when contiguous."""

    def __init__(self, ranges: Sequence[tuple[int, int]], device: torch.device) -> None:
        merged: list[tuple[int, int]] = []
        for start, stop in ranges:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], stop)
            else:
                merged.append((start, stop))
        self.key = tuple(merged)
        """Hashable identity: equal keys select the same rows."""
        self.num_rows = sum(stop - start for start, stop in merged)
        self._slice = merged[0] if len(merged) == 1 else None
        self._device = device
        self._device_index: torch.Tensor | None = None

    @property
    def _index(self) -> torch.Tensor:
        """The row index on the device (made here, synchronously, unless `schedule_tables` delivered it)."""
        if self._device_index is None:
            self._device_index = torch.tensor(self._host_index(), dtype=torch.int64, device=self._device)
        return self._device_index

    def _host_index(self) -> list[int]:
        return [row for start, stop in self.key for row in range(start, stop)]

    def schedule_tables(self, tables: HostTables) -> None:
        """Have `tables` deliver the row index (of non-contiguous rows) with the micro-batch's one copy."""
        if self._slice is None and self._device_index is None:
            tables.add(self._host_index(), lambda t: setattr(self, "_device_index", t), dtype=torch.int64)

    def take(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """The selected rows of `x` along `dim` (a view when contiguous)."""
        if self._slice is not None:
            return x.narrow(dim, self._slice[0], self.num_rows)
        return x.index_select(dim, self._index)

    def put(self, x: torch.Tensor, values: torch.Tensor, dim: int = 0) -> None:
        """Overwrite the selected rows of `x` with `values`."""
        if self._slice is not None:
            x.narrow(dim, self._slice[0], self.num_rows).copy_(values)
        else:
            x.index_copy_(dim, self._index, values.to(x.dtype))

    def add(self, x: torch.Tensor, values: torch.Tensor, dim: int = 0) -> None:
        """Add `values` to the selected rows of `x`."""
        if self._slice is not None:
            x.narrow(dim, self._slice[0], self.num_rows).add_(values)
        else:
            x.index_add_(dim, self._index, values.to(x.dtype))


@dataclasses.dataclass(frozen=True)
class Block:
    """One kernel call of one ring step."""

    q_rows: Rows
    """Local q (and out, lse, dout) rows taking part."""
    kv_rows: Rows
    """Rows of the KV held at this step (the source position's local layout)."""
    segments: Segments
    causal: bool


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Everything position `position` of a ring of `ring_size` computes, step by step."""

    ring_size: int
    position: int
    num_tokens: tuple[int, ...]
    """Tokens each ring position holds (sizes of the KV buffers that travel)."""
    blocks: tuple[Block | None, ...]
    """Per step, the kernel call (None: nothing of the held KV is visible to local rows)."""

    def source(self, step: int) -> int:
        """Ring position whose KV this position holds at `step`."""
        return (self.position - step) % self.ring_size

    def schedule_tables(self, tables: HostTables) -> None:
        """Have `tables` deliver every device table of the plan not made yet (cu_seqlens, row indices)."""
        for block in filter(None, self.blocks):
            block.segments.schedule_tables(tables)
            block.q_rows.schedule_tables(tables)
            block.kv_rows.schedule_tables(tables)


def _block(pieces: list[tuple[int, int, int, int]], causal: bool, device: torch.device) -> Block | None:
    """Block from per-document (q_start, q_len, kv_start, kv_len), dropping documents with an empty side."""
    pieces = [p for p in pieces if p[1] > 0 and p[3] > 0]
    if not pieces:
        return None
    return Block(
        q_rows=Rows([(qs, qs + ql) for qs, ql, _, _ in pieces], device),
        kv_rows=Rows([(ks, ks + kl) for _, _, ks, kl in pieces], device),
        segments=Segments(tuple(p[1] for p in pieces), tuple(p[3] for p in pieces), device),
        causal=causal,
    )


@functools.lru_cache(maxsize=256)
def ring_plan(
    seqlens: tuple[int, ...], ring_size: int, position: int, causal: bool, device: torch.device
) -> RingPlan:
    """The plan of ring position `position` for documents of `seqlens` (validated by the caller)."""
    chunks = [zigzag_chunk_lengths(seqlens, ring_size, p) for p in range(ring_size)]  # [pos][doc] = (a, b)
    starts = []  # [pos][doc] = first local row of the document
    for per_doc in chunks:
        offsets, offset = [], 0
        for a, b in per_doc:
            offsets.append(offset)
            offset += a + b
        starts.append(offsets)
    num_tokens = tuple(sum(a + b for a, b in per_doc) for per_doc in chunks)

    mine, my_starts = chunks[position], starts[position]
    blocks = []
    for step in range(ring_size):
        src = (position - step) % ring_size
        theirs, their_starts = chunks[src], starts[src]
        pieces = []
        for doc, ((a, b), (sa, sb)) in enumerate(zip(mine, theirs)):
            q0, k0 = my_starts[doc], their_starts[doc]
            if step == 0 or not causal:
                pieces.append((q0, a + b, k0, sa + sb))
            elif src < position:
                pieces.append((q0, a + b, k0, sa))
            else:
                pieces.append((q0 + a, b, k0, sa + sb))
        blocks.append(_block(pieces, causal and step == 0, device))
    return RingPlan(ring_size=ring_size, position=position, num_tokens=num_tokens, blocks=tuple(blocks))
