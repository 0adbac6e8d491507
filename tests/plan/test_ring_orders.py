"""`search.ring_orders` against references that share no code with it: the moves of a 4-ring order
written out by hand, and the climb's answer checked against an exhaustive look at every order one move
away (it must be a local optimum unless the budget stopped it), the starts' values, and a count of the
evaluations it made."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from megatron_hdp.plan.search.ring_orders import climb_orders, order_moves


def test_moves_of_four_rings_are_front_back_and_neighbour_swaps():
    expected = {
        (1, 0, 2, 3), (1, 2, 3, 0),  # 0 to the back; to the front (itself); swapped with 1 (= 1 to the front)
        (0, 2, 3, 1), (0, 2, 1, 3),  # 1 to the back, 1 swapped with 2
        (2, 0, 1, 3), (0, 1, 3, 2),  # 2 to the front; 2 to the back (= swapped with 3)
        (3, 0, 1, 2),                # 3 to the front
    }
    moves = order_moves((0, 1, 2, 3))
    assert set(moves) == expected and len(moves) == len(expected)


def _one_move_away(a: tuple, b: tuple) -> bool:
    """Whether b is a by one ring moved to the front or back, or two neighbours swapped (by definition)."""
    n = len(a)
    if any(b == a[:i] + (a[i + 1], a[i]) + a[i + 2:] for i in range(n - 1)):
        return True
    return any(b in ((a[i],) + a[:i] + a[i + 1:], a[:i] + a[i + 1:] + (a[i],)) for i in range(n)) and b != a


@pytest.mark.parametrize("seed", range(8))
def test_climb_ends_in_a_local_optimum_no_worse_than_its_starts(seed):
    rng = np.random.default_rng(seed)
    items = tuple(range(5))
    table = {(v, p): float(rng.integers(0, 20)) for v in (False, True) for p in itertools.permutations(items)}
    calls = []

    def evaluate(variant, order):
        calls.append((variant, order))
        return table[variant, order]

    starts = [(False, items), (True, items[::-1])]
    value, variant, order = climb_orders(starts, evaluate, budget=10_000)
    assert value == table[variant, order]
    assert value <= min(table[start] for start in starts)
    neighbours = [p for p in itertools.permutations(items) if _one_move_away(order, p)]
    assert len(neighbours) == len(order_moves(order))
    assert all(table[variant, p] >= value for p in neighbours)
    assert len(calls) <= 10_000


def test_climb_stops_before_a_round_would_pass_the_budget():
    calls = []

    def evaluate(variant, order):  # strictly better the more sorted: every climb would go on
        calls.append(order)
        return float(sum(a > b for a, b in itertools.combinations(order, 2)))

    start = (None, (5, 4, 3, 2, 1, 0))
    climb_orders([start], evaluate, budget=len(order_moves(start[1])))
    assert len(calls) == 1  # the start alone: a round of moves would pass the budget
    budget = 1 + 3 * len(order_moves(start[1]))
    climb_orders([start], evaluate, budget=budget)
    assert len(calls) - 1 <= budget
