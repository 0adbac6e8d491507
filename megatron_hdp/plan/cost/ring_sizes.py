"""Ring sizes a step-time target implies: the smallest ring at least D(s) whose member time meets it.

A ring's member time falls with k until the ring traffic dominates, so a long sequence that would set the
step time at D(s) ranks can meet a target T at a larger k. `RingSizer` answers, per distinct length, the
smallest such k; `settle_target` finds the smallest T for which the work those ring sizes imply, spread
over the pool with a slack, fits under T. Balance's ring widening (`plan.search.widening`, with slack)
and the step-time lower bound (`plan.timeline.bounds`, without) ask the same question here.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, Sequence

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import fastest_ring_size, shard_time


_PRECISION = 0.002
"""Relative precision of the bisection on the target."""


class RingSizer:
    """Member times of the distinct long lengths of a batch, and the ring sizes a step-time target implies.

    `fractional=True` times a member as holding exactly s/k tokens (what the lower bound needs: no plan
    does better); otherwise ceil(s/k), as the plan will. Ring sizes run from D(s) (`fewest`) to `widest(s)`.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        fewest: dict[int, int],
        *,
        widest: Callable[[int], int],
        cost_model: CostModel,
        pp_size: int,
        fractional: bool,
    ) -> None:
        self.lengths = list(lengths)
        self.fewest = fewest
        self._widest = widest
        self._cost_model = cost_model
        self._pp_size = pp_size
        self._fractional = fractional
        self.member = lru_cache(maxsize=None)(self._member)
        self.fastest = lru_cache(maxsize=None)(self._fastest)

    def _member(self, s: int, k: int) -> float:
        tokens = s / k if self._fractional else -(-s // k)
        return shard_time(self._cost_model, seq_len=s, num_tokens=tokens, ring_size=k, pp_size=self._pp_size)

    def _fastest(self, s: int) -> int:
        lo = self.fewest[s]
        return fastest_ring_size(lambda k: self.member(s, k), lo=lo, hi=max(lo, self._widest(s)))

    def floor(self) -> float:
        """The longest sequence at its fastest ring size (a longer sequence is slower at every k)."""
        s = max(self.lengths)
        return self.member(s, self.fastest(s))

    def sizes_for(self, target: float) -> dict[int, int]:
        """Per length, the smallest ring size whose member time is <= target (the fastest if none is)."""
        chosen = {}
        for s in self.lengths:
            lo = self.fewest[s]
            if self.member(s, lo) > target:
                hi = self.fastest(s)  # the member time decreases on [D(s), fastest]
                while lo < hi:
                    mid = (lo + hi) // 2
                    lo, hi = (mid + 1, hi) if self.member(s, mid) > target else (lo, mid)
            chosen[s] = lo
        return chosen

    def work(self, chosen: dict[int, int], counts: Sequence[int]) -> float:
        """Total member time of all rings at the chosen sizes (`counts`: sequences per length)."""
        return sum(c * k * self.member(s, k) for (s, k), c in zip(chosen.items(), counts))


def settle_target(
    sizer: RingSizer,
    *,
    counts: Sequence[int],
    other_work: float,
    floor: float,
    num_ranks: int,
    slack: float,
    from_below: bool = False,
) -> float:
    """The smallest target T >= floor with (1 + slack) x (other_work + ring work at T) / D <= T (bisection).

    The ring work falls as T rises (looser targets need fewer ranks), so the condition is monotone. The
    bisection stops within `_PRECISION`; `from_below=True` returns the end below the true T (for a lower
    bound), else the end above it (a target that holds).
    """

    def holds(target: float) -> bool:
        work = other_work + sizer.work(sizer.sizes_for(target), counts)
        return (1 + slack) * work / num_ranks <= target

    if holds(floor):
        return floor
    lo, hi = floor, 2 * floor
    while not holds(hi):  # terminates: a target above every D(s) time leaves the work fixed
        lo, hi = hi, 2 * hi
    while hi - lo > _PRECISION * lo:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return lo if from_below else hi
