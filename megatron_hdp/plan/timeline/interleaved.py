"""Megatron's pipeline op order for one stage (1F1B and interleaved), and the ring rule that keeps HDP
rings across pipelines of different micro-batch counts free of deadlock.

The op order
------------
A pipeline of `pp_size` stages with `vpp_size` model chunks per stage (virtual pipeline stages; chunk c
of stage s holds the layers of virtual stage c x pp_size + s) runs `num_microbatches` N micro-batches.
Megatron-core 0.19 (`pipeline_parallel.schedules`) orders the N x v forwards of a stage by its schedule
table (`get_schedule_table`): micro-batches in groups of G = `microbatch_group_size_per_vp_stage`
(default pp_size), each group running chunk 0 for all its micro-batches, then chunk 1, ...; the last
group takes every micro-batch left (G plus the remainder). Backward virtual id k runs the table's
micro-batch of id k on the chunk reversed (v - 1 - c). Stage s runs W forwards of warm-up, then
alternates forward W + k / backward k (1F1B steady state), then the remaining backwards (cool-down):

    W = min(N x v, pp - s - 1)                          v = 1  (forward_backward_pipelining_without_interleaving)
    W = min(N x v, 2 (pp - s - 1) + (v - 1) G)          v > 1  (get_pp_rank_microbatches)

so forward id j runs before backward id k iff j <= W + k. Megatron refuses, for v > 1, G outside
[pp, N] and a remainder N mod G in (0, pp) (`megatron_constraint_error`). With v = 1 the table is
micro-batch order and `stage_order` is the classic 1F1B order.

The ring rule
-------------
An HDP ring of k > 1 members holds one document at micro-batch index m of every member pipeline
(`StepPlan.validate` puts all shards of a sequence at one index); its members are the same stage of
those pipelines, and on every stage s and chunk c both the forward and the backward of (c, m) are
collective: each member's op starts when all members reached it. Pipelines may run different counts
N_p. **Rule: in each set of pipelines linked by rings (directly or through other pipelines), every
pipeline runs either the set's largest count or a multiple of G.** With v = 1 (1F1B) the rule is empty:
any counts, no padding (derived below). With v > 1 and the default G = pp, Megatron's own constraint
already makes every count a multiple of G; the rule adds padding only for G > pp, where Megatron lets a
last group of G + r micro-batches, pp <= r < G, run.

Deadlock freedom. Model every rank's wait-for graph: its ops in `stage_order`; a forward of (c, m) on
stage s waits for the forward of (c, m) on stage s - 1 (stage 0 waits for chunk c - 1 of the last
stage), a backward for the backward of the next stage (the last stage waits for chunk c + 1 of stage
0; chunk v - 1 of the last stage for its own forward); a ring merges its members' ops of one (stage,
kind, chunk, m) into one node. Point-to-point sends are taken as posted without waiting for the
receiver (the receiver waits for the sender), as Megatron's batched isend/irecv pairs them. A plan is
deadlock-free iff this graph is acyclic (`deadlock_free` builds it and checks).

The argument rests on one property, *prefix order*: pipeline p's op order on every stage is R's order
restricted to p's (chunk, micro-batch) ids, R a pipeline of the linked set with the largest count M.
Given it: map every op of every member to R's op of the same key: consecutive ops of p map to ops R runs
in that order on that stage (a path in R), a dependency of p maps to the same dependency of R (they do
not depend on the count), and a ring node maps to one op of R because all its members have the same
key. A cycle in the linked set's graph would thus map to a closed walk of positive length in R's own
graph, which is acyclic (Megatron's schedule completes: each op's dependencies come earlier in a run with
unit op times). Pipelines in different linked sets share no node. So no cycle.

Prefix order, 1F1B (v = 1). The table is micro-batch order, so p's ids 0..N_p - 1 are a prefix of R's.
On stage s forwards run in increasing m, backwards in increasing m, and forward j runs before backward k
iff j <= W + k with W = min(N_p, W0), W0 = pp - s - 1. If N_p > W0 the bound is W0, R's own (M >= N_p >
W0). If N_p <= W0 the warm-up is capped (every forward before every backward), but then every j < N_p
<= W0 <= W0 + k, so j <= W0 + k holds for all of p's pairs as well: the capped order *is* R's order
restricted to p's ids. Hence prefix order for any counts: 1F1B pipelines of different counts never
deadlock through rings held at one index, and `padded_counts` leaves them unpadded (only a pipeline
without micro-batches runs one, to join the gradient reduction). What the rule does need is one index
per ring: members holding a ring at different indices can wait on each other in a cycle (two rings
at indices 0 and 1 on one member and 1 and 0 on the other do); `deadlock_cycle` takes such plans with
per-member indices so tests can plant them.

Prefix order, interleaved (v > 1). Under the rule every member's schedule table is a prefix of R's: when
N_p = M it is R's table, and when N_p is a multiple of G every group of p is a full group of G that R
has at the same place (R's group starting at N_p - G is not R's last, since M > N_p). Forward id j
precedes backward id k on a stage iff j <= W0 + k, with W0 the uncapped warm-up (a capped warm-up N_p x v
only drops ids p does not have, as for v = 1), the same bound on every pipeline; so p's op order is R's
restricted to p's ids. A count that is neither M nor a multiple of G puts a short last group where R has
a full one, and the same micro-batch's chunk-1 forward gets another virtual id (see the tests' planted
plan, which deadlocks).

The rule is sufficient, not necessary: a pipeline that breaks it may still be free of deadlock, which
`deadlock_free` decides; `padded_counts` gives the least counts that satisfy both Megatron and the
rule, and the planner times those padding micro-batches.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Sequence

import numpy as np

Op = tuple[str, int, int]
"""(kind 'F' or 'B', model chunk, micro-batch) of one stage's op."""

