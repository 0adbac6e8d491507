"""Every policy's plan satisfies the StepPlan contract on random and adversarial batches; impossible
inputs raise ValueError naming the value; plan times agree with an independent recomputation."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.sharding import max_member_tokens
from megatron_hdp.plan.timeline.bounds import step_time_lower_bound
from megatron_hdp.plan.timeline.pipeline import pipeline_time
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import min_ring_size
from plan_reference import assert_refusal_is_justified, fits_without_offload, reference_finish

CM = analytic_cost_model("llama-7b")
OURS = ("balance", "naive", "static")
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def hybrid_cp_available() -> bool:
    try:
        from megatron_hdp.megatron.comparison.hybrid_cp import plan_megatron_hybrid_cp  # noqa: F401
    except Exception:  # noqa: BLE001 — absent adapter or Megatron: the policy is simply not tested here
        return False
    return True


def recompute(plan, cm):
    """Micro-batch and rank times from the plan's shards alone, with the cost model directly: the padded
    micro-batch times [rank][index] and each rank's busy time (PP bubble included)."""
    rings = {s.id: s.ring for s in plan.sequences}
    rank_times, padded_times = [], []
    for schedule in plan.ranks:
        times = []
        for mb in schedule.microbatches:
            shards = [(plan.sequences[sh.seq].length, sh.num_tokens, rings[sh.seq]) for sh in mb.shards]
            times.append(cm.microbatch_time(shards, pp_size=plan.pp_size))
            assert mb.est_time == pytest.approx(times[-1], rel=1e-9)
        # the runtime pads an idle rank with one empty micro-batch; 1F1B pipelines run their own counts
        # (plan.timeline.interleaved: a shorter pipeline's order is the longer one's restricted to its micro-batches)
        padded = max(1, len(times))
        times += [cm.microbatch_time([], pp_size=plan.pp_size)] * (padded - len(times))
        rank_times.append(pipeline_time(times, pp_size=plan.pp_size))  # checked in test_plan_pipeline
        assert schedule.est_time == pytest.approx(rank_times[-1], rel=1e-9)
        padded_times.append(times)
    return padded_times, rank_times


def check(lengths, *, num_ranks, capacity, policy, offload=True, pp_size=1):
    config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
    try:
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=CM, pp_size=pp_size, policy=policy)
    except ValueError as error:
        text = str(error)
        if policy == "megatron-hybrid-cp" and pp_size > 1:  # Megatron's Hybrid-CP has no pipeline parallelism
            assert "pipeline" in text, text
            return None
        # only the documented refusals, and only where the batch cannot be planned (computed independently)
        assert any(m in text for m in ("does not fit", "static CP group", "divisible by the CP size",
                                       "power-of-two", "exceeds the pool")), text
        assert_refusal_is_justified(text, lengths, num_ranks=num_ranks, capacity=capacity, policy=policy)
        return None
    if not offload:
        assert all(fits_without_offload(n, num_ranks=num_ranks, capacity=capacity) for n in lengths), lengths
    assert plan.policy == policy and plan.lengths == list(lengths)
    if policy in OURS:  # (the hybrid-cp adapter times each sub-sample as its own pass: its own model)
        times, rank_times = recompute(plan, CM)
        assert plan.est_step_time >= max(rank_times) * (1 - 1e-9)
        if pp_size == 1:  # from above too: exactly when the last rank finishes under the waiting rule
            assert plan.est_step_time == pytest.approx(max(reference_finish(plan, times)), rel=1e-9)
        else:  # at most every index waiting for the slowest rank's, plus the largest pipeline bubble
            lockstep = sum(max(t[i] for t in times if i < len(t)) for i in range(max(map(len, times))))
            bubble = max(r - sum(t) for r, t in zip(rank_times, times))
            assert plan.est_step_time <= (lockstep + bubble) * (1 + 1e-9)
    bound = step_time_lower_bound(lengths, num_ranks=num_ranks, capacity=capacity, cost_model=CM, pp_size=pp_size)
    assert plan.est_step_time >= bound * (1 - 1e-9)
    for seq in plan.sequences:  # the offload ratio recorded is what the member needs to fit C
        if len(seq.ring) == 1 and seq.length <= capacity:
            assert seq.offload_ratio == 0.0
    return plan


