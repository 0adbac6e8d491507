"""One timing model: the planner's step time, `plan.timeline.timing` and the simulator agree on random plans.

Random valid plans (`hand_plan.random_plan`: rings of any size at any micro-batch index, overlapping
rings, uneven micro-batch counts) are timed three ways: the planner's `assemble_plan` (which times each
micro-batch with `CostModel.microbatch_time` and composes them with `assemble.step_time`), the per-rank
composition of `plan.timeline.timing.coupled_finish` over `CostModel.microbatch_time` written out here, and the
vectorised simulator (`simulate_step`, pp_size 1, our runtime's rules, no offload). Rank busy times and
the time the last rank reaches the all-reduce must agree to 1e-9. With a multi-latent attention model the
planner picks each ring call's kind (K/V or latent ring) and records it; the other two read it from the plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.hand_plan import plan_from_rings, random_plan
from megatron_hdp.plan.timeline.assemble import assemble_plan
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.timeline.timing import coupled_finish, plan_groups
from megatron_hdp.sim.simulator import PolicyRules, simulate_step
from plan_reference import reference_finish

H100 = analytic_cost_model("llama-7b", tp_size=8)
SLOW_RING = CostModel.from_dict({**H100.to_dict(), "ring_bandwidth": 2e9, "ring_latency": 1e-4,
                                 "ring_block_overhead": 3e-5})
JITTERY = CostModel.from_dict({**SLOW_RING.to_dict(), "jitter": 0.07})
# DeepSeek-V3 at TP 8 on a link where the K/V ring is hidden for members holding a few thousand tokens and
# exposed below: the planner's auto choice gives both ring kinds on these plans
MLA = CostModel.from_dict({**analytic_cost_model("deepseek-v3", tp_size=8).to_dict(), "ring_bandwidth": 4e11})


def _microbatch_times(plan, cost_model):
    """[rank][index] -> CostModel.microbatch_time of that micro-batch's shards (each ring of its plan's kind)."""
    seqs = plan.sequences
    return [[cost_model.microbatch_time([(plan.lengths[s.seq], s.num_tokens, seqs[s.seq].ring if len(seqs[s.seq].ring) > 1
                                          else (), seqs[s.seq].ring_kind) for s in mb.shards])
             for mb in schedule.microbatches]
            for schedule in plan.ranks]


def _assembled(plan, cost_model):
    """The same placement re-timed by the planner's `assemble_plan`."""
    schedule = [[[s.seq for s in mb.shards] for mb in r.microbatches] for r in plan.ranks]
    return assemble_plan(policy=plan.policy, lengths=plan.lengths, rings=[s.ring for s in plan.sequences],
                         offload_ratios=[0.0] * len(plan.lengths), schedule=schedule, capacity=plan.capacity,
                         cost_model=cost_model)


@pytest.mark.parametrize("cost_model", [H100, SLOW_RING, JITTERY, MLA], ids=["h100", "slow-ring", "jittery", "mla"])
def test_planner_timing_and_simulator_agree_on_random_plans(cost_model):
    rng = np.random.default_rng(0)
    kinds = set()
    for seed in range(60):
        num_ranks = int(rng.integers(1, 7))
        lengths = rng.integers(1, 20000, size=int(rng.integers(1, 12))).tolist()
        plan = _assembled(random_plan(lengths, num_ranks=num_ranks, seed=seed, max_slots=4), cost_model)
        kinds |= {seq.ring_kind for seq in plan.sequences if len(seq.ring) > 1}
        times = _microbatch_times(plan, cost_model)
        for rank_times in times:  # a rank without micro-batches runs one empty one (the runtime's padding)
            rank_times += [cost_model.microbatch_time([])] * (not rank_times)
        finish = coupled_finish([times], plan_groups(plan), jitter=cost_model.jitter)
        assembled = _assembled(plan, cost_model)
        assert [s.ring_kind for s in assembled.sequences] == [s.ring_kind for s in plan.sequences]
        timeline = simulate_step(plan, cost_model, rules=PolicyRules())
        where = f"seed {seed}, {num_ranks} ranks, lengths {lengths}"
        busy = [sum(t) for t in times]
        np.testing.assert_allclose([r.est_time for r in assembled.ranks], busy, rtol=1e-9, err_msg=where)
        np.testing.assert_allclose(timeline.busy, busy, rtol=1e-9, atol=1e-15, err_msg=where)
        assert assembled.est_step_time == pytest.approx(float(finish.max()), rel=1e-9), where
        assert timeline.compute_end == pytest.approx(float(finish.max()), rel=1e-9), where
    assert kinds == ({"kv", "latent"} if cost_model is MLA else {"kv"})


