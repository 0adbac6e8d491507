"""Where a pipeline's rings go in Megatron's order, and with which group size: steps of `balance`'s step 6.

With PP a heavy ring micro-batch run first leaves the other stages waiting through it, so `balance`
tries each placement with its rings moved 0-3 indices later (`shifted`, all members alike so rings stay
aligned) and, with virtual stages, with Megatron's micro-batch group size raised to cover every
pipeline's ring micro-batches (`group_sizes`), where the resident activations still fit the capacity
(`fits_memory`); the plan of least predicted step time is kept.
"""

from __future__ import annotations

from megatron_hdp.plan.timeline.assemble import TimedPlan
from megatron_hdp.plan.timeline.interleaved import pipelines_fit
from megatron_hdp.plan.timeline.timing import runtime_microbatch_counts


def group_sizes(pp_size: int, vpp_size: int, ring_span: int) -> list[int | None]:
    """The microbatch group sizes G a plan is tried with: Megatron's default (None: G = pp), and with
    virtual stages G = `ring_span` (the indices up to a pipeline's last ring micro-batch) when that is
    more than pp: then all its heavy ring micro-batches share the first group, and each one's chunks
    interleave with the others' instead of crossing the stages alone beside light ones (a heavy
    micro-batch alone in its group costs nearly its 1F1B crossing, pp x its time)."""
    if vpp_size == 1 or ring_span <= pp_size:
        return [None]
    return [None, ring_span]


def fits_memory(plan: TimedPlan) -> bool:
    """Whether every pipeline of `plan`, run with its group size, keeps no more activations than the
    capacity was sized for (`interleaved.pipelines_fit`; a micro-batch's resident tokens are those it
    holds up to C, offloading keeping the rest on the host; padding micro-batches hold none)."""
    counts = runtime_microbatch_counts([len(held) for held in plan.held], pp_size=plan.pp_size,
                                       vpp_size=plan.vpp_size, group_size=plan.group_size,
                                       rings={ring for ring in plan.rings if len(ring) > 1})
    tokens = [[min(num, plan.capacity) for num in held] + [0] * (count - len(held))
              for held, count in zip(plan.held, counts)]
    return pipelines_fit(tokens, capacity=plan.capacity, pp_size=plan.pp_size, vpp_size=plan.vpp_size,
                         group_size=plan.group_size)


RING_SHIFTS = (0, 1, 2, 3)
"""With PP, the micro-batch indices the rings are moved down by (`shifted`); the plan of least predicted
step time is kept."""


def shifted(lead: list[list[int]], bins: list[list[int]], shift: int, *, weight) -> list[list[int]]:
    """A pipeline's micro-batches with its rings `shift` indices later (PP-Balance: heavy micro-batches
    where the pipeline hides them). A heavy ring micro-batch crosses every stage one after the other;
    run first, the other stages wait through it with only the warm-up's forwards to do, and in the
    interleaved schedule a heavy micro-batch alone in its group of G has no other chunks to interleave
    with, while light micro-batches before it fill those waits. Every ring member moves its rings
    (`lead`, aligned on one index across members) by the same `shift`, so they stay aligned: the
    lightest `shift` of its whole-sequence `bins` go first, empty micro-batches where it has fewer (each
    costs the micro-batch overhead; with virtual stages they often replace padding that runs anyway). A
    pipeline without rings keeps its packing's order."""
    if not lead or not shift:
        return lead + bins
    by_weight = sorted(range(len(bins)), key=lambda i: weight(bins[i]))
    first = set(by_weight[:shift])
    before = [bins[i] for i in by_weight[:shift]] + [[] for _ in range(shift - len(first))]
    return before + lead + [b for i, b in enumerate(bins) if i not in first]
