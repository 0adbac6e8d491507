"""A lower bound on the exact planner's optimum from a smaller MILP: which ranks hold what, without slots.

The exact planner's MILP (`optimal`) times slots with big-M rows, so its LP relaxation lets rings spread
fractionally over ranks and sits at the work bound; on the issue's 10-document, 4-rank cases HiGHS
branched on slots for minutes without lifting it. This relaxation drops the slots and keeps what blocks
rings from each other in any order:

- each rank's own time: its ring slots (each the ring's time T(s, k), overhead included) plus its whole
  documents plus one overhead per micro-batch they need (at least tokens / C, rounded up, and at least
  one micro-batch per rank), and the step is at least every rank's;
- rings that cannot run side by side run one after the other: two rings of k and k' ranks with
  k + k' > D share a rank, so for a ring of k <= D / 2 ranks the rings wider than D - k and it are
  pairwise serial (their times add up), and at most p rings wider than D / (p + 1) run at once;
- chains of rings that pairwise share a rank, whichever ranks the plan gives them (`optimal_cuts`): per
  rank r, the rings through it of at least m ranks and the others wider than D - m.

Every plan of `optimal`'s space meets these rows with its own step time, so the relaxation's optimum (or
the solver's dual bound when time runs out) is at most the plan space's optimum: `optimal` adds it as a
row on the step, and a plan that reaches it is proven optimal at once. Symmetries: ranks are ordered by
their own time, documents of one length by ring size. Times in the caller's unit: milliseconds there (in
seconds, HiGHS's tolerances let it call a plan 0.64 ms above its optimum optimal).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from megatron_hdp.plan.policies.milp import Milp
from megatron_hdp.plan.policies.optimal_cuts import chain_rows


@dataclasses.dataclass(frozen=True)
class SlotFree:
    """The relaxation's answer: `bound` on the step, and where its optimum (or, out of time, the best
    assignment found) puts each document (`sizes[s]` ranks, `ranks[s]` which; None when the solver found
    none, `ranks[s]` None where the relaxation places no ranks): a hint where plans at the bound lie."""

    bound: float
    sizes: tuple[int, ...] | None = None
    ranks: tuple[tuple[int, ...] | None, ...] | None = None


def assignment_bound(lengths: Sequence[int], times: Sequence[dict[int, float]], *, num_ranks: int,
                     capacity: int, overhead: float, big: float, time_limit: float) -> SlotFree:
    """A lower bound on the step time of every plan that runs document s on a ring of one of the sizes
    of `times[s]` (ring size -> slot time; size 1: whole, its time including one `overhead`), every time
    below `big` (module doc), with the relaxation's optimum. The bound is 0 when the solver finds none in
    `time_limit` seconds."""
    n = len(lengths)
    m = Milp()
    w = [{k: m.add(integer=True) for k in times[s]} for s in range(n)]
    x = {(s, r): m.add(integer=True) for s in range(n) if 1 in w[s] for r in range(num_ranks)}
    y = {(s, k, r): m.add(integer=True) for s in range(n) for k in w[s] if k > 1 for r in range(num_ranks)}
    batches = {r: m.add(integer=True, upper=float(n)) for r in range(num_ranks)}
    own = {r: m.add(integer=False, upper=big) for r in range(num_ranks)}
    z = m.add(integer=False, upper=big)
    m.cost[z] = 1.0
    for s in range(n):
        m.row({w[s][k]: 1.0 for k in w[s]}, 1.0, 1.0)
        if 1 in w[s]:
            m.row({**{x[s, r]: 1.0 for r in range(num_ranks)}, w[s][1]: -1.0}, 0.0, 0.0)
        for k in (k for k in w[s] if k > 1):
            m.row({**{y[s, k, r]: 1.0 for r in range(num_ranks)}, w[s][k]: -float(k)}, 0.0, 0.0)
            for r in range(num_ranks):
                m.row({y[s, k, r]: 1.0, w[s][k]: -1.0}, upper=0.0)
    for r in range(num_ranks):
        whole = {x[s, r]: float(min(lengths[s], capacity)) for s in range(n) if (s, r) in x}
        m.row({batches[r]: float(capacity), **{c: -t for c, t in whole.items()}}, lower=0.0)
        rings = {y[s, k, r]: 1.0 for s in range(n) for k in w[s] if k > 1}
        m.row({batches[r]: 1.0, **rings}, lower=1.0)
        busy = {own[r]: 1.0, batches[r]: -overhead}
        busy.update({x[s, r]: -(times[s][1] - overhead) for s in range(n) if (s, r) in x})
        busy.update({y[s, k, r]: -times[s][k] for s in range(n) for k in w[s] if k > 1})
        m.row(busy, 0.0, 0.0)
        m.row({z: 1.0, own[r]: -1.0}, lower=0.0)
        if r:  # ranks are interchangeable: order them by their own time
            m.row({own[r - 1]: 1.0, own[r]: -1.0}, lower=0.0)
    for most in range(1, num_ranks):  # at most `most` rings wider than num_ranks / (most + 1) at once
        wide = {w[s][k]: -times[s][k] for s in range(n) for k in w[s] if k > 1 and k * (most + 1) > num_ranks}
        if wide:
            m.row({z: float(most), **wide}, lower=0.0)
    for s in range(n):  # a ring of k <= D / 2 and the rings wider than D - k: pairwise serial
        for k in (k for k in w[s] if 1 < k and 2 * k <= num_ranks):
            wider = {w[t][j]: -times[t][j] for t in range(n) if t != s for j in w[t] if j > num_ranks - k}
            if wider:
                m.row({z: 1.0, w[s][k]: -times[s][k], **wider}, lower=0.0)
    for chain in chain_rows(times, w=w, y=y, num_ranks=num_ranks):  # rings that pairwise share a rank
        m.row({z: 1.0, **{col: -t for col, t in chain.items()}}, lower=0.0)
    order = sorted(range(n), key=lambda s: (-lengths[s], s))
    for earlier, later in zip(order, order[1:]):  # documents of one length: the earlier on the narrower ring
        if lengths[earlier] == lengths[later]:
            m.row({**{w[earlier][k]: float(k) for k in w[earlier]}, **{w[later][k]: -float(k) for k in w[later]}},
                  upper=0.0)
    result = m.solve(time_limit=time_limit)
    bound = getattr(result, "mip_dual_bound", None)
    if result.status == 0:
        bound = float(result.fun) if bound is None else min(float(result.fun), float(bound))
    bound = 0.0 if bound is None or not bound > 0 else float(bound)
    if result.x is None:
        return SlotFree(bound)
    on = lambda col: result.x[col] > 0.5  # noqa: E731  (out of time: the best found, still a hint)
    sizes = tuple(next(k for k in w[s] if on(w[s][k])) for s in range(n))
    ranks = tuple(tuple(r for r in range(num_ranks) if on(x[s, r] if sizes[s] == 1 else y[s, sizes[s], r]))
                  for s in range(n))
    return SlotFree(bound, sizes, ranks)
