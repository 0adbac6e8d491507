"""Refinement of the balance scheduler's assignment of whole sequences to ranks.

The greedy (LPT) leaves the slowest rank up to one sequence above the rest. Two improvers, both
deterministic so that every rank computes the same plan:

- `refine_local`: local search on the makespan. Repeatedly take the slowest rank and try to move one
  of its sequences to a light rank, or swap one of its sequences with a lighter one there, choosing the
  transfer closest to half the load difference; stop when the slowest rank cannot be improved. With
  PP the rank's cost includes the 1F1B fill/drain (`PipelineCost`), which favours more, smaller
  micro-batches on ranks that hold a heavy one.
- `refine_pairs`: on small pools and batches without PP, after `refine_local`: exchanges of up to two sequences
  each way between the slowest rank and another (two for one, one for two, two for two), which single
  moves and swaps cannot make (the exact planner's worst case, optimal_gap seed 36: two short
  sequences of the slowest rank for one of similar total time elsewhere).
- `refine_exact`: an exact MILP (SciPy's HiGHS) for small instances: minimise T subject to
  load_r + sum_j w_j x_jr <= T and sum_r x_jr = 1 with binary x. Bounded by a node limit, never a time
  limit (a time limit would make the plan depend on machine load and differ between ranks). The
  solver's answer is checked and used only if it is a valid assignment that is really better.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from itertools import chain, combinations
from typing import Sequence

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineCost:
    """A rank's predicted time from its busy time S and whole-sequence tokens T, with PP.

    S + (pp - 1) / v x S / n, n = its ring micro-batches + ceil(T / C) (the micro-batches packing will
    make, at best), v the model chunks per stage: `pipeline.pipeline_time` for n equal micro-batches, a
    cheap guide for the search (the plan is timed exactly afterwards). With pp_size = 1 it is S.
    """

    pp_size: int
    capacity: int
    ring_microbatches: np.ndarray
    vpp_size: int = 1

    def __call__(self, rank: int, busy: float, tokens: float) -> float:
        if self.pp_size == 1:
            return busy
        count = int(self.ring_microbatches[rank]) + -(-int(tokens) // self.capacity)
        return busy + (self.pp_size - 1) / self.vpp_size * busy / max(1, count)


def refine_local(
    given: list[list[int]],
    *,
    weights: Sequence[float],
    base: np.ndarray,
    tokens: Sequence[int] | None = None,
    cost: PipelineCost | None = None,
    max_steps: int = 20000,
    candidates: int = 8,
) -> list[list[int]]:
    """A better assignment than `given` (items per rank); `base` is each rank's busy time before its items.

    Each step takes the slowest rank (by `cost`, default: busy time) and tries the `candidates` lightest
    ranks as partners; `tokens` (per item) feed the PP cost's micro-batch count.
    """
    num_ranks = len(given)
    weights = np.asarray(weights, dtype=np.float64)
    tokens = np.zeros(len(weights)) if tokens is None else np.asarray(tokens, dtype=np.float64)
    busy = base.astype(np.float64).copy()
    counts = [len(rank_items) for rank_items in given]
    flat = np.fromiter(chain.from_iterable(given), dtype=np.int64, count=sum(counts))
    # Token counts are integers, so their sums are exact in any order; busy times are summed per rank by
    # numpy's own (pairwise) sum over each rank's slice, exactly as a per-rank weights[items].sum().
    held = np.bincount(np.repeat(np.arange(num_ranks), counts), weights=tokens[flat], minlength=num_ranks)
    grouped = weights[flat]
    start = 0
    for rank, count in enumerate(counts):
        if count:
            busy[rank] += float(grouped[start : start + count].sum())
            start += count
    cost = cost or PipelineCost(1, 1, np.zeros(num_ranks, dtype=np.int64))
    loads = busy.copy() if cost.pp_size == 1 else np.array([cost(r, busy[r], held[r]) for r in range(num_ranks)])
    state = _State(busy, held, loads, tokens, cost)
    sorted_items: dict[int, list[tuple[float, int]]] = {}  # built for the ranks the search touches

    def items(rank: int) -> list[tuple[float, int]]:
        if rank not in sorted_items:
            sorted_items[rank] = sorted((float(weights[i]), i) for i in given[rank])
        return sorted_items[rank]

    for _ in range(max_steps):
        hi = int(np.argmax(loads))
        partners = np.argpartition(loads, min(candidates, num_ranks - 1))[: candidates + 1]
        partners = sorted((float(loads[r]), int(r)) for r in partners if r != hi)
        for _, lo in partners:
            if _improve(items(hi), items(lo), state, hi, lo):
                break
        else:
            break
    return [[i for _, i in sorted_items[r]] if r in sorted_items else list(given[r]) for r in range(num_ranks)]


@dataclass
class _State:
    busy: np.ndarray
    held: np.ndarray
    loads: np.ndarray
    tokens: np.ndarray
    cost: PipelineCost

    def after(self, rank: int, weight: float, tokens: float) -> float:
        """The rank's cost after adding `weight` seconds and `tokens` tokens (negative: removing)."""
        return self.cost(rank, self.busy[rank] + weight, self.held[rank] + tokens)

    def apply(self, rank: int, weight: float, tokens: float) -> None:
        self.busy[rank] += weight
        self.held[rank] += tokens
        self.loads[rank] = self.cost(rank, self.busy[rank], self.held[rank])


