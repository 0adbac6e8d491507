"""`ep_floor.ep_prefix_floor` bounds from below the timed step of every schedule that starts with a ring
placement and appends micro-batches of whole sequences, and balance's by-time placements pruned with it
leave every plan as it was.

The reference is the timing (`assemble.time_plan`) of the completed schedule, and `build_ranks` with the
pruning off; the floor shares no code with them beyond the whole-sequence times and zigzag token counts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import shard_sequences
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.policies import balance, balance_candidates
from megatron_hdp.plan.search.widening import widening_options
from megatron_hdp.plan.timeline.assemble import time_plan
from megatron_hdp.plan.timeline.ep_floor import ep_coupled_floor, ep_prefix_floor, ep_step_floor


def _cost_models():
    """Mixtral (spread expert work, the all-to-all) and DeepSeek-V3 at TP 8 (MLA), with and without a
    topology and jitter."""
    for model, tp in (("mixtral-8x7b", 1), ("deepseek-v3", 8)):
        base = analytic_cost_model(model, "h100", tp_size=tp)
        for ranks_per_node, jitter in ((None, 0.0), (4, 0.0), (2, 0.05)):
            yield dataclasses.replace(base, ranks_per_node=ranks_per_node, jitter=jitter)


def _prefix_and_completion(rng: np.random.Generator, num_ranks: int, num_rings: int, num_whole: int):
    """Rings on random members at one index each (members padded with empty micro-batches up to it), some
    whole sequences beside them (the gaps a by-time placement fills); then the other whole sequences in new
    micro-batches after each rank's prefix. Returns lengths, rings, the prefix and the whole schedule."""
    lengths, rings = [], []
    prefix: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    for _ in range(num_rings):
        k = int(rng.integers(2, num_ranks + 1))
        members = tuple(sorted(rng.choice(num_ranks, size=k, replace=False).tolist()))
        seq = len(lengths)
        lengths.append(int(rng.integers(2 * k, 200_000)))
        rings.append(members)
        index = max(len(prefix[r]) for r in members) + int(rng.integers(0, 2))
        for r in members:
            prefix[r] += [[] for _ in range(index - len(prefix[r]))] + [[seq]]
    appended: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    for _ in range(num_whole):
        seq = len(lengths)
        lengths.append(int(rng.integers(1, 16_384)))
        rank = int(rng.integers(num_ranks))
        rings.append((rank,))
        if prefix[rank] and rng.random() < 0.2:  # a gap filled beside a ring or in an empty slot
            prefix[rank][int(rng.integers(len(prefix[rank])))].append(seq)
        elif appended[rank] and rng.random() < 0.5:
            appended[rank][-1].append(seq)
        else:
            appended[rank].append([seq])
    schedule = [[list(mb) for mb in p] + a for p, a in zip(prefix, appended)]
    return lengths, rings, prefix, schedule


@pytest.mark.parametrize("seed", range(30))
def test_prefix_floor_is_at_most_the_timed_step_of_every_completion(seed):
    rng = np.random.default_rng(seed)
    for cost_model in _cost_models():
        ep = int(rng.choice([2, 4, 8]))
        num_ranks = ep * int(rng.integers(1, 5))
        cost_model = dataclasses.replace(cost_model, expert_parallel_size=ep)
        lengths, rings, prefix, schedule = _prefix_and_completion(
            rng, num_ranks, num_rings=int(rng.integers(0, 4)), num_whole=int(rng.integers(0, 6 * num_ranks)))
        ring_of = {seq: ring for seq, ring in enumerate(rings) if len(ring) > 1}
        floor = ep_prefix_floor(prefix, ring_of=ring_of, lengths=lengths, cost_model=cost_model)
        step = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                         schedule=schedule, capacity=200_000, cost_model=cost_model).est_step_time
        assert 0 <= floor <= step, (seed, ep, floor, step)


def _options(lengths, ranks, cost_model):
    """Every ring-size choice balance plans for the batch (`widening_options` with its alternatives)."""
    tokens = np.asarray(lengths, dtype=np.int64)
    sharding = shard_sequences(tokens, capacity=16384, num_ranks=ranks, cost_model=cost_model, max_offload_ratio=1.0)
    return tokens, widening_options(tokens, sharding.ring_sizes, sharding.offload_ratios, num_ranks=ranks,
                                    capacity=16384, cost_model=cost_model, max_offload_ratio=1.0, alternatives=True)


