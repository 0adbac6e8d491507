"""Data-aware sharding: how many ranks D(s) each sequence needs, and the offload ratio that allows it.

ByteScale (arXiv 2502.21231) Sec. 5: a sequence that fits one rank's token capacity C stays whole on one
rank; a longer one is split by per-document zigzag over a ring of k ranks. Selective offloading (Eq. 3)
lets a ring member keep more than C tokens by moving a fraction r of each layer's activations to host
memory, so k shrinks:

    minimise k = D(s)   subject to   (1 - r) * Act(t_k) <= Act(C),
                                     r <= min(max_offload_ratio, hidden_offload_ratio(s, t_k, k)),

where t_k is the largest token count a zigzag member holds and `hidden_offload_ratio` is the cost model's
overlap constraint (the D2H copy of r * Act(t_k) hides under the layer's compute). We add one bound
the equation leaves implicit: the offloaded bytes, r * Act(t_k) per layer of a pipeline stage, must fit
the host memory of the cost model (`host_memory_bytes`) as pinned by the offload pool (at most
`HOST_BUFFER_OVERHEAD` = 9/8 of them); without it a 2M-token document would offload
~99% of terabytes of activations to fit on a single rank. With offloading off,
r = 0 and k = ceil(s / C) (one more in the rare case where zigzag rounding gives a member C + 1 tokens).
The recorded ratio is the smallest r that makes the chosen k fit: offload no more than needed.

Pure Python + numpy.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import HOST_BUFFER_OVERHEAD, CostModel


@functools.lru_cache(maxsize=1 << 16)
def max_member_tokens(length: int, ring_size: int) -> int:
    """Most tokens any member of a zigzag ring of `ring_size` holds of a document of `length` tokens.

    Position p holds chunks p and 2k-1-p of 2k floor-bounded chunks; the largest pair is ceil(L/k) or
    ceil(L/k) + 1. Vectorised over the k positions; remembered, as balance's candidate families ask it for
    the same (length, size) pairs (~1,000 a family on DeepSeek-V3 at 2,048 GPUs, ~20 us each).
    """
    if ring_size == 1:
        return length
    bounds = np.arange(2 * ring_size + 1, dtype=np.int64) * length // (2 * ring_size)
    sizes = np.diff(bounds)
    return int((sizes[:ring_size] + sizes[::-1][:ring_size]).max())


def shard_time(cost_model: CostModel, *, seq_len: int, num_tokens: int, ring_size: int, pp_size: int = 1) -> float:
    """Seconds one shard adds to a micro-batch on one pipeline stage (the micro-batch overhead excluded)."""
    per_layer = cost_model.layer_shard_time(seq_len=seq_len, num_tokens=num_tokens, ring_size=ring_size)
    return per_layer * cost_model.num_layers / pp_size


def needed_offload_ratio(cost_model: CostModel, *, num_tokens: int, capacity: int) -> float:
    """Smallest r with (1 - r) * Act(num_tokens) <= Act(capacity): 0 when the tokens fit."""
    if num_tokens <= capacity:
        return 0.0
    return 1.0 - cost_model.activation_bytes(capacity) / cost_model.activation_bytes(num_tokens)


def ring_offload_ratio(cost_model: CostModel, *, length: int, ring_size: int, capacity: int) -> float:
    """The offload ratio the fullest member of a zigzag ring of `ring_size` ranks needs to hold its share
    of a document of `length` tokens within `capacity` (0 when it fits)."""
    return needed_offload_ratio(cost_model, num_tokens=max_member_tokens(length, ring_size), capacity=capacity)


def fits(
    cost_model: CostModel,
    *,
    seq_len: int,
    ring_size: int,
    num_tokens: int,
    capacity: int,
    max_offload_ratio: float,
    pp_size: int = 1,
) -> bool:
    """Whether a member holding `num_tokens` of a ring of `ring_size` fits capacity with hidden offload.

    Besides Eq. 3's overlap bound, the offloaded bytes of the stage's layers must fit the host memory
    the cost model allows (`host_memory_bytes`). The overlap bound, which times the shard, is asked last:
    a ring size that fails the offload cap or host memory is not timed.
    """
    if num_tokens <= capacity:
        return True
    needed = needed_offload_ratio(cost_model, num_tokens=num_tokens, capacity=capacity)
    if needed > max_offload_ratio + 1e-12:
        return False
    host = cost_model.host_memory_bytes
    layers = cost_model.num_layers / pp_size
    if host is not None and needed * cost_model.activation_bytes(num_tokens) * layers * HOST_BUFFER_OVERHEAD > host:
        return False
    hidden = cost_model.hidden_offload_ratio(seq_len=seq_len, num_tokens=num_tokens, ring_size=ring_size)
    return needed <= hidden + 1e-12


@dataclass(frozen=True)
class Sharding:
    """Ring size and offload ratio of every sequence of a batch (index = sequence id)."""

    ring_sizes: np.ndarray
    offload_ratios: np.ndarray


def min_ring_size(
    length: int,
    *,
    capacity: int,
    num_ranks: int,
    cost_model: CostModel,
    max_offload_ratio: float,
    pp_size: int = 1,
    seq: int = 0,
) -> tuple[int, float]:
    """D(s) and its offload ratio for one sequence (see the module docstring); ValueError if k > num_ranks."""
    if length <= capacity:
        return 1, 0.0
    no_offload = -(-length // capacity)
    k = 1
    if max_offload_ratio < 1.0:
        # (1 - r_max) * Act(t) <= Act(C) bounds t from above, hence k from below: skip hopeless k.
        act_c = cost_model.activation_bytes(capacity)
        if cost_model.a2 > 0:
            t_max = (act_c / (1.0 - max_offload_ratio) - cost_model.b2) / cost_model.a2
            k = max(1, min(no_offload, math.ceil(length / max(t_max, 1.0)) - 1))
    # Scan up with the optimistic ceil(s/k) (a lower bound of the member tokens), then confirm with the
    # exact zigzag maximum: the first k passing both is the smallest feasible one.
    common = dict(seq_len=length, capacity=capacity, max_offload_ratio=max_offload_ratio, pp_size=pp_size)
    while k <= num_ranks:
        even = -(-length // k)
        if fits(cost_model, ring_size=k, num_tokens=even, **common):
            held = max_member_tokens(length, k)
            if held == even or fits(cost_model, ring_size=k, num_tokens=held, **common):  # the same question
                return k, needed_offload_ratio(cost_model, num_tokens=held, capacity=capacity)
        k += 1
    raise ValueError(
        f"sequence {seq} of length {length} does not fit even on all {num_ranks} ranks of the HDP domain "
        f"(capacity {capacity} tokens per rank, offload ratio <= {max_offload_ratio:g})"
    )


def shard_sequences(
    lengths: Sequence[int],
    *,
    capacity: int,
    num_ranks: int,
    cost_model: CostModel,
    max_offload_ratio: float,
    pp_size: int = 1,
) -> Sharding:
    """D(s) and offload ratio for every sequence (computed once per distinct length)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive token count, got {capacity}")
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    lengths = np.asarray(lengths, dtype=np.int64)
    ring_sizes = np.ones(len(lengths), dtype=np.int64)
    ratios = np.zeros(len(lengths), dtype=np.float64)
    long_ids = np.flatnonzero(lengths > capacity)
    cache: dict[int, tuple[int, float]] = {}
    for seq in long_ids.tolist():
        length = int(lengths[seq])
        if length not in cache:
            cache[length] = min_ring_size(length, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                          max_offload_ratio=max_offload_ratio, pp_size=pp_size, seq=seq)
        ring_sizes[seq], ratios[seq] = cache[length]
    return Sharding(ring_sizes=ring_sizes, offload_ratios=ratios)