def test_jitter_adds_the_expected_lead_of_the_slowest_ring_member():
    """Two ranks on one 2-ring, equal work t: with jitter s the pair finishes at t (1 + s E[max of 2]),
    E[max of 2 standard normals] = 1 / sqrt(pi); checked against a Monte Carlo of noisy members."""
    t = JITTERY.microbatch_time([(8000, 4000, (0, 1))])
    plan = assemble_plan(policy="hand", lengths=[8000], rings=[(0, 1)], offload_ratios=[0.0], schedule=[[[0]], [[0]]],
                         capacity=4000, cost_model=JITTERY)
    assert plan.est_step_time == pytest.approx(t * (1 + 0.07 / np.sqrt(np.pi)), rel=1e-6)
    noisy = t * (1 + 0.07 * np.random.default_rng(0).standard_normal((200_000, 8)))
    monte_carlo = noisy.max(axis=1).mean()  # a ring of 8: the slowest of 8 noisy members
    eight = {(rank, 0): 0 for rank in range(8)}  # ranks 0-7 run index 0 as one group
    assert coupled_finish([[[t]] * 8], eight, jitter=0.07).max() == pytest.approx(monte_carlo, rel=2e-3)
    assert coupled_finish([[[t]] * 8], eight).max() == pytest.approx(t)  # measured times: no extra


def test_1f1b_pipelines_run_their_own_counts():
    """PP = 2: rank 0 runs three micro-batches, rank 1 one; 1F1B needs no padding for rings
    (`plan.timeline.interleaved`), so rank 1's pipeline runs its one micro-batch only
    (`data.prepare.pad_microbatches`). Planner and simulator both time exactly that."""
    from megatron_hdp.plan.timeline.pipeline import pipeline_time

    lengths = [3000, 3000, 3000, 6000]
    schedule = [[[0], [1], [2]], [[3]]]
    plan = assemble_plan(policy="hand", lengths=lengths, rings=[(0,), (0,), (0,), (1,)], offload_ratios=[0.0] * 4,
                         schedule=schedule, capacity=6000, cost_model=H100, pp_size=2)
    own = H100.microbatch_time([(6000, 6000, ())], pp_size=2)
    assert plan.ranks[1].est_time == pytest.approx(pipeline_time([own], pp_size=2))
    timeline = simulate_step(plan, H100, rules=PolicyRules())
    assert timeline.busy[1] == pytest.approx(own)
    assert timeline.compute_end == pytest.approx(plan.est_step_time)


def test_expert_parallel_groups_couple_every_microbatch():
    """EP = 2: the MoE all-to-all couples micro-batch i of both members; rank 1 has one micro-batch and
    runs a padding one beside rank 0's second (`data.prepare.num_microbatches_to_run`)."""
    ep = CostModel.from_dict({**H100.to_dict(), "expert_parallel_size": 2})
    lengths = [3000, 1000, 6000]
    plan = assemble_plan(policy="hand", lengths=lengths, rings=[(0,), (0,), (1,)], offload_ratios=[0.0] * 3,
                         schedule=[[[0], [1]], [[2]]], capacity=6000, cost_model=ep)
    a, b, c = (ep.microbatch_time([(n, n, ())]) for n in lengths)
    empty = ep.microbatch_time([])
    assert plan.est_step_time == pytest.approx(max(a, c) + max(b, empty))
    assert plan.ranks[1].est_time == pytest.approx(c + empty)
    timeline = simulate_step(plan, ep, rules=PolicyRules())
    assert timeline.compute_end == pytest.approx(plan.est_step_time)
    with pytest.raises(ValueError, match="expert_parallel_size 2 does not divide the 3"):
        assemble_plan(policy="hand", lengths=lengths, rings=[(0,), (1,), (2,)], offload_ratios=[0.0] * 3,
                      schedule=[[[0]], [[1]], [[2]]], capacity=6000, cost_model=ep)


