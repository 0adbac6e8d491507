"""StepPlan contract: JSON round trip, digest, and validate() catching each broken invariant."""

import dataclasses

import pytest

from megatron_hdp.plan.layout import zigzag_chunks
from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan


def _two_rank_plan(length=10, capacity=8):
    """Sequence 0 (length 10) on a ring [1, 0]; sequence 1 (length 3) whole on rank 1."""
    pos = {1: 0, 0: 1}
    shards = {r: Shard(0, zigzag_chunks(length, 2, pos[r])) for r in (0, 1)}
    return StepPlan(
        policy="test",
        num_ranks=2,
        capacity=capacity,
        sequences=(SequencePlacement(0, length, (1, 0)), SequencePlacement(1, 3, (1,))),
        ranks=(
            RankSchedule(0, (MicroBatch((shards[0],), capacity),)),
            RankSchedule(1, (MicroBatch((shards[1],), capacity), MicroBatch((Shard(1, ((0, 3),)),), capacity))),
        ),
    )


def test_round_trip_and_digest():
    plan = _two_rank_plan().validate()
    again = StepPlan.from_json(plan.to_json())
    assert again == plan and again.digest() == plan.digest()
    assert again.to_dict()["sequences"][0]["ring"] == [1, 0]


def test_digest_changes_with_content():
    assert _two_rank_plan(length=10).digest() != _two_rank_plan(length=11).digest()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: dataclasses.replace(p, capacity=0), "must be > 0"),
        (lambda p: dataclasses.replace(p, sequences=(p.sequences[0], dataclasses.replace(p.sequences[1], ring=(0,)))),
         "held by ranks"),
        (lambda p: dataclasses.replace(p, sequences=(dataclasses.replace(p.sequences[0], ring=(0, 1)), p.sequences[1])),
         "expected"),
        (lambda p: dataclasses.replace(p, ranks=(p.ranks[0], dataclasses.replace(p.ranks[1], microbatches=p.ranks[1].microbatches[::-1]))),
         "different micro-batches"),
        (lambda p: dataclasses.replace(p, sequences=(dataclasses.replace(p.sequences[0], ring=(1, 2)), p.sequences[1])),
         "outside"),
    ],
)
def test_validate_catches(mutate, message):
    with pytest.raises(ValueError, match=message):
        mutate(_two_rank_plan()).validate()


def test_capacity_is_enforced():
    with pytest.raises(ValueError, match="capacity"):
        _two_rank_plan(length=10, capacity=4).validate()
