"""Zigzag row indices and ring plans, checked for every ring position in one process (no torch.distributed)."""

import itertools

import pytest
import torch

from megatron_hdp.attention import zigzag_token_indices
from megatron_hdp.attention.ring_plan import ring_plan
from megatron_hdp.comm.p2p import Ring, current_ring
from megatron_hdp.plan.zigzag import zigzag_chunks, zigzag_num_tokens

CPU = torch.device("cpu")


def _edge_lengths(ring_size):
    """1, 2k-1, 2k, 2k+1 and a longer odd length."""
    return [1, 2 * ring_size - 1, 2 * ring_size, 2 * ring_size + 1, 5 * ring_size + 3]


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5, 8])
def test_positions_cover_every_token_once_in_zigzag_order(ring_size):
    seqlens = _edge_lengths(ring_size)
    starts = list(itertools.accumulate([0] + seqlens))
    held = []
    for position in range(ring_size):
        rows = zigzag_token_indices(seqlens, ring_size, position)
        assert rows.dtype == torch.int64
        assert len(rows) == sum(zigzag_num_tokens(n, ring_size, position) for n in seqlens)
        expected = [
            r
            for doc, length in enumerate(seqlens)
            for a, b in zigzag_chunks(length, ring_size, position)
            for r in range(starts[doc] + a, starts[doc] + b)
        ]
        assert rows.tolist() == expected
        held.extend(expected)
    assert sorted(held) == list(range(sum(seqlens)))


@pytest.mark.parametrize("seqlens", [[], [0], [3, -1], [2.5]])
def test_bad_seqlens_raise(seqlens):
    with pytest.raises(ValueError, match="seqlens|length"):
        zigzag_token_indices(seqlens, 2, 0)


def _pairs_of_plan(seqlens, ring_size, position, causal):
    """(q token, kv token) global pairs the plan of `position` attends, with multiplicity."""
    plan = ring_plan(tuple(seqlens), ring_size, position, causal, CPU)
    rows = [zigzag_token_indices(seqlens, ring_size, p) for p in range(ring_size)]
    doc_of = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    pairs = []
    for step, block in ((s, b) for s, calls in enumerate(plan.blocks) for b in calls):
        src = plan.source(step)
        q_tokens = block.q_rows.take(rows[position])
        kv_tokens = block.kv_rows.take(rows[src])
        seg = block.segments
        for q0, q1, k0, k1 in zip(seg.cu_q, seg.cu_q[1:], seg.cu_k, seg.cu_k[1:]):
            qs, ks = q_tokens[q0:q1].tolist(), kv_tokens[k0:k1].tolist()
            assert len({int(doc_of[t]) for t in qs + ks}) == 1, "a segment mixes documents"
            if block.causal:
                assert q1 - q0 == k1 - k0
                pairs += [(qs[i], ks[j]) for i in range(len(qs)) for j in range(i + 1)]
            else:
                pairs += [(a, b) for a in qs for b in ks]
    return pairs


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_plan_attends_each_visible_pair_exactly_once(ring_size, causal):
    seqlens = _edge_lengths(ring_size)
    starts = list(itertools.accumulate([0] + seqlens))
    for position in range(ring_size):
        pairs = _pairs_of_plan(seqlens, ring_size, position, causal)
        assert len(pairs) == len(set(pairs)), "a pair is attended twice"
        local = zigzag_token_indices(seqlens, ring_size, position).tolist()
        expected = set()
        for t in local:
            doc = max(d for d in range(len(seqlens)) if starts[d] <= t)
            last = t if causal else starts[doc + 1] - 1
            expected |= {(t, j) for j in range(starts[doc], last + 1)}
        assert set(pairs) == expected


def test_plan_sizes_and_sources():
    plan = ring_plan((10, 3), 3, 1, True, CPU)
    assert plan.num_tokens == tuple(zigzag_num_tokens(10, 3, p) + zigzag_num_tokens(3, 3, p) for p in range(3))
    assert [plan.source(s) for s in range(3)] == [1, 0, 2]


def test_ring_descriptor():
    ring = Ring(ranks=(5, 2, 7), rank=2)
    assert (ring.size, ring.position, ring.next_rank, ring.prev_rank) == (3, 1, 7, 5)
    for ranks, rank, message in [
        ((), 0, "at least one"),
        ((1, 1), 1, "distinct"),
        ((-1, 2), 2, "non-negative"),
        ((0, 1), 3, "rank 3 is not in the ring"),
    ]:
        with pytest.raises(ValueError, match=message):
            Ring(ranks=ranks, rank=rank)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        current_ring([0, 1])
    with pytest.raises(ValueError, match="integers"):
        current_ring(["a"])
    assert current_ring([0]).size == 1


def test_nested_traffic_blocks_count_what_they_enclose():
    from megatron_hdp.comm import traffic

    before = traffic.total_traffic()
    with traffic.count_traffic() as outer:
        with traffic.count_traffic() as inner:  # equal (all zero) to `outer` when opened
            traffic.record(bytes_sent=10, bytes_received=4, num_sent=1, num_received=1)
        traffic.record(bytes_sent=1, bytes_received=0, num_sent=1, num_received=0)
    assert (inner.bytes_sent, inner.bytes_received, inner.num_messages_sent) == (10, 4, 1)
    assert (outer.bytes_sent, outer.bytes_received, outer.num_messages_sent) == (11, 4, 2)
    assert traffic.total_traffic().bytes_sent == before.bytes_sent + 11
    traffic.reset_traffic()
    assert traffic.total_traffic() == traffic.Traffic()
