"""Build a StepPlan from an explicit placement: which ranks hold each sequence, in which micro-batch slot.

Tests and examples use it to pin down exactly the plan they exercise (whole, split, rings that overlap,
ranks with different micro-batch counts) without depending on a planner's choices; the harnesses use it
to time exactly the micro-batches they measure.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_hdp.plan.zigzag import zigzag_chunks
from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan


def plan_from_rings(
    lengths: Sequence[int],
    rings: Sequence[Sequence[int]],
    slots: Sequence[int],
    *,
    num_ranks: int,
    capacity: int,
    pp_size: int = 1,
    vpp_size: int = 1,
    policy: str = "hand",
    offload_ratios: Optional[Sequence[float]] = None,
) -> StepPlan:
    """Sequence i of `lengths[i]` tokens lives on `rings[i]` (zigzag when > 1 rank) in micro-batch slot
    `slots[i]` of every member (slot = micro-batch index), offloading `offload_ratios[i]` of its
    activations (default 0). A rank runs slots 0..its highest used slot; a slot it leaves unused becomes
    an empty micro-batch, so that a later ring still lines up."""
    ratios = [0.0] * len(lengths) if offload_ratios is None else list(offload_ratios)
    if not len(lengths) == len(rings) == len(slots) == len(ratios):
        raise ValueError(
            f"lengths, rings, slots and offload_ratios differ in length: {len(lengths)}, {len(rings)}, "
            f"{len(slots)}, {len(ratios)}"
        )
    per_rank: list[dict[int, list[Shard]]] = [{} for _ in range(num_ranks)]
    for seq, (length, ring, slot) in enumerate(zip(lengths, rings, slots)):
        for position, rank in enumerate(ring):
            chunks = ((0, length),) if len(ring) == 1 else zigzag_chunks(length, len(ring), position)
            per_rank[rank].setdefault(slot, []).append(Shard(seq, tuple(chunks)))
    ranks = []
    for rank, by_slot in enumerate(per_rank):
        num_slots = max(by_slot) + 1 if by_slot else 0
        mbs = tuple(MicroBatch(shards=tuple(by_slot.get(s, ())), capacity=capacity) for s in range(num_slots))
        ranks.append(RankSchedule(rank=rank, microbatches=mbs))
    return StepPlan(
        policy=policy,
        num_ranks=num_ranks,
        capacity=capacity,
        pp_size=pp_size,
        vpp_size=vpp_size,
        sequences=tuple(
            SequencePlacement(i, int(n), tuple(r), float(x)) for i, (n, r, x) in enumerate(zip(lengths, rings, ratios))
        ),
        ranks=tuple(ranks),
    ).validate()


def random_plan(
    lengths: Sequence[int], *, num_ranks: int, seed: int, max_slots: int = 3, pp_size: int = 1
) -> StepPlan:
    """A random valid plan: each sequence gets a random ring (size 1..num_ranks, random members in
    random order) and a random micro-batch slot — whole, split and overlapping rings, uneven counts."""
    import random

    rng = random.Random(seed)
    rings, slots = [], []
    for _ in lengths:
        size = rng.randint(1, num_ranks)
        rings.append(tuple(rng.sample(range(num_ranks), size)))
        slots.append(rng.randrange(max_slots))
    return plan_from_rings(
        lengths, rings, slots, num_ranks=num_ranks, capacity=sum(lengths), pp_size=pp_size, policy="random"
    )
