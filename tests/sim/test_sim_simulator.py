"""The step simulator on plans whose timelines can be computed by hand.

A made-up cost model with round coefficients (4 layers, a1 = 1e-9 s/token^2, b1 = 1e-6 s/token,
g = 1e-4 s, 1 kB of K/V per token, fp32 so that dK/dV cost what K/V cost, 1 GB/s ring links) keeps every expected time a short formula written
out here, independent of the simulator's code.
"""

import dataclasses

import numpy as np
import pytest

from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.sim.simulator import PolicyRules, allreduce_time, simulate_step

LAYERS, A1, B1, G, KV, BW = 4, 1e-9, 1e-6, 1e-4, 1000.0, 1e9
COST = CostModel(a1=A1, b1=B1, g=G, a2=100.0, b2=0.0, kv_bytes_per_token=KV, num_layers=LAYERS,
                 ring_bandwidth=BW, ring_latency=0.0, d2h_bandwidth=1e9, h2d_bandwidth=1e9, activation_dtype_bytes=4)


def whole(length):
    """Hand formula: one whole document of `length` tokens, all layers, fwd + bwd."""
    return LAYERS * (G + A1 * length * length + B1 * length)


def test_one_rank_one_document():
    timeline = simulate_step(plan_from_rings([1000], [(0,)], [0], num_ranks=1, capacity=1000), COST)
    assert timeline.step_time == pytest.approx(whole(1000))  # 4 * (1e-4 + 1e-3 + 1e-3) = 8.4 ms
    assert timeline.idle_fraction == pytest.approx(0.0) and timeline.balance == pytest.approx(1.0)
    assert timeline.tokens_per_second == pytest.approx(1000 / whole(1000))


def test_two_equal_ranks_and_gradient_allreduce():
    plan = plan_from_rings([1000, 1000], [(0,), (1,)], [0, 0], num_ranks=2, capacity=1000)
    timeline = simulate_step(plan, COST, grad_bytes=1e6, allreduce_bandwidth=1e9)
    # ring all-reduce over 2 ranks: 2 * (2-1)/2 * 1 MB / 1 GB/s = 1 ms after both finish
    assert timeline.allreduce_time == pytest.approx(1e-3)
    assert timeline.step_time == pytest.approx(whole(1000) + 1e-3)
    assert list(timeline.finish) == pytest.approx([whole(1000)] * 2)


def test_unequal_ranks_idle_and_balance():
    plan = plan_from_rings([2000, 1000], [(0,), (1,)], [0, 0], num_ranks=2, capacity=2000)
    timeline = simulate_step(plan, COST)
    assert timeline.step_time == pytest.approx(whole(2000))
    busy = [whole(2000), whole(1000)]
    assert timeline.balance == pytest.approx(max(busy) / (sum(busy) / 2))
    assert timeline.idle_fraction == pytest.approx((whole(2000) - whole(1000)) / (2 * whole(2000)))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_ring_of_k(k):
    """L = 8000 over k ranks: t = L/k tokens each; attention a1 L t = 8e-6 t hides traffic
    (3k-2) t KV / BW (forward k-1 K/V, backward k-1 K/V + k dK/dV buffers) = 4e-6 t for k = 2; for
    k = 4, 8 the traffic's excess is exposed."""
    length = 8000
    t = length // k
    plan = plan_from_rings([length], [tuple(range(k))], [0], num_ranks=k, capacity=t)
    timeline = simulate_step(plan, COST)
    attention, traffic = A1 * length * t, (3 * k - 2) * t * KV / BW
    expected = LAYERS * (G + B1 * t + max(attention, traffic))
    assert timeline.step_time == pytest.approx(expected)
    assert list(timeline.comm) == pytest.approx([LAYERS * max(0.0, traffic - attention)] * k)
    assert timeline.attention_bytes == pytest.approx(k * (3 * k - 2) * t * KV * LAYERS)


