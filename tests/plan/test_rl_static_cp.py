"""The RL frameworks' static-CP policy (`rl-static-cp`) and the `rl-rollouts` length mix (issue 39).

Each property is checked against a reference written here: brute-force partitions for Karmarkar-Karp,
the CP rule and zigzag shares recomputed from the lengths, and the log-normal the mix is built from,
evaluated with scipy.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model, hardware_profile, model_shape
from megatron_hdp.plan.lengths import K, ROLLOUT_MEDIAN, ROLLOUT_RANGE, ROLLOUT_SIGMA, synthetic_lengths
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.search.cp_groups import karmarkar_karp


def _best_max_part(weights: list[float], k: int) -> float:
    """The optimal k-way partition's largest part, by trying every assignment."""
    best = math.inf
    for assignment in itertools.product(range(k), repeat=len(weights)):
        sums = [0.0] * k
        for w, part in zip(weights, assignment):
            sums[part] += w
        best = min(best, max(sums))
    return best


@pytest.mark.parametrize("k", [2, 3])
def test_karmarkar_karp_places_each_item_once_within_its_known_bound_of_the_optimum(k):
    # The differencing method's largest part is at most (4/3 - 1/(3k)) x the optimum (Michiels et al.,
    # "Performance ratios for the Karmarkar-Karp differencing method", 2007).
    rng = np.random.default_rng(k)
    exact = 0
    for _ in range(40):
        weights = rng.integers(1, 50, size=int(rng.integers(1, 8))).astype(float).tolist()
        parts = karmarkar_karp(weights, k)
        assert len(parts) == k and sorted(i for p in parts for i in p) == list(range(len(weights)))
        got = max(sum(weights[i] for i in p) for p in parts)
        best = _best_max_part(weights, k)
        assert got <= (4 / 3 - 1 / (3 * k)) * best + 1e-9
        exact += got == best
    assert exact >= 30  # and on most small cases it finds the optimum


def test_karmarkar_karp_on_the_textbook_case_and_edge_cases():
    # {8, 7, 6, 5, 4}: differencing leaves a difference of 2 (16 vs 14) where 15 / 15 exists.
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in parts) == [14, 16]
    assert karmarkar_karp([], 3) == [[], [], []]
    assert sorted(map(len, karmarkar_karp([1.0, 2.0], 4))) == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="num_parts must be >= 1, got 0"):
        karmarkar_karp([1.0], 0)


def _cost_model():
    return analytic_cost_model(model_shape("llama3-8b"), hardware_profile("h100"), tp_size=8)


def _reference_cp(max_length: int, capacity: int) -> int:
    cp = 1
    while (max_length if cp == 1 else math.ceil(max_length / (2 * cp)) * 2) > capacity:
        cp *= 2
    return cp


