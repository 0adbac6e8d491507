"""A mixed-integer linear program under construction, solved by SciPy's HiGHS interface: the one model
class the exact planner's formulations (`optimal`, `optimal_bound`) build their columns and rows in."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator

import numpy as np


class Milp:
    """Columns (variables, each in [0, upper], integer or not) and sparse rows (lower <= terms <= upper)
    of a minimisation; `cost` holds the objective's coefficients."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.cost: list[float] = []
        self.rows: list[tuple[dict[int, float], float, float]] = []

    def add(self, *, integer: bool, upper: float = 1.0) -> int:
        """A new column in [0, `upper`]; returns its index."""
        self.lower.append(0.0)
        self.upper.append(upper)
        self.integer.append(int(integer))
        self.cost.append(0.0)
        return len(self.cost) - 1

    def row(self, terms: dict[int, float], lower: float = -np.inf, upper: float = np.inf) -> None:
        """The row lower <= sum(coefficient x column) <= upper, `terms` mapping column to coefficient."""
        self.rows.append((terms, lower, upper))

    def solve(self, *, time_limit: float):
        """SciPy's `milp` result (HiGHS) for the model as built, within `time_limit` seconds."""
        from scipy.optimize import Bounds, LinearConstraint, milp  # only the exact planner pays for the import
        from scipy.sparse import coo_array

        entries = [(i, col, val) for i, (terms, _, _) in enumerate(self.rows) for col, val in terms.items()]
        rows, cols, vals = zip(*entries)
        matrix = coo_array((vals, (rows, cols)), shape=(len(self.rows), len(self.cost))).tocsr()
        constraint = LinearConstraint(matrix, [r[1] for r in self.rows], [r[2] for r in self.rows])
        return milp(np.array(self.cost), constraints=constraint, integrality=np.array(self.integer),
                    bounds=Bounds(self.lower, self.upper),
                    options={"time_limit": time_limit, "mip_rel_gap": 1e-7, "disp": False})


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """The process's stdout (file descriptor 1) sent to the null device for the block: the HiGHS that SciPy
    bundles writes "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();" there from C,
    at random and with its output off (ERGO-Code/HiGHS#2783), which landed in optimal_gap's table. Python's
    own buffered output is flushed first, so nothing of the caller's is lost. The descriptor is the whole
    process's, so the callers that print a table around a solve use it (`plan --compare ... optimal`,
    benchmarks/optimal_gap.py), not `Milp.solve`: in a training run another thread's log must not vanish
    for a solve's seconds."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
