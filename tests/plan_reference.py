"""Independent references for the planner's tests: written from the rules' statements, sharing no code
with `megatron_hdp.plan.timeline.timing` (the waiting rule) or the planner's sharding (which batches fit).

- `reference_finish`: when every rank finishes a plan, given each micro-batch's time, by the waiting rule
  stated in docs/architecture.md: ranks that hold one ring at micro-batch index i run that index together, and so do
  ranks linked through several rings at one index (a rank in rings (0, 1) and (2, 1) at index 0 makes
  ranks 0, 1 and 2 one group): the group starts when its last member is ready and releases every member
  when its slowest is done. A sweep over indices with its own breadth-first search for the groups.
  With expert parallelism (EP groups of `ep_size` consecutive ranks, docs/architecture.md's constraints) the
  members of an EP group run every index together too (the MoE all-to-all), and every member runs the
  group's largest micro-batch count, a rank without any one: `expert_padded`.
- `set_partitions`: every partition of a list into blocks, for the brute forces.
- `member_tokens` / `fits_without_offload`: the zigzag layout's largest member share, from the contract's
  chunk bounds floor(j L / (2k)), and whether a batch surely fits the pool with no offload at all;
  `assert_refusal_is_justified`: a planner's refusal of well-formed lengths only where they cannot be
  planned, naming the offending length.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np


def _linked_ranks(plan, index: int, ep_size: int = 1) -> dict[int, set[int]]:
    """rank -> ranks it shares a ring with at micro-batch `index` (from the plan's shards and rings), and
    with `ep_size` > 1 the ranks of its EP group (consecutive blocks of ep_size ranks)."""
    neighbours: dict[int, set[int]] = {}
    for rank in range(plan.num_ranks if ep_size > 1 else 0):
        first = rank - rank % ep_size
        neighbours.setdefault(rank, set()).update(range(first, first + ep_size))
    for schedule in plan.ranks:
        if index >= len(schedule.microbatches):
            continue
        for shard in schedule.microbatches[index].shards:
            ring = plan.sequences[shard.seq].ring
            if len(ring) > 1:
                for a in ring:
                    neighbours.setdefault(a, set()).update(ring)
    return neighbours


def _groups_at(plan, index: int, num_ranks: int, ep_size: int = 1) -> list[list[int]]:
    """The ranks that run `index` together: connected components of the ring (and EP) graph at that index."""
    neighbours = _linked_ranks(plan, index, ep_size)
    seen: set[int] = set()
    groups = []
    for rank in range(num_ranks):
        if rank in seen:
            continue
        component, frontier = [], [rank]
        seen.add(rank)
        while frontier:
            current = frontier.pop()
            component.append(current)
            for other in neighbours.get(current, ()):
                if other not in seen:
                    seen.add(other)
                    frontier.append(other)
        groups.append(sorted(component))
    return groups


def reference_finish(plan, times: Sequence[Sequence[float]], *, barrier_per_index: bool = False,
                     ep_size: int = 1) -> list[float]:
    """Each rank's clock after its micro-batches, `times[r][i]` being rank r's micro-batch i (padding
    included: `expert_padded`). With `barrier_per_index` every rank waits for all after each index
    (Megatron's hybrid-CP group barrier); with `ep_size` > 1 the ranks of an EP group run each index
    together. No jitter: measured-like times."""
    num_ranks = len(times)
    clock = [0.0] * num_ranks
    depth = max((len(t) for t in times), default=0)
    for index in range(depth):
        for group in _groups_at(plan, index, num_ranks, ep_size):
            running = [r for r in group if index < len(times[r])]
            if not running:
                continue
            start = max(clock[r] for r in running)
            end = start + max(times[r][index] for r in running)
            for r in running:
                clock[r] = end
        if barrier_per_index:
            clock = [max(clock)] * num_ranks
    return clock


def expert_padded(times: Sequence[Sequence[float]], *, empty: float, ep_size: int = 1) -> list[list[float]]:
    """`times` as the runtime runs them (pp 1): every rank of an EP group (`ep_size` consecutive ranks)
    runs its group's largest count, the missing ones empty micro-batches of `empty` seconds, and a rank
    without micro-batches runs one."""
    out = []
    for first in range(0, len(times), ep_size):
        group = times[first:first + ep_size]
        count = max(1, max(len(t) for t in group))
        out += [list(t) + [empty] * (count - len(t)) for t in group]
    return out


def expert_spread(times: Sequence[Sequence[float]], tokens: Sequence[Sequence[float]], *, per_token: float,
                  ep_size: int, alltoall_per_token: float = 0.0) -> list[list[float]]:
    """`times` (padded by `expert_padded`) when the MoE all-to-all shares the routed expert work of each
    index evenly over the EP group: every member's own tokens' expert seconds (`per_token` each) are
    replaced by the group's mean at that index, and every member waits for the all-to-all's transfers,
    `alltoall_per_token` per token of the group's fullest member at that index; `tokens` padded alike (0
    for padding)."""
    out = []
    for first in range(0, len(times), ep_size):
        t = np.array(times[first:first + ep_size], dtype=np.float64)
        n = np.array(tokens[first:first + ep_size], dtype=np.float64)
        out += (t + per_token * (n.mean(axis=0) - n) + alltoall_per_token * n.max(axis=0)).tolist()
    return out


def microbatch_tokens(plan) -> list[list[int]]:
    """Tokens each rank holds in each of its micro-batches (sum of its shards' chunk widths)."""
    return [[sum(end - start for shard in mb.shards for start, end in shard.chunks) for mb in r.microbatches]
            for r in plan.ranks]


def member_tokens(length: int, ring_size: int) -> int:
    """Most tokens a zigzag member holds: position p has chunks p and 2k-1-p of 2k chunks, chunk j being
    [floor(j L / 2k), floor((j + 1) L / 2k)) (docs/architecture.md, StepPlan contract)."""
    k = ring_size
    bound = [j * length // (2 * k) for j in range(2 * k + 1)]
    size = [bound[j + 1] - bound[j] for j in range(2 * k)]
    return max(size[p] + size[2 * k - 1 - p] for p in range(k))


def fits_without_offload(length: int, *, num_ranks: int, capacity: int) -> bool:
    """Whether a document surely fits the pool: whole on one rank, or zigzag within C over some ring of at
    most all ranks (not always the widest: 3 tokens over 4 ranks give a member 2, over 3 ranks 1)."""
    return length <= capacity or any(member_tokens(length, k) <= capacity for k in range(2, num_ranks + 1))


def static_cp(longest: int, *, capacity: int, num_ranks: int) -> int:
    """Static DP x CP's CP size: the smallest power of two whose zigzag members hold <= C tokens of the
    longest document (Megatron sizes its CP group for the longest sequence); the first power of two
    above `num_ranks` when none of the pool's does (a member may hold 2 tokens however large the ring)."""
    cp = 1
    while cp <= num_ranks and member_tokens(longest, cp) > capacity:
        cp *= 2
    return cp


def _names(text: str, value: int) -> bool:
    """Whether `text` names the number `value` as a whole number (1 does not match inside 10 or 2.1)."""
    return re.search(rf"(?<![\d.]){value}(?!\d|\.\d)", text) is not None


def assert_refusal_is_justified(text: str, lengths: Sequence[int], *, num_ranks: int, capacity: int,
                                policy: str) -> None:
    """A planner's ValueError on well-formed lengths is right only when the batch cannot be planned, as
    computed here, and the message names an offending length. Static refuses when its CP group (sized
    for the longest document) exceeds or does not divide the pool; Megatron's Hybrid-CP on a pool that is
    not a power of two; every policy when a document does not fit on all ranks (without offload: with
    it a policy may still plan it, so such a refusal is accepted too)."""
    if policy == "static":
        longest, cp = max(lengths), static_cp(max(lengths), capacity=capacity, num_ranks=num_ranks)
        assert cp > num_ranks or num_ranks % cp, f"static refused CP {cp} on {num_ranks} ranks: {text}"
        assert _names(text, longest), f"static's refusal does not name the longest length {longest}: {text}"
        return
    if policy == "megatron-hybrid-cp" and num_ranks & (num_ranks - 1):
        assert str(num_ranks) in text and "power-of-two" in text, text
        return
    unfit = [n for n in lengths if not fits_without_offload(n, num_ranks=num_ranks, capacity=capacity)]
    assert unfit, f"{policy} refused a batch whose every document fits {num_ranks} ranks of {capacity}: {text}"
    assert any(_names(text, n) for n in unfit), f"the refusal names none of the lengths that do not fit {unfit}: {text}"


def set_partitions(items: list[int]):
    """Every partition of `items` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for blocks in set_partitions(rest):
        for i in range(len(blocks)):
            yield blocks[:i] + [[first] + blocks[i]] + blocks[i + 1:]
        yield [[first]] + blocks
