"""Ring widening: give a long sequence more than D(s) ranks when its member time would set the step time.

Beyond ByteScale, which keeps every ring at D(s), the fewest ranks memory allows. A ring's member time
falls with k until the ring traffic (~3 s kv-bytes per member and layer, whatever k) dominates, so a
long sequence can be the slowest item of the step at D(s) yet fine at a larger k. The planner picks a
step-time target T and gives each long sequence the smallest k >= D(s) whose member time is <= T:

- T can be no lower than the floor: the slowest whole short sequence, or the longest sequence at its
  fastest ring size (a longer sequence is slower at every k, so the longest one sets it);
- wider rings do more work (more ring traffic), so T must also cover the work spread over all ranks
  with some room for packing: (1 + WIDEN_SLACK) x W(T) / D <= T, where W(T) is the total work with the
  ring sizes T implies. W falls as T rises, so the smallest such T is found by bisection;
- with PP (ByteScale's PP-Balance: a pipeline's micro-batches should take about the same time, else
  the 1F1B bubbles grow) T is also capped at the time of one full micro-batch, a whole C-token sequence.

The floor gets no slack: when one sequence sets the step time the other ranks would idle anyway, so
its widest useful ring costs nothing. Ring sizes stay <= min(D, s // 2) so zigzag chunks are non-empty.
Offloading is re-decided for the smaller shards of widened rings.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.ring_sizes import RingSizer, settle_target
from megatron_hdp.plan.cost.sharding import whole_times
from megatron_hdp.plan.search.neighbours import ring_offload

WIDEN_SLACK = 0.01
"""Room left for packing: the target must exceed the spread-out work by this fraction."""

LADDER = 0.85
"""Alternative targets step down from the settled one by this factor (`widening_options`)."""

NARROWER_STEPS = 2
"""Alternative targets above the settled one, one ring narrower each (`narrower_targets`)."""

NARROWER_POOL = 64
"""Largest pool given the narrower targets: where one rank freed matters (the exact planner's cases); at
1,024 ranks (github, llama-7b) their plans cost 45 ms of 130 and none won."""

PIPELINE_CAPS = (1, 2, 4, 8)
"""With PP, ring member times are capped at one full micro-batch's time divided by these."""


def narrower_targets(sizer: RingSizer, target: float, *, fewest: dict[int, int]) -> list[float]:
    """Up to NARROWER_STEPS targets above `target`, the least that put some ring one rank narrower than
    `target` does (that ring's member time one rank narrower; never below D(s)): the settled target
    spreads the work evenly, but a narrower ring can free a rank for whole sequences that would otherwise
    share one (three documents near C beside a ring of 4 on 7 ranks; benchmarks/optimal_gap.py)."""
    chosen = sizer.sizes_for(target)
    goals = sorted({sizer.member(s, k - 1) for s, k in chosen.items() if k > fewest[s]})
    return [goal for goal in goals if goal > target][:NARROWER_STEPS]


def widening_options(
    lengths: Sequence[int],
    ring_sizes: np.ndarray,
    offload_ratios: np.ndarray,
    *,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    max_offload_ratio: float,
    pp_size: int = 1,
    alternatives: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ring_sizes, offload_ratios) with long sequences widened to a step-time target (module doc).

    The first option is the settled target's (with PP capped at one full micro-batch's time). With
    `alternatives`, distinct further options follow, for a caller that builds and compares plans:
    - lower targets, LADDER^i x the settled one down to the floor: the settled target assumes perfect
      spreading, but ring members must share a micro-batch index, so e.g. two 3-rank rings on 4 ranks
      strand a rank that a ring of 4 would use;
    - on pools of at most NARROWER_POOL ranks, higher ones, each the least that narrows some ring by one
      rank, up to NARROWER_STEPS (`narrower_targets`): a narrower ring can free a rank for whole
      sequences that would otherwise share one;
    - with PP, caps of a full micro-batch's time / PIPELINE_CAPS (PP-Balance: a ring micro-batch much
      heavier than the pipeline's others sets the 1F1B bubble; wider rings make it lighter).
    """
    return list(_options(lengths, ring_sizes, offload_ratios, num_ranks=num_ranks, capacity=capacity,
                         cost_model=cost_model, max_offload_ratio=max_offload_ratio, pp_size=pp_size,
                         alternatives=alternatives))


class LazyOptions:
    """`widening_options(..., alternatives=True)`, its alternatives made when something past the first option
    is first asked for (an index or slice beyond it, `len`: all of them; iteration: each as it is reached).
    Balance plans the first option and the alternatives only where that plan leaves room
    (`policies.balance`'s `improvable`), and on large batches it mostly does not: the ladder of lower
    targets and their offload decisions were 20-40% of the widening's time on DeepSeek-V3 at 1,024 ranks
    (MLA auto rings). The options are those of `widening_options`, in its order."""

    def __init__(self, lengths: Sequence[int], ring_sizes: np.ndarray, offload_ratios: np.ndarray, **settings) -> None:
        self._rest: Iterator | None = _options(lengths, ring_sizes, offload_ratios, alternatives=True, **settings)
        self._made = [next(self._rest)]

    def _all(self) -> list[tuple[np.ndarray, np.ndarray]]:
        for _ in self:  # (iterating makes every alternative not made yet)
            pass
        return self._made

    def __getitem__(self, index):
        if index == 0:
            return self._made[0]
        return self._all()[index]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        at = 0
        while at < len(self._made) or self._rest is not None:
            if at == len(self._made):  # the next alternative, made now
                option = next(self._rest, None)
                if option is None:
                    self._rest = None
                    return
                self._made.append(option)
            yield self._made[at]
            at += 1

    def __len__(self) -> int:
        return len(self._all())


def _options(
    lengths: Sequence[int],
    ring_sizes: np.ndarray,
    offload_ratios: np.ndarray,
    *,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    max_offload_ratio: float,
    pp_size: int = 1,
    alternatives: bool = False,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The options of `widening_options`, one at a time: the first before any alternative is computed."""
    lengths = np.asarray(lengths, dtype=np.int64)
    long_mask = lengths > capacity
    long_ids = np.flatnonzero(long_mask)
    long_lengths, inverse, counts = np.unique(lengths[long_ids], return_inverse=True, return_counts=True)
    if not len(long_lengths):
        yield ring_sizes, offload_ratios
        return
    long_lengths, counts = long_lengths.tolist(), counts.tolist()
    holders = {s: long_ids[inverse == j] for j, s in enumerate(long_lengths)}  # the sequences of each length
    fewest = {s: int(ring_sizes[holders[s][0]]) for s in long_lengths}
    sizer = RingSizer(long_lengths, fewest, widest=lambda s: min(num_ranks, s // 2), cost_model=cost_model,
                      pp_size=pp_size, fractional=False)
    short = whole_times(lengths[~long_mask], cost_model=cost_model, pp_size=pp_size)
    floor = max(float(short.max(initial=0.0)), sizer.floor())
    target = settle_target(sizer, counts=counts, other_work=float(short.sum()), floor=floor, num_ranks=num_ranks,
                           slack=WIDEN_SLACK)
    full_microbatch = float(whole_times([capacity], cost_model=cost_model, pp_size=pp_size)[0])
    if pp_size > 1:
        target = max(floor, min(target, full_microbatch))
    targets = [target]
    if alternatives:
        lowest = sizer.floor()
        step = target * LADDER
        while step > lowest:
            targets.append(step)
            step *= LADDER
        targets.append(lowest)
        if num_ranks <= NARROWER_POOL:
            targets += narrower_targets(sizer, target, fewest=fewest)
        if pp_size > 1:
            targets += [max(lowest, min(target, full_microbatch / parts)) for parts in PIPELINE_CAPS]
    seen = set()
    widened: dict[tuple[int, int], float | None] = {}  # (s, k) -> offload ratio, None if k does not fit
    for goal in targets:
        chosen = sizer.sizes_for(goal)
        key = tuple(chosen.values())
        if key in seen:
            continue
        seen.add(key)
        sizes, ratios = ring_sizes.copy(), offload_ratios.copy()
        for s, k in chosen.items():
            if k == fewest[s]:
                continue
            if (s, k) not in widened:  # options share most (length, ring size) pairs
                widened[s, k] = ring_offload(s, k, cost_model=cost_model, capacity=capacity,
                                             max_offload_ratio=max_offload_ratio, pp_size=pp_size)
            if widened[s, k] is not None:
                sizes[holders[s]] = k
                ratios[holders[s]] = widened[s, k]
        yield sizes, ratios  # the first before the alternatives' ring sizes and offload decisions are made
