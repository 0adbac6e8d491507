"""One cost path: the planner's per-rank times are what the simulator computes for the same plan.

The simulator (`megatron_hdp.sim.simulator`) evaluates the cost model on arrays of shards with its own
grouping code (one ring exchange per ring per forward/backward pass); the planner times micro-batches
with `CostModel.microbatch_time`. With PP = 1 a rank's busy time in the simulator is the sum of its
micro-batch times, so it must equal the plan's `est_time` for every rank of every policy. Megatron's
Hybrid-CP runs one pass per sub-sample (its adapter charges the micro-batch overhead per sub-sample), so
its plans are compared under its own execution rules, `POLICY_RULES["megatron-hybrid-cp"]`. The
planner's offload ratios hide their copies under compute (ByteScale Eq. 3), so the simulator's exposed
offload is zero and does not separate the two either. With PP the planner's step time is the
simulator's compute end on random pipeline plans with rings, so both rank candidate plans alike.
"""

import os

import numpy as np
import pytest

from megatron_hdp.config import POLICIES, HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.simulator import POLICY_RULES, PolicyRules, simulate_step
from plan_reference import expert_padded, expert_spread, microbatch_tokens, reference_finish

CM = analytic_cost_model("llama-7b", tp_size=8)
# a slow ring link, so that ring traffic is exposed for short documents and sharing an exchange matters
SLOW_RING = CostModel.from_dict({**CM.to_dict(), "ring_bandwidth": 2e9, "ring_latency": 1e-4})
# multi-latent attention: the planner picks the K/V or the latent ring per ring call (both occur here)
MLA = CostModel.from_dict({**analytic_cost_model("deepseek-v3", tp_size=8).to_dict(), "ring_bandwidth": 4e11})


def _batches():
    rng = np.random.default_rng(3)
    yield "short docs on static rings", [300] * 40 + [8000], 8, 2048, False
    yield "mixed, offloading", rng.integers(50, 6000, size=60).tolist() + [20000, 12000, 40000], 16, 4096, True
    yield "one long", [30000] + rng.integers(100, 2000, size=30).tolist(), 16, 4096, False


def _policies():
    import megatron_hdp.megatron  # noqa: F401  (registers Megatron's policies)

    for name in (*POLICIES, "rl-static-cp"):  # and the comparison policy no training run takes
        if name == "megatron-dynamic-cp" and not os.environ.get("MEGATRON_LM_DIR"):
            continue  # needs a Megatron-LM dev checkout (its own tests cover it)
        yield name


@pytest.mark.parametrize("cost_model", [CM, SLOW_RING, MLA], ids=["h100", "slow-ring", "mla"])
def test_planner_rank_times_equal_simulated_busy_time(cost_model):
    for name, lengths, num_ranks, capacity, offload in _batches():
        for policy in _policies():
            config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
            plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, policy=policy)
            rules = POLICY_RULES.get(policy, PolicyRules())
            timeline = simulate_step(plan, cost_model, rules=rules, grad_bytes=0)
            planned = np.array([r.est_time for r in plan.ranks])
            np.testing.assert_allclose(planned, timeline.busy, rtol=1e-9, err_msg=f"{policy} on {name}")


def test_shards_on_one_ring_share_one_exchange():
    """Hand case: two documents on ring (0, 1) in one micro-batch pay one exchange of their summed tokens."""
    ring = (0, 1)
    one = SLOW_RING.microbatch_time([(400, 200, ring), (600, 300, ring)])
    kv, bw, lat = SLOW_RING.kv_bytes_per_token, SLOW_RING.ring_bandwidth, SLOW_RING.ring_latency
    attention = SLOW_RING.a1 * (400 * 200 + 600 * 300)
    # k = 2 in bf16: forward 1 K/V buffer, backward 1 K/V + 2 fp32 dK/dV (6 K/V units) in 4 messages
    per_layer = SLOW_RING.g + SLOW_RING.b1 * 500 + max(attention, 6 * kv * 500 / bw + 4 * lat)
    assert one == pytest.approx(per_layer * SLOW_RING.num_layers)
    # two different rings each pay their own exchange; whole documents have none
    two = SLOW_RING.microbatch_time([(400, 200, (0, 1)), (600, 300, (0, 2)), (50, 50, ())])
    separate = sum(SLOW_RING.layer_shard_time(seq_len=s, num_tokens=t, ring_size=k)
                   for s, t, k in ((400, 200, 2), (600, 300, 2), (50, 50, 1)))
    assert two == pytest.approx((SLOW_RING.g + separate) * SLOW_RING.num_layers)


