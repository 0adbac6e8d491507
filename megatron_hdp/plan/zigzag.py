"""Token layout of a sequence over its ring: the per-document zigzag of docs/architecture.md.

A ring of k ranks cuts a document of length L into 2k chunks, chunk j spanning
[floor(j*L/(2k)), floor((j+1)*L/(2k))), and ring position p holds chunks p and 2k-1-p. Under causal
attention chunk j costs ~ j, so pairing an early chunk with its mirror gives every member the same work.
Chunks may be empty when L < 2k; every token is still held exactly once.

Pure integer math (no torch; numpy for all positions at once), shared by the planner, the data collation and ring attention.
"""

from __future__ import annotations

import numpy as np

Interval = tuple[int, int]


def zigzag_chunk_bounds(length: int, ring_size: int, chunk: int) -> Interval:
    """Half-open token interval of zigzag chunk `chunk` (0..2*ring_size-1) of a document."""
    num_chunks = 2 * ring_size
    return (chunk * length) // num_chunks, ((chunk + 1) * length) // num_chunks


def zigzag_chunks(length: int, ring_size: int, position: int) -> tuple[Interval, Interval]:
    """The two intervals ring position `position` holds: chunk p, then chunk 2k-1-p."""
    if length < 1:
        raise ValueError(f"document length must be >= 1, got {length}")
    if ring_size < 1:
        raise ValueError(f"ring size must be >= 1, got {ring_size}")
    if not 0 <= position < ring_size:
        raise ValueError(f"ring position {position} is outside a ring of {ring_size}")
    return (
        zigzag_chunk_bounds(length, ring_size, position),
        zigzag_chunk_bounds(length, ring_size, 2 * ring_size - 1 - position),
    )


def zigzag_num_tokens(length: int, ring_size: int, position: int) -> int:
    """Tokens ring position `position` holds of a document of `length` tokens."""
    (a0, a1), (b0, b1) = zigzag_chunks(length, ring_size, position)
    return (a1 - a0) + (b1 - b0)


def zigzag_token_counts(length: int, ring_size: int) -> np.ndarray:
    """`zigzag_num_tokens` of every ring position, as one array (chunk bounds of `zigzag_chunk_bounds`)."""
    num_chunks = 2 * ring_size
    sizes = np.diff((np.arange(num_chunks + 1, dtype=np.int64) * length) // num_chunks)
    return sizes[:ring_size] + sizes[::-1][:ring_size]