def test_expert_parallel_groups_share_their_routed_expert_work():
    """EP = 2 with half of b1 routed-expert work: at each index each member runs its group's mean expert
    work (the all-to-all sends its tokens to the experts' owners), rank 1's padding micro-batch included;
    the group's total work is unchanged. Worked by hand from the cost model's formulas."""
    ep = CostModel.from_dict({**H100.to_dict(), "expert_parallel_size": 2, "expert_share": 0.5})
    lengths = [3000, 1000, 6000]
    plan = assemble_plan(policy="hand", lengths=lengths, rings=[(0,), (0,), (1,)], offload_ratios=[0.0] * 3,
                         schedule=[[[0], [1]], [[2]]], capacity=6000, cost_model=ep)
    a, b, c = (ep.microbatch_time([(n, n, ())]) for n in lengths)
    empty = ep.microbatch_time([])
    e = 0.5 * ep.b1 * ep.num_layers  # routed expert seconds per token, all layers
    first = (a + e * (4500 - 3000), c + e * (4500 - 6000))
    second = (b + e * (500 - 1000), empty + e * (500 - 0))
    assert plan.est_step_time == pytest.approx(max(first) + max(second))
    assert plan.est_step_time < max(a, c) + max(b, empty)  # the long micro-batch hands work to its peer
    assert [r.est_time for r in plan.ranks] == pytest.approx([first[0] + second[0], first[1] + second[1]])
    timeline = simulate_step(plan, ep, rules=PolicyRules())
    assert timeline.compute_end == pytest.approx(plan.est_step_time)
    np.testing.assert_allclose(timeline.busy, [r.est_time for r in plan.ranks], rtol=1e-9)
    with pytest.raises(ValueError, match="expert_share must be in \\[0, 1\\], got 1.5"):
        CostModel.from_dict({**H100.to_dict(), "expert_share": 1.5})


def test_planner_and_simulator_agree_with_expert_parallelism_on_random_plans():
    ep = CostModel.from_dict({**SLOW_RING.to_dict(), "expert_parallel_size": 2})
    rng = np.random.default_rng(1)
    for seed in range(30):
        num_ranks = 2 * int(rng.integers(1, 4))
        lengths = rng.integers(1, 20000, size=int(rng.integers(1, 12))).tolist()
        plan = random_plan(lengths, num_ranks=num_ranks, seed=seed, max_slots=4)
        assembled = _assembled(plan, ep)
        timeline = simulate_step(plan, ep, rules=PolicyRules())
        where = f"seed {seed}, {num_ranks} ranks, lengths {lengths}"
        np.testing.assert_allclose(timeline.busy, [r.est_time for r in assembled.ranks], rtol=1e-9, err_msg=where)
        assert timeline.compute_end == pytest.approx(assembled.est_step_time, rel=1e-9), where


@pytest.mark.parametrize("ep_size,pp_size,vpp_size", [(2, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 2)])
def test_ep_aware_balance_plans_are_timed_alike_by_planner_and_simulator(ep_size, pp_size, vpp_size):
    """`balance` planning EP groups as units (with PP and virtual stages too): its `est_step_time` is the
    simulator's compute end and its rank times the simulator's busy times, to 1e-9."""
    ep = CostModel.from_dict({**SLOW_RING.to_dict(), "expert_parallel_size": ep_size})
    config = HDPConfig(hdp_capacity=4096)
    rng = np.random.default_rng(ep_size * 10 + pp_size)
    for seed in range(8):
        num_ranks = ep_size * int(rng.integers(1, 4))
        lengths = rng.integers(1, 20000, size=int(rng.integers(2, 30))).tolist()
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=ep, policy="balance",
                         pp_size=pp_size, vpp_size=vpp_size)
        timeline = simulate_step(plan, ep, rules=PolicyRules())
        where = f"seed {seed}, {num_ranks} ranks, lengths {lengths}"
        assert timeline.compute_end == pytest.approx(plan.est_step_time, rel=1e-9), where
        if pp_size == 1:
            np.testing.assert_allclose(timeline.busy, [r.est_time for r in plan.ranks], rtol=1e-9, err_msg=where)


