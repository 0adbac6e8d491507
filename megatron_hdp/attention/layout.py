"""Where a ring member's tokens sit in the packed documents: the per-document zigzag as row indices.

The chunk math is `megatron_hdp.plan.zigzag.zigzag_chunks` (chunk p and 2k-1-p of 2k, floor
boundaries); this module turns it into the THD rows a rank holds: document after document, chunk p then
chunk 2k-1-p. Pure functions of the lengths, identical on every rank. `AttentionGroup` names one run of
those rows that one attention call handles: the contract between the collation (`data/collate.py`)
and the core attention.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch

from megatron_hdp.plan.zigzag import zigzag_chunks


@dataclass(frozen=True)
class AttentionGroup:
    """A contiguous run of the packed tokens that one attention call handles.

    `ring` lists HDP ranks (not global ranks) in ring order; a ring of one is a local group of whole
    documents. `seqlens` are the full document lengths (what ring attention needs), `tokens` = [start,
    end) the group's rows of the packed micro-batch.
    """

    ring: tuple[int, ...]
    seq_ids: tuple[int, ...]
    seqlens: tuple[int, ...]
    tokens: tuple[int, int]
    ring_kind: str = "kv"
    """The plan's ring kind of the group's sequences (`SequencePlacement.ring_kind`): "kv", or "latent" for
    multi-latent attention's latent ring (`latent_ring_attention`)."""

    @property
    def is_ring(self) -> bool:
        return len(self.ring) > 1


def check_seqlens(seqlens: Sequence[int]) -> tuple[int, ...]:
    """`seqlens` as a tuple of ints, each >= 1, at least one; ValueError naming the bad value otherwise."""
    try:
        lengths = tuple(operator.index(n) for n in seqlens)
    except TypeError as err:
        raise ValueError(f"seqlens must be a sequence of integers, got {seqlens!r}") from err
    if not lengths:
        raise ValueError("seqlens is empty: at least one document is needed")
    bad = [n for n in lengths if n < 1]
    if bad:
        raise ValueError(f"document lengths must be >= 1, got {bad[0]} in seqlens {list(lengths)}")
    return lengths


def zigzag_chunk_lengths(seqlens: Sequence[int], ring_size: int, position: int) -> list[tuple[int, int]]:
    """Per document, the token counts of the two chunks position `position` holds (chunk p, chunk 2k-1-p)."""
    lengths = []
    for length in check_seqlens(seqlens):
        (a0, a1), (b0, b1) = zigzag_chunks(length, ring_size, position)
        lengths.append((a1 - a0, b1 - b0))
    return lengths


def zigzag_token_indices(seqlens: Sequence[int], ring_size: int, position: int) -> torch.Tensor:
    """Rows of the packed documents (int64, in local order) that ring position `position` of a ring of
    `ring_size` holds: for each document, chunk p then chunk 2k-1-p of its 2k zigzag chunks.

    Over all positions the rows cover every token of every document exactly once; a position may hold
    no token of a short document (length < 2k).
    """
    ranges = []
    offset = 0
    for length in check_seqlens(seqlens):
        for start, stop in zigzag_chunks(length, ring_size, position):
            if stop > start:
                ranges.append(torch.arange(offset + start, offset + stop, dtype=torch.int64))
        offset += length
    return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.int64)