def whole_times(lengths: Sequence[int], *, cost_model: CostModel, pp_size: int = 1) -> np.ndarray:
    """Seconds of each sequence computed whole on one rank (per pipeline stage).

    The vectorised form of `shard_time(seq_len=s, num_tokens=s, ring_size=1)`: a whole sequence has no
    ring traffic, so a layer takes a1 s^2 + b1 s (the tests check that the two agree).
    """
    s = np.asarray(lengths, dtype=np.float64)
    return (cost_model.a1 * s * s + cost_model.b1 * s) * (cost_model.num_layers / pp_size)


def member_times(
    lengths: Sequence[int], ring_sizes: Sequence[int], *, cost_model: CostModel, pp_size: int = 1
) -> np.ndarray:
    """Seconds one member spends on its shard (ceil(s/k) tokens) of each sequence."""
    lengths = np.asarray(lengths, dtype=np.int64)
    ring_sizes = np.asarray(ring_sizes, dtype=np.int64)
    out = whole_times(lengths, cost_model=cost_model, pp_size=pp_size)
    cache: dict[tuple[int, int], float] = {}
    for seq in np.flatnonzero(ring_sizes > 1).tolist():
        key = s, k = int(lengths[seq]), int(ring_sizes[seq])
        if key not in cache:
            cache[key] = member_time(s, k, cost_model=cost_model, pp_size=pp_size)
        out[seq] = cache[key]
    return out


def member_time(length: int, ring_size: int, *, cost_model: CostModel, pp_size: int = 1) -> float:
    """Seconds one member of a ring of `ring_size` (> 1) spends on its shard (ceil(s/k) tokens) of a
    sequence of `length` tokens: `member_times` of one sequence, without its arrays."""
    return shard_time(cost_model, seq_len=length, num_tokens=-(-length // ring_size), ring_size=ring_size,
                      pp_size=pp_size)


def fastest_ring_size(member_time: Callable[[int], float], *, lo: int, hi: int) -> int:
    """The ring size in [lo, hi] of least member time (the smallest such k).

    Per layer the member time is b1 s/k + max(a1 s^2/k, (2 (k-1) + k f) kv s/(k bw) + (3k-2) latency)
    (f: dK/dV bytes over K/V bytes, `CostModel.layer_ring_bytes`): with u = 1/k both branches are convex
    in u, so the time is unimodal in k and a ternary search finds the minimum. So is a latent ring's
    (multi-latent attention: its up-projection adds (4 (k-1) + 1) s/k = (4 - 3u) s up-projections, linear
    in u); where the cost model picks the faster kind per k (`ring_kind` auto) the time is the smaller of
    two unimodal functions, and the search returns a local minimum.
    """
    while hi - lo > 2:
        third = (hi - lo) // 3
        if member_time(lo + third) <= member_time(hi - third):
            hi = hi - third
        else:
            lo = lo + third
    return min(range(lo, hi + 1), key=lambda k: (member_time(k), k))
