"""Planning a post-training batch: each sample's token count in, a `StepPlan` out (pure; no torch, no Megatron).

A framework's driver (which may have no GPU stack) calls `plan_rollouts` on the token counts of its
rollouts and ships the plan (`StepPlan.to_json()`) and, to each HDP rank, the samples `samples_of_rank`
names; every worker then runs the same plan (`posttrain.runtime.PostTrainer`). Deterministic: the same
counts, config and cost model give the same plan on every process.

Position convention (one for the whole post-training door): a sample of N tokens t_0..t_{N-1} has N - 1
next-token predictions, so it is an HDP sequence of plan length L = N - 1 with L + 1 raw tokens (the
project's label convention, `data/collate.py`): plan position i reads t_i and predicts t_{i+1}.
Token-aligned values (log-probs, entropy, every side field) are indexed by the *predicted* token: entry t
(1 <= t < N) belongs to the prediction of t_t from t_0..t_{t-1}; entry 0 predicts nothing.

Prompt lengths (optional): sample i's first P_i tokens are its prompt (0 <= P_i < N_i). The plan carries
them (`StepPlan.prompt_lengths`, in its JSON), so every worker knows which predictions carry loss: the
response mask (`response_masks`) is 1 at entry t iff t >= max(P_i, 1), i.e. on the prediction of every
response token, and `PostTrainer` hands it to `loss_fn` as the field `"response_mask"`. They do not
move the placement: a prompt token costs the forward and backward of any other (the response attends to
it, and its activations are kept for the backward), so a placement by token count is the placement by
work.

Every sample is placed exactly once (`StepPlan.validate`); a rank the plan leaves without work runs one
loss-free padding micro-batch at run time (`data.prepare.pad_microbatches`), so it never hangs in the
gradient reduction; MoE expert-parallel groups are planned as units when `cost_model` carries the unit
(`mesh_cost_model(..., ep_size=...)` or `HDPTrainer.planning_cost_model`); pipelines and virtual stages
are planned as in pre-training (`pp_size`, `vpp_size`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.step_plan import StepPlan


def plan_lengths(num_tokens: Sequence[int]) -> list[int]:
    """The plan length (next-token predictions, N - 1) of each sample of `num_tokens[i]` = N tokens.

    ValueError naming the first sample with fewer than 2 tokens (it predicts nothing)."""
    lengths = []
    for index, count in enumerate(num_tokens):
        if isinstance(count, bool) or int(count) != count or count < 2:
            raise ValueError(f"sample {index} has {count!r} tokens: a sample needs at least 2 (one prediction)")
        lengths.append(int(count) - 1)
    return lengths


def plan_rollouts(
    num_tokens: Sequence[int],
    *,
    prompt_lengths: Optional[Sequence[int]] = None,
    num_ranks: int,
    config: HDPConfig,
    cost_model: CostModel,
    pp_size: int = 1,
    vpp_size: int = 1,
    policy: Optional[str] = None,
) -> StepPlan:
    """The StepPlan of a post-training batch whose sample i has `num_tokens[i]` tokens (prompt and
    response), over `num_ranks` HDP ranks with the capacity and policy of `config` (`policy` overrides
    it). Sequence i of the plan is sample i (plan length N_i - 1: module docstring). `prompt_lengths`: each
    sample's prompt tokens, carried by the plan for its response mask (module docstring)."""
    if not len(num_tokens):
        raise ValueError("cannot plan an empty batch: pass the token count of at least one sample")
    plan = make_plan(plan_lengths(num_tokens), num_ranks=num_ranks, config=config, cost_model=cost_model,
                     pp_size=pp_size, vpp_size=vpp_size, policy=policy)
    if prompt_lengths is None:
        return plan
    return dataclasses.replace(plan, prompt_lengths=tuple(prompt_lengths)).validate()  # names a bad prompt


def response_masks(plan: StepPlan, samples: Optional[Sequence[int]] = None) -> list[np.ndarray]:
    """The float32 token-aligned response mask of each of `samples` (plan indices; default all) of a plan
    with prompt lengths: entry t is 1 iff t >= max(prompt, 1) (module docstring)."""
    if plan.prompt_lengths is None:
        raise ValueError("this plan carries no prompt lengths: plan with plan_rollouts(..., prompt_lengths=...)")
    indices = range(len(plan.sequences)) if samples is None else samples
    return [(np.arange(plan.sequences[i].length + 1) >= max(plan.prompt_lengths[i], 1)).astype(np.float32)
            for i in indices]


def samples_of_rank(plan: StepPlan, rank: int) -> list[int]:
    """Indices of the samples HDP rank `rank` holds a part of (ascending): what a driver ships to it."""
    if not 0 <= rank < plan.num_ranks:
        raise ValueError(f"rank {rank} is not an HDP rank of a plan for {plan.num_ranks} ranks")
    return sorted({shard.seq for mb in plan.microbatches(rank) for shard in mb.shards})


def sample_owner(plan: StepPlan) -> list[int]:
    """The HDP rank that owns each sample's results (`gather="own"`): the first member of its ring."""
    return [seq.ring[0] for seq in plan.sequences]
