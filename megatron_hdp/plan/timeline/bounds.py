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

That is a bound on work, per pipeline stage. A second one holds on a dependency chain (`fastest_crossing`):
a document's micro-batch crosses every pipeline stage forward and back one op after the other, whatever
the schedule, so no step is shorter than its longest document's fastest crossing. With PP 4 a 1.2M-token
document sets it above the work bound (issue 23); `critical_path_floor` is the larger of the two.
"""

from __future__ import annotations

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
) -> float:
    """The lower bound of the module docstring, in seconds.

    `max_offload_ratio` only tightens the bound (a ring has at least D(s) members, and more offloading
    allows fewer); the default 1.0 gives a bound valid for every configuration.
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
        return max(other_work / num_ranks, slowest)
    fewest = {}
    for s in long_lengths.tolist():
        try:
            fewest[s], _ = min_ring_size(s, capacity=capacity, num_ranks=num_ranks, cost_model=cost_model,
                                         max_offload_ratio=max_offload_ratio, pp_size=pp_size)
        except ValueError:
            fewest[s] = num_ranks  # no plan exists; keep the bound finite
    sizer = RingSizer(long_lengths.tolist(), fewest, widest=lambda s: num_ranks, cost_model=cost_model,
                      pp_size=pp_size, fractional=True)
    return settle_target(sizer, counts=counts.tolist(), other_work=other_work,
                         floor=max(slowest, sizer.floor()), num_ranks=num_ranks, slack=0.0, from_below=True)


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
