"""A lower bound on the predicted step of an expert-parallel schedule without PP, far cheaper than timing it.

`balance` plans its EP-unit families one after the other and keeps the plan of least predicted step
(`assemble.time_plan`). Timing a family costs about as much as placing it (the micro-batch loop with ring
costs and kinds, the spread expert work, the coupling over every index); where the placement alone already
shows that the family cannot beat the best plan so far, the timing can be skipped and the same plan comes
out. `ep_step_floor` is that proof: for every schedule, rings and cost model with `pp_size` 1 and EP size
e > 1, floor <= `time_plan(...).est_step_time`.

Why (every step a lower bound of the one before, in exact arithmetic):

1. A rank's micro-batch time (before the EP spread) is `CostModel.microbatch_time` of its pieces, per layer
   g + sum over whole sequences of (a1 s^2 + b1 s) + sum over its ring calls of (b1 T + max(work, comm) +
   blocks), with work = sum(a1 s t) + up-projection >= sum(a1 s t) and blocks = 2 (k - 1) ring_block_overhead
   per document. So it is at least `own` = overhead + sum of the whole sequences' `whole_times` + for each
   ring piece (a1 s t + b1 t) L / pp + its blocks' time, t the tokens its ring position holds
   (`zigzag_token_counts`): the ring traffic and the latent up-projection are left out (both >= 0). An empty
   micro-batch (a lane with nothing at an index, or the runtime's padding to the group's count) is the
   overhead alone, holding 0 tokens.
2. The spread (`experts.spread_expert_work`) makes member m's time at index i
   own'_m = time_m + spt (mean_h - h_m) + a2a max_h, h the tokens each member holds there, spt and a2a the
   cost model's expert and all-to-all seconds per token. The largest of these over the group's members is
   at least max_m (own_m - spt h_m) + spt mean_h + a2a max_h (`time_m >= own_m`).
3. `timing.expert_coupled_finish`: an index of a group starts when every member has finished the previous
   one (and, on a ring, every other group's members too) and lasts the largest member time (plus a jitter
   lead >= 0). So a group's last index ends no earlier than the sum over its indices of step 2's term, and
   the runtime's counts (`runtime_microbatch_counts`: at least every member's count, the group's largest
   for all) only add indices. The step is the latest group's end: at least the largest such sum.

A ring placement's floor (`ep_prefix_floor`): `balance` places rings first (`leading[r]`, rank r's
micro-batches up to its last ring) and appends micro-batches of whole sequences after them (assignment
and packing, the costlier half of a candidate). Every completion's floor is at least the floor of
`leading` alone: an appended whole sequence of s tokens in a cell (rank, index) adds w(s) =
(a1 s^2 + b1 s) L to `own` and s to h, so own - spt h grows by w(s) - spt s >= 0 (spt = expert_share b1 L,
and `CostModel` holds expert_share to [0, 1]), and mean h and max h do not fall: step 2's term at that
index does not fall, whether the cell was an empty (padded) one inside the group's count or past it; an
index past the group's count adds a term >= 0 (at the member of least h, own - spt h + spt mean h >= own
>= 0). The coupled floor (`ep_coupled_floor`) does not fall either: every spread time of the grid is
non-decreasing in own and in the tokens of the same index (the member's own w(s) - spt s (1 - 1/e) >= 0, the
others' spt s / e >= 0, the all-to-all's maximum), the runtime's counts only grow, and the coupled finish is
monotone in both. So a by-time placement whose prefix floor is already no better than what it must beat
(the aligned plan less `PLACEMENT_MARGIN`, or the best plan so far) is not worth assigning, packing and
timing.

Floats: the bound sums in another order than the timing, so it is scaled by 1 - `SLACK` (far above the
~1e-13 relative error of a few hundred float additions), so that floor <= the timed step holds to the bit.
tests/plan/test_ep_floor.py checks the inequality on random batches, schedules and cost models.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import whole_times
from megatron_hdp.plan.flat_ids import flat_ids
from megatron_hdp.plan.timeline.timing import expert_coupled_finish
from megatron_hdp.plan.zigzag import zigzag_token_counts

SLACK = 1e-9
"""Relative margin the floor keeps below the exact-arithmetic bound, for the float error of its sums."""


def ep_step_floor(
    schedule: Sequence[Sequence[Sequence[int]]],
    *,
    rings: Sequence[tuple[int, ...]],
    lengths: Sequence[int],
    cost_model: CostModel,
) -> float:
    """A lower bound on `time_plan(schedule=schedule, rings=rings, ..., pp_size=1)`'s step time under
    `cost_model` (its expert-parallel size e > 1 couples consecutive blocks of e ranks), from the module
    doc's three steps: per group and index the largest member time left after the spread, summed over the
    group's indices; the largest group's sum, less `SLACK`."""
    own, tokens, depth, _ = _floor_grid(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
    ep_size, width = cost_model.expert_parallel_size, own.shape[1]
    own, tokens = own.reshape(-1, ep_size, width), tokens.reshape(-1, ep_size, width)
    spt = cost_model.expert_seconds_per_token()
    a2a = cost_model.expert_alltoall_seconds_per_token()
    term = (own - spt * tokens).max(axis=1) + spt * tokens.mean(axis=1) + a2a * tokens.max(axis=1)
    term[np.arange(width)[None, :] >= depth[:, None]] = 0.0  # no index there: the group has finished
    return float(term.sum(axis=1).max(initial=0.0)) * (1 - SLACK)


def ep_coupled_floor(
    schedule: Sequence[Sequence[Sequence[int]]],
    *,
    rings: Sequence[tuple[int, ...]],
    lengths: Sequence[int],
    cost_model: CostModel,
) -> float:
    """`ep_step_floor` with the rings' coupling across groups (module doc, step 3 in full): the lower-bound
    times `own` spread as the timing spreads them (`CostModel.expert_coupled_grid`, which adds to `own` a
    term of the tokens alone, so it keeps own's order), then `timing.expert_coupled_finish` without jitter
    over the groups' counts and the rings at their indices, less `SLACK`. That finish is a max-plus
    recurrence, so it does not fall where a time rises, and jitter only adds a lead: at most the timed step,
    and at least `ep_step_floor` (an index of a group lasts its slowest member; rings add waits)."""
    own, tokens, depth, links = _floor_grid(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
    if not own.size:  # no micro-batch anywhere
        return 0.0
    counts = np.repeat(depth, cost_model.expert_parallel_size)
    past = np.arange(own.shape[1])[None, :] >= counts[:, None]
    own[past], tokens[past] = 0.0, 0.0  # the grid's zeros past every rank's count
    finish = expert_coupled_finish(cost_model.expert_coupled_grid(own, tokens), counts, links,
                                   ep_size=cost_model.expert_parallel_size)
    return float(finish.max(initial=0.0)) * (1 - SLACK)


def _floor_grid(
    schedule: Sequence[Sequence[Sequence[int]]],
    *,
    rings: Sequence[tuple[int, ...]],
    lengths: Sequence[int],
    cost_model: CostModel,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[int, tuple[int, ...]]]]:
    """Step 1 of the module doc on a [rank, index] grid as wide as the deepest group: each cell's `own` (the
    overhead alone where a rank has no micro-batch) and tokens held, each group's count (its deepest
    member's), and every ring's (index, members), its index that of its first piece."""
    ep_size = cost_model.expert_parallel_size
    num_ranks = len(schedule)
    if ep_size <= 1 or num_ranks % ep_size:
        raise ValueError(f"the EP floors need an EP size > 1 dividing the ranks, got {ep_size} for {num_ranks}")
    scale = cost_model.num_layers  # pp_size 1: a layer's seconds times the layers
    overhead = cost_model.microbatch_time([])
    counts = np.fromiter(map(len, schedule), dtype=np.int64, count=num_ranks)
    depth = counts.reshape(-1, ep_size).max(axis=1)  # each group's count: the runtime pads its members to it
    width = int(depth.max(initial=0))
    # every piece as (cell = rank x width + index, sequence), whole sequences priced as arrays
    flat = list(itertools.chain.from_iterable(schedule))  # every micro-batch, rank by rank
    sizes, seq = flat_ids(flat)
    starts = np.cumsum(counts) - counts
    index = np.arange(len(flat)) - np.repeat(starts, counts)  # each micro-batch's index on its rank
    cell = np.repeat(np.repeat(np.arange(num_ranks) * width, counts) + index, sizes)
    length = np.asarray(lengths, dtype=np.int64)
    extra = whole_times(length, cost_model=cost_model)[seq]
    held = length[seq].astype(np.float64)
    in_ring = np.flatnonzero(np.fromiter(map(len, rings), dtype=np.int64, count=len(rings))[seq] > 1)
    in_ring = in_ring[np.argsort(seq[in_ring], kind="stable")]
    firsts = np.flatnonzero(np.diff(seq[in_ring], prepend=-1))
    links = []
    for at in np.split(in_ring, firsts[1:]) if len(in_ring) else []:  # each ring's pieces: its positions' tokens
        s = int(seq[at[0]])
        ring, n = rings[s], int(length[s])
        position = {member: p for p, member in enumerate(ring)}
        t = zigzag_token_counts(n, len(ring))[[position[rank] for rank in (cell[at] // width).tolist()]]
        block = cost_model.layer_ring_block_time(num_documents=1, ring_size=len(ring))
        extra[at] = ((cost_model.a1 * n + cost_model.b1) * t + block) * scale
        held[at] = t
        links.append((int(cell[at[0]] % width), ring))
    own = overhead + np.bincount(cell, weights=extra, minlength=num_ranks * width)
    tokens = np.bincount(cell, weights=held, minlength=num_ranks * width)
    return own.reshape(num_ranks, width), tokens.reshape(num_ranks, width), depth, links


def ep_prefix_floor(
    leading: Sequence[Sequence[Sequence[int]]],
    *,
    ring_of: dict[int, tuple[int, ...]],
    lengths: Sequence[int],
    cost_model: CostModel,
) -> float:
    """A lower bound on the timed step (`pp_size` 1, EP size e > 1) of every schedule that runs
    `leading[r]` first on rank r and only micro-batches of whole sequences after it (module doc): the
    coupled floor (`ep_coupled_floor`) of `leading` with the rings of `ring_of` (sequence -> ring)."""
    rings: list[tuple[int, ...]] = [()] * len(lengths)
    for seq, ring in ring_of.items():
        rings[seq] = ring
    return ep_coupled_floor(leading, rings=rings, lengths=lengths, cost_model=cost_model)
