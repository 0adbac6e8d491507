"""A group scheduler's answer as a StepPlan's rings and per-rank schedule (Megatron's CP schedulers).

Megatron's Hybrid-CP (`BalancedCPScheduler`) and Dynamic-CP (`DefaultDynamicCPScheduler`) schedulers
answer with `sample_id_groups[j][rank]`: the ids of the sequences rank `rank` works on in group (or
micro-batch) j. Both policy adapters (`megatron.comparison.hybrid_cp`, `megatron.comparison.dynamic_cp`) convert
it the same way, here: a sequence held by k ranks of its group becomes a ring of those k ranks, ascending
(the CP rank order of the group), k = 1 a whole sequence on one rank; group j is index j on every rank.
"""

from __future__ import annotations

from typing import Sequence


def rings_and_schedule(
    groups: Sequence[Sequence[Sequence[int]]], *, num_ranks: int, num_sequences: int
) -> tuple[list[tuple[int, ...]], list[list[list[int]]]]:
    """(ring of each sequence, schedule[rank][j] = sequence ids of rank at index j) of `groups`
    (`groups[j][rank]` -> sequence ids); asserts that every sequence sits in exactly one group."""
    rings: list[tuple[int, ...]] = [()] * num_sequences
    for per_rank in groups:
        assert len(per_rank) == num_ranks, f"the scheduler scheduled {len(per_rank)} ranks, not {num_ranks}"
        members: dict[int, list[int]] = {}
        for rank, ids in enumerate(per_rank):
            for sequence in ids:
                members.setdefault(sequence, []).append(rank)
        for sequence, ranks in members.items():
            assert not rings[sequence], f"the scheduler scheduled sequence {sequence} in two groups"
            rings[sequence] = tuple(ranks)
    assert all(rings), "the scheduler's schedule dropped a sequence"
    return rings, [[list(per_rank[rank]) for per_rank in groups] for rank in range(num_ranks)]


def check_pool_holds(lengths: Sequence[int], *, num_ranks: int, capacity: int) -> None:
    """ValueError naming the first sequence longer than the whole pool (`num_ranks` x `capacity` tokens),
    which no CP group of a Megatron scheduler can hold."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > capacity * num_ranks]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sequence {i} of length {n} exceeds the pool's {num_ranks} x {capacity} tokens "
                         f"({len(too_long)} such sequences)")
