"""Step time of a cluster where every rank has a core of its own, from each rank's measured busy time.

A CPU run of N gloo ranks on fewer cores cannot show that step time directly: a rank that finishes its
micro-batches early gives its core to the others, so wall time measures the total work, not the slowest
rank. What each rank *did* is measurable though — the CPU seconds of each phase (a rank blocked in a gloo
wait uses none) — and the runtime's waits follow from the plan: ring members run a ring micro-batch
together, layer by layer, so it ends for all of them when the slowest is done (the layers are identical,
so waiting per layer adds up to waiting once per forward and once per backward); the gradient all-reduce
starts when the last rank arrives. `dedicated_step_time` replays the measured phases through exactly
those waits — the one timing model of `megatron_hdp.plan.timeline.timing`, which the planner and the simulator use — so
it is the step time the same ranks would reach on dedicated cores, and the measurement a prediction of
`simulate_step(..., rules=PolicyRules())` is held against. With expert parallelism the members of an EP
group also run each micro-batch index together (their MoE all-to-all): a member's measured CPU seconds
hold its own tokens' work and the expert work routed to it from the group. Pipeline parallelism is not
replayed.
"""

from __future__ import annotations

from typing import Collection, Sequence

from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.timeline.timing import coupled_finish, plan_groups


def dedicated_step_time(
    plan: StepPlan,
    *,
    before: Sequence[float],
    forward: Sequence[Sequence[float]],
    backward: Sequence[Sequence[float]],
    after: Sequence[float],
    barriers_after: Collection[int] = (),
    ep_size: int = 1,
) -> float:
    """Seconds of one step of `plan` (pp_size 1) if each rank ran its measured phases on its own core.

    Per HDP rank r: `before[r]` (plan check, collation), `forward[r][i]` and `backward[r][i]` of each
    micro-batch it ran (padding included, so at least one), `after[r]` (gradient reduction, optimizer).
    Micro-batch i of ranks coupled by a ring at index i starts when all of them are ready and ends when
    the slowest is done, forward and backward each; the reduction starts when every rank is done.
    `barriers_after`: micro-batch indices after which every rank waits for all (Megatron's hybrid-CP
    group barrier, for a plan run one sub-sample per micro-batch). `ep_size`: HDP ranks per expert-parallel
    group, which run every micro-batch index together (the MoE all-to-all of each layer), padding included.
    """
    n = plan.num_ranks
    if plan.pp_size != 1:
        raise ValueError(f"dedicated_step_time replays pp_size=1 plans only, got pp_size={plan.pp_size}")
    for name, values in (("before", before), ("forward", forward), ("backward", backward), ("after", after)):
        if len(values) != n:
            raise ValueError(f"{name} has {len(values)} entries for a plan of {n} ranks")
    for r in range(n):
        if len(forward[r]) != len(backward[r]) or len(forward[r]) < len(plan.ranks[r].microbatches):
            raise ValueError(
                f"rank {r}: {len(forward[r])} forward and {len(backward[r])} backward times for "
                f"{len(plan.ranks[r].microbatches)} planned micro-batches"
            )
    clock = coupled_finish([forward, backward], plan_groups(plan, ep_size=ep_size), start=before,
                           barriers_after=barriers_after)
    return float(clock.max()) + max(after)
