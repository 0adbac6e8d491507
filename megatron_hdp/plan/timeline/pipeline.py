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

`pipelines_finish` evaluates many pipelines at once, vectorised over pipelines, with ring members of
several pipelines waiting for each other op by op (`timing.pipeline_step_finish`, the planner's step
time). The simulator (`megatron_hdp.sim.simulator`) runs the same order with the same shares in an event
loop of its own; both give the same times (tests/plan/test_plan_pipeline.py without rings,
tests/plan/test_plan_sim_agreement.py with them).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import FORWARD_SHARE

from megatron_hdp.plan.timeline.interleaved import (default_group_size, dependency, linked_sets, megatron_constraint_error,
                                           stage_order)

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
    over the 2 x len(times) x pp_size x vpp_size ops in plain Python: the packer's inner loop times one
    pipeline thousands of times, where numpy's per-call cost would dominate; `pipelines_finish` is the
    same recurrence over many pipelines at once (tests/plan/test_plan_pipeline.py holds them equal).
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


def pipelines_finish(
    times: Sequence[Sequence[float]],
    *,
    pp_size: int,
    vpp_size: int = 1,
    group_size: int | None = None,
    groups: Mapping[tuple[int, int], int] | None = None,
    lead: Callable[[int], float] | None = None,
) -> np.ndarray:
    """When each pipeline's last op ends: pipeline r runs micro-batches of stage times `times[r]` in
    Megatron's order (module doc), and the ops of micro-batch i of the pipelines sharing a group id at
    `groups[(r, i)]` (`timing.link_groups`: rings, expert-parallel groups) are coupled on every (stage,
    chunk, forward/backward): the op starts when every member's stage is ready for it (its own previous
    op and its pipeline dependency released) and ends for all members when the slowest is done, plus
    `lead(k)` x the members' summed op time for a group of k (`timing.jitter_lead`; None: no lead).

    Exact: the same start/end recurrence as the op-level simulator, evaluated without an event queue.
    In each set of coupled pipelines the counts keep the ring rule (`interleaved.padded_counts`), so
    every pipeline's op order is a restriction of the order of one with the set's largest count M
    (`interleaved` module doc, prefix order); one topological order of M's ops (`_program`) is then a
    valid order for all of them, and the ops of one key (stage, micro-batch, direction) of all pipelines
    sharing that order are evaluated together as numpy arrays. With 1F1B every count is a prefix of the
    largest; interleaved, sets whose largest count is a multiple of G share the order of the global
    largest count and every other largest count gets its own. Cost: one numpy step over pipelines per op
    of each distinct order (2 x M x pp_size x vpp_size ops), not one Python step per op of every pipeline.

    With pp_size = 1 (no pipeline, no coupling allowed here: `timing.coupled_finish`) each pipeline's
    time is the sum of its times. Raises ValueError for a count Megatron does not run or counts that break
    the ring rule.
    """
    num = len(times)
    if pp_size == 1:
        if groups:
            raise ValueError("coupled micro-batches without pipeline stages are timed by timing.coupled_finish")
        return np.array([float(sum(t)) for t in times])
    counts = [len(t) for t in times]
    for count in set(counts) - {0}:
        error = megatron_constraint_error(count, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)
        if error:
            raise ValueError(error)
    g = default_group_size(pp_size, group_size)
    members: dict[int, list[int]] = {}
    for (rank, _), gid in (groups or {}).items():
        members.setdefault(gid, []).append(rank)
    most = max(counts, default=0)
    classes: dict[int, list[int]] = {}
    for linked in linked_sets(num, [(0, ranks) for ranks in members.values()]):
        largest = max(counts[r] for r in linked)
        shared = vpp_size == 1 or largest == most or largest % g == 0
        if any(counts[r] != largest and (vpp_size > 1 and counts[r] % g) for r in linked):
            raise ValueError(f"counts {[counts[r] for r in linked]} of coupled pipelines {linked} break the ring "
                             f"rule (group size {g}): pad them with interleaved.padded_counts")
        classes.setdefault(most if shared else largest, []).extend(linked)
    out = np.zeros(num)
    for count, ranks in classes.items():
        if count:
            out[ranks] = _finish_in_order(count, [times[r] for r in ranks], ranks, groups or {}, lead,
                                          pp_size=pp_size, vpp_size=vpp_size,
                                          group_size=group_size if vpp_size > 1 else None)
    return out


def _finish_in_order(count: int, times: list[Sequence[float]], ranks: list[int], groups: Mapping[tuple[int, int], int],
                     lead: Callable[[int], float] | None, *, pp_size: int, vpp_size: int,
                     group_size: int | None) -> np.ndarray:
    """`pipelines_finish` of the pipelines `ranks` (their `times`), all running restrictions of the op
    order of `count` micro-batches."""
    width = len(ranks)
    stage_times = np.zeros((count, width))
    present = np.zeros((count, width), dtype=bool)
    for column, rank_times in enumerate(times):
        stage_times[: len(rank_times), column] = rank_times
        present[: len(rank_times), column] = True
    everywhere = present.all(axis=1).tolist()
    forward = stage_times * FORWARD_SHARE / vpp_size
    backward = stage_times / vpp_size - forward
    # coupled pipelines per micro-batch index: members sorted by group, for numpy's reduceat
    local = {rank: column for column, rank in enumerate(ranks)}
    by_index: dict[int, dict[int, list[int]]] = {}
    for (rank, index), gid in groups.items():
        if rank in local:
            by_index.setdefault(index, {}).setdefault(gid, []).append(local[rank])
    coupled = {}
    for index, by_gid in by_index.items():
        sizes = np.array([len(m) for m in by_gid.values()])
        factor = np.array([lead(int(k)) for k in sizes]) if lead else None
        coupled[index] = (np.concatenate([np.array(m) for m in by_gid.values()]),
                          np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes, factor)
    program = _program(count, pp_size, vpp_size, group_size)
    clock = np.zeros((pp_size, width))
    end = np.empty((len(program), width))
    for position, (stage, mb, is_forward, dep) in enumerate(program):
        duration = forward[mb] if is_forward else backward[mb]
        start = clock[stage] if dep < 0 else np.maximum(clock[stage], end[dep])
        finish = start + duration
        if mb in coupled:
            order, offsets, sizes, factor = coupled[mb]
            spent = duration[order]
            top = np.maximum.reduceat(start[order], offsets) + np.maximum.reduceat(spent, offsets)
            if factor is not None:
                top += factor * np.add.reduceat(spent, offsets)
            finish[order] = np.repeat(top, sizes)
        clock[stage] = finish if everywhere[mb] else np.where(present[mb], finish, clock[stage])
        end[position] = clock[stage]
    return clock.max(axis=0)
