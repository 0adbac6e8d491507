"""`ep_floor.ep_step_floor` bounds the timed step of an EP schedule from below, and balance's pruning with it
leaves the plan as it was.

The reference is the timing itself (`assemble.time_plan`: the micro-batch costs, ring kinds, the spread
expert work, the runtime's padding and the coupling), which the floor shares no code with beyond the
whole-sequence times and the zigzag token counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.policies import balance, balance_candidates
from megatron_hdp.plan.timeline.assemble import time_plan
from megatron_hdp.plan.timeline.ep_floor import ep_step_floor


def _cost_models():
    """MoE cost models with the spread expert work and the all-to-all (Mixtral), multi-latent attention with
    auto ring kinds (DeepSeek-V3 at TP 8), each with and without a topology and jitter."""
    for model, tp in (("mixtral-8x7b", 1), ("deepseek-v3", 8)):
        base = analytic_cost_model(model, "h100", tp_size=tp)
        for ranks_per_node, jitter in ((None, 0.0), (4, 0.0), (2, 0.05)):
            yield dataclasses.replace(base, ranks_per_node=ranks_per_node, jitter=jitter)


def _random_schedule(rng: np.random.Generator, num_ranks: int, lengths: list[int]):
    """Rings on random members at a common index (the others padded with empty micro-batches up to it),
    whole sequences in a new micro-batch or beside what a rank already runs."""
    schedule: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    rings = []
    for seq, length in enumerate(lengths):
        k = int(rng.integers(2, min(num_ranks, length // 2) + 1)) if length >= 4 and rng.random() < 0.4 else 1
        members = sorted(rng.choice(num_ranks, size=k, replace=False).tolist())
        rings.append(tuple(members))
        if k == 1 and schedule[members[0]] and rng.random() < 0.5:
            schedule[members[0]][int(rng.integers(len(schedule[members[0]])))].append(seq)
            continue
        index = max(len(schedule[r]) for r in members) + int(rng.integers(0, 2))
        for r in members:
            schedule[r] += [[] for _ in range(index - len(schedule[r]))] + [[seq]]
    return schedule, rings


@pytest.mark.parametrize("seed", range(40))
def test_floor_is_at_most_the_timed_step_of_random_schedules(seed):
    rng = np.random.default_rng(seed)
    for cost_model in _cost_models():
        ep = int(rng.choice([2, 4, 8]))
        num_ranks = ep * int(rng.integers(1, 5))
        cost_model = dataclasses.replace(cost_model, expert_parallel_size=ep)
        lengths = rng.integers(1, 40_000, size=int(rng.integers(1, 4 * num_ranks))).tolist()
        schedule, rings = _random_schedule(rng, num_ranks, lengths)
        step = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                         schedule=schedule, capacity=40_000, cost_model=cost_model).est_step_time
        floor = ep_step_floor(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
        assert 0 < floor <= step, (seed, cost_model.expert_parallel_size, floor, step)


def _balance_cases():
    """Batches on which balance plans several EP-unit families and the floor skips the timing of some (3-4
    of 5-6 families each; DeepSeek-V3 with MLA auto rings, Mixtral with the all-to-all's transfers)."""
    for model, tp, ep, ranks, mix, seed, per_rank in (
            ("deepseek-v3", 8, 32, 256, "byted", 1, 2), ("deepseek-v3", 8, 8, 128, "github", 1, 4),
            ("mixtral-8x7b", 1, 8, 64, "github", 2, 2), ("mixtral-8x7b", 1, 4, 32, "byted", 3, 2)):
        cost_model = dataclasses.replace(analytic_cost_model(model, "h100", tp_size=tp), ranks_per_node=8,
                                         expert_parallel_size=ep)
        lengths = sample_global_batch(mix, num_tokens=ranks * per_rank * 16384, seed=seed, max_length=ranks * 8192)
        yield lengths, ranks, cost_model


def test_balance_prunes_only_unit_families_that_could_not_win(monkeypatch):
    """Every floor balance computes is at most that family's timed step, and balance with the pruning makes
    the plan it makes with the pruning off (a floor of 0 prunes nothing), to the digest."""
    floors = []

    def checked(schedule, *, rings, lengths, cost_model):
        floor = ep_step_floor(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
        step = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                         schedule=schedule, capacity=16384, cost_model=cost_model).est_step_time
        assert floor <= step, (floor, step)
        floors.append(floor)
        return floor

    config = HDPConfig(hdp=True, hdp_capacity=16384)
    for lengths, ranks, cost_model in _balance_cases():
        monkeypatch.setattr(balance_candidates, "ep_step_floor", checked)
        pruned = balance.plan_balance(lengths, num_ranks=ranks, config=config, cost_model=cost_model)
        monkeypatch.setattr(balance_candidates, "ep_step_floor", lambda *args, **kwargs: 0.0)
        assert balance.plan_balance(lengths, num_ranks=ranks, config=config, cost_model=cost_model).digest() == \
            pruned.digest()
    assert floors  # the cases do plan more than one EP-unit family