@pytest.mark.parametrize("num_ranks,capacity,seed", [(8, 4 * K, 0), (16, 8 * K, 1), (8, 64 * K, 2)])
def test_rl_static_cp_pads_to_2cp_rings_every_sequence_and_gives_every_rank_the_same_count(num_ranks, capacity, seed):
    lengths = [int(n) for n in np.minimum(synthetic_lengths("rl-rollouts", num_sequences=60, seed=seed), 32 * K)]
    plan = make_plan(lengths, num_ranks=num_ranks, config=HDPConfig(hdp=True, hdp_capacity=capacity),
                     cost_model=_cost_model(), policy="rl-static-cp")
    cp = _reference_cp(max(lengths), capacity)
    for seq, n in zip(plan.sequences, lengths):
        pad = 1 if cp == 1 else 2 * cp
        assert seq.length % pad == 0 and n <= seq.length < n + pad
        first = seq.ring[0]
        assert first % cp == 0 and seq.ring == tuple(range(first, first + cp))  # its DP group's whole CP ring
    counts = {len(r.microbatches) for r in plan.ranks}
    assert len(counts) == 1  # equal micro-batch counts on every rank
    for rank in plan.ranks:
        group = rank.rank - rank.rank % cp
        for index, mb in enumerate(rank.microbatches):
            held = sum(shard.num_tokens for shard in mb.shards)
            assert held <= capacity
            assert all(shard.num_tokens == plan.sequences[shard.seq].length // cp for shard in mb.shards)
            assert ({s.seq for s in mb.shards} == {s.seq for s in plan.ranks[group].microbatches[index].shards})


def test_rl_static_cp_runs_empty_microbatches_where_a_dp_group_has_less_to_do():
    # CP 2 at C = 4K; KK puts {8192, 8192, 100} on one group (3 micro-batches: 4096 + 50 > C per member)
    # and {8192, 8192} on the other, which then runs 2 micro-batches and one empty, loss-free one.
    plan = make_plan([8192, 8192, 8192, 8192, 100], num_ranks=4, config=HDPConfig(hdp=True, hdp_capacity=4 * K),
                     cost_model=_cost_model(), policy="rl-static-cp")
    assert [len(r.microbatches) for r in plan.ranks] == [3, 3, 3, 3]
    assert sorted(sum(not mb.shards for mb in r.microbatches) for r in plan.ranks) == [0, 0, 1, 1]


def test_rl_static_cp_balances_dp_groups_as_karmarkar_karp_on_the_cost_model():
    # 6 sequences, CP 2 (the longest needs it), 2 DP groups: the groups' busy times are within the
    # differencing method's bound of the best split, found by trying all 2^6 splits.
    cost_model = _cost_model()
    lengths = [6000, 3000, 2500, 2000, 1200, 900]
    plan = make_plan(lengths, num_ranks=4, config=HDPConfig(hdp=True, hdp_capacity=4 * K), cost_model=cost_model,
                     policy="rl-static-cp")
    overhead = cost_model.microbatch_time([])
    work = [cost_model.microbatch_time([(s.length, s.length // 2, (0, 1))]) - overhead for s in plan.sequences]
    groups = [sum(work[s.id] for s in plan.sequences if s.ring[0] == g) for g in (0, 2)]
    assert max(groups) <= (4 / 3 - 1 / 6) * _best_max_part(work, 2) + 1e-12


def test_rl_static_cp_refuses_a_sequence_no_static_group_holds():
    with pytest.raises(ValueError, match="policy rl-static-cp: the longest sequence \\(9000 tokens\\) needs a static CP "
                                         "group of 4 ranks"):
        make_plan([9000, 100], num_ranks=2, config=HDPConfig(hdp=True, hdp_capacity=4 * K),
                  cost_model=_cost_model(), policy="rl-static-cp")


def test_rl_rollouts_mix_follows_its_log_normal_on_1k_to_128k():
    lengths = synthetic_lengths("rl-rollouts", num_sequences=200_000, seed=7)
    lo, hi = ROLLOUT_RANGE
    law = stats.lognorm(s=ROLLOUT_SIGMA, scale=ROLLOUT_MEDIAN)
    inside = law.cdf(hi) - law.cdf(lo)
    assert lengths.min() >= lo and lengths.max() <= hi
    for edge in (2 * K, 4 * K, 8 * K, 16 * K, 32 * K, 64 * K):  # the octave edges: exact masses
        expected = (law.cdf(edge) - law.cdf(lo)) / inside
        assert abs(np.mean(lengths <= edge) - expected) < 0.004
    from scipy.integrate import quad

    mean = quad(lambda x: x * law.pdf(x), lo, hi, limit=200)[0] / inside
    assert abs(lengths.mean() / mean - 1) < 0.02
    clipped = np.minimum(lengths, 32 * K)  # a 32K response cap: the truncated rollouts sit at the cap
    assert abs(np.mean(clipped == 32 * K) - (law.cdf(hi) - law.cdf(32 * K)) / inside) < 0.003
