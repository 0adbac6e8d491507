"""A hill climb over the order in which rings are placed by time (`placement.place_rings_by_time`).

The by-time placement puts each ring, in the order given, on the ranks where it starts earliest; balance
gives it two orders (widest first, narrowest first). Which rings share the pool at a given moment
follows from the order alone, and neither of those two may be the one that fills it: on optimal_gap
case 8 (7 ranks, rings of 3, 3, 2, 2, 2, 2) a ring of 3 and two rings of 2 side by side from the start
and the other ring of 3 last, on the busy pair of one ring of 2 and the third member of the first ring
of 3, take 152.3 ms (the exact planner's best plan found: 151.9), widest first 168.7, narrowest first
162.5. `climb_orders` searches the orders near the given ones: each ring moved to the front or to the
back, or swapped with its neighbour, the best such move taken while it lowers the caller's step time,
within a budget of evaluations (the same for every rank: no clock).
"""

from __future__ import annotations

from typing import Callable, Hashable, Sequence

Order = tuple[int, ...]


def order_moves(order: Order) -> list[Order]:
    """The distinct orders one move from `order`: a ring to the front, to the back, or swapped with the next
    (without `order` itself), in a fixed order of generation."""
    seen, moves = {order}, []
    for i, seq in enumerate(order):
        rest = order[:i] + order[i + 1:]
        candidates = [(seq, *rest), (*rest, seq)]
        if i + 1 < len(order):
            candidates.append(order[:i] + (order[i + 1], seq) + order[i + 2:])
        for candidate in candidates:
            if candidate not in seen:
                seen.add(candidate)
                moves.append(candidate)
    return moves


def climb_orders(starts: Sequence[tuple[Hashable, Order]], evaluate: Callable[[Hashable, Order], float], *,
                 budget: int) -> tuple[float, Hashable, Order]:
    """(value, variant, order) of least `evaluate(variant, order)` found by best-improvement climbs over
    `order_moves`, one from each (variant, order) of `starts` (a variant is what the caller's placement
    takes beside the order, e.g. `latest_ready`), the start of least value first (ties: in the order given).
    A climb stops where no move lowers its value by a relative 1e-9; the search stops before a round of
    moves would pass `budget` evaluations (the starts count; they are all evaluated)."""
    assert starts, "no order to start from"
    values = [evaluate(variant, order) for variant, order in starts]
    used = len(starts)
    ranked = sorted(range(len(starts)), key=lambda i: (values[i], i))
    best = (values[ranked[0]], *starts[ranked[0]])
    for value, (variant, order) in ((values[i], starts[i]) for i in ranked):
        while True:
            moves = order_moves(order)
            if not moves or used + len(moves) > budget:
                break
            used += len(moves)
            step, at = min((evaluate(variant, move), i) for i, move in enumerate(moves))
            if step >= value * (1 - 1e-9):
                break
            value, order = step, moves[at]
        if value < best[0]:
            best = (value, variant, order)
    return best
