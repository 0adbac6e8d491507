"""Baseline policies, planned and timed by the same code as `balance` so that they compare side by side.

`static` — Megatron's static DP x CP mesh: one CP size for the whole run, sized for the longest
sequence (the smallest power of two cp with ceil(max_len / cp) <= C: Megatron's CP splits a sequence
into 2 cp zigzag chunks and requires power-of-two-friendly sizes), DP = num_ranks / cp. *Every* sequence,
even a 100-token one, is split over its DP group's whole CP ring — that redundant ring traffic and the
compute imbalance between DP groups are what HDP removes. Sequences are packed, in data-loader order
(next fit), into micro-batches of up to cp * C tokens (each CP rank <= C), and micro-batches are dealt round-robin to the
DP groups (Megatron gives every DP rank the same number of micro-batches, give or take one).
CP group g is HDP ranks [g * cp, (g + 1) * cp). No offloading.

`naive` — ByteScale Algorithm 1 ("naive HDP", the ablation's "dynamic communication" step): data-aware
sharding without offload (D(s) = ceil(s / C) ranks per sequence) and compute-oblivious placement: rings,
then whole sequences in data-loader order, each on the ranks holding the fewest *tokens*, so every rank
holds about the same number of tokens and micro-batches. Because attention cost grows as s^2, equal
tokens are not equal time: this is the imbalance the balance scheduler fixes. (Rings are placed in
non-increasing ring size, which keeps ring members aligned on one micro-batch index; see `placement.py`.)
The policy never offloads, whatever the config says: selective offloading is ByteScale's next
technique (the ablation's "+ selective offload" step), which is `naive-offload`.

`naive-offload` — the same placement on selective-offload sharding (Eq. 3, `config.max_offload_ratio`): a
long document goes on as few ranks as memory and the copy overlap allow. Without the balance scheduler
that is usually slower, not faster: the document's ring shrinks, its per-member attention grows as
s^2 / D(s), and the token-balanced placement gives that ring's ranks as many tokens as everyone else's,
so the step waits on it (benchmarks/README.md, "ablation_bench").
"""

from __future__ import annotations

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.timeline.assemble import assemble_plan, gc_paused
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.zigzag import zigzag_chunk_bounds
from megatron_hdp.plan.search.packing import best_fit
from megatron_hdp.plan.search.placement import lpt, place_rings
from megatron_hdp.plan.cost.sharding import shard_sequences
from megatron_hdp.plan.step_plan import StepPlan


def static_cp_size(max_length: int, *, capacity: int, num_ranks: int) -> int:
    """Megatron's CP size for a run: the smallest power of two cp with every CP rank's share <= C."""
    cp = 1
    while cp <= num_ranks and _member_tokens(np.array([max_length]), cp).max() > capacity:
        cp *= 2
    if cp > num_ranks:
        raise ValueError(
            f"the longest sequence ({max_length} tokens) needs a static CP group of {cp} ranks of capacity "
            f"{capacity}, more than the {num_ranks} ranks available"
        )
    if num_ranks % cp:
        raise ValueError(
            f"static DP x CP needs num_ranks divisible by the CP size: {num_ranks} ranks, CP {cp} "
            f"(the power of two that fits the longest sequence, {max_length} tokens, at capacity {capacity})"
        )
    return cp


def _member_tokens(lengths: np.ndarray, cp: int) -> np.ndarray:
    """Tokens each CP position holds of each sequence: array [len(lengths), cp] (zigzag chunks p, 2cp-1-p)."""
    position = np.arange(cp)

    def size(chunk: np.ndarray) -> np.ndarray:
        start, end = zigzag_chunk_bounds(lengths[:, None], cp, chunk)  # vectorised over lengths and chunks
        return end - start

    return size(position) + size(2 * cp - 1 - position)


