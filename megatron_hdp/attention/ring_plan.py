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

With a sliding window (query at position x sees keys x - left .. x of its document) a step's work is
split by chunk pairs instead: every (local chunk, received chunk) piece of a document is trimmed to the
query rows that see some key of it and the keys some of those rows see, and carries its true offset
(`BlockWindow.shifts`); a piece wholly outside every query's window is dropped, and so is a step with
no piece left (no compute). A step makes one kernel call per received chunk (chunk src, chunk 2k-1-src),
so no local row appears twice in one call. Windowed plans are `direct`: K/V relayed hop by hop would
have to visit positions that do not need it (chunk 2k-1-p needs chunk 2k-2-p, one hop *back*), so each
step's K/V goes straight from its owner to the position that needs it, and a step no one needs at a
given distance posts nothing (`RingPlan.sends`).

Plans are pure functions of (lengths, k, p, causal, window) and cached: every layer of a micro-batch
reuses them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from megatron_hdp.attention.backends.base import BlockWindow, Segments
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import zigzag_chunk_lengths
from megatron_hdp.plan.zigzag import zigzag_chunks


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
    window: BlockWindow | None = None
    """The sliding window of the call at the pieces' true offsets (None: the causal flag alone)."""


@dataclasses.dataclass(frozen=True)
class RingPlan:
    """Everything position `position` of a ring of `ring_size` computes, step by step."""

    ring_size: int
    position: int
    num_tokens: tuple[int, ...]
    """Tokens each ring position holds (sizes of the KV buffers that travel)."""
    blocks: tuple[tuple[Block, ...], ...]
    """Per step, its kernel calls (none: nothing of the held KV is visible to local rows)."""
    direct: bool = False
    """K/V go straight from their owner to the position that needs them (step s: from position p-s, and
    the dK/dV partials straight back), instead of hop by hop around the ring; steps without a call move
    nothing. Windowed plans (a relayed K/V would have to visit positions that do not need it)."""
    sends: tuple[bool, ...] = ()
    """Direct plans, per step s: whether position p+s has a call at step s (needs this position's K/V)."""

    def source(self, step: int) -> int:
        """Ring position whose KV this position holds at `step`."""
        return (self.position - step) % self.ring_size

    def schedule_tables(self, tables: HostTables) -> None:
        """Have `tables` deliver every device table of the plan not made yet (cu_seqlens, row indices, the
        window shifts of pieces at offsets)."""
        for block in (b for step in self.blocks for b in step):
            block.segments.schedule_tables(tables)
            block.q_rows.schedule_tables(tables)
            block.kv_rows.schedule_tables(tables)
            if block.window is not None:
                block.window.schedule_tables(tables, block.segments.device)


def _block(
    pieces: list[tuple[int, int, int, int]], causal: bool, device: torch.device, window: int | None = None,
    shifts: Sequence[int] = (),
) -> tuple[Block, ...]:
    """The call of per-document (q_start, q_len, kv_start, kv_len) pieces (with their window shifts),
    dropping pieces with an empty side; no call when none is left."""
    kept = [i for i, p in enumerate(pieces) if p[1] > 0 and p[3] > 0]
    if not kept:
        return ()
    pieces = [pieces[i] for i in kept]
    return (
        Block(
            q_rows=Rows([(qs, qs + ql) for qs, ql, _, _ in pieces], device),
            kv_rows=Rows([(ks, ks + kl) for _, _, ks, kl in pieces], device),
            segments=Segments(tuple(p[1] for p in pieces), tuple(p[3] for p in pieces), device),
            causal=causal,
            window=None if window is None else BlockWindow(window, tuple(shifts[i] for i in kept)),
        ),
    )


def window_piece(q: tuple[int, int], k: tuple[int, int], left: int) -> tuple[int, int, int, int] | None:
    """The part of the (query positions q, key positions k) pair of one document that a window of `left`
    makes visible: (x0, x1, y0, y1), queries x0..x1-1 each seeing some key, keys y0..y1-1 each seen by
    some of them; None when no query of q sees any key of k (x sees y when 0 <= x - y <= left)."""
    x0, x1 = max(q[0], k[0]), min(q[1], k[1] + left)
    y0, y1 = max(k[0], x0 - left), min(k[1], x1)
    return (x0, x1, y0, y1) if x0 < x1 and y0 < y1 else None


def _window_calls(
    seqlens: Sequence[int], ring_size: int, position: int, src: int, starts: list[list[int]], window: int,
    device: torch.device,
) -> tuple[Block, ...]:
    """The windowed calls of one step: per received chunk, the trimmed pieces of every local chunk."""
    calls = []
    for theirs in (0, 1):  # chunk src, then chunk 2k-1-src of every document
        pieces, shifts = [], []
        for doc, length in enumerate(seqlens):
            mine, held = zigzag_chunks(length, ring_size, position), zigzag_chunks(length, ring_size, src)
            k = held[theirs]
            k_row = starts[src][doc] + (0 if theirs == 0 else held[0][1] - held[0][0]) - k[0]
            for m, q in enumerate(mine):
                piece = window_piece(q, k, window)
                if piece is None:
                    continue
                x0, x1, y0, y1 = piece
                q_row = starts[position][doc] + (0 if m == 0 else mine[0][1] - mine[0][0]) - q[0]
                pieces.append((q_row + x0, x1 - x0, k_row + y0, y1 - y0))
                shifts.append(x0 - y0)
        calls += _block(pieces, True, device, window, shifts)
    return tuple(calls)


@functools.lru_cache(maxsize=256)
def _windowed_steps(
    seqlens: tuple[int, ...], ring_size: int, position: int, device: torch.device, window: int
) -> tuple[tuple[Block, ...], ...]:
    """Per step, the windowed calls of ring position `position`."""
    starts = []  # [pos][doc] = first local row of the document
    for per_doc in (zigzag_chunk_lengths(seqlens, ring_size, p) for p in range(ring_size)):
        starts.append([sum(a + b for a, b in per_doc[:doc]) for doc in range(len(per_doc))])
    return tuple(
        _window_calls(seqlens, ring_size, position, (position - step) % ring_size, starts, window, device)
        for step in range(ring_size)
    )


@functools.lru_cache(maxsize=256)
def ring_plan(
    seqlens: tuple[int, ...], ring_size: int, position: int, causal: bool, device: torch.device,
    window: int | None = None,
) -> RingPlan:
    """The plan of ring position `position` for documents of `seqlens` (validated by the caller), with a
    sliding window of `window` keys before each query (None: none; a window reaching every earlier
    key of every document is no window)."""
    if window is not None and window >= max(seqlens) - 1:
        window = None
    chunks = [zigzag_chunk_lengths(seqlens, ring_size, p) for p in range(ring_size)]  # [pos][doc] = (a, b)
    starts = []  # [pos][doc] = first local row of the document
    for per_doc in chunks:
        offsets, offset = [], 0
        for a, b in per_doc:
            offsets.append(offset)
            offset += a + b
        starts.append(offsets)
    num_tokens = tuple(sum(a + b for a, b in per_doc) for per_doc in chunks)
    if window is not None:
        steps = _windowed_steps(seqlens, ring_size, position, device, window)
        sends = tuple(
            bool(_windowed_steps(seqlens, ring_size, (position + s) % ring_size, device, window)[s])
            for s in range(ring_size)
        )
        return RingPlan(ring_size, position, num_tokens, steps, direct=True, sends=sends)

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