def test_ring_communication_bound():
    """A slow link: 8 ranks, L = 8000, 100 MB/s -> traffic 22*1000*1e3/1e8 = 0.22 s per layer exposed."""
    slow = CostModel(**{**COST.to_dict(), "ring_bandwidth": 1e8})
    plan = plan_from_rings([8000], [tuple(range(8))], [0], num_ranks=8, capacity=1000)
    timeline = simulate_step(plan, slow)
    attention, traffic = A1 * 8000 * 1000, 22 * 1000 * KV / 1e8
    assert timeline.step_time == pytest.approx(LAYERS * (G + B1 * 1000 + traffic))
    assert timeline.comm[0] == pytest.approx(LAYERS * (traffic - attention))


def test_ring_waits_for_its_slowest_member():
    """Rank 0 runs a 2000-token document first; rank 1 must wait for it before their shared ring."""
    plan = plan_from_rings([2000, 2000], [(0,), (0, 1)], [0, 1], num_ranks=2, capacity=2000)
    timeline = simulate_step(plan, COST)
    ring = LAYERS * (G + B1 * 1000 + max(A1 * 2000 * 1000, 4 * 1000 * KV / BW))
    assert timeline.step_time == pytest.approx(whole(2000) + ring)
    ring_op = [op for op in timeline.ops[1][0] if op.microbatch == 1][0]
    assert ring_op.start == pytest.approx(whole(2000))
    # rank 1's slot 0 is an empty micro-batch: the runtime still runs it, at the overhead g per layer
    assert timeline.idle_fraction == pytest.approx((whole(2000) - LAYERS * G) / (2 * (whole(2000) + ring)))


@pytest.mark.parametrize("num_microbatches, pp", [(1, 2), (4, 2), (5, 4), (8, 4)])
def test_pipeline_bubble_uniform(num_microbatches, pp):
    """1F1B with M equal micro-batches of t per stage takes (M + p - 1) t."""
    plan = plan_from_rings([1000] * num_microbatches, [(0,)] * num_microbatches, list(range(num_microbatches)),
                           num_ranks=1, capacity=1000, pp_size=pp)
    t = whole(1000) / pp
    assert simulate_step(plan, COST).step_time == pytest.approx((num_microbatches + pp - 1) * t)


def test_offload_exposed_beyond_layer_compute():
    """Offload ratio 1 of 1000 tokens: 1e5 bytes/layer each way at 1e3 B/s is 100 s, far over compute.
    The D2H copy hides only under the forward (1/3 of the layer), the H2D prefetch under the backward
    (2/3): exposed 100 - layer/3 + 100 - 2 layer/3 per layer."""
    slow_host = CostModel(**{**COST.to_dict(), "d2h_bandwidth": 1e3, "h2d_bandwidth": 1e3})
    plan = plan_from_rings([1000], [(0,)], [0], num_ranks=1, capacity=1000)
    plan = dataclasses.replace(plan, sequences=(dataclasses.replace(plan.sequences[0], offload_ratio=1.0),))
    timeline = simulate_step(plan, slow_host)
    layer = G + A1 * 1e6 + B1 * 1000
    assert timeline.offload[0] == pytest.approx(LAYERS * (200.0 - layer))
    assert timeline.step_time == pytest.approx(LAYERS * 200.0)


def test_offload_copies_hide_in_their_own_pass_only():
    """Bandwidths set so that the D2H copy just fits the forward window and the H2D copy the backward one:
    nothing exposed; a little slower D2H exposes exactly its excess over the forward (Eq. 3's windows)."""
    layer = G + A1 * 1e6 + B1 * 1000
    act = 100.0 * 1000  # a2 * tokens
    fits = CostModel(**{**COST.to_dict(), "d2h_bandwidth": act / (layer / 3), "h2d_bandwidth": act / (2 * layer / 3)})
    plan = plan_from_rings([1000], [(0,)], [0], num_ranks=1, capacity=1000)
    plan = dataclasses.replace(plan, sequences=(dataclasses.replace(plan.sequences[0], offload_ratio=1.0),))
    assert simulate_step(plan, fits).offload[0] == pytest.approx(0.0, abs=1e-12)
    # the planner's bound leaves out the micro-batch overhead G (it is not the shard's): slightly stricter
    assert fits.hidden_offload_ratio(seq_len=1000, num_tokens=1000, ring_size=1) == pytest.approx((layer - G) / layer)
    slower = CostModel(**{**fits.to_dict(), "d2h_bandwidth": act / (layer / 2)})
    assert simulate_step(plan, slower).offload[0] == pytest.approx(LAYERS * (layer / 2 - layer / 3))
    assert slower.hidden_offload_ratio(seq_len=1000, num_tokens=1000, ring_size=1) == pytest.approx(
        2 / 3 * (layer - G) / layer)


