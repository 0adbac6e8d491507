"""StepPlan contract: JSON round trip, digest, and validate() catching each broken invariant."""

import copy
import dataclasses
import random

import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.zigzag import zigzag_chunks
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.step_plan import MicroBatch, RankSchedule, SequencePlacement, Shard, StepPlan, _all_valid, build_many


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


def _mutations(plan_dict: dict, rng: random.Random) -> dict:
    """One random edit of a plan's JSON form: the kinds of mistakes a planner could make."""
    data = copy.deepcopy(plan_dict)
    slots = [(r, i) for r, rank in enumerate(data["ranks"]) for i in range(len(rank["microbatches"]))]
    holding = [(r, i, j) for r, i in slots for j in range(len(data["ranks"][r]["microbatches"][i]["shards"]))]
    r, i, j = rng.choice(holding)
    mb = data["ranks"][r]["microbatches"][i]
    shard = mb["shards"][j]
    seq = data["sequences"][rng.randrange(len(data["sequences"]))]
    kind = rng.randrange(12)
    if kind == 0:  # a chunk boundary off by one
        chunk = rng.choice(shard["chunks"])
        chunk[rng.randrange(2)] += rng.choice((-1, 1))
    elif kind == 1:  # a shard moved to another micro-batch (maybe of another rank)
        del mb["shards"][j]
        r2, i2 = rng.choice(slots)
        data["ranks"][r2]["microbatches"][i2]["shards"].append(shard)
    elif kind == 2:  # a shard dropped or held twice
        if rng.random() < 0.5:
            del mb["shards"][j]
        else:
            r2, i2 = rng.choice(slots)
            data["ranks"][r2]["microbatches"][i2]["shards"].append(copy.deepcopy(shard))
    elif kind == 3:  # a capacity one token short (or one token more: still valid)
        held = sum(b - a for s in mb["shards"] for a, b in s["chunks"])
        mb["capacity"] = held + rng.choice((-1, 1))
    elif kind == 4:  # a ring member replaced or the ring reordered
        ring = seq["ring"]
        if len(ring) > 1 and rng.random() < 0.5:
            ring.reverse()
        else:
            ring[rng.randrange(len(ring))] = rng.randrange(data["num_ranks"] + 1)
    elif kind == 5:  # a length off by one
        seq["length"] += rng.choice((-1, 1))
    elif kind == 6:  # an offload ratio outside [0, 1] (or inside: valid)
        seq["offload_ratio"] = rng.choice((-0.1, 1.5, 0.5, float("nan")))
    elif kind == 7:  # a shard naming an unknown sequence
        shard["seq"] = rng.choice((-1, len(data["sequences"])))
    elif kind == 8:  # a chunk split in two (same tokens) or given a third bound
        chunk = shard["chunks"][0]
        if chunk[1] - chunk[0] > 1 and rng.random() < 0.5:
            middle = (chunk[0] + chunk[1]) // 2
            shard["chunks"][0:1] = [[chunk[0], middle], [middle, chunk[1]]]
        else:
            chunk.append(chunk[1])
    elif kind == 9:  # a sequence id or a length of the wrong type
        seq[rng.choice(("id", "length"))] = float(seq["length"])
    elif kind == 10:  # a rank's micro-batches in another order (ring members then meet at different indices)
        rng.shuffle(data["ranks"][r]["microbatches"])
    else:  # an extra empty chunk: the same tokens, but not the layout
        shard["chunks"].append([0, 0])
    return data


def test_vectorised_validate_is_never_laxer_than_the_per_sequence_check():
    """`validate` trusts `_all_valid` (array checks) and runs `_check_each` (the per-sequence reference)
    only when it cannot prove a plan valid: on hundreds of corrupted plans, whenever the fast path says
    valid the reference agrees, and on the uncorrupted plans the fast path does prove them valid."""
    rng = random.Random(0)
    config = HDPConfig(hdp_capacity=256)
    cm = analytic_cost_model("llama-7b")
    outcomes = {"both valid": 0, "fast rejects, reference accepts": 0, "both reject": 0}
    for trial in range(12):
        num_ranks = rng.choice((2, 3, 5, 8))
        lengths = [rng.randint(1, 256 * rng.choice((1, 1, num_ranks))) for _ in range(rng.randint(2, 30))]
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cm,
                         pp_size=rng.choice((1, 2)), policy=rng.choice(("balance", "naive")))
        assert _all_valid(plan)
        for _ in range(40):
            bad = StepPlan.from_dict(_mutations(plan.to_dict(), rng))
            try:
                bad._check_each()
                reference = True
            except (ValueError, TypeError):
                reference = False
            fast = _all_valid(bad)
            assert reference or not fast, f"fast path accepted a plan the reference rejects: {bad.to_dict()}"
            outcomes["both valid" if fast else "both reject" if not reference else "fast rejects, reference accepts"] += 1
    assert outcomes["both reject"] > 200 and outcomes["both valid"] > 10, outcomes


