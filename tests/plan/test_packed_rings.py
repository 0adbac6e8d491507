"""Balance's placement of the sequences longer than C packed on CP groups' rings (`search.packed_rings`),
each step against a case solved by hand or by brute force."""

import itertools

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import max_member_tokens
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.search.cp_groups import group_size, karmarkar_karp
from megatron_hdp.plan.search.packed_rings import _GroupLayout, even_bins, groups_beside_whole, pack_on_groups

CM = analytic_cost_model("llama3-8b")


def test_groups_beside_whole_leaves_room_for_whole_sequences():
    """Two groups of 2 ranks, four ring sequences of 1 s per member and two whole ones of 2 s: equal ring
    loads (two per group, Karmarkar-Karp's) put a whole one on top of 2 s, a step of 4 s; the optimum (by
    hand: 12 s of work over 4 ranks) is 3 s, both whole ones in one group beside one ring sequence."""
    groups, ranks = groups_beside_whole([1.0] * 4, [2.0, 2.0], cp=2, num_ranks=4)
    assert sorted(map(len, groups)) == [1, 3] and sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    host = next(g for g, group in enumerate(groups) if len(group) == 1)
    assert [ranks[2 * host], ranks[2 * host + 1]] in ([[0], [1]], [[1], [0]])


@pytest.mark.parametrize("seed", range(20))
def test_even_bins_are_never_worse_than_karmarkar_karp_and_near_the_brute_force(seed):
    """7-9 items in 3 bins: the heaviest bin of `even_bins` is never above Karmarkar-Karp's, and within 5%
    of the brute-force optimum over all 3^n assignments."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1.0, 10.0, size=int(rng.integers(7, 10)))
    bins = even_bins(weights, 3)
    assert sorted(i for b in bins for i in b) == list(range(len(weights)))
    heaviest = max(weights[b].sum() for b in bins)
    assert heaviest <= max(weights[b].sum() for b in karmarkar_karp(weights.tolist(), 3)) + 1e-12
    every = np.array(list(itertools.product(range(3), repeat=len(weights))))  # each row an assignment
    best = np.max([(weights * (every == k)).sum(axis=1) for k in range(3)], axis=0).min()
    assert heaviest <= 1.05 * best


def test_even_bins_fix_karmarkar_karps_textbook_miss():
    """Karmarkar-Karp splits 8 7 6 5 4 into 16 / 14; the even split is 15 / 15 (8 + 7, 6 + 5 + 4)."""
    weights = np.array([8.0, 7.0, 6.0, 5.0, 4.0])
    assert sorted(weights[b].sum() for b in karmarkar_karp(weights.tolist(), 2)) == [14.0, 16.0]
    assert sorted(weights[b].sum() for b in even_bins(weights, 2)) == [15.0, 15.0]


def test_a_sequence_that_fits_half_a_group_runs_beside_the_busy_half():
    """A group of 4 whose members 0 and 1 already hold whole sequences of t seconds, and one sequence of
    1.5 C (it needs a ring of 2) whose time on a ring of 2 is t: on members 2 and 3 every member ends at t;
    on the group's ring of 4 members 0 and 1 would end above t."""
    tokens = np.array([6144])
    layout = _GroupLayout(tokens, np.array([0]), cp=4, capacity=4096, cost_model=CM, pp_size=1)
    assert layout.need == [2]
    t = layout.work(0, 2)
    beside = np.array([t, t, 0.0, 0.0])
    blocks, ring = layout.layout([0], beside, 0)
    loads = beside + ring
    assert blocks == [((2, 2), [[0]])]
    assert loads[0] == loads[1] == t and loads[2] == loads[3] > 0.9 * t


@pytest.mark.parametrize("seed", range(4))
def test_pack_on_groups_places_every_sequence_once_on_aligned_rings_within_capacity(seed):
    """Every ring sequence on one ring inside one group, at the same micro-batch index on every member,
    <= C tokens per member per micro-batch; every whole sequence on one rank; nothing else."""
    rng = np.random.default_rng(seed)
    tokens = np.concatenate([rng.integers(4097, 32769, size=30), rng.integers(500, 4097, size=25)])
    long_ids, whole_ids = np.flatnonzero(tokens > 4096), np.flatnonzero(tokens <= 4096)
    rings, leading, finish, whole = pack_on_groups(tokens, long_ids=long_ids, whole_ids=whole_ids,
                                           whole_seconds=tokens[whole_ids] * 1e-4, cp=8, num_ranks=32, capacity=4096,
                                           cost_model=CM)
    assert sorted(rings) == long_ids.tolist()
    assert sorted(s for items in whole for s in items) == whole_ids.tolist()
    for seq, ring in rings.items():
        assert ring[0] // 8 == ring[-1] // 8 and list(ring) == list(range(ring[0], ring[0] + len(ring)))
        index = {rank: next(k for k, mb in enumerate(leading[rank]) if seq in mb) for rank in ring}
        assert len(set(index.values())) == 1
    for mbs in leading:
        for mb in mbs:  # a member holds at least ceil(L / k) tokens of a document of L on a ring of k
            assert all(seq in rings for seq in mb)
            assert sum(-(-int(tokens[q]) // len(rings[q])) for q in mb) <= 4096
    for rank, mbs in enumerate(leading):  # each rank's ring seconds: its micro-batches timed on their rings
        assert finish[rank] == pytest.approx(sum(CM.microbatch_time(
            [(int(tokens[q]), max_member_tokens(int(tokens[q]), len(rings[q])), rings[q]) for q in mb]) for mb in mbs))


def test_group_size_checks_every_length_and_balance_plans_what_no_group_holds():
    """A zigzag member's share is not monotone in the length: at C = 1 a ring of 4 holds 4 tokens (1 per
    member) but no ring holds 3 (a member always gets 2 of its 2k chunks' tokens), so the group size is
    checked on each length (hypothesis found [3, 4] on 4 ranks at C = 1 crashing balance's candidate)."""
    assert group_size([4], capacity=1, num_ranks=4) == 4
    assert group_size([3, 4], capacity=1, num_ranks=16) is None
    assert group_size([3, 4], capacity=2, num_ranks=16) == 2
    plan = make_plan([3, 4], num_ranks=4, config=HDPConfig(hdp=True, hdp_capacity=1, hdp_offload=False),
                     cost_model=analytic_cost_model("llama-7b"), policy="balance")
    assert sorted(p.length for p in plan.sequences) == [3, 4]
