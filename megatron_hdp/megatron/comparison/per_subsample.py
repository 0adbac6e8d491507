"""Megatron's Hybrid-CP as Megatron executes it: one pass per sub-sample, a barrier after each group.

The `megatron-hybrid-cp` policy's plan has one micro-batch per group of Megatron's scheduler on every
rank (what our runtime can run as is). Megatron itself runs each sub-sample of a group as its own
forward/backward pass and ends every group with a barrier over the whole DP x CP group.
`per_subsample_plan` turns the grouped plan into that execution, so that the CPU harness can run it and
a replay can time it as Megatron would. Pure: a StepPlan in, a StepPlan and barrier indices out.
"""

from __future__ import annotations

from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, StepPlan


def per_subsample_plan(plan: StepPlan) -> tuple[StepPlan, tuple[int, ...]]:
    """`plan` (this policy's: group j = micro-batch j) as Megatron executes it: one micro-batch per sub-sample
    (<= C tokens per rank per pass), and the micro-batch indices after which its group barrier falls.

    Inside a group each rank runs its sub-samples in Megatron's order; the members of a split sub-sample run
    it together, so it takes the first index free on all of them (our runtime aligns ring members on one
    micro-batch index). A rank with nothing at an index gets an empty micro-batch there: a pass Megatron
    does not run (collated as padding; a replay of measured times counts it as zero).
    """
    rings = {seq.id: seq.ring for seq in plan.sequences}
    slots: list[list] = [[] for _ in range(plan.num_ranks)]
    barriers = []
    for group in range(max(len(s.microbatches) for s in plan.ranks)):
        start = len(slots[0])
        cursor = [start] * plan.num_ranks
        placed: dict[int, int] = {}
        order = sorted(
            ((position, rank, shard) for rank, schedule in enumerate(plan.ranks)
             for position, shard in enumerate(schedule.microbatches[group].shards)),
            key=lambda item: (item[0], item[1]),
        )
        for _, rank, shard in order:
            if shard.seq not in placed:
                members = rings[shard.seq]
                placed[shard.seq] = max(cursor[m] for m in members)
                for m in members:
                    cursor[m] = placed[shard.seq] + 1
            index = placed[shard.seq]
            row = slots[rank]
            row.extend([None] * (index + 1 - len(row)))
            row[index] = shard
        end = max(cursor)
        for row in slots:
            row.extend([None] * (end - len(row)))
        barriers.append(end - 1)
    schedules = []
    for rank, row in enumerate(slots):
        microbatches = tuple(
            MicroBatch((), plan.capacity) if shard is None
            else MicroBatch((shard,), max(plan.capacity, shard.num_tokens)) for shard in row
        )
        schedules.append(RankSchedule(rank, microbatches))
    split = StepPlan(policy=plan.policy, num_ranks=plan.num_ranks, capacity=plan.capacity, sequences=plan.sequences,
                     ranks=tuple(schedules), est_step_time=plan.est_step_time, pp_size=plan.pp_size).validate()
    return split, tuple(barriers[:-1])