Ring = tuple[int | Sequence[int], Sequence[int]]
"""(micro-batch index, member pipelines) of one ring. The checker (`deadlock_cycle`) also takes one index
per member, a plan `StepPlan.validate` refuses, so tests can plant it; the rule's functions take one."""


def default_group_size(pp_size: int, group_size: int | None) -> int:
    """Megatron's `microbatch_group_size_per_vp_stage`: pp_size unless set."""
    return pp_size if group_size is None else group_size


def megatron_constraint_error(num_microbatches: int, *, pp_size: int, vpp_size: int,
                              group_size: int | None = None) -> str | None:
    """Why Megatron-core 0.19 refuses to run this interleaved pipeline, or None where it runs it
    (forward_backward_pipelining_with_interleaving's checks; v = 1 has none)."""
    if vpp_size == 1:
        return None
    g = default_group_size(pp_size, group_size)
    if pp_size < 2:
        return f"virtual pipeline stages (vpp_size={vpp_size}) need pp_size >= 2, got {pp_size}"
    if not pp_size <= g <= num_microbatches:
        return (f"{num_microbatches} micro-batches with group size {g}: Megatron needs pp_size={pp_size} <= "
                f"group size <= micro-batches")
    remainder = num_microbatches % g
    if 0 < remainder < pp_size:
        return (f"{num_microbatches} micro-batches leave a last group of {remainder} extra (group size {g}): "
                f"Megatron needs 0 or >= pp_size={pp_size}")
    return None


