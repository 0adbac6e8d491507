"""The exact planner's solve in stages, so that a plan at the slot-free bound is found fast.

Where the slot-free bound (`optimal_bound`) meets the optimum, the slotted MILP (`optimal`) is proven as
soon as HiGHS holds a plan at that bound, but finding one took it anywhere from 4 s to over 40 s of CPU
on the same model (the issue's 10-document case under the H100 mesh model; optimal_gap's seed 54 had no
plan at all after 40 s): the slots, aligned across each ring's members, leave its primal heuristics
little to hold on to. The slot-free optimum names a ring size for every document and the ranks that
hold it, so the slotted MILP is solved first with those fixed, then with the sizes fixed, then free:

1. sizes and ranks fixed, without the symmetry rows (they could exclude every plan of this assignment):
   what is left is the order of the slots and the empty ones, solved in about a second;
2. sizes fixed (every symmetry row kept; the slot-free MILP orders equal documents by size the same way);
3. nothing fixed: the module doc's MILP.

Each has the step's row at the slot-free bound. A stage's plan is a plan of the whole space, so one at
the bound is optimal (the bound is below every plan of step at most the big M) and ends the solve; a
plan above it is an upper bound on the optimum and becomes the big M of the next stages. A fixed stage
that is infeasible or out of its share of the time proves nothing and hands on. Only the last stage's
infeasibility means the big M was below the optimum.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from megatron_hdp.plan.policies.milp import Milp
from megatron_hdp.plan.policies.optimal_bound import SlotFree

STAGE_SHARES = (0.1, 0.3)
"""Shares of the time left that stages 1 and 2 may take (stage 3 takes the rest)."""
AT_BOUND = 1e-7
"""Relative distance from the slot-free bound within which a stage's plan counts as at it (HiGHS's
relative MIP gap in `Milp.solve`)."""

Build = Callable[..., tuple[Milp, dict]]
"""`optimal`'s formulation for a big M (keyword `big`), with or without its symmetry rows (keyword
`symmetric`): the model and its columns (w, x, a, q, z)."""


@dataclasses.dataclass(frozen=True)
class Staged:
    """What the stages found: SciPy's `result` (a plan in `result.x` when not None) and the `columns` it
    reads, whether that plan is `proven` optimal, `dual`, the least step any plan may have, and the last
    stage's `message` (why it stopped: a fixed stage's "optimal" is no proof)."""

    result: Any
    columns: dict
    proven: bool
    dual: float
    message: str


def solve_in_stages(build: Build, slot_free: SlotFree, *, big: float, slack: float, num_ranks: int,
                    time_limit: float, margin: float) -> Staged:
    """The stages of the module doc within `time_limit` seconds: the last stage's result when it is proven
    or none found a plan (infeasible: the big M is below the optimum), else the best plan found, unproven.
    `big`: the big M to start from; `slack`: how far below the bound the step's row sits; `margin`: the
    relative room above a stage's plan for the next big M (`optimal.UPPER_MARGIN`)."""
    deadline = time.perf_counter() + time_limit
    stages: list[tuple[tuple[int, ...] | None, tuple[tuple[int, ...], ...] | None, float]] = [(None, None, 1.0)]
    if slot_free.sizes is not None:
        stages = [(slot_free.sizes, slot_free.ranks, STAGE_SHARES[0]), (slot_free.sizes, None, STAGE_SHARES[1]),
                  *stages]
    best = None
    for sizes, ranks, share in stages:
        m, cols = build(big=big, symmetric=ranks is None)
        m.row({cols["z"]: 1.0}, lower=slot_free.bound - slack)
        if sizes is not None:
            _fix(m, cols, sizes=sizes, ranks=ranks, num_ranks=num_ranks)
        result = m.solve(time_limit=share * max(0.0, deadline - time.perf_counter()))
        if result.x is None:
            continue
        if float(result.fun) <= slot_free.bound * (1 + AT_BOUND):
            return Staged(result, cols, True, slot_free.bound, result.message)
        if best is None or float(result.fun) < float(best[0].fun):
            best = (result, cols)
            big = min(big, float(result.fun) * (1 + margin))
    dual = max(slot_free.bound, getattr(result, "mip_dual_bound", None) or 0.0)  # the last stage fixes nothing
    if result.status == 0 or best is None:
        return Staged(result, cols, result.status == 0, dual, result.message)
    return Staged(*best, False, dual, result.message)


def _fix(m: Milp, cols: dict, *, sizes: tuple[int, ...], ranks: tuple[tuple[int, ...] | None, ...] | None,
         num_ranks: int) -> None:
    """Rows that hold document s on a ring of `sizes[s]` ranks (1: whole), over the ranks `ranks[s]` when given
    (the rigid bound's hint places the rings only: a whole document's ranks are None)."""
    w, x, a = cols["w"], cols["x"], cols["a"]
    for s, k in enumerate(sizes):
        m.lower[w[s][k]] = 1.0
        if ranks is None or ranks[s] is None:
            continue
        held = x if k == 1 else a
        for r in range(num_ranks):
            on = float(r in ranks[s])
            m.row({col: 1.0 for (d, rank, _), col in held.items() if d == s and rank == r}, on, on)
