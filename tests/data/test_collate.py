"""THD collation: every rank's packed shards reassemble each document exactly, in the contract's order."""

import numpy as np
import pytest
import torch

from megatron_hdp.data.collate import collate_microbatch, empty_microbatch
from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.zigzag import zigzag_chunks


def _raw(seq, start, end):
    # raw token j of sequence s is 1000 * s + j, so every token says where it came from
    return np.arange(start, end, dtype=np.int64) + 1000 * seq


def _plan():
    # seq 0 whole on 0; seq 1 over (0, 1); seq 2 whole on 1; seq 3 over (1, 0); seq 4 over (0, 1, 2) with
    # L < 2k (empty chunks); seq 5 whole on 2 in a second micro-batch.
    return plan_from_rings(
        [5, 10, 3, 7, 4, 6],
        [(0,), (0, 1), (1,), (1, 0), (0, 1, 2), (2,)],
        [0, 0, 0, 0, 1, 1],
        num_ranks=3,
        capacity=64,
    )


def test_documents_reassemble_exactly_and_in_order():
    plan = _plan()
    seen: dict[int, dict[int, tuple[int, float]]] = {s.id: {} for s in plan.sequences}
    for rank in range(plan.num_ranks):
        for mb in plan.microbatches(rank):
            packed = collate_microbatch(plan, mb, _raw, pad_to_multiple=4)
            assert packed.num_tokens % 4 == 0
            assert packed.num_loss_tokens == mb.num_tokens
            # groups tile the row; whole documents first, then rings by smallest sequence id
            assert packed.groups[0].tokens[0] == 0 and packed.groups[-1].tokens[1] == packed.num_tokens
            for a, b in zip(packed.groups, packed.groups[1:]):
                assert a.tokens[1] == b.tokens[0]
            rings = [g for g in packed.groups if g.is_ring]
            assert [g.seq_ids[0] for g in rings] == sorted(g.seq_ids[0] for g in rings)
            assert all(not g.is_ring for g in packed.groups[: len(packed.groups) - len(rings) - (packed.num_padding > 0)])
            for group in packed.groups:
                if group.is_ring:
                    position = group.ring.index(rank)
                    expected = np.concatenate(
                        [
                            np.arange(a, b) + 1000 * s
                            for s, n in zip(group.seq_ids, group.seqlens)
                            for a, b in zigzag_chunks(n, len(group.ring), position)
                        ]
                    )
                    lo, hi = group.tokens
                    np.testing.assert_array_equal(packed.tokens[lo:hi].numpy(), expected)
            for t, lab, m, p in zip(packed.tokens, packed.labels, packed.loss_mask, packed.position_ids):
                if m:
                    seq, pos = divmod(int(t), 1000)
                    assert pos == int(p) and int(lab) == int(t) + 1
                    assert pos not in seen[seq]
                    seen[seq][pos] = (rank, float(m))
            assert packed.cu_seqlens[-1] == packed.num_tokens
            assert packed.loss_mask[packed.num_tokens - packed.num_padding :].sum() == 0
    for s in plan.sequences:
        assert sorted(seen[s.id]) == list(range(s.length)), f"sequence {s.id} not covered once"


def test_loss_mask_reader_and_explicit_rank():
    plan = _plan()
    mb = plan.microbatches(0)[0]
    packed = collate_microbatch(
        plan, mb, _raw, rank=0, read_loss_mask=lambda s, a, b: (np.arange(a, b) % 2 == 0).astype(np.float32)
    )
    expected = (packed.position_ids % 2 == 0).float()
    torch.testing.assert_close(packed.loss_mask, expected)
    assert packed.num_loss_tokens == int(expected.sum())
    with pytest.raises(ValueError, match="not one of rank 1"):
        collate_microbatch(plan, mb, _raw, rank=1)


def test_bad_reader_and_padding_arguments_raise():
    plan = _plan()
    mb = plan.microbatches(0)[0]
    with pytest.raises(ValueError, match="returned shape"):
        collate_microbatch(plan, mb, lambda s, a, b: np.zeros(b - a - 1, dtype=np.int64))
    with pytest.raises(ValueError, match="pad_to_multiple"):
        collate_microbatch(plan, mb, _raw, pad_to_multiple=0)
    empty = empty_microbatch(rank=2, num_tokens=3)
    assert empty.num_loss_tokens == 0 and empty.num_tokens == 3 and empty.groups[0].ring == (2,)


def test_each_microbatch_carries_the_largest_offload_ratio_of_its_sequences():
    """The forward step offloads the ratio the micro-batch carries (no side channel beside the iterator):
    the largest planned ratio of the sequences it holds shards of, read here from the plan itself; 0 for
    padding; kept through `to` and `pin_memory`'s copies."""
    ratios = [0.0, 0.25, 0.5, 0.0, 0.75, 0.0]
    base = _plan()
    plan = plan_from_rings([s.length for s in base.sequences], [s.ring for s in base.sequences],
                           [0, 0, 0, 0, 1, 1], num_ranks=3, capacity=64, offload_ratios=ratios)
    for rank in range(3):
        for mb in plan.microbatches(rank):
            packed = collate_microbatch(plan, mb, _raw, rank=rank)
            held = {shard.seq for shard in mb.shards}
            assert packed.offload_ratio == max((ratios[seq] for seq in held), default=0.0), (rank, held)
            assert packed.to("cpu").offload_ratio == packed.offload_ratio
    assert empty_microbatch(rank=0).offload_ratio == 0.0


def test_ring_groups_carry_the_plans_ring_kind():
    """The plan's ring kind of a ring call reaches the core attention with its group (multi-latent
    attention's latent ring); whole documents and K/V rings stay "kv"."""
    import dataclasses

    plan = _plan()
    sequences = tuple(dataclasses.replace(s, ring_kind="latent") if s.id == 3 else s for s in plan.sequences)
    plan = dataclasses.replace(plan, sequences=sequences).validate()
    for rank in (0, 1):
        groups = collate_microbatch(plan, plan.microbatches(rank)[0], _raw).groups
        kinds = {g.seq_ids: g.ring_kind for g in groups if g.seq_ids}
        assert kinds[(3,)] == "latent" and kinds[(1,)] == "kv" and set(kinds.values()) == {"kv", "latent"}