def test_megatron_hybrid_cp_barrier():
    """Under policy megatron-hybrid-cp every micro-batch index ends in a barrier over all ranks."""
    lengths, rings, slots = [2000, 1000, 1000], [(0,), (1,), (1,)], [0, 1, 0]
    hand = plan_from_rings(lengths, rings, slots, num_ranks=2, capacity=2000)
    hybrid = plan_from_rings(lengths, rings, slots, num_ranks=2, capacity=2000, policy="megatron-hybrid-cp")
    # without the barrier rank 1 runs its two 1000s back to back; with it, its second waits for the 2000
    assert simulate_step(hand, COST).step_time == pytest.approx(whole(2000))
    assert simulate_step(hybrid, COST).step_time == pytest.approx(whole(2000) + whole(1000))


def test_megatron_hybrid_cp_barrier_lead_of_sub_sample_passes():
    """Hybrid CP's barrier couples all ranks once per group, each running its sub-samples as passes of
    their own. With jitter s per pass, varying independently, the group ends at the expected slowest of
    the ranks' summed passes (relative spread s / 2 for four passes, not s): checked against a Monte Carlo
    of noisy passes, two ranks with four 1000-token documents each."""
    s = 0.08
    jittery = CostModel(**{**COST.to_dict(), "jitter": s})
    hybrid = plan_from_rings([1000] * 8, [(0,)] * 4 + [(1,)] * 4, [0] * 8, num_ranks=2, capacity=4000,
                             policy="megatron-hybrid-cp")
    noise = np.random.default_rng(0).standard_normal((200_000, 2, 4))
    forward_share = simulate_step(hybrid, COST).ops[0][0][0].busy_end / (4 * whole(1000))
    monte_carlo = 0.0
    for share in (forward_share, 1 - forward_share):  # the barrier holds on the forward and the backward
        passes = share * whole(1000) * (1 + s * noise)
        monte_carlo += passes.sum(axis=2).max(axis=1).mean()
    assert simulate_step(hybrid, jittery).step_time == pytest.approx(monte_carlo, rel=2e-3)


def test_allreduce_formula():
    assert allreduce_time(grad_bytes=8e9, num_ranks=8, bandwidth=1e9) == pytest.approx(2 * 7 / 8 * 8)
    assert allreduce_time(grad_bytes=8e9, num_ranks=1, bandwidth=1e9) == 0.0


def test_documents_on_one_ring_share_its_exchange():
    """Two 4000-token documents on the same 2-rank ring in one micro-batch (static CP packing): one
    exchange of their 4000 summed tokens per ring step, with a 1 ms message latency paid once, hidden
    under their summed attention only as far as it goes."""
    lagging = CostModel(**{**COST.to_dict(), "ring_latency": 1e-3})
    plan = plan_from_rings([4000, 4000], [(0, 1), (0, 1)], [0, 0], num_ranks=2, capacity=4000)
    timeline = simulate_step(plan, lagging)
    attention = 2 * A1 * 4000 * 2000
    traffic = 4 * (4000 * KV / BW + 1e-3)  # 3k-2 messages of the summed tokens, one latency each
    assert timeline.step_time == pytest.approx(LAYERS * (G + B1 * 4000 + max(attention, traffic)))
    assert timeline.comm[0] == pytest.approx(LAYERS * max(0.0, traffic - attention))


def test_rules_override_predicts_our_runtime_for_hybrid_cp_plans():
    """Our runtime runs a megatron-hybrid-cp plan like any other (no barrier, one pass per micro-batch)."""
    plan = plan_from_rings([2000, 1000, 1000], [(0,), (1,), (1,)], [0, 1, 0], num_ranks=2, capacity=2000,
                           policy="megatron-hybrid-cp")
    assert simulate_step(plan, COST, rules=PolicyRules()).step_time == pytest.approx(whole(2000))