@gc_paused()  # like `balance`: the whole build, not only its assembly (see `assemble.gc_paused`)
def plan_static(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1,
    vpp_size: int = 1,
) -> StepPlan:
    """Static DP x CP (see the module doc)."""
    capacity = config.hdp_capacity
    array = np.asarray(lengths, dtype=np.int64)
    cp = static_cp_size(int(array.max()), capacity=capacity, num_ranks=num_ranks)
    dp = num_ranks // cp
    per_member = _member_tokens(array, cp)
    # Next fit over the data-loader stream: a micro-batch closes when a CP position would exceed C.
    bins: list[list[int]] = [[]]
    used = np.zeros(cp, dtype=np.int64)
    for seq in range(len(lengths)):
        need = per_member[seq]
        if bins[-1] and (used + need > capacity).any():
            bins.append([])
            used[:] = 0
        bins[-1].append(seq)
        used += need
    schedule: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    for b, seqs in enumerate(bins):
        group = b % dp
        for rank in range(group * cp, (group + 1) * cp):
            schedule[rank].append(seqs)
    rings = [()] * len(lengths)
    for b, seqs in enumerate(bins):
        group = tuple(range((b % dp) * cp, (b % dp + 1) * cp))
        for seq in seqs:
            rings[seq] = group
    return assemble_plan(policy="static", lengths=lengths, rings=rings, offload_ratios=np.zeros(len(lengths)),
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size)


def _token_balanced_plan(
    lengths: list[int], *, num_ranks: int, capacity: int, cost_model: CostModel, pp_size: int,
    max_offload_ratio: float, policy: str, vpp_size: int = 1,
) -> StepPlan:
    """Algorithm 1's placement on the sharding that `max_offload_ratio` allows (see the module doc)."""
    sharding = shard_sequences(lengths, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                               max_offload_ratio=max_offload_ratio, pp_size=pp_size)
    ring_sizes = sharding.ring_sizes
    array = np.asarray(lengths, dtype=np.int64)
    tokens = np.where(ring_sizes > 1, -(-array // ring_sizes), array).astype(np.float64)
    long_ids = np.flatnonzero(ring_sizes > 1)
    order = long_ids[np.argsort(-ring_sizes[long_ids], kind="stable")].tolist()
    layout = place_rings(order, ring_sizes=ring_sizes, weights=tokens, num_ranks=num_ranks)
    loads = layout.busy.copy()
    given = lpt(np.flatnonzero(ring_sizes == 1).tolist(), weights=tokens, loads=loads)
    schedule = []
    rings: list[tuple[int, ...]] = [layout.rings.get(seq, ()) for seq in range(len(lengths))]
    for rank in range(num_ranks):
        items = given[rank]
        for seq in items:
            rings[seq] = (rank,)
        packed = best_fit([lengths[i] for i in items], capacity=capacity, order="given")
        schedule.append([[seq] for seq in layout.ring_microbatches[rank]] + [[items[j] for j in b] for b in packed])
    return assemble_plan(policy=policy, lengths=lengths, rings=rings, offload_ratios=sharding.offload_ratios,
                         schedule=schedule, capacity=capacity, cost_model=cost_model, pp_size=pp_size,
                         vpp_size=vpp_size)


@gc_paused()
def plan_naive(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1,
    vpp_size: int = 1,
) -> StepPlan:
    """ByteScale Algorithm 1: sharding without offload, token-balanced placement (see the module doc)."""
    return _token_balanced_plan(lengths, num_ranks=num_ranks, capacity=config.hdp_capacity, cost_model=cost_model,
                                pp_size=pp_size, max_offload_ratio=0.0, policy="naive", vpp_size=vpp_size)


@gc_paused()
def plan_naive_offload(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int = 1,
    vpp_size: int = 1,
) -> StepPlan:
    """Algorithm 1's placement on selective-offload sharding (ByteScale Eq. 3; see the module doc)."""
    return _token_balanced_plan(lengths, num_ranks=num_ranks, capacity=config.hdp_capacity, cost_model=cost_model,
                                pp_size=pp_size, max_offload_ratio=config.max_offload_ratio, policy="naive-offload",
                                vpp_size=vpp_size)