def test_build_ranks_prunes_only_by_time_placements_that_could_not_replace(monkeypatch):
    """`build_ranks` under EP makes, for every ring-size choice, the plan it makes with the pruning off (a
    floor of 0 prunes nothing), while it does prune placements (fewer timed) and by-time placements do win
    elsewhere (the plan differs where all are pruned)."""
    timed = {"on": 0, "off": 0}
    finish = balance_candidates.fastest
    wins = 0
    cases = (("mixtral-8x7b", 1, 8, 32, "byted", 1), ("mixtral-8x7b", 1, 4, 64, "github", 1),
             ("deepseek-v3", 8, 8, 32, "byted", 2))
    for model, tp, ep, ranks, mix, seed in cases:
        cost_model = dataclasses.replace(analytic_cost_model(model, "h100", tp_size=tp), ranks_per_node=8,
                                         expert_parallel_size=ep)
        lengths = sample_global_batch(mix, num_tokens=ranks * 2 * 16384, seed=seed, max_length=ranks * 8192)
        tokens, options = _options(lengths, ranks, cost_model)

        def plans(floor, count=None, beats=None):
            monkeypatch.setattr(balance_candidates, "ep_prefix_floor", floor)

            def counted(*args, **kwargs):
                timed[count] = timed.get(count, 0) + 1
                return finish(*args, **kwargs)

            monkeypatch.setattr(balance_candidates, "fastest", counted)
            return [balance_candidates.build_ranks(
                lengths, sizes, ratios, tokens=tokens, num_ranks=ranks, capacity=16384, cost_model=cost_model,
                pp_size=1, vpp_size=1, exact=False, shared=balance_candidates.BatchShare(),
                beat=None if beats is None else beats[i]) for i, (sizes, ratios) in enumerate(options)]

        on, off = plans(ep_prefix_floor, "on"), plans(lambda *a, **k: 0.0, "off")
        never = plans(lambda *a, **k: float("inf"))
        for a, b in zip(on, off):
            assert (a.est_step_time, a.schedule, a.rings) == (b.est_step_time, b.schedule, b.rings)
        wins += sum(b.schedule != c.schedule for b, c in zip(off, never))
        # told to beat a step just above the plan's, every by-time placement that wins must still be made
        just = plans(ep_prefix_floor, "beat", beats=[b.est_step_time * (1 + 1e-9) for b in off])
        for a, b in zip(just, off):
            assert (a.est_step_time, a.schedule) == (b.est_step_time, b.schedule)
    assert timed["on"] < timed["off"] and wins


@pytest.mark.parametrize("seed", range(30))
def test_coupled_floor_is_between_the_step_floor_and_the_timed_step(seed):
    """`ep_coupled_floor` (the floor's grid run through the coupling) is at most the timed step of every
    schedule, jitter included, and at least `ep_step_floor` (the rings only add waits)."""
    rng = np.random.default_rng(1000 + seed)
    for cost_model in _cost_models():
        ep = int(rng.choice([2, 4, 8]))
        num_ranks = ep * int(rng.integers(1, 5))
        cost_model = dataclasses.replace(cost_model, expert_parallel_size=ep)
        lengths, rings, _, schedule = _prefix_and_completion(
            rng, num_ranks, num_rings=int(rng.integers(0, 5)), num_whole=int(rng.integers(0, 6 * num_ranks)))
        step = time_plan(policy="balance", lengths=lengths, rings=rings, offload_ratios=[0.0] * len(lengths),
                         schedule=schedule, capacity=200_000, cost_model=cost_model).est_step_time
        coupled = ep_coupled_floor(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
        floor = ep_step_floor(schedule, rings=rings, lengths=lengths, cost_model=cost_model)
        assert floor * (1 - 1e-12) <= coupled <= step, (seed, ep, floor, coupled, step)


def test_balance_prunes_only_by_time_placements_that_could_not_win(monkeypatch):
    """balance under EP, whose plans rank by rank skip by-time placements that could not beat the best plan
    so far (`beat`) or replace their aligned plan, makes the plan it makes with the pruning off, to the
    digest, on batches where it prunes (fewer placements timed)."""
    timed = {}
    finish = balance_candidates.fastest
    config = HDPConfig(hdp=True, hdp_capacity=16384)
    cases = (("mixtral-8x7b", 1, 8, 64, "byted", 1), ("mixtral-8x7b", 1, 8, 32, "github", 1),
             ("deepseek-v3", 8, 8, 32, "byted", 1))
    for model, tp, ep, ranks, mix, seed in cases:
        cost_model = dataclasses.replace(analytic_cost_model(model, "h100", tp_size=tp), ranks_per_node=8,
                                         expert_parallel_size=ep)
        lengths = sample_global_batch(mix, num_tokens=ranks * 2 * 16384, seed=seed, max_length=ranks * 8192)
        digests = {}
        for name, floor in (("on", ep_prefix_floor), ("off", lambda *args, **kwargs: 0.0)):
            def counted(*args, name=name, **kwargs):
                timed[name] = timed.get(name, 0) + 1
                return finish(*args, **kwargs)

            monkeypatch.setattr(balance_candidates, "fastest", counted)
            monkeypatch.setattr(balance_candidates, "ep_prefix_floor", floor)
            plan = balance.plan_balance(lengths, num_ranks=ranks, config=config, cost_model=cost_model)
            digests[name] = plan.digest()
        assert digests["on"] == digests["off"], (model, ranks, mix, seed)
    assert timed["on"] < timed["off"]
