"""A lower bound on the exact planner's optimum from its rings as rigid tasks, scheduled exactly.

The slot-free relaxation (`optimal_bound`) keeps each rank's own time and which rings block each other,
but not that a ring's members run it at the same time: on optimal_gap's seed 73 (six documents on rings
of 3 and 4 over 7 ranks) it stays 10% below the best plan even after 600 s of HiGHS. This bound keeps
exactly that and drops the rest:

- a document of more than C tokens runs on one of its ring sizes k (1: whole, offloaded): a task that holds
  k ranks at once for its slot time T(s, k) (overhead and jitter lead included, `optimal.ring_options`);
  in `optimal`'s plan space a ring slot starts when its last member is ready and ends for all members
  together, and a rank runs its slots one after the other, so every plan gives such a schedule in which
  a ring holds its ranks for at least T(s, k);
- the whole documents of at most C tokens are fluid work: their whole times less the overhead, plus one
  overhead per C tokens of them (a micro-batch holds at most C), spread over any idle rank time; each
  takes at least its own whole time on one rank, so that much more work exists, whatever slots hold it.

So the optimum is at least min over the ring sizes of max(the least makespan of the rings as rigid tasks
on D ranks, (the rings' rank-seconds + the fluid work) / D). Before a makespan is searched, cheaper floors
of it prune the sizes: the longest task, and the summed times of tasks that pairwise cannot run at once
(k + k' > D). The rigid makespan is exact: scheduling tasks that need k of D identical ranks is the
resource-constrained project scheduling problem with one renewable resource of D units (any k free ranks
will do, as a task runs without interruption), whose active schedules, the serial schedule-generation
scheme's outputs over every task order (each task at its earliest start where k ranks are free for its
time), hold an optimal one (Kolisch, EJOR 1996). The search enumerates the sizes (cheapest rank-seconds
first) and then the orders, pruned at the best value so far; `MAX_NODES` bounds it, and past that it
gives no bound (None) rather than a wrong one. Its best sizes, and ranks for the rings from its schedule
(each ring, in order of start, on the first ranks free), are where `optimal_stages` looks first for a
plan at the bound (seed 63: proven at once with them).
"""

from __future__ import annotations

import math
from typing import Sequence

from megatron_hdp.plan.policies.optimal_bound import SlotFree

MAX_NODES = 200_000
"""Most search nodes (size choices and task orders) before the bound gives up (None): a 12-document case
with every document on a ring could otherwise enumerate millions of orders (optimal_gap's hardest case
that finishes, seed 73, takes ~150,000, about 2 s)."""

Task = tuple[int, float, int]
"""(ranks held, seconds, document) of a ring's slot."""


class _OutOfNodes(Exception):
    pass


def rigid_ring_bound(lengths: Sequence[int], times: Sequence[dict[int, float]], *, capacity: int, overhead: float,
                     num_ranks: int, upper: float, max_nodes: int = MAX_NODES) -> SlotFree | None:
    """A lower bound (module doc) on the step of every plan that runs document s on a ring of one of the
    sizes of `times[s]` (ring size -> slot time; size 1: whole, its time including one `overhead`) on
    `num_ranks` ranks of capacity `capacity`: the least such step with its sizes and the rings' ranks when
    below `upper`, else `upper` alone (the search looks below it only); None when the search needs more
    than `max_nodes` nodes. The ranks of the whole documents of at most C tokens are None (not placed)."""
    short = [s for s, length in enumerate(lengths) if length <= capacity]
    fluid = sum(times[s][1] - overhead for s in short) + overhead * math.ceil(sum(lengths[s] for s in short) / capacity)
    rings = sorted((s for s in range(len(lengths)) if lengths[s] > capacity),
                   key=lambda s: -min(k * t for k, t in times[s].items()))  # the largest documents decided first
    options = [sorted(((k, t, s) for k, t in times[s].items()), key=lambda task: task[0] * task[1]) for s in rings]
    least_area = [opts[0][0] * opts[0][1] for opts in options]
    least_time = [min(t for _, t, _ in opts) for opts in options]
    rest_area = [sum(least_area[i:]) for i in range(len(options) + 1)]
    rest_time = [max(least_time[i:], default=0.0) for i in range(len(options) + 1)]
    best: tuple[float, list] = (upper, [])
    nodes = 0

    def count() -> None:
        nonlocal nodes
        nodes += 1
        if nodes > max_nodes:
            raise _OutOfNodes

    def choose(i: int, chosen: list[Task], area: float, longest: float) -> None:
        nonlocal best
        count()
        if max((area + rest_area[i] + fluid) / num_ranks, longest, rest_time[i]) >= best[0]:
            return
        if i < len(options):
            for task in options[i]:
                choose(i + 1, chosen + [task], area + task[0] * task[1], max(longest, task[1]))
            return
        floor = max((area + fluid) / num_ranks, longest, _serial(chosen, num_ranks=num_ranks))
        if floor < best[0]:
            makespan, schedule = _makespan(chosen, num_ranks=num_ranks, below=best[0], count=count)
            if schedule:
                best = (max(floor, makespan), schedule)

    try:
        choose(0, [], 0.0, 0.0)
    except _OutOfNodes:
        return None
    bound, schedule = best
    if not schedule:
        return SlotFree(bound)
    sizes, ranks = [1] * len(lengths), [None] * len(lengths)
    free_at = [0.0] * num_ranks
    for start, end, (size, _, doc) in sorted(schedule, key=lambda item: item[0]):
        held = [r for r in range(num_ranks) if free_at[r] <= start][:size]  # a free rank stays free till used
        for r in held:
            free_at[r] = end
        sizes[doc], ranks[doc] = size, tuple(held)
    return SlotFree(bound, tuple(sizes), tuple(ranks))


