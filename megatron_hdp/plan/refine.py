"""Refinement of the balance scheduler's assignment of whole sequences to ranks.

The greedy (LPT) leaves the slowest rank up to one sequence above the rest. Two improvers, both
deterministic so that every rank computes the same plan:

- `refine_local`: local search on the makespan. Repeatedly take the slowest rank and try to move one
  of its sequences to a light rank, or swap one of its sequences with a lighter one there, choosing the
  transfer closest to half the load difference; stop when the slowest rank cannot be improved.
- `refine_exact`: an exact MILP (SciPy's HiGHS) for small instances: minimise T subject to
  load_r + sum_j w_j x_jr <= T and sum_r x_jr = 1 with binary x. Bounded by a node limit, never a time
  limit (a time limit would make the plan depend on machine load and differ between ranks). The
  solver's answer is checked and used only if it is a valid assignment that is really better.
"""

from __future__ import annotations

import bisect
import logging
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)


def refine_local(
    given: list[list[int]], *, weights: Sequence[float], base: np.ndarray, max_steps: int = 20000, candidates: int = 8
) -> list[list[int]]:
    """A better assignment than `given` (items per rank); `base` is each rank's load before its items.

    Each step takes the slowest rank and tries the `candidates` lightest ranks as partners.
    """
    num_ranks = len(given)
    loads = base.astype(np.float64).copy()
    for rank, rank_items in enumerate(given):
        loads[rank] += float(np.sum(np.asarray(weights)[rank_items])) if rank_items else 0.0
    sorted_items: dict[int, list[tuple[float, int]]] = {}  # built for the ranks the search touches

    def items(rank: int) -> list[tuple[float, int]]:
        if rank not in sorted_items:
            sorted_items[rank] = sorted((float(weights[i]), i) for i in given[rank])
        return sorted_items[rank]

    eps = 1e-12 * max(1.0, float(loads.max(initial=0.0)))
    for _ in range(max_steps):
        hi = int(np.argmax(loads))
        partners = np.argpartition(loads, min(candidates, num_ranks - 1))[: candidates + 1]
        partners = sorted((float(loads[r]), int(r)) for r in partners if r != hi)
        for _, lo in partners:
            if _improve(items(hi), items(lo), loads, hi, lo, eps):
                break
        else:
            break
    return [[i for _, i in sorted_items[r]] if r in sorted_items else list(given[r]) for r in range(num_ranks)]


def _improve(
    source: list[tuple[float, int]], target: list[tuple[float, int]], loads: np.ndarray, hi: int, lo: int, eps: float
) -> bool:
    """Best single move or swap from rank `hi` (items `source`) to rank `lo` (items `target`), applied if it
    lowers max(load_hi, load_lo); the item lists are (weight, item), sorted."""
    diff = loads[hi] - loads[lo]
    if diff <= eps:
        return False
    half = diff / 2
    best = (loads[hi] - eps, None, None)  # (new max of the pair, item from hi, item from lo)
    # move: the item of hi closest to half the difference
    at = bisect.bisect_left(source, (half, -1))
    for j in (at - 1, at):
        if 0 <= j < len(source) and 0 < source[j][0] < diff:
            pair = max(loads[hi] - source[j][0], loads[lo] + source[j][0])
            if pair < best[0]:
                best = (pair, j, None)
    # swap: for each item a of hi, the item b of lo with w_a - w_b closest to half the difference
    for j, (wa, _) in enumerate(source):
        at = bisect.bisect_left(target, (wa - half, -1))
        for m in (at - 1, at):
            if 0 <= m < len(target):
                delta = wa - target[m][0]
                if 0 < delta < diff:
                    pair = max(loads[hi] - delta, loads[lo] + delta)
                    if pair < best[0]:
                        best = (pair, j, m)
    _, j, m = best
    if j is None:
        return False
    moved = source.pop(j)
    back = target.pop(m) if m is not None else None
    bisect.insort(target, moved)
    loads[hi] -= moved[0]
    loads[lo] += moved[0]
    if back is not None:
        bisect.insort(source, back)
        loads[hi] += back[0]
        loads[lo] -= back[0]
    return True


def refine_exact(
    given: list[list[int]], *, weights: Sequence[float], base: np.ndarray, node_limit: int = 2000
) -> list[list[int]]:
    """Optimal assignment of the items of `given` to ranks by MILP (see the module doc).

    Returns `given` unchanged when the solver finds nothing better than it.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp  # only small instances pay for the import

    num_ranks = len(given)
    pool = [i for rank_items in given for i in rank_items]
    num_items = len(pool)
    if num_items == 0 or num_ranks == 1:
        return given
    w = np.array([float(weights[i]) for i in pool])
    current = base.astype(np.float64) + np.array([sum(float(weights[i]) for i in r) for r in given])
    scale = float(current.max()) or 1.0  # seconds can be tiny; scale so the solver's tolerances bite
    n = num_items * num_ranks  # x[j * num_ranks + r], then T
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    one_rank = np.zeros((num_items, n + 1))
    for j in range(num_items):
        one_rank[j, j * num_ranks:(j + 1) * num_ranks] = 1.0
    capacity = np.zeros((num_ranks, n + 1))
    for r in range(num_ranks):
        capacity[r, r:n:num_ranks] = w / scale
    capacity[:, -1] = -1.0
    constraints = [
        LinearConstraint(one_rank, 1.0, 1.0),
        LinearConstraint(capacity, -np.inf, -base / scale),
    ]
    integrality = np.ones(n + 1)
    integrality[-1] = 0
    bounds = Bounds(np.zeros(n + 1), np.concatenate([np.ones(n), [np.inf]]))
    result = milp(cost, integrality=integrality, bounds=bounds, constraints=constraints,
                  options={"node_limit": node_limit, "presolve": True})
    if result.x is None:
        return given
    x = result.x[:n].reshape(num_items, num_ranks)
    if np.abs(x.sum(axis=1) - 1).max() > 1e-6 or np.abs(x - np.rint(x)).max() > 1e-6:
        logger.warning("MILP returned a non-integral assignment (status %s); keeping the heuristic", result.status)
        return given
    chosen = x.argmax(axis=1)
    loads = base.astype(np.float64) + np.bincount(chosen, weights=w, minlength=num_ranks)
    if loads.max() >= current.max() * (1 - 1e-9):
        return given
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for j, r in enumerate(chosen.tolist()):
        out[r].append(pool[j])
    return out