@pytest.mark.parametrize("cost_model", [CM, SLOW_RING, MLA], ids=["h100", "slow-ring", "mla"])
def test_step_time_follows_the_independent_waiting_rule(cost_model):
    """Every policy's predicted step (the planner's `est_step_time` and the simulator's) is when the last
    rank finishes under the waiting rule written out in `tests.plan_reference.reference_finish` (no code
    of `plan.timeline.timing`), from the plan's own micro-batch times (held to the cost model above); Megatron's
    Hybrid-CP with its barrier after every group."""
    for name, lengths, num_ranks, capacity, offload in _batches():
        for policy in _policies():
            config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
            plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, policy=policy)
            rules = POLICY_RULES.get(policy, PolicyRules())
            empty = cost_model.microbatch_time([])  # a rank without micro-batches runs one empty one
            times = [[mb.est_time for mb in r.microbatches] or [empty] for r in plan.ranks]
            step = max(reference_finish(plan, times, barrier_per_index=rules.barrier_per_microbatch))
            timeline = simulate_step(plan, cost_model, rules=rules, grad_bytes=0)
            assert timeline.compute_end == pytest.approx(step, rel=1e-9), f"{policy} on {name}"
            assert plan.est_step_time == pytest.approx(step, rel=1e-9), f"{policy} on {name}"


@pytest.mark.parametrize("ep_size,expert_share,alltoall_bytes", [(2, 0.0, 0.0), (4, 0.0, 0.0), (2, 0.7, 0.0),
                                                                  (4, 0.7, 0.0), (4, 0.7, 4096.0)])
def test_expert_parallel_step_time_follows_the_independent_waiting_rule(ep_size, expert_share, alltoall_bytes):
    """With expert parallelism every policy's predicted step (planner and simulator, to 1e-9) is the
    waiting rule of `plan_reference` with EP groups of consecutive ranks running every index together,
    each member running its group's largest count (`expert_padded`) and, with an expert share, the group's
    mean routed expert work at each index (`expert_spread`), with all-to-all bytes the transfers of its
    fullest member at each index (4 per layer, (e - 1) / e of each token's bytes over the ring link), and
    the planner's rank times are the
    simulator's busy times, padding included. The EP-aware `balance` plans its groups as units: the same
    count on every member, so on the two larger batches here the runtime pads none of its EP groups."""
    cost_model = CostModel.from_dict({**SLOW_RING.to_dict(), "expert_parallel_size": ep_size,
                                      "expert_share": expert_share, "expert_alltoall_bytes_per_token": alltoall_bytes})
    per_token = expert_share * cost_model.b1 * cost_model.num_layers
    alltoall_per_token = 4 * alltoall_bytes * (ep_size - 1) / ep_size / cost_model.ring_bandwidth * cost_model.num_layers
    for name, lengths, num_ranks, capacity, offload in _batches():
        for policy in _policies():
            config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
            plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, policy=policy)
            rules = POLICY_RULES.get(policy, PolicyRules())
            times = expert_padded([[mb.est_time for mb in r.microbatches] for r in plan.ranks],
                                  empty=cost_model.microbatch_time([]), ep_size=ep_size)
            tokens = expert_padded(microbatch_tokens(plan), empty=0, ep_size=ep_size)
            times = expert_spread(times, tokens, per_token=per_token, ep_size=ep_size,
                                  alltoall_per_token=alltoall_per_token)
            step = max(reference_finish(plan, times, barrier_per_index=rules.barrier_per_microbatch, ep_size=ep_size))
            timeline = simulate_step(plan, cost_model, rules=rules, grad_bytes=0)
            where = f"{policy} on {name}, EP {ep_size}"
            assert timeline.compute_end == pytest.approx(step, rel=1e-9), where
            assert plan.est_step_time == pytest.approx(step, rel=1e-9), where
            np.testing.assert_allclose([r.est_time for r in plan.ranks], timeline.busy, rtol=1e-9, err_msg=where)
            if policy == "balance" and name != "short docs on static rings":
                counts = [len(r.microbatches) for r in plan.ranks]
                assert [len(t) for t in times] == counts, where