def test_build_many_gives_the_instances_the_constructor_gives():
    """assemble_plan builds shards and placements column-wise; they must be indistinguishable from
    constructed ones: equal, same hash and repr, frozen, usable with dataclasses.replace and pickle."""
    import pickle

    built = build_many(SequencePlacement, range(3), [5, 7, 9], [(0,), (1, 2), (2,)], [0.0, 0.5, 1.0],
                       ["kv", "latent", "kv"])
    made = [SequencePlacement(0, 5, (0,)), SequencePlacement(1, 7, (1, 2), 0.5, "latent"),
            SequencePlacement(2, 9, (2,), 1.0)]
    assert built == made and [hash(b) for b in built] == [hash(m) for m in made]
    assert [repr(b) for b in built] == [repr(m) for m in made]
    assert pickle.loads(pickle.dumps(built)) == made
    assert dataclasses.replace(built[1], ring=(2, 1)) == SequencePlacement(1, 7, (2, 1), 0.5, "latent")
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].length = 6
    shards = build_many(Shard, [4, 8], [((0, 3),), ((0, 1), (5, 6))])
    assert shards == [Shard(4, ((0, 3),)), Shard(8, ((0, 1), (5, 6)))] and shards[1].num_tokens == 2
    with pytest.raises(AssertionError, match="fields"):
        build_many(Shard, [1])


def test_validate_catches_a_member_holding_a_tiny_ring_twice():
    """Length 1 over a ring of 3: positions 1 and 2 both hold ((0, 0), (0, 0)), so only the count of
    holders per (sequence, rank) tells rank 1 holding it twice from ranks 1 and 2 holding it once."""
    chunks = {p: zigzag_chunks(1, 3, p) for p in range(3)}
    assert chunks[1] == chunks[2]
    held = {0: [chunks[0]], 1: [chunks[1], chunks[2]], 2: []}
    plan = StepPlan(policy="test", num_ranks=3, capacity=4, sequences=(SequencePlacement(0, 1, (0, 1, 2)),),
                    ranks=tuple(RankSchedule(r, (MicroBatch(tuple(Shard(0, c) for c in held[r]), 4),))
                                for r in range(3)))
    with pytest.raises(ValueError, match="more than once"):
        plan.validate()


def test_validate_catches_a_ring_shard_on_a_rank_outside_the_ring():
    """Ring (0, 2) over 3 ranks, with rank 1 holding what rank 2 should: right chunks, wrong rank."""
    shards = {p: Shard(0, zigzag_chunks(10, 2, p)) for p in range(2)}
    held = {0: (shards[0],), 1: (shards[1],), 2: ()}
    plan = StepPlan(policy="test", num_ranks=3, capacity=8, sequences=(SequencePlacement(0, 10, (0, 2)),),
                    ranks=tuple(RankSchedule(r, (MicroBatch(held[r], 8),)) for r in range(3)))
    with pytest.raises(ValueError, match="held by ranks"):
        plan.validate()


def test_validate_catches_a_ring_sequence_nobody_holds():
    plan = StepPlan(policy="test", num_ranks=2, capacity=8, sequences=(SequencePlacement(0, 10, (0, 1)),),
                    ranks=(RankSchedule(0, ()), RankSchedule(1, ())))
    with pytest.raises(ValueError, match="held by ranks"):
        plan.validate()


def test_vpp_size_is_in_the_json_only_with_virtual_stages():
    """Plans without virtual stages keep docs/architecture.md's JSON as it was; vpp_size > 1 round-trips, changes the
    digest, and needs PP."""
    plan = dataclasses.replace(_two_rank_plan(), pp_size=2).validate()
    assert "vpp_size" not in plan.to_dict()
    interleaved = dataclasses.replace(plan, vpp_size=2).validate()
    assert interleaved.to_dict()["vpp_size"] == 2
    again = StepPlan.from_json(interleaved.to_json())
    assert again == interleaved and again.digest() != plan.digest()
    with pytest.raises(ValueError, match="vpp_size=2 needs pipeline parallelism"):
        dataclasses.replace(_two_rank_plan(), vpp_size=2).validate()


def test_group_size_is_in_the_json_only_when_the_plan_carries_one():
    """The optional "microbatch_group_size" (Megatron's microbatch_group_size_per_vp_stage the plan was made
    for): absent when None, so old plans read and write as before; set, it round-trips and changes the
    digest; it needs virtual stages and at least pp."""
    interleaved = dataclasses.replace(_two_rank_plan(), pp_size=2, vpp_size=2).validate()
    assert "microbatch_group_size" not in interleaved.to_dict()
    assert StepPlan.from_json(interleaved.to_json()).group_size is None
    grouped = dataclasses.replace(interleaved, group_size=3).validate()
    assert grouped.to_dict()["microbatch_group_size"] == 3
    again = StepPlan.from_json(grouped.to_json())
    assert again == grouped and again.digest() != interleaved.digest()
    with pytest.raises(ValueError, match="group size 1 needs virtual pipeline stages"):
        dataclasses.replace(interleaved, group_size=1).validate()
    with pytest.raises(ValueError, match="group size 3 needs virtual pipeline stages"):
        dataclasses.replace(interleaved, vpp_size=1, group_size=3).validate()
