"""Rows of an EP unit (`expert_units`) and the widening of their rings into the lanes they leave free.

A row is one micro-batch index of a unit of e lanes: every lane of it waits at each MoE layer for the
row's slowest lane. Lane rings (rings of at most e ranks) are grouped into rows of alike member time
(`expert_units.ring_rows`), and the lanes their sizes leave free take whole sequences. But whole
sequences of at most C tokens take at most a C-token document's time on a lane, while the members of the
rings of long documents take several times that: the free lanes of such a row idle. `widen_rings` gives
those lanes to the row's rings as extra members instead, each to the ring whose members are slowest then
(lowering the row's time, as processors go to the longest job): a ring of k + 1 members does the k
members' work in less time each, at the cost of more ring traffic its attention may no longer hide (and
where that traffic makes the members slower, the ring stays as it is).

On DeepSeek-V3 at EP 32 rows of rings of 75K-130K-token documents, sized within capacity for C = 16K,
left 2-6 lanes of 32 that a lighter ring took (members at 50-60% of the row's time, benchmarks/README.md).
Widened instead (and rings joining only rows within `expert_units.JOIN_TOLERANCE` of their time), the
plans at 2,048 GPUs gain 0.04-1.0 points of the work floor (github and byted, seeds 0-3), at 1,024 GPUs
1.5-2.0, at 512 GPUs -0.6 to +2.4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class Row:
    """One micro-batch index of a unit: what each of its lanes runs, the time of the rings in it (0 for a
    row of whole sequences; member seconds while `ring_rows` forms the rows, then the slowest lane's
    seconds apart from the routed expert work for `fill_holes`), and the lanes still free."""

    lanes: list[list[int]]
    time: float
    free: list[int]


def widen_rings(rows: Sequence[Row], *, lengths: np.ndarray, own: Callable[[int, int], float],
                fill: float) -> dict[int, int]:
    """The free lanes of each row of lane rings given to its rings, one at a time, to the ring whose
    members' `own` time (length, size) -> seconds is the largest (ties: the lowest sequence id), while that
    time is above `fill` (the most a free lane's whole sequences would take), one more member lowers it
    (over slow ring links the traffic of a wider ring can outweigh its smaller shards) and the document
    allows it (zigzag chunks of >= 1 token: size <= length / 2). Changes `rows` in place; returns every
    widened ring's new size by sequence id. Rows must hold lane rings only (whole sequences come later)."""
    widened: dict[int, int] = {}
    for row in rows:
        if not row.free:
            continue
        size: dict[int, int] = {}
        for lane in row.lanes:
            for seq in lane:
                size[seq] = size.get(seq, 0) + 1
        while row.free and size:
            seq = max(size, key=lambda s: (own(int(lengths[s]), size[s]), -s))
            length, k = int(lengths[seq]), size[seq]
            if 2 * (k + 1) > length or own(length, k) <= fill or own(length, k + 1) >= own(length, k):
                break
            row.lanes[row.free.pop(0)].append(seq)
            size[seq] = widened[seq] = k + 1
    return widened
