"""Blending datasets by tokens: the pure arithmetic behind `BlendedDocumentSource` (no Megatron, no torch).

Megatron's `BlendedDataset` blends members by *samples*; HDP plans documents of any length, so the
blend's weights must hold for the tokens. `token_blend_order` interleaves the members' pieces by fair
queuing on tokens, `blend_quotas` (with `apportion_tokens`) gives each member exactly its share of one
epoch of a sized blend, and `leading_pieces` cuts a member's pieces where its share ends.
"""

from __future__ import annotations

import numpy as np


def token_blend_order(member_lengths: list[np.ndarray], weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Interleave members' samples (each in its own order) so that member i gets `weights[i]` of the tokens.

    Fair queuing on tokens: sample k of member i starts at virtual time (tokens of its predecessors in
    member i) / weights[i]; samples are taken in order of start time (ties: lower member first), and the
    blend stops before the first sample that starts at or after the earliest time a member runs out.
    Taken this way, at every prefix of the blend holding T tokens, member i holds t_i tokens with
    -(members x longest sample) <= t_i - weights[i] x T <= longest sample, so over any stretch of the
    blend (a global batch) a member's tokens are off by less than (members + 1) x the longest sample,
    and the share over the whole blend converges to the weight as its tokens grow. Returns (member id,
    member sample id) per blend sample.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if len(member_lengths) != weights.size or (weights <= 0).any():
        raise ValueError(f"need one positive weight per member, got {weights.tolist()} for {len(member_lengths)}")
    weights = weights / weights.sum()
    starts = [np.concatenate(([0], np.cumsum(lengths)[:-1])) / w for lengths, w in zip(member_lengths, weights)]
    end = min(float(np.sum(lengths)) / w for lengths, w in zip(member_lengths, weights))
    member = np.concatenate([np.full(s.size, i, dtype=np.int64) for i, s in enumerate(starts)])
    sample = np.concatenate([np.arange(s.size, dtype=np.int64) for s in starts])
    start = np.concatenate(starts)
    keep = start < end
    order = np.lexsort((member[keep], start[keep]))
    return member[keep][order], sample[keep][order]


def apportion_tokens(total: int, weights: np.ndarray) -> np.ndarray:
    """Split `total` tokens by `weights` into integers that sum to `total`, each within 1 of its share.

    Largest remainder (Hamilton): every member gets the floor of its exact share, and the tokens left
    over go to the largest fractional parts (ties: lower member first).
    """
    weights = np.asarray(weights, dtype=np.float64)
    exact = total * weights / weights.sum()
    quotas = np.floor(exact).astype(np.int64)
    left = int(total - quotas.sum())
    quotas[np.argsort(-(exact - quotas), kind="stable")[:left]] += 1
    return quotas


def leading_pieces(lengths: np.ndarray, tokens: int) -> np.ndarray:
    """The lengths of the first pieces holding exactly `tokens` positions: the last one cut where they end.

    A cut piece keeps its start (its `origin` is unchanged) and reads its last label from the document,
    which goes on past the cut. Raises ValueError when the pieces hold fewer than `tokens` positions.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    ends = np.cumsum(lengths)
    if tokens > (ends[-1] if ends.size else 0):
        raise ValueError(f"the pieces hold {int(ends[-1]) if ends.size else 0} positions, fewer than {tokens}")
    count = int(np.searchsorted(ends, tokens, side="left")) + 1 if tokens else 0
    taken = lengths[:count].copy()
    if count:
        taken[-1] -= int(ends[count - 1]) - tokens
    return taken


def blend_quotas(member_tokens: np.ndarray, weights: np.ndarray, budget: int) -> np.ndarray:
    """Each member's tokens in one epoch of a sized blend: exactly the weights' shares of the epoch.

    The epoch holds `budget` tokens (Megatron's size x sequence length) when every member can supply its
    share, else as many as the scarcest member allows. `apportion_tokens` splits them, so member i gets
    its share of the epoch rounded to a whole token, and never more than it holds.
    """
    member_tokens = np.asarray(member_tokens, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64) / np.sum(weights)
    scarcest = int(np.floor(np.min(member_tokens / weights)))
    quotas = apportion_tokens(min(int(budget), scarcest), weights)
    while (quotas > member_tokens).any():  # floating-point rounding can put a share a hair above the floor
        scarcest -= 1
        quotas = apportion_tokens(min(int(budget), scarcest), weights)
    return quotas