def _improve(source: list[tuple[float, int]], target: list[tuple[float, int]], state: _State, hi: int, lo: int) -> bool:
    """Best single move or swap from rank `hi` (items `source`) to rank `lo` (items `target`), applied if it
    lowers max(cost_hi, cost_lo); the item lists are (weight, item), sorted by weight."""
    loads, tokens = state.loads, state.tokens
    eps = 1e-12 * max(1.0, float(loads[hi]))
    diff = state.busy[hi] - state.busy[lo]
    if loads[hi] - loads[lo] <= eps or diff <= 0:
        return False
    half = diff / 2
    best = (loads[hi] - eps, None, None)  # (new max of the pair, index in source, index in target)
    # move: the items of hi closest to half the busy-time difference
    at = bisect.bisect_left(source, (half, -1))
    for j in (at - 1, at):
        if 0 <= j < len(source) and 0 < source[j][0] < diff:
            w, t = source[j][0], tokens[source[j][1]]
            pair = max(state.after(hi, -w, -t), state.after(lo, w, t))
            if pair < best[0]:
                best = (pair, j, None)
    # swap: for each item a of hi, the items b of lo with w_a - w_b closest to half the difference
    for j, (wa, a) in enumerate(source):
        at = bisect.bisect_left(target, (wa - half, -1))
        for m in (at - 1, at):
            if 0 <= m < len(target):
                delta = wa - target[m][0]
                if 0 < delta < diff:
                    dt = tokens[a] - tokens[target[m][1]]
                    pair = max(state.after(hi, -delta, -dt), state.after(lo, delta, dt))
                    if pair < best[0]:
                        best = (pair, j, m)
    _, j, m = best
    if j is None:
        return False
    moved = source.pop(j)
    back = target.pop(m) if m is not None else None
    bisect.insort(target, moved)
    state.apply(hi, -moved[0], -tokens[moved[1]])
    state.apply(lo, moved[0], tokens[moved[1]])
    if back is not None:
        bisect.insort(source, back)
        state.apply(hi, back[0], tokens[back[1]])
        state.apply(lo, -back[0], -tokens[back[1]])
    return True


PAIR_ITEMS = 32
"""Most sequences `refine_pairs` takes (the exact planner's cases have at most 12): it tries every exchange."""


def refine_pairs(given: list[list[int]], *, weights: Sequence[float], base: np.ndarray, tokens: Sequence[int],
                 capacity: int, overhead: float, max_steps: int = 100) -> list[list[int]]:
    """`given` (items per rank, busy time `base` before them) after exchanges of up to two items each way
    between the slowest rank and any other, the one lowering the pair's larger time most first, until
    none lowers the slowest rank (module doc); unchanged above `PAIR_ITEMS` items. A rank's time counts
    `overhead` per micro-batch its items need at least (tokens / `capacity`, rounded up), so that an
    exchange does not balance busy time at the price of an extra micro-batch."""
    if sum(map(len, given)) > PAIR_ITEMS:
        return given
    weights, tokens = np.asarray(weights, dtype=np.float64), np.asarray(tokens, dtype=np.int64)
    out = [list(items) for items in given]
    busy = np.array([float(base[r]) + float(weights[out[r]].sum()) for r in range(len(out))])
    held = np.array([int(tokens[out[r]].sum()) for r in range(len(out))])

    def groups(items: list[int]) -> tuple[list[tuple[int, ...]], np.ndarray, np.ndarray, np.ndarray]:
        """Every group of at most two of `items`: the groups, their weights, tokens and sizes."""
        chosen = [()] + [(a,) for a in items] + list(combinations(items, 2))
        return (chosen, np.array([sum(float(weights[i]) for i in g) for g in chosen]),
                np.array([sum(int(tokens[i]) for i in g) for g in chosen]), np.array(list(map(len, chosen))))

    def time(busy_: np.ndarray, held_: np.ndarray) -> np.ndarray:
        return busy_ + overhead * -(-held_ // capacity)

    for _ in range(max_steps):
        loads = time(busy, held)
        hi = int(np.argmax(loads))
        if not out[hi]:  # an exchange only adds to a rank that gives nothing
            break
        best, eps = (loads[hi], None), 1e-12 * max(1.0, float(loads[hi]))
        give, give_w, give_t, give_n = groups(out[hi])
        for lo in range(len(out)):
            if lo == hi:
                continue
            take, take_w, take_t, take_n = groups(out[lo])
            dw, dt = give_w[:, None] - take_w[None, :], give_t[:, None] - take_t[None, :]
            pair = np.maximum(time(busy[hi] - dw, held[hi] - dt), time(busy[lo] + dw, held[lo] + dt))
            pair[give_n[:, None] + take_n[None, :] < 3] = np.inf  # moves and swaps of one item: refine_local's
            at = np.unravel_index(int(np.argmin(pair)), pair.shape)
            if pair[at] < best[0] - eps:
                best = (float(pair[at]), (lo, give[at[0]], take[at[1]]))
        if best[1] is None:
            break
        lo, gone, back = best[1]
        out[hi] = [i for i in out[hi] if i not in gone] + list(back)
        out[lo] = [i for i in out[lo] if i not in back] + list(gone)
        for r in (hi, lo):
            busy[r] = float(base[r]) + float(weights[out[r]].sum())
            held[r] = int(tokens[out[r]].sum())
    return out


def refine_exact(
    given: list[list[int]], *, weights: Sequence[float], base: np.ndarray, node_limit: int = 500
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