def adversarial_batches(num_ranks, capacity):
    return {
        "all tiny": [1] * (3 * num_ranks + 1),
        "all exactly C": [capacity] * (2 * num_ranks + 1),
        "all C+1": [capacity + 1] * (num_ranks + 1),
        "one of D*C": [num_ranks * capacity],
        "under 2k": [max(1, 2 * (num_ranks // 2) - 1)] * 5 + [capacity + 1, 2],
        "one long many short": [num_ranks * capacity // 2] + [capacity // 3 + 1] * (4 * num_ranks),
    }


@pytest.mark.parametrize("policy", OURS)
@pytest.mark.parametrize("num_ranks,capacity", [(1, 16), (3, 5), (8, 64), (16, 1000)])
def test_adversarial_mixes(policy, num_ranks, capacity):
    for offload in (True, False):
        for name, lengths in adversarial_batches(num_ranks, capacity).items():
            check(lengths, num_ranks=num_ranks, capacity=capacity, policy=policy, offload=offload)


@pytest.mark.parametrize("policy", OURS)
def test_pipeline_parallel_plans(policy):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, size=60).tolist() + [9000, 20000]
    for pp in (2, 4):
        plan = check(lengths, num_ranks=8, capacity=4096, policy=policy, pp_size=pp)
        assert plan is not None and plan.pp_size == pp


@SETTINGS
@given(
    num_ranks=st.integers(1, 12),
    capacity=st.sampled_from([1, 2, 3, 8, 100, 4096]),
    data=st.data(),
    offload=st.booleans(),
    policy=st.sampled_from(OURS),
)
def test_random_mixes_validate(num_ranks, capacity, data, offload, policy):
    longest = num_ranks * capacity  # (C + 1 exceeds the pool of a single rank: capped)
    lengths = data.draw(st.lists(st.one_of(st.integers(1, max(1, capacity)), st.integers(1, longest),
                                           st.sampled_from([1, capacity, min(capacity + 1, longest), longest])),
                                 min_size=1, max_size=40))
    plan = check(lengths, num_ranks=num_ranks, capacity=capacity, policy=policy, offload=offload)
    if plan is None:  # only static may refuse a batch whose zigzag split fits the pool without offload
        assert policy == "static" or any(max_member_tokens(n, num_ranks) > capacity for n in lengths), lengths
        return
    if policy == "balance":
        for seq in plan.sequences:  # data-aware sharding: whole when it fits, never fewer ranks than D(s)
            if seq.length <= capacity:
                assert len(seq.ring) == 1
            else:
                k, _ = min_ring_size(seq.length, capacity=capacity, num_ranks=num_ranks, cost_model=CM,
                                     max_offload_ratio=1.0 if offload else 0.0)
                assert len(seq.ring) >= k


@SETTINGS
@given(
    num_ranks=st.integers(1, 12),
    capacity=st.integers(1, 5000),
    data=st.data(),
    policy=st.sampled_from(OURS),
)
def test_random_impossible_batches_raise(num_ranks, capacity, data, policy):
    """A sequence longer than all D ranks hold (no offload) is refused by every policy, by name."""
    # lengths <= D (C - 1) surely fit: a zigzag member holds at most ceil(L / D) + 1 tokens
    fine = data.draw(st.lists(st.integers(1, max(1, num_ranks * (capacity - 1))), max_size=10))
    too_long = data.draw(st.integers(num_ranks * capacity + 1, num_ranks * capacity * 3 + 1))
    at = data.draw(st.integers(0, len(fine)))
    lengths = fine[:at] + [too_long] + fine[at:]
    config = HDPConfig(hdp_capacity=capacity, hdp_offload=False)
    with pytest.raises(ValueError, match=str(too_long)):
        make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=CM, policy=policy)


@pytest.mark.skipif(not hybrid_cp_available(), reason="megatron-hybrid-cp adapter or Megatron-Core not importable")
def test_megatron_hybrid_cp_on_adversarial_mixes():
    for name, lengths in adversarial_batches(8, 64).items():
        check(lengths, num_ranks=8, capacity=64, policy="megatron-hybrid-cp")


@pytest.mark.parametrize("policy", OURS)
def test_impossible_inputs_raise(policy):
    config = HDPConfig(hdp_capacity=10, hdp_offload=False)
    with pytest.raises(ValueError, match="empty global batch"):
        make_plan([], num_ranks=4, config=config, cost_model=CM, policy=policy)
    with pytest.raises(ValueError, match="num_ranks must be positive, got 0"):
        make_plan([5], num_ranks=0, config=config, cost_model=CM, policy=policy)
    with pytest.raises(ValueError, match=r"lengths must be >= 1, got \[0\]"):
        make_plan([5, 0], num_ranks=4, config=config, cost_model=CM, policy=policy)
    with pytest.raises(ValueError, match="41"):
        make_plan([5, 41], num_ranks=4, config=config, cost_model=CM, policy=policy)
    with pytest.raises(ValueError, match="hdp_capacity must be a positive token count, got 0"):
        HDPConfig(hdp_capacity=0)


def test_a_sequence_that_fits_only_with_offload():
    # 4 ranks of C = 1000 hold 4000 tokens without offload; with offload they hold more
    lengths = [6000]
    config = HDPConfig(hdp_capacity=1000, hdp_offload=True)
    plan = make_plan(lengths, num_ranks=4, config=config, cost_model=CM, policy="balance")
    seq = plan.sequences[0]
    assert seq.offload_ratio > 0 and len(seq.ring) <= 4
    held = max(mb.num_tokens for r in plan.ranks for mb in r.microbatches)
    assert (1 - seq.offload_ratio) * CM.activation_bytes(held) <= CM.activation_bytes(1000) * (1 + 1e-9)
    assert max(mb.capacity for r in plan.ranks for mb in r.microbatches) == held
    with pytest.raises(ValueError, match="length 6000 does not fit"):
        make_plan(lengths, num_ranks=4, config=HDPConfig(hdp_capacity=1000, hdp_offload=False), cost_model=CM,
                  policy="balance")


def test_static_cp_size_rules():
    config = HDPConfig(hdp_capacity=100)
    plan = make_plan([350, 20, 20], num_ranks=8, config=config, cost_model=CM, policy="static")
    assert {len(s.ring) for s in plan.sequences} == {4}  # every sequence rides the 4-rank CP ring
    assert {s.ring for s in plan.sequences} <= {(0, 1, 2, 3), (4, 5, 6, 7)}
    with pytest.raises(ValueError, match="divisible by the CP size: 6 ranks, CP 4"):
        make_plan([350], num_ranks=6, config=config, cost_model=CM, policy="static")
    with pytest.raises(ValueError, match="static CP group of 8 ranks"):
        make_plan([750], num_ranks=6, config=config, cost_model=CM, policy="static")


def test_naive_uses_minimal_rings_and_equal_tokens():
    lengths = [5000, 3000] + [400] * 40
    config = HDPConfig(hdp_capacity=1000, hdp_offload=False)
    plan = make_plan(lengths, num_ranks=16, config=config, cost_model=CM, policy="naive")
    assert [len(s.ring) for s in plan.sequences[:2]] == [5, 3]
    tokens = [sum(mb.num_tokens for mb in r.microbatches) for r in plan.ranks]
    assert max(tokens) - min(tokens) <= 400 + 1  # token-balanced to within one short sequence
    assert math.isclose(sum(tokens), sum(lengths))
