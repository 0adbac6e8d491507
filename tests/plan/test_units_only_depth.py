"""`balance.UNITS_ONLY_DEPTH`: with EP units, a deep batch on a large pool is planned by units alone.

The rule is evidence, not a proof (benchmarks/ep_families.py's sweeps): these tests pin what it skips and
where, and that where the skipped families would not have won the plan is the one the full search makes.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.policies import balance
from megatron_hdp.sim.cluster import ClusterSpec

CAPACITY = 16384
RANKS = 128  # above `SMALL_POOL`


def _mixtral():
    spec = ClusterSpec("mixtral-8x7b", num_gpus=RANKS, tp_size=1)
    return dataclasses.replace(spec.cost_model(), expert_parallel_size=8, ranks_per_node=8)


def _plan(monkeypatch, lengths, *, num_ranks=RANKS, depth=None):
    """balance's plan of `lengths` and how often it built a plan rank by rank (the EP-1 pass included)."""
    built = []
    build_ranks = balance.build_ranks
    monkeypatch.setattr(balance, "build_ranks", lambda *a, **k: built.append(1) or build_ranks(*a, **k))
    if depth is not None:
        monkeypatch.setattr(balance, "UNITS_ONLY_DEPTH", depth)
    plan = balance.plan_balance(lengths, num_ranks=num_ranks, cost_model=_mixtral(),
                                config=HDPConfig(hdp=True, hdp_capacity=CAPACITY))
    monkeypatch.undo()
    return plan, len(built)


def _batch(depth: float, seed: int, num_ranks: int = RANKS) -> list[int]:
    """A byted batch of `depth` C-token micro-batches a rank whose unit plan leaves room (`improvable`)."""
    return sample_global_batch("byted", num_tokens=int(depth * CAPACITY * num_ranks), seed=seed, max_length=1 << 18)


@pytest.mark.parametrize("seed", [1, 3])
def test_a_deep_batch_on_a_large_pool_is_planned_by_units_alone_and_as_the_full_search_plans_it(monkeypatch, seed):
    """2.25 C-token micro-batches a rank on 128 ranks: no plan rank by rank is built, and the plan is the
    full search's, which built one and lost with it (as in every sweep batch at that depth)."""
    lengths = _batch(2.25, seed)
    assert sum(lengths) >= balance.UNITS_ONLY_DEPTH * CAPACITY * RANKS
    gated, built = _plan(monkeypatch, lengths)
    full, built_full = _plan(monkeypatch, lengths, depth=float("inf"))
    assert built == 0
    assert built_full > 0  # the full search did try them (its unit plan was `improvable`)
    assert gated.est_step_time == pytest.approx(full.est_step_time, rel=1e-12)


def test_a_shallow_batch_or_a_small_pool_still_tries_plans_rank_by_rank(monkeypatch):
    """Below the depth (1.5 micro-batches a rank), or on a pool of `SMALL_POOL` ranks at any depth (2.25),
    the plan rank by rank is still built where the unit plan leaves room."""
    assert _plan(monkeypatch, _batch(1.5, seed=3))[1] > 0
    small = balance.SMALL_POOL
    assert _plan(monkeypatch, _batch(2.25, seed=4, num_ranks=small), num_ranks=small)[1] > 0