def test_virtual_stages_with_rings_on_random_plans():
    """Random plans with rings at any index and uneven counts, run with virtual pipeline stages: the
    runtime's counts (`plan.timeline.interleaved.padded_counts`: multiples of pp here) keep the ring rule, so the
    brute-force wait-for graph is acyclic and the simulator completes; its busy time is the planner's
    micro-batch times plus the padding, and coupling only adds waits: every rank finishes no earlier than
    its own pipeline alone (`pipeline_time`, the planner's rank time)."""
    from megatron_hdp.plan.timeline.interleaved import deadlock_free
    from megatron_hdp.plan.timeline.timing import plan_runtime_counts

    rng = np.random.default_rng(4)
    for seed in range(12):
        pp, vpp = (2, 2) if seed % 2 else (4, 2)
        num_ranks = int(rng.integers(2, 6))
        lengths = rng.integers(1, 20000, size=int(rng.integers(2, 10))).tolist()
        drawn = random_plan(lengths, num_ranks=num_ranks, seed=seed, max_slots=5)
        schedule = [[[s.seq for s in mb.shards] for mb in r.microbatches] for r in drawn.ranks]
        plan = assemble_plan(policy="random", lengths=lengths, rings=[s.ring for s in drawn.sequences],
                             offload_ratios=[0.0] * len(lengths), schedule=schedule, capacity=drawn.capacity,
                             cost_model=SLOW_RING, pp_size=pp, vpp_size=vpp)
        counts = plan_runtime_counts(plan)
        assert all(n % pp == 0 and n >= len(r.microbatches) for n, r in zip(counts, plan.ranks))
        rings = [(index, seq.ring) for seq in plan.sequences if len(seq.ring) > 1
                 for index, mb in enumerate(plan.ranks[seq.ring[0]].microbatches)
                 if any(s.seq == seq.id for s in mb.shards)]
        assert deadlock_free(counts, rings=rings, pp_size=pp, vpp_size=vpp)
        timeline = simulate_step(plan, SLOW_RING, rules=PolicyRules())
        padding = SLOW_RING.microbatch_time([], pp_size=pp)
        busy = [sum(mb.est_time for mb in r.microbatches) + padding * (n - len(r.microbatches))
                for r, n in zip(plan.ranks, counts)]
        where = f"seed {seed}, {num_ranks} ranks, pp {pp}, lengths {lengths}"
        np.testing.assert_allclose(timeline.busy, busy, rtol=1e-9, err_msg=where)
        assert all(f >= r.est_time * (1 - 1e-9) for f, r in zip(timeline.finish, plan.ranks)), where
        assert sum(len(stage) for stage in timeline.ops[0]) == 2 * vpp * pp * counts[0]


# a linear cost model for hand arithmetic: 0.1 ms per token, no attention term, no ring traffic, no overhead
LINEAR = CostModel(a1=0.0, b1=1e-4, g=0.0, a2=1.0, b2=0.0, kv_bytes_per_token=0.0, num_layers=1,
                   ring_bandwidth=1e12, ring_latency=0.0)


