"""How long one pipeline takes to run its micro-batches in 1F1B order: the planner's PP time model.

Each HDP rank with PP is a pipeline of `pp_size` stages holding num_layers / pp_size layers each, so a
micro-batch of stage time t costs t on every stage: a forward of FORWARD_SHARE x t, a backward of the
rest (backward does twice the forward's work). Stage s runs Megatron's 1F1B order: pp_size - 1 - s
warm-up forwards, then alternating forward/backward, then cool-down backwards. The forward of
micro-batch i on stage s waits for its forward on stage s - 1, the backward for its backward on stage
s + 1. The makespan is the longest path through these dependencies:

    uniform times t:   (m + pp_size - 1) x t             (the textbook fill + drain bubble)
    heterogeneous:     computed exactly (`pipeline_time`), e.g. one heavy micro-batch H among light ones
                       costs about pp_size x H on its own, so the bubble is set by the heaviest
                       micro-batches, not by the mean.

The simulator (`megatron_hdp.sim.simulator`) runs the same order with the same shares and adds what a
single pipeline cannot see (ring members of several pipelines waiting for each other); for a pipeline
without rings both give the same time (tests/test_plan_pipeline.py).
"""

from __future__ import annotations

from typing import Sequence

from megatron_hdp.plan.interleaved import stage_order

FORWARD_SHARE = 1.0 / 3.0
"""Fraction of a micro-batch's time spent in the forward pass (backward = 2x forward)."""


def one_f_one_b_order(num_microbatches: int, pp_size: int, stage: int) -> list[tuple[str, int]]:
    """The 1F1B op order of one stage (warm-up forwards, alternating F/B, cool-down backwards): Megatron's
    order with one model chunk, `interleaved.stage_order` with vpp_size = 1, as (kind, micro-batch)."""
    return [(kind, mb) for kind, _, mb in stage_order(num_microbatches, pp_size=pp_size, stage=stage)]


def pipeline_time(times: Sequence[float], *, pp_size: int) -> float:
    """Makespan of one pipeline running micro-batches of these stage `times` in 1F1B (module doc).

    With pp_size = 1 it is the sum of the times. Cost: O(len(times) x pp_size).
    """
    num = len(times)
    if pp_size == 1 or num == 0:
        return float(sum(times))
    orders = [one_f_one_b_order(num, pp_size, stage) for stage in range(pp_size)]
    forward = [t * FORWARD_SHARE for t in times]
    backward = [t - f for t, f in zip(times, forward)]
    f_end = [[-1.0] * num for _ in range(pp_size)]
    b_end = [[-1.0] * num for _ in range(pp_size)]
    clock = [0.0] * pp_size
    position = [0] * pp_size
    remaining = 2 * num * pp_size
    while remaining:
        progressed = False
        for stage in range(pp_size):
            order = orders[stage]
            while position[stage] < len(order):
                kind, i = order[position[stage]]
                if kind == "F":
                    ready = f_end[stage - 1][i] if stage > 0 else 0.0
                else:
                    ready = b_end[stage + 1][i] if stage < pp_size - 1 else 0.0
                if ready < 0:
                    break
                start = max(clock[stage], ready)
                clock[stage] = start + (forward[i] if kind == "F" else backward[i])
                (f_end if kind == "F" else b_end)[stage][i] = clock[stage]
                position[stage] += 1
                remaining -= 1
                progressed = True
        assert progressed, "1F1B dependencies form a cycle"
    return max(clock)