JITTERY = CostModel.from_dict({**SLOW_RING.to_dict(), "jitter": 0.07})
PIPELINES = [(2, 1, None), (4, 1, None), (2, 2, None), (4, 2, None), (4, 2, 8), (2, 3, 4)]
"""(pp_size, vpp_size, group_size) of the random pipeline plans below: 1F1B, interleaved, G above pp."""


def _random_pipeline_plan(lengths, *, num_ranks, seed, cost_model, pp_size, vpp_size, group_size):
    """A random placement (`hand_plan.random_plan`: rings of any size at any index, uneven counts) timed
    by the planner's `assemble_plan` as a pipeline plan."""
    from megatron_hdp.plan.timeline.assemble import assemble_plan
    from megatron_hdp.plan.hand_plan import random_plan

    drawn = random_plan(lengths, num_ranks=num_ranks, seed=seed, max_slots=5)
    schedule = [[[s.seq for s in mb.shards] for mb in r.microbatches] for r in drawn.ranks]
    return assemble_plan(policy="random", lengths=lengths, rings=[s.ring for s in drawn.sequences],
                         offload_ratios=[0.0] * len(lengths), schedule=schedule, capacity=drawn.capacity,
                         cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size)


@pytest.mark.parametrize("cost_model", [CM, SLOW_RING, JITTERY], ids=["h100", "slow-ring", "jittery"])
def test_pipeline_step_time_is_the_simulated_one_and_ranks_candidates_alike(cost_model):
    """With PP the planner's `est_step_time` (`timing.pipeline_step_finish`) is the simulator's compute
    end, to 1e-9, on random plans with rings (1F1B and interleaved, G = pp and above): ring waits and
    pipeline bubbles are one timeline in both, so a wait that falls in a rank's fill or drain costs
    nothing. Hence the planner ranks two candidate plans of one batch (two placements, or one placement
    with two group sizes, as the balance planner's candidates differ) the way the simulator does. The
    rule before (each rank's coupled finish plus its own bubble) fails both."""
    rng = np.random.default_rng(5)
    pairs = 0
    for seed in range(24):
        pp, vpp, group = PIPELINES[seed % len(PIPELINES)]
        num_ranks = int(rng.integers(2, 6))
        lengths = rng.integers(1, 20000, size=int(rng.integers(2, 10))).tolist()
        first = _random_pipeline_plan(lengths, num_ranks=num_ranks, seed=seed, cost_model=cost_model, pp_size=pp,
                                      vpp_size=vpp, group_size=group)
        other = dict(seed=seed + 1000, group_size=group) if vpp == 1 else dict(seed=seed, group_size=2 * pp)
        second = _random_pipeline_plan(lengths, num_ranks=num_ranks, cost_model=cost_model, pp_size=pp,
                                       vpp_size=vpp, **other)
        simulated = [simulate_step(p, cost_model, rules=PolicyRules()).compute_end for p in (first, second)]
        where = f"seed {seed}, {num_ranks} ranks, pp {pp}, vpp {vpp}, G {group}, lengths {lengths}"
        for plan, end in zip((first, second), simulated):
            assert plan.est_step_time == pytest.approx(end, rel=1e-9), where
        if abs(simulated[0] - simulated[1]) > 1e-6 * max(simulated):
            pairs += 1
            assert (first.est_step_time < second.est_step_time) == (simulated[0] < simulated[1]), where
    assert pairs >= 12  # most pairs differ: the ranking is tested, not skipped