def test_two_rings_sharing_a_rank_at_one_index_wait_as_one_group():
    """Hand plan (3 ranks, linear model, 1e-4 s per token): at index 0 document A (2000 tokens) on ring
    (0, 1) and B (2000) on ring (2, 1), so rank 1 runs both rings' layers and ranks 0, 1, 2 move together;
    rank 0 also holds W (4000, whole) at index 0, rank 2 holds V (4000, whole) at index 1.
    Index 0: rank 0 holds 1000 + 4000 tokens (0.5 s), rank 1 2000 (0.2 s), rank 2 1000 (0.1 s): the group
    ends at 0.5 s for all three; rank 2 then runs V: 0.5 + 0.4 = 0.9 s. Were the two rings timed apart,
    rank 2 would wait only for rank 1 (0.2 s) and finish at 0.6 s."""

    lengths, rings, slots = [2000, 2000, 4000, 4000], [(0, 1), (2, 1), (0,), (2,)], [0, 0, 0, 1]
    hand = plan_from_rings(lengths, rings, slots, num_ranks=3, capacity=8000)
    assembled = _assembled(hand, LINEAR)
    timeline = simulate_step(hand, LINEAR, rules=PolicyRules())
    assert [r.est_time for r in assembled.ranks] == pytest.approx([0.5, 0.2, 0.5])
    assert reference_finish(hand, _microbatch_times(hand, LINEAR)) == pytest.approx([0.5, 0.5, 0.9])
    assert assembled.est_step_time == pytest.approx(0.9, rel=1e-9)
    assert timeline.compute_end == pytest.approx(0.9, rel=1e-9)


def test_a_ring_waits_for_a_member_still_busy_with_an_earlier_index():
    """Hand plan (linear model): rank 0 runs W (3000, whole, 0.3 s) at index 0, then document A (2000) on
    ring (0, 1) at index 1 (1000 tokens each, 0.1 s); rank 1 runs an empty index 0 (no overhead in this
    model) and waits for rank 0: A ends at 0.3 + 0.1 = 0.4 s on both; rank 1's own U (1000 tokens, whole)
    at index 2 ends at 0.5 s, not at 0.2 s as it would if it did not wait."""

    hand = plan_from_rings([3000, 2000, 1000], [(0,), (0, 1), (1,)], [0, 1, 2], num_ranks=2, capacity=8000)
    assert reference_finish(hand, _microbatch_times(hand, LINEAR)) == pytest.approx([0.4, 0.5])
    assert _assembled(hand, LINEAR).est_step_time == pytest.approx(0.5, rel=1e-9)
    assert simulate_step(hand, LINEAR, rules=PolicyRules()).compute_end == pytest.approx(0.5, rel=1e-9)


@pytest.mark.parametrize("cost_model", [H100, SLOW_RING], ids=["h100", "slow-ring"])
def test_waiting_rule_matches_an_independent_reference_on_random_plans(cost_model):
    """The planner and the simulator against `tests.plan_reference.reference_finish`, the waiting rule
    written from its statement with no code of `plan.timeline.timing` (the 1e-9 agreement above shares it)."""

    rng = np.random.default_rng(2)
    for seed in range(60):
        num_ranks = int(rng.integers(2, 7))
        lengths = rng.integers(1, 20000, size=int(rng.integers(2, 12))).tolist()
        if seed % 2:  # small rings (1-3 ranks) at few indices: chains of rings that share a rank
            rings = [tuple(rng.permutation(num_ranks)[:int(rng.integers(1, min(3, num_ranks) + 1))].tolist())
                     for _ in lengths]
            plan = plan_from_rings(lengths, rings, rng.integers(0, 2, size=len(lengths)).tolist(),
                                   num_ranks=num_ranks, capacity=sum(lengths))
        else:
            plan = random_plan(lengths, num_ranks=num_ranks, seed=100 + seed, max_slots=3)
        times = _microbatch_times(plan, cost_model)
        for rank_times in times:
            rank_times += [cost_model.microbatch_time([])] * (not rank_times)
        reference = reference_finish(plan, times)
        where = f"case {seed}, rings {[q.ring for q in plan.sequences]}, lengths {lengths}"
        np.testing.assert_allclose(coupled_finish([times], plan_groups(plan)), reference, rtol=1e-9, err_msg=where)
        assert _assembled(plan, cost_model).est_step_time == pytest.approx(max(reference), rel=1e-9), where
        timeline = simulate_step(plan, cost_model, rules=PolicyRules())
        assert timeline.compute_end == pytest.approx(max(reference), rel=1e-9), where
