"""A lower bound on the step time of any plan, and a plan's gap to it.

Let T_whole(s) be the cost model's time of a sequence whole on one rank, T_member(s, k) the time of a
member holding s/k tokens of a ring of k (`sharding.shard_time` with fractional tokens; the fullest
member holds at least that), and D(s) the fewest ranks memory allows (`sharding.min_ring_size`). A plan
with step time T has

- T >= T_whole(s) for every short sequence (it stays whole on one rank);
- T >= min_{D(s) <= k <= D} T_member(s, k) for every long one: the floor. The ring traffic, ~(2 + f) s
  kv-bytes per member and layer whatever k (f = 2 in bf16, whose dK/dV travel in fp32), is why a 2M-token document is slow at any ring size;
- each long sequence on k_s(T) ranks or more, the smallest k >= D(s) with T_member(s, k) <= T, and a
  ring of k members does k x T_member(s, k) work, which grows with k (the whole sequence's linear and
  attention work, or, when larger, the ring traffic, 2 (k - 1) + k f kv-bytes per token held). So
  D x T >= W(T) = sum of T_whole over short sequences + sum of k_s(T) x T_member(s, k_s(T)).
  Under expert parallelism every member of an EP group waits for the MoE all-to-all's transfers at each
  index, at least its own tokens' (`CostModel.expert_alltoall_seconds_per_token` per token), so W(T) also
  holds that for every token of the batch; the spread expert work moves work inside a group but keeps its
  total.

W(T) falls as T rises, so the smallest T meeting all three is found by bisection (`widening.settle_target`
with no slack, the same search the planner's ring widening uses with slack). Micro-batch overheads, waits
and the PP fill/drain only add to a plan's time, so the bound holds for every policy's plan.

On pools of at most `SMALL_POOL` ranks two more terms count pieces and rings rather than work; the exact
planner (`plan.policies.optimal`) showed the work alone up to ~25% below the optimum there, with a few
sequences that do not pair up evenly (benchmarks/README.md, opt/bound before and after).

- Pieces (`_pigeonhole_floor`). A piece is a rank's share of one sequence: a short sequence is one piece
  of T_whole(s); a long one on k ranks is k pieces, each at least its fastest member time, and a step of
  T puts it on k_s(T) ranks or more. Pieces of one sequence sit on distinct ranks, so among the q D + 1
  longest pieces some rank holds q + 1 of distinct sequences (pigeonhole) and runs them one after the
  other: T is at least the q + 1 shortest of those pieces summed, for every q. Fewer pieces as T rises,
  so the least T meeting it is found by bisection.
- Wide rings (`_wide_rings_floor`). p + 1 rings of more than D / (p + 1) members each would need more
  than D ranks, so at most p of them run at any instant; a ring's slot lasts at least its fullest
  member's time, and two rings on one rank run in different slots. So p x T is at least the summed time
  of those rings: a long sequence is one of them unless a ring of at most D / (p + 1) ranks (and at least
  D(s)) has a member time <= T, and then it takes at least its least member time over the wider sizes.
  The sum falls as T rises; the least T meeting it is read off the sequences sorted by the T from which
  they may run narrow.

That is a bound on work, per pipeline stage. A second one holds on a dependency chain (`fastest_crossing`):
a document's micro-batch crosses every pipeline stage forward and back one op after the other, whatever
the schedule, so no step is shorter than its longest document's fastest crossing. With PP 4 a 1.2M-token
document sets it above the work bound (issue 23); `critical_path_floor` is the larger of the two.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import min_ring_size, whole_times
from megatron_hdp.plan.cost.ring_sizes import RingSizer, settle_target
from megatron_hdp.plan.step_plan import StepPlan


def step_time_lower_bound(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    capacity: int,
    cost_model: CostModel,
    pp_size: int = 1,
    max_offload_ratio: float = 1.0,
    fewest: dict[int, int] | None = None,
    sizers: dict | None = None,
) -> float:
    """The lower bound of the module docstring, in seconds.

    `max_offload_ratio` only tightens the bound (a ring has at least D(s) members, and more offloading
    allows fewer); the default 1.0 gives a bound valid for every configuration. `fewest`: D(s) by length
    where the caller has them (`sharding.shard_sequences` with the same capacity, ranks, offload limit and
    `pp_size`), else each is found here (`min_ring_size`). `sizers`: a dict the caller keeps for bounds of one
    batch whose cost models differ at most in the EP size (balance's EP and EP-1 passes): the member times
    and fastest ring sizes (`RingSizer`) read nothing of it, so they are found once.
    """
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    lengths = np.asarray(lengths, dtype=np.int64)
    short = lengths <= capacity
    whole = whole_times(lengths[short], cost_model=cost_model, pp_size=pp_size)
    slowest = float(whole.max(initial=0.0))
    other_work = float(whole.sum()) + cost_model.expert_alltoall_seconds_per_token(pp_size=pp_size) * float(lengths.sum())
    long_lengths, counts = np.unique(lengths[~short], return_counts=True)
    if not len(long_lengths):
        pieces = _pieces_floor(whole, np.ones(len(whole)), num_ranks) if num_ranks <= SMALL_POOL else 0.0
        return max(other_work / num_ranks, slowest, pieces)
    if fewest is None:
        fewest = {}
        for s in long_lengths.tolist():
            try:
                fewest[s], _ = min_ring_size(s, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                             max_offload_ratio=max_offload_ratio, pp_size=pp_size)
            except ValueError:
                fewest[s] = num_ranks  # no plan exists; keep the bound finite
    key, basis = (num_ranks, pp_size, tuple(fewest.items())), dataclasses.replace(cost_model, expert_parallel_size=1)
    if sizers is None or key not in sizers:
        sizer = RingSizer(long_lengths.tolist(), fewest, widest=lambda s: num_ranks, cost_model=cost_model,
                          pp_size=pp_size, fractional=True)
        if sizers is not None:
            sizers[key] = (basis, sizer)
    else:
        known, sizer = sizers[key]
        assert known == basis, "bound sizers shared by cost models that differ beyond the EP size"
    work = settle_target(sizer, counts=counts.tolist(), other_work=other_work,
                         floor=max(slowest, sizer.floor()), num_ranks=num_ranks, slack=0.0, from_below=True)
    if num_ranks > SMALL_POOL:
        return work
    work = _pigeonhole_floor(sizer, counts=counts.tolist(), short_times=whole, num_ranks=num_ranks, start=work)
    return max(work, _wide_rings_floor(sizer, counts=counts.tolist(), num_ranks=num_ranks))


def _pieces_floor(durations: np.ndarray, counts: np.ndarray, num_ranks: int) -> float:
    """max over q of the q + 1 shortest of the q D + 1 longest pieces (`counts[i]` pieces of `durations[i]`;
    pieces of distinct sequences whenever they share a rank), summed; 0 with at most D pieces."""
    order = np.argsort(durations)[::-1]
    values, many = durations[order], counts[order]
    held = np.cumsum(many)
    most = (int(held[-1]) - 1) // num_ranks if len(held) else 0
    if most < 1:
        return 0.0
    summed = np.concatenate([[0.0], np.cumsum(values * many)])
    before = np.concatenate([[0], held])

    def longest(number: np.ndarray) -> np.ndarray:  # the sum of the `number` longest pieces
        group = np.searchsorted(held, number)
        return summed[group] + (number - before[group]) * values[group]

    q = np.arange(1, most + 1)
    return float((longest(q * num_ranks + 1) - longest(q * num_ranks - q)).max())


def _pigeonhole_floor(sizer: RingSizer, *, counts: Sequence[int], short_times: np.ndarray, num_ranks: int,
                      start: float) -> float:
    """The least T >= `start` at least the pigeonhole sum of the pieces a step of T forces (module doc),
    from below within the bisection's precision."""
    fastest = {s: sizer.member(s, sizer.fastest(s)) for s in sizer.lengths}

    def forced(target: float) -> float:
        sizes = sizer.sizes_for(target)
        durations = np.concatenate([short_times, [fastest[s] for s in sizer.lengths]])
        many = np.concatenate([np.ones(len(short_times)), [c * sizes[s] for s, c in zip(sizer.lengths, counts)]])
        return _pieces_floor(durations, many, num_ranks)

    lo = start
    hi = forced(lo)
    if hi <= lo:
        return lo
    while hi - lo > 1e-4 * lo:  # forced() falls as T rises: the least T >= forced(T) lies in [lo, hi]
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if forced(mid) <= mid else (mid, hi)
    return lo


SMALL_POOL = 64
"""Largest pool on which `step_time_lower_bound` adds the piece and wide-ring terms: they time every ring
size of every long sequence (a few hundred member times here; at thousands of ranks, 5-8x the bound's
own time, inside the planner's loop, where the pieces outnumber the ranks only with many per rank)."""


def _wide_rings_floor(sizer: RingSizer, *, counts: Sequence[int], num_ranks: int) -> float:
    """The least T with p x T >= the summed least times of the rings wider than num_ranks / (p + 1) that a
    step of T forces, for every p (module doc)."""
    best = 0.0
    for most in range(1, num_ranks):
        cut = num_ranks // (most + 1)  # rings of at most `cut` members are not wide
        leave, stay = [], []  # per sequence: the T from which it may run narrow; its least time when wide
        for s, count in zip(sizer.lengths, counts):
            times = {k: sizer.member(s, k) for k in range(sizer.fewest[s], num_ranks + 1)}
            leave += [min((t for k, t in times.items() if k <= cut), default=float("inf"))] * count
            stay += [min(t for k, t in times.items() if k > cut)] * count
        order = np.argsort(leave)[::-1]
        leave_sorted = np.append(np.asarray(leave)[order], 0.0)
        forced = np.concatenate([[0.0], np.cumsum(np.asarray(stay)[order])])
        for j in range(len(order), -1, -1):  # j sequences forced wide, on [leave_sorted[j], leave_sorted[j-1])
            target = max(leave_sorted[j], forced[j] / most)
            if j == 0 or target < leave_sorted[j - 1]:
                best = max(best, target)
                break
    return best


def gap(plan: StepPlan, *, cost_model: CostModel, max_offload_ratio: float = 1.0) -> float:
    """est_step_time / lower bound - 1 for a plan (0: provably optimal under the cost model)."""
    bound = step_time_lower_bound(plan.lengths, num_ranks=plan.num_ranks, capacity=plan.capacity,
                                  cost_model=cost_model, pp_size=plan.pp_size, max_offload_ratio=max_offload_ratio)
    return plan.est_step_time / bound - 1.0 if bound > 0 else 0.0


def _fastest_links(ring_size: int, *, cost_model: CostModel, num_ranks: int) -> list[tuple[int, ...]]:
    """Rings of `ring_size` ranks out of `num_ranks` between them on every link speed such a ring can get:
    inside one node where it fits one, and one that crosses nodes where one can (the inter-node link may
    be the faster in a cost model); the cost model prices a ring at its slowest link."""
    rings = [tuple(range(ring_size))]
    per_node = cost_model.ranks_per_node
    if per_node is not None and 1 < ring_size <= per_node < num_ranks:
        rings.append(tuple(range(ring_size - 1)) + (per_node,))
    return rings


@functools.lru_cache(maxsize=64)
def fastest_crossing(length: int, *, num_ranks: int, cost_model: CostModel, pp_size: int = 1) -> tuple[float, int]:
    """(seconds, ring size): the least time a document of `length` tokens needs to cross every pipeline
    stage forward and back, and the ring size that gives it.

    Megatron's schedules (1F1B or interleaved) run a micro-batch's forward of chunk c on stage s after the
    forward of the virtual stage before it, and its backward after the one after it, so its 2 x pp x vpp
    ops form one chain: their times, `cost.model.FORWARD_SHARE` / vpp and the rest / vpp of its stage time
    each, sum to pp x its stage time, whatever the vpp. A member of a ring of k holds at least ceil(length / k) of its
    tokens, and its micro-batch's stage time is at least that shard's alone in the cost model's own
    `microbatch_time` (further shards, offload copies, waits and jitter only add), at the fastest link such
    a ring can get (`_fastest_links`). Minimised over k = 1 .. min(num_ranks, length): a larger k holds one
    token and only sends more. With pp 1 this is the document's fastest forward and backward. Longer
    documents take no less at every k, so a batch's longest document has the longest crossing. Cached:
    `plan` and `simulate` ask for one document's twice (its time, and the floor it sets).
    """
    if length <= 0 or num_ranks <= 0:
        raise ValueError(f"a crossing needs a positive length and ranks, got length {length}, num_ranks {num_ranks}")
    best = (float("inf"), 1)
    for k in range(1, min(num_ranks, length) + 1):
        tokens = -(-length // k)
        stage = min(cost_model.microbatch_time([(length, tokens, ring)], pp_size=pp_size)
                    for ring in _fastest_links(k, cost_model=cost_model, num_ranks=num_ranks))
        if pp_size * stage < best[0]:
            best = (pp_size * stage, k)
    return best


def critical_path_floor(work_floor: float, lengths: Sequence[int], *, num_ranks: int, cost_model: CostModel,
                        pp_size: int = 1) -> float:
    """max(`work_floor`, the longest document's `fastest_crossing`): a step-time lower bound on the
    longest chain of dependent work as well as on the work per rank (`work_floor`: seconds, e.g.
    `step_time_lower_bound` or the simulator's compute floor)."""
    if not len(lengths):
        return work_floor
    crossing, _ = fastest_crossing(int(max(lengths)), num_ranks=num_ranks, cost_model=cost_model, pp_size=pp_size)
    return max(work_floor, crossing)
