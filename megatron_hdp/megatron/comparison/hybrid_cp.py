"""Policy `megatron-hybrid-cp`: Megatron-Core's own Hybrid-CP scheduler, expressed as a StepPlan.

Megatron-Core (>= 0.15) ships a dynamic-CP scheduler for packed variable-length data:
`megatron.core.pipeline_parallel.hybrid_cp_schedule.BalancedCPScheduler`. It gives every sequence a CP
group whose size is the next power of two of L / C (C = `max_seqlen_per_dp_cp_rank`), and forms *groups*
of sub-samples; inside a group each rank runs its sub-samples one forward/backward pass each, and a
barrier over the whole DP x CP group ends every group (`hybrid_context_parallel_forward_backward`).
PP is not supported there.

This adapter calls that scheduler (not a re-implementation) and converts its answer as the Dynamic-CP
adapter does (`megatron.comparison.scheduler_groups.rings_and_schedule`: rings of the ranks holding a sequence, zigzag
chunks; group j -> micro-batch index j on every rank, holding that rank's sub-samples of group j). The
  simulator puts a barrier after each micro-batch index of this policy (Megatron's group barrier).
  Megatron runs each sub-sample as its own forward/backward pass, so peak memory is one sub-sample's
  (<= C tokens per rank) even when the group's sum exceeds C; the micro-batch's `capacity` is therefore
  max(C, its tokens), and its `est_time` sums one pass per sub-sample. `megatron.comparison.per_subsample` turns
  this plan into Megatron's execution (a micro-batch per sub-sample, the group barriers).
  Every ring is a K/V ring (Megatron's Hybrid-CP runs TE's K/V ring): the policy is in
  `plan.planner.KV_RING_ONLY_POLICIES`, so `--hdp-ring-kind latent` with it is refused at flag validation
  and `auto` says once that it plans K/V rings (`megatron/pretrain/args.py`).

Calling the scheduler without a process group: `BalancedCPScheduler.__init__` reads only
`dp_cp_group.size()`, and `get_groups_and_subsamples` is pure Python over (sample id, length) pairs (its
`config` argument is unused). So we hand it `_PoolSize`, an object whose `size()` is the HDP pool size;
no torch.distributed, no Megatron globals. `test_hybrid_cp_policy.py` checks that this stays true.
"""

from __future__ import annotations

import logging
from typing import Sequence

from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.zigzag import zigzag_chunks
from megatron_hdp.megatron.comparison.scheduler_groups import check_pool_holds, rings_and_schedule
from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan

logger = logging.getLogger(__name__)

POLICY = "megatron-hybrid-cp"


class _PoolSize:
    """The one thing `BalancedCPScheduler` asks of its `dp_cp_group`: how many ranks it has."""

    def __init__(self, num_ranks: int) -> None:
        self._num_ranks = num_ranks

    def size(self) -> int:
        return self._num_ranks


def megatron_schedule(
    lengths: Sequence[int], *, num_ranks: int, capacity: int
) -> tuple[list[list[list[int]]], list[list[list[int]]]]:
    """Megatron's raw answer: (groups, sample_id_groups), each [group][rank] -> list of lengths / ids."""
    scheduler = BalancedCPScheduler(max_seq_len_per_rank=capacity, dp_cp_group=_PoolSize(num_ranks))
    return scheduler.get_groups_and_subsamples(list(enumerate(int(n) for n in lengths)), None)


def _check_inputs(lengths: Sequence[int], *, num_ranks: int, capacity: int, pp_size: int) -> None:
    if pp_size != 1:
        raise ValueError(f"policy {POLICY} does not support pipeline parallelism (Megatron's Hybrid-CP has no PP); "
                         f"got pp_size={pp_size}")
    if num_ranks < 1 or num_ranks & (num_ranks - 1):
        raise ValueError(f"policy {POLICY} needs a power-of-two HDP pool (Megatron builds a CP group per power "
                         f"of two), got num_ranks={num_ranks}")
    check_pool_holds(lengths, num_ranks=num_ranks, capacity=capacity)


def plan_megatron_hybrid_cp(
    lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel, pp_size: int
) -> StepPlan:
    """Plan a global batch with Megatron-Core's `BalancedCPScheduler` (see the module docstring)."""
    capacity = config.hdp_capacity
    _check_inputs(lengths, num_ranks=num_ranks, capacity=capacity, pp_size=pp_size)
    _, sample_id_groups = megatron_schedule(lengths, num_ranks=num_ranks, capacity=capacity)

    rings, schedule = rings_and_schedule(sample_id_groups, num_ranks=num_ranks, num_sequences=len(lengths))
    per_rank = []
    for rank, per_group in enumerate(schedule):
        microbatches = []
        for ids in per_group:
            shards, est_time = [], 0.0
            for sample in ids:
                length, ring = lengths[sample], rings[sample]
                k = len(ring)
                chunks = ((0, length),) if k == 1 else zigzag_chunks(length, k, ring.index(rank))
                shard = Shard(sample, tuple(chunks))
                shards.append(shard)
                # one forward/backward pass per sub-sample, as Megatron runs them, on TE's K/V ring
                est_time += cost_model.microbatch_time([(length, shard.num_tokens, ring, "kv")])
            tokens = sum(s.num_tokens for s in shards)
            microbatches.append(MicroBatch(tuple(shards), max(capacity, tokens), est_time))
        per_rank.append(tuple(microbatches))

    # a barrier closes every group: the step is the sum over groups of the slowest rank, each rank of an EP
    # group running the group's mean routed expert work of that group
    times = cost_model.expert_coupled_times([[mb.est_time for mb in mbs] for mbs in per_rank],
                                            [[mb.num_tokens for mb in mbs] for mbs in per_rank])
    schedules = [RankSchedule(rank, mbs, sum(t)) for rank, (mbs, t) in enumerate(zip(per_rank, times))]
    step_time = sum(max(t[j] for t in times) for j in range(len(sample_id_groups)))
    sequences = tuple(SequencePlacement(i, int(n), rings[i]) for i, n in enumerate(lengths))
    logger.debug("%s: %d groups for %d sequences on %d ranks", POLICY, len(sample_id_groups), len(lengths), num_ranks)
    return StepPlan(
        policy=POLICY,
        num_ranks=num_ranks,
        capacity=capacity,
        sequences=sequences,
        ranks=tuple(schedules),
        est_step_time=step_time,
        pp_size=pp_size,
    ).validate()