def schedule_table(num_microbatches: int, *, vpp_size: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward virtual id: groups of `group_size` micro-batches, each group
    running chunk 0 for all its micro-batches, then chunk 1, ...; the last group takes the rest."""
    table: list[tuple[int, int]] = []
    for first in range(0, num_microbatches, group_size):
        last = num_microbatches if first + group_size >= num_microbatches else first + group_size
        table += [(mb, chunk) for chunk in range(vpp_size) for mb in range(first, last)]
        if last == num_microbatches:
            break
    return table


def uncapped_warmup(*, pp_size: int, stage: int, vpp_size: int, group_size: int) -> int:
    """Forwards a stage runs before its first backward, before the cap at N x v (module doc)."""
    if vpp_size == 1:
        return pp_size - stage - 1
    return 2 * (pp_size - stage - 1) + (vpp_size - 1) * group_size


def stage_order(num_microbatches: int, *, pp_size: int, stage: int, vpp_size: int = 1,
                group_size: int | None = None) -> list[Op]:
    """The ops of `stage` in the order Megatron runs them: warm-up forwards, forward/backward pairs,
    cool-down backwards (module doc). Does not check Megatron's constraints (`megatron_constraint_error`)."""
    g = default_group_size(pp_size, group_size)
    table = schedule_table(num_microbatches, vpp_size=vpp_size, group_size=g)
    total = len(table)
    warmup = min(total, uncapped_warmup(pp_size=pp_size, stage=stage, vpp_size=vpp_size, group_size=g))

    def forward(j: int) -> Op:
        mb, chunk = table[j]
        return ("F", chunk, mb)

    def backward(k: int) -> Op:
        mb, chunk = table[k]
        return ("B", vpp_size - 1 - chunk, mb)

    order = [forward(j) for j in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def resident_peak(tokens: Sequence[float], *, pp_size: int, vpp_size: int = 1, group_size: int | None = None) -> float:
    """Most activation tokens any stage of a pipeline keeps at once when it runs micro-batches of these
    resident `tokens` in Megatron's order: a chunk's forward keeps its micro-batch's tokens / v (the
    chunk's share of the stage's layers) until that chunk's backward. The group size G sets how many
    forwards run before the first backward, so a larger G keeps more (`group_size_fits`)."""
    return float(resident_peaks([tokens], pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)[0])


def resident_peaks(tokens: Sequence[Sequence[float]], *, pp_size: int, vpp_size: int = 1,
                   group_size: int | None = None) -> np.ndarray:
    """`resident_peak` of every pipeline `tokens[p]` at once: pipelines of one count share each stage's op
    order, so the tokens each op keeps (+) or frees (-) form a [pipeline, op] array whose running sum
    (numpy's cumsum, left to right, as one op after the other adds them) is what the stage holds after
    every op."""
    peaks = np.zeros(len(tokens))
    by_count: dict[int, list[int]] = {}
    for pipeline, pipeline_tokens in enumerate(tokens):
        by_count.setdefault(len(pipeline_tokens), []).append(pipeline)
    for count, rows in by_count.items():
        if not count:
            continue
        share = np.array([tokens[p] for p in rows], dtype=np.float64) / vpp_size
        for stage in range(pp_size):
            ops = stage_order(count, pp_size=pp_size, stage=stage, vpp_size=vpp_size, group_size=group_size)
            sign = np.array([1.0 if kind == "F" else -1.0 for kind, _, _ in ops])
            held = np.cumsum(share[:, [mb for _, _, mb in ops]] * sign, axis=1)
            peaks[rows] = np.maximum(peaks[rows], held.max(axis=1))
    return peaks


def activation_budget(capacity: int, *, pp_size: int, vpp_size: int = 1) -> float:
    """The resident tokens a micro-batch capacity C was sized for: Megatron's default G = pp with every
    micro-batch full, at its first stage (which keeps the most): pp micro-batches in 1F1B, 2 (pp - 1) +
    (v - 1) pp + 1 chunks of C / v interleaved (`sim.cluster.ClusterSpec.memory_capacity` sizes C so)."""
    if vpp_size == 1:
        return float(pp_size * capacity)
    return (2 * (pp_size - 1) + (vpp_size - 1) * pp_size + 1) * capacity / vpp_size


def group_size_fits(tokens: Sequence[float], *, capacity: int, pp_size: int, vpp_size: int, group_size: int) -> bool:
    """Whether a pipeline running micro-batches of these resident `tokens` with group size G keeps no
    more activations than C was sized for (`activation_budget`): a G above pp is free where the
    micro-batches are light in tokens (e.g. long documents' ring shards), and refused where it would
    overflow the memory that the default G fills."""
    return pipelines_fit([tokens], capacity=capacity, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)


def pipelines_fit(tokens: Sequence[Sequence[float]], *, capacity: int, pp_size: int, vpp_size: int,
                  group_size: int | None) -> bool:
    """`group_size_fits` of every pipeline `tokens[p]`, timed together (`resident_peaks`)."""
    peaks = resident_peaks(tokens, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)
    return bool((peaks <= activation_budget(capacity, pp_size=pp_size, vpp_size=vpp_size) * (1 + 1e-9)).all())


def dependency(op: Op, *, stage: int, pp_size: int, vpp_size: int) -> tuple[int, Op] | None:
    """(stage, op) that `op` on `stage` receives its input from, or None: a forward from the previous
    virtual stage, a backward from the next one, the last virtual stage's backward from its forward."""
    kind, chunk, mb = op
    if kind == "F":
        if stage > 0:
            return stage - 1, op
        return (pp_size - 1, ("F", chunk - 1, mb)) if chunk > 0 else None
    if stage < pp_size - 1:
        return stage + 1, op
    return (0, ("B", chunk + 1, mb)) if chunk < vpp_size - 1 else (stage, ("F", chunk, mb))


def union_root(parent: list[int] | dict[Hashable, Hashable], x: Hashable) -> Hashable:
    """Union-find root of `x` in `parent` (a list or a dict mapping every key seen to its parent; a root
    is its own parent), halving the path on the way. `linked_sets`, `deadlock_cycle` and
    `timing.link_groups` share it."""
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def linked_sets(num_pipelines: int, rings: Iterable[Ring]) -> list[list[int]]:
    """The pipelines linked by rings, directly or through others (each pipeline in exactly one set)."""
    parent = list(range(num_pipelines))

    def find(x: int) -> int:
        return union_root(parent, x)

    for _, members in rings:
        members = list(members)
        for other in members[1:]:
            parent[find(other)] = find(members[0])
    sets: dict[int, list[int]] = {}
    for p in range(num_pipelines):
        sets.setdefault(find(p), []).append(p)
    return list(sets.values())


def _least_valid_count(num: int, *, pp_size: int, vpp_size: int, group_size: int) -> int:
    """The smallest count >= max(num, 1) that Megatron runs."""
    num = max(1, num)
    while megatron_constraint_error(num, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size):
        num += 1
    return num


def padded_counts(counts: Sequence[int], *, pp_size: int, vpp_size: int = 1, group_size: int | None = None,
                  rings: Iterable[Ring] = ()) -> list[int]:
    """The least micro-batch counts, each >= counts[p] and >= 1, that Megatron runs and that satisfy the
    ring rule (module doc): per linked set, the largest count raised to the next count Megatron runs,
    every other pipeline to the next multiple of G (at least G) unless the set's largest is smaller.
    With v = 1 (1F1B) that is max(count, 1): the rule needs no padding (module doc, prefix order)."""
    g = default_group_size(pp_size, group_size)
    if vpp_size == 1:  # in numpy: at 16,384 ranks a Python `max` per rank cost ~3 ms a timing
        return np.maximum(np.asarray(counts, dtype=np.int64), 1).tolist()
    out = list(counts)
    for members in linked_sets(len(counts), rings):
        most = _least_valid_count(max(counts[p] for p in members), pp_size=pp_size, vpp_size=vpp_size,
                                  group_size=g)
        for p in members:
            out[p] = min(most, g * max(1, -(-counts[p] // g)))
    return out


def satisfies_ring_rule(counts: Sequence[int], *, rings: Iterable[Ring], pp_size: int, vpp_size: int = 1,
                        group_size: int | None = None) -> bool:
    """Whether `counts` satisfy the ring rule (module doc); Megatron's own constraints not included. With
    v = 1 any counts do (1F1B's prefix order); the one-index-per-ring part is `StepPlan.validate`'s."""
    if vpp_size == 1:
        return True
    g = default_group_size(pp_size, group_size)
    rings = list(rings)
    for members in linked_sets(len(counts), rings):
        most = max(counts[p] for p in members)
        if any(counts[p] != most and counts[p] % g for p in members):
            return False
    return True


def deadlock_cycle(counts: Sequence[int], *, rings: Iterable[Ring], pp_size: int, vpp_size: int = 1,
                   group_size: int | None = None) -> list[tuple[int, int, Op]] | None:
    """A cycle of (pipeline, stage, op) in the global wait-for graph of pipelines running `counts`
    micro-batches with `rings` (module doc), or None when the graph is acyclic (no deadlock).

    Brute force over every op of every rank: for checking plans and the rule in tests, not for the
    planner's hot path. A ring's index may be one per member (`Ring`). Raises ValueError for a ring at
    an index a member does not run.
    """
    g = default_group_size(pp_size, group_size)
    node: dict[tuple[int, int, Op], int] = {}
    orders = []
    for p, num in enumerate(counts):
        per_stage = [stage_order(num, pp_size=pp_size, stage=s, vpp_size=vpp_size, group_size=g)
                     for s in range(pp_size)]
        orders.append(per_stage)
        for s, order in enumerate(per_stage):
            for op in order:
                node[(p, s, op)] = len(node)
    parent = list(range(len(node)))

    def find(x: int) -> int:
        return union_root(parent, x)

    for index, members in rings:
        members = list(members)
        at = [index] * len(members) if isinstance(index, int) else list(index)
        for p, mb in zip(members, at):
            if not 0 <= mb < counts[p]:
                raise ValueError(f"ring at micro-batch {mb} includes pipeline {p}, which runs {counts[p]}")
        for s in range(pp_size):
            for kind in "FB":
                for chunk in range(vpp_size):
                    first = find(node[(members[0], s, (kind, chunk, at[0]))])
                    for p, mb in zip(members[1:], at[1:]):
                        parent[find(node[(p, s, (kind, chunk, mb))])] = first
    edges: dict[int, set[int]] = {}
    witness: dict[tuple[int, int], tuple[int, int, Op]] = {}

    def add(before: tuple[int, int, Op], after: tuple[int, int, Op]) -> None:
        a, b = find(node[before]), find(node[after])
        edges.setdefault(a, set()).add(b)
        witness.setdefault((a, b), after)

    for p, per_stage in enumerate(orders):
        for s, order in enumerate(per_stage):
            for i, op in enumerate(order):
                if i:
                    add((p, s, order[i - 1]), (p, s, op))
                dep = dependency(op, stage=s, pp_size=pp_size, vpp_size=vpp_size)
                if dep is not None:
                    add((p, dep[0], dep[1]), (p, s, op))
    # iterative DFS for a back edge
    state: dict[int, int] = {}  # 1 on the stack, 2 done
    for root in {find(x) for x in range(len(node))}:
        if root in state:
            continue
        stack = [(root, iter(edges.get(root, ())))]
        state[root] = 1
        while stack:
            here, successors = stack[-1]
            for nxt in successors:
                if state.get(nxt) == 1:
                    path = [entry for entry, _ in stack]
                    cycle = path[path.index(nxt):] + [nxt]
                    return [witness[(a, b)] for a, b in zip(cycle, cycle[1:])]
                if nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(edges.get(nxt, ()))))
                    break
            else:
                state[here] = 2
                stack.pop()
    return None


def deadlock_free(counts: Sequence[int], *, rings: Iterable[Ring], pp_size: int, vpp_size: int = 1,
                  group_size: int | None = None) -> bool:
    """Whether pipelines running `counts` micro-batches with `rings` cannot deadlock (`deadlock_cycle`)."""
    return deadlock_cycle(counts, rings=rings, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size) is None
