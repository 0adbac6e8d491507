"""How long one pipeline takes to run its micro-batches in Megatron's order: the planner's PP time model.

Each HDP rank with PP is a pipeline of `pp_size` stages holding num_layers / pp_size layers each, so a
micro-batch of stage time t costs t on every stage: a forward of FORWARD_SHARE x t, a backward of the
rest (backward does twice the forward's work). With `vpp_size` v > 1 virtual stages a stage holds v model
chunks of num_layers / (pp_size x v) layers, each op (forward or backward of one chunk) taking 1/v of
that. Stage s runs Megatron's order (`interleaved.stage_order`): warm-up forwards (pp_size - 1 - s for
1F1B, 2 (pp_size - 1 - s) + (v - 1) G interleaved), then alternating forward/backward, then cool-down
backwards. A forward waits for the previous virtual stage's forward of its micro-batch, a backward for
the next one's backward (`interleaved.dependency`). The makespan is the longest path through these
dependencies:

    uniform times t:   (m + pp_size - 1) x t             1F1B (the textbook fill + drain bubble)
                       (m + (pp_size - 1) / v) x t       interleaved, m a multiple of pp_size
    heterogeneous:     computed exactly (`pipeline_time`), e.g. one heavy micro-batch H among light ones
                       costs about pp_size x H on its own in 1F1B (its forward and backward cross every
                       stage while the others wait), so the bubble is set by the heaviest micro-batches;
                       the interleaved order lets the others' chunks run while it crosses.

The simulator (`megatron_hdp.sim.simulator`) runs the same order with the same shares and adds what a
single pipeline cannot see (ring members of several pipelines waiting for each other); for a pipeline
without rings both give the same time (tests/test_plan_pipeline.py).
"""

from __future__ import annotations

import functools
from typing import Sequence

from megatron_hdp.plan.interleaved import dependency, megatron_constraint_error, stage_order

FORWARD_SHARE = 1.0 / 3.0
"""Fraction of a micro-batch's time spent in the forward pass (backward = 2x forward)."""


@functools.lru_cache(maxsize=1024)
def _program(num: int, pp_size: int, vpp_size: int, group_size: int | None) -> tuple[tuple[int, int, int, int], ...]:
    """Every op of the pipeline in an order that respects all dependencies, each as (stage, micro-batch,
    is_forward, index of the op it waits for in this tuple or -1): a topological order, so the makespan
    is one pass. Its own cycle check: Megatron's order never waits on later work of the same pipeline."""
    orders = [stage_order(num, pp_size=pp_size, stage=s, vpp_size=vpp_size, group_size=group_size)
              for s in range(pp_size)]
    done: dict[tuple[int, tuple[str, int, int]], int] = {}
    out: list[tuple[int, int, int, int]] = []
    position = [0] * pp_size
    while len(out) < 2 * num * vpp_size * pp_size:
        progressed = False
        for stage in range(pp_size):
            while position[stage] < len(orders[stage]):
                op = orders[stage][position[stage]]
                dep = dependency(op, stage=stage, pp_size=pp_size, vpp_size=vpp_size)
                if dep is not None and dep not in done:
                    break
                done[(stage, op)] = len(out)
                out.append((stage, op[2], op[0] == "F", -1 if dep is None else done[dep]))
                position[stage] += 1
                progressed = True
        assert progressed, "the pipeline order waits on its own later work"
    return tuple(out)


def pipeline_time(times: Sequence[float], *, pp_size: int, vpp_size: int = 1, group_size: int | None = None) -> float:
    """Makespan of one pipeline running micro-batches of these stage `times` in Megatron's order with
    `vpp_size` model chunks per stage and `group_size` G (microbatch_group_size_per_vp_stage; None: pp_size)
    micro-batches per group (module doc).

    With pp_size = 1 it is the sum of the times. With vpp_size > 1 the count must be one Megatron runs
    (`interleaved.megatron_constraint_error`; pad first, `interleaved.padded_counts`). Cost: one pass
    over the 2 x len(times) x pp_size x vpp_size ops.
    """
    num = len(times)
    if pp_size == 1 or num == 0:
        return float(sum(times))
    error = megatron_constraint_error(num, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)
    if error:
        raise ValueError(error)
    forward = [t * FORWARD_SHARE / vpp_size for t in times]
    backward = [t / vpp_size - f for t, f in zip(times, forward)]
    clock = [0.0] * pp_size
    end = []
    for stage, mb, is_forward, dep in _program(num, pp_size, vpp_size, group_size if vpp_size > 1 else None):
        start = clock[stage] if dep < 0 else max(clock[stage], end[dep])
        clock[stage] = start + (forward[mb] if is_forward else backward[mb])
        end.append(clock[stage])
    return max(clock)