def _serial(tasks: list[Task], *, num_ranks: int) -> float:
    """Seconds of tasks that pairwise cannot overlap (two of k and k' ranks with k + k' > `num_ranks`): those
    of more than half the ranks, and the longest other task too wide to run beside the narrowest of them."""
    wide = [(size, seconds) for size, seconds, _ in tasks if 2 * size > num_ranks]
    if not wide:
        return 0.0
    narrowest = min(size for size, _ in wide)
    beside = [seconds for size, seconds, _ in tasks if 2 * size <= num_ranks and size + narrowest > num_ranks]
    return sum(seconds for _, seconds in wide) + max(beside, default=0.0)


def _makespan(tasks: list[Task], *, num_ranks: int, below: float, count) -> tuple[float, list]:
    """The least makespan of `tasks` on `num_ranks` ranks and its schedule ((start, end, task) each), or
    (`below`, []) when none is below it: every serial schedule-generation order (module doc), equal tasks
    (ranks and seconds) tried once per position, a partial order dropped where a task left could not end
    below the best (its earliest start now is at most its start in any completion) or the tasks left hold
    more rank-seconds than the ranks have free between the earliest of those starts and the best."""
    tasks = sorted(tasks, key=lambda task: -task[0] * task[1])
    best: tuple[float, list] = (below, [])

    def place(placed: list[tuple[float, float, Task]], left: list[Task], end: float) -> None:
        nonlocal best
        count()
        if not left:
            best = (end, placed)
            return
        starts = [_earliest(placed, size=size, seconds=seconds, num_ranks=num_ranks) for size, seconds, _ in left]
        if max(start + task[1] for start, task in zip(starts, left)) >= best[0]:
            return  # a task placed later only starts later (the ranks only fill up): none can end sooner
        first = min(starts)  # and the tasks left fit only in the rank time free from then on
        used = sum(task[0] * max(0.0, min(stop, best[0]) - max(start, first)) for start, stop, task in placed)
        if sum(size * seconds for size, seconds, _ in left) >= num_ranks * (best[0] - first) - used:
            return
        tried = set()
        for j, (task, start) in enumerate(zip(left, starts)):
            if task[:2] in tried:
                continue  # an equal task was tried in this position
            tried.add(task[:2])
            finish = start + task[1]
            if max(end, finish) < best[0]:
                place(placed + [(start, finish, task)], left[:j] + left[j + 1:], max(end, finish))

    place([], tasks, 0.0)
    return best


def _earliest(placed: list[tuple[float, float, Task]], *, size: int, seconds: float, num_ranks: int) -> float:
    """The earliest start from which `size` of `num_ranks` ranks are free for `seconds` beside the `placed`
    (start, end, task) slots: 0 or some slot's end (where ranks come free), the first that fits; the ranks
    in use over [t, t + seconds) peak at t or at a start inside it."""
    for t in sorted({0.0, *(end for _, end, _ in placed)}):
        points = [t, *(start for start, _, _ in placed if t < start < t + seconds)]
        if all(size + sum(task[0] for start, end, task in placed if start <= p < end) <= num_ranks for p in points):
            return t
    return math.inf  # unreachable: after the last end every rank is free
