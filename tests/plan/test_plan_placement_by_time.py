"""`place_rings_by_time` keeps each node's ranks in a sorted list and re-times only the nodes a ring lands
on; its layouts must be exactly those of the definition: for every ring, time the k earliest ranks of
every node that has k (else the k earliest of all) and keep the group that starts first (ties: least
summed ready time, then lowest node id). The definition below is the straightforward version the
planner used until it cost ~1 ms a ring at 128 nodes."""

import numpy as np

from megatron_hdp.plan.search.placement import TimedLayout, place_rings_by_time


def _by_definition(order, ring_sizes, weights, num_ranks, overhead, domains, latest_ready=False):
    layout = TimedLayout(num_ranks)
    count = np.zeros(num_ranks, dtype=np.int64)
    node = np.zeros(num_ranks, dtype=np.int64) if domains is None else np.asarray(domains, dtype=np.int64)
    for seq in order:
        k, weight = int(ring_sizes[seq]), float(weights[seq])
        by_time = np.lexsort((np.arange(num_ranks), count, layout.finish))
        lists = [by_time[node[by_time] == n] for n in np.unique(node) if (node == n).sum() >= k] or [by_time]
        best = None
        for ranks in lists:
            group = ranks[:k]
            slot = int(count[group].max())
            ready = layout.finish[group] + (slot - count[group]) * overhead
            key = (float(ready.max()), float(ready.sum()))
            if best is None or key < best[0]:
                best = (key, ranks)
        members = best[1][:k]
        if latest_ready:  # of the ranks finished by the k-th earliest's finish, the k that finish last
            ready_by = int((layout.finish[best[1]] <= layout.finish[members[-1]]).sum())
            members = best[1][ready_by - k:ready_by]
        slot = int(count[members].max())
        ready = layout.finish[members] + (slot - count[members]) * overhead
        start = float(ready.max())
        for rank, rank_ready in zip(members.tolist(), ready.tolist()):
            fillers = slot - int(count[rank])
            if fillers:
                layout.gaps.append((rank, slot - 1, start - rank_ready))
            layout.leading[rank] += [[] for _ in range(fillers)] + [[seq]]
        layout.rings[seq] = tuple(sorted(members.tolist()))
        layout.finish[members] = start + overhead + weight
        count[members] = slot + 1
    return layout


def test_node_lists_reproduce_the_definition_exactly():
    """Random instances with many ties (integer weights, equal nodes, a zero overhead), uneven and
    shuffled node ids, rings larger than any node, and ring sizes in any order (the planner sorts them
    non-increasing, the function does not rely on it)."""
    rng = np.random.default_rng(14)
    for trial in range(300):
        num_ranks, num_rings = int(rng.integers(1, 40)), int(rng.integers(0, 30))
        ring_sizes = rng.integers(2, max(3, num_ranks + 1), size=num_rings)
        ring_sizes = np.minimum(ring_sizes, num_ranks) if num_ranks > 1 else ring_sizes[:0]
        num_rings = len(ring_sizes)
        weights = rng.integers(1, 4, size=num_rings).astype(float) if trial % 2 else rng.random(num_rings) * 3
        overhead = [0.0, 0.5, 0.1][trial % 3]
        domains = [None, np.arange(num_ranks) // int(rng.integers(1, 10)),
                   rng.permutation(rng.integers(0, 5, size=num_ranks) * 7)][trial % 3]
        order = list(range(num_rings)) if trial % 4 else sorted(range(num_rings), key=lambda s: -ring_sizes[s])
        args = dict(ring_sizes=ring_sizes, weights=weights, num_ranks=num_ranks, overhead=overhead)
        latest_ready = trial % 5 == 1
        got = place_rings_by_time(order, **args, domains=domains, latest_ready=latest_ready)
        expected = _by_definition(order, ring_sizes, weights, num_ranks, overhead, domains, latest_ready)
        assert got.rings == expected.rings
        assert got.leading == expected.leading
        assert got.gaps == expected.gaps
        assert got.finish.tolist() == expected.finish.tolist()


def test_latest_ready_members_start_the_ring_as_early_with_fewer_ranks_waiting():
    """4 ranks, narrow rings first: A (2 s) and B (1 s) side by side, then a ring of 3 that cannot start
    before A ends at 2 s. From the earliest ranks (B's two and one of A's) two ranks wait 1 s for it; from
    the latest ranks ready by 2 s (A's two and one of B's) one waits, and the other of B's is free from
    1 s for whole sequences. (All ranks ready at 0, the latest are the highest: A takes {2, 3}.)"""
    args = dict(ring_sizes=[2, 2, 3], weights=[2.0, 1.0, 1.5], num_ranks=4, overhead=0.0)
    earliest = place_rings_by_time([0, 1, 2], **args)
    latest = place_rings_by_time([0, 1, 2], **args, latest_ready=True)
    assert earliest.rings == {0: (0, 1), 1: (2, 3), 2: (0, 2, 3)}
    assert latest.rings == {0: (2, 3), 1: (0, 1), 2: (1, 2, 3)}
    assert earliest.finish.tolist() == [3.5, 2.0, 3.5, 3.5] and latest.finish.tolist() == [1.0, 3.5, 3.5, 3.5]
    # the ring starts at 2 s either way (3.5 - 1.5); rank 1 (earliest) or rank 0 (latest) stays out


def test_a_ring_stays_inside_a_node_when_one_has_room():
    """Two nodes of 4 ranks, a 4-ring on node 0 and a 2-ring on ranks 4, 5, all of one second: the next
    4-ring starts at 1 s on either node or on the four earliest ranks {0, 1, 6, 7}; it keeps to node 1
    (least summed ready time) when the nodes are known."""
    args = dict(ring_sizes=[4, 2, 4], weights=[1.0, 1.0, 1.0], num_ranks=8, overhead=0.0)
    inside = place_rings_by_time([0, 1, 2], **args, domains=[0, 0, 0, 0, 1, 1, 1, 1])
    anywhere = place_rings_by_time([0, 1, 2], **args)
    assert inside.rings == {0: (0, 1, 2, 3), 1: (4, 5), 2: (4, 5, 6, 7)}
    assert anywhere.rings == {0: (0, 1, 2, 3), 1: (4, 5), 2: (0, 1, 6, 7)}


def test_start_keys_of_many_groups_are_each_groups_own_to_the_bit():
    """The batched keys (`_start_keys`, every node at a ring-size change) equal `_start_key` of each group
    alone, float for float, for sizes past numpy's pairwise-summation block (8) and with ties."""
    from megatron_hdp.plan.search.placement import _start_key, _start_keys

    rng = np.random.default_rng(0)
    for _ in range(200):
        k, many = int(rng.integers(1, 40)), int(rng.integers(1, 30))
        overhead = float(rng.choice([0.0, 0.013, rng.random()]))
        groups = [[(float(rng.choice([rng.random() * 100, 1.0])), int(rng.integers(0, 5)), int(rank))
                   for rank in range(k)] for _ in range(many)]
        assert _start_keys(groups, overhead) == [_start_key(group, overhead) for group in groups]
