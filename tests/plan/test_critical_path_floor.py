"""The critical-path floor: no step is shorter than its longest document's fastest pipeline crossing.

`plan.timeline.bounds.fastest_crossing` times a document with the cost model's own `microbatch_time`; what is
checked here shares no code with it: (a) it is a true lower bound, so no policy's plan and no random
placement, simulated op by op (`simulate_step`, PP 1 to 4, 1F1B and interleaved), finishes below it;
(b) on one long document and a cost model small enough to price by hand, the crossing and its ring size
are the numbers written out below, and a plan holding that document alone on that ring reaches it.
"""

import os

import numpy as np
import pytest

from megatron_hdp.config import POLICIES, HDPConfig
from megatron_hdp.plan.timeline.assemble import assemble_plan
from megatron_hdp.plan.timeline.bounds import critical_path_floor, fastest_crossing
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.hand_plan import random_plan
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.compare import compute_floor
from megatron_hdp.sim.simulator import simulate_step

CM = analytic_cost_model("llama-7b", tp_size=8)
SLOW_RING = CostModel.from_dict({**CM.to_dict(), "ring_bandwidth": 2e9, "ring_latency": 1e-4, "jitter": 0.05})
# a topology whose network is faster than its node's links: the bound must take the faster one
ODD_LINKS = CostModel.from_dict({**CM.to_dict(), "ring_bandwidth": 4e9, "ranks_per_node": 2,
                                 "intra_node_bandwidth": 1e9, "ring_block_overhead": 2e-5})
PIPELINES = [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (2, 4)]
"""(pp_size, vpp_size) of the random cases."""


def _policies(pp_size):
    import megatron_hdp.megatron  # noqa: F401  (registers Megatron's policies)

    for name in POLICIES:
        if name == "megatron-dynamic-cp" and not os.environ.get("MEGATRON_LM_DIR"):
            continue  # needs a Megatron-LM dev checkout
        if name == "megatron-hybrid-cp" and pp_size > 1:
            continue  # refuses pipeline parallelism
        yield name


def _random_placement(lengths, *, num_ranks, seed, cost_model, pp_size, vpp_size):
    drawn = random_plan(lengths, num_ranks=num_ranks, seed=seed, max_slots=4)
    schedule = [[[s.seq for s in mb.shards] for mb in r.microbatches] for r in drawn.ranks]
    return assemble_plan(policy="random", lengths=lengths, rings=[s.ring for s in drawn.sequences],
                         offload_ratios=[0.0] * len(lengths), schedule=schedule, capacity=drawn.capacity,
                         cost_model=cost_model, pp_size=pp_size, vpp_size=vpp_size)


@pytest.mark.parametrize("cost_model", [CM, SLOW_RING, ODD_LINKS], ids=["h100", "slow-jittery", "odd-links"])
def test_no_simulated_step_beats_the_critical_path_floor(cost_model):
    """Every policy's plan and random placements of random batches, PP 1-4 with and without virtual
    stages: the simulated step (compute end) is never below the floor, and in some cases the crossing
    is what sets the floor (so the crossing term is tested, not only the work term)."""
    rng = np.random.default_rng(11)
    crossing_binds = 0
    for case in range(18):
        pp, vpp = PIPELINES[case % len(PIPELINES)]
        num_ranks = int(rng.choice([4, 8]))
        capacity = 4096  # documents up to 4 C - 8 tokens: static's CP group of 4 holds them
        long = rng.integers(capacity, 4 * capacity - 8, size=int(rng.integers(0, 3))).tolist()
        lengths = rng.integers(50, capacity, size=int(rng.integers(3, 30))).tolist() + long
        work = compute_floor(lengths, cost_model, num_ranks=num_ranks, pp_size=pp)
        floor = critical_path_floor(work, lengths, num_ranks=num_ranks, cost_model=cost_model, pp_size=pp)
        crossing_binds += floor > work
        plans = []
        for policy in _policies(pp):
            try:
                plans.append(make_plan(lengths, num_ranks=num_ranks, config=HDPConfig(hdp_capacity=capacity),
                                       cost_model=cost_model, pp_size=pp, vpp_size=vpp, policy=policy))
            except ValueError as refused:  # Megatron's dev scheduler asserts on some batches (its limit, not ours)
                if "Megatron's scheduler refused the batch" not in str(refused):
                    raise
        plans += [_random_placement(lengths, num_ranks=num_ranks, seed=case * 10 + i, cost_model=cost_model,
                                    pp_size=pp, vpp_size=vpp) for i in range(3)]
        for plan in plans:
            end = simulate_step(plan, cost_model).compute_end
            assert end >= floor * (1 - 1e-12), (f"{plan.policy}: simulated {end} s below the floor {floor} s, "
                                                f"case {case}, pp {pp}, vpp {vpp}, {num_ranks} ranks, {lengths}")
    assert crossing_binds >= 4


# One 1,200-token document, 4 layers, by hand. Per layer a member of a ring of k holding t = ceil(1200/k)
# tokens takes g + b1 t + max(a1 1200 t, ring traffic) with ring traffic (2 (k-1) + 2 k) t kv / bw +
# (3k - 2) latency (K/V in bf16 forward and backward, dK/dV in fp32: twice the bytes; 3k - 2 messages).
TINY = CostModel(a1=1e-6, b1=1e-3, g=0.01, a2=1.0, b2=0.0, kv_bytes_per_token=1.0, num_layers=4,
                 ring_bandwidth=2e4, ring_latency=0.01)
HAND_PER_LAYER = {  # k: (t, ring traffic, attention) -> seconds per layer
    1: 0.01 + 1.2 + 1.44,                 # whole: no traffic, attention 1.44
    2: 0.01 + 0.6 + max(0.72, 0.22),      # 6 x 600 / 2e4 + 4 x 0.01
    3: 0.01 + 0.4 + max(0.48, 0.27),      # 10 x 400 / 2e4 + 7 x 0.01
    4: 0.01 + 0.3 + max(0.36, 0.31),      # 14 x 300 / 2e4 + 10 x 0.01
    5: 0.01 + 0.24 + max(0.288, 0.346),   # 18 x 240 / 2e4 + 13 x 0.01
    6: 0.01 + 0.2 + max(0.24, 0.38),      # 22 x 200 / 2e4 + 16 x 0.01 -> 0.59, the fastest
    7: 0.01 + 0.172 + max(0.2064, 0.4136),  # 26 x 172 / 2e4 + 19 x 0.01
    8: 0.01 + 0.15 + max(0.18, 0.445),    # 30 x 150 / 2e4 + 22 x 0.01
}


@pytest.mark.parametrize("pp_size", [1, 2, 4])
@pytest.mark.parametrize("num_ranks", [4, 8])
def test_crossing_of_one_document_by_hand(pp_size, num_ranks):
    """The crossing is pp stages of 4 / pp layers each, forward and back: all 4 layers of the fastest
    ring's member, whatever the pp; with 4 ranks the ring of 6 is out of reach and 4 is the fastest."""
    best_k = min(range(1, num_ranks + 1), key=lambda k: HAND_PER_LAYER[k])
    assert best_k == (6 if num_ranks == 8 else 4)
    seconds, ring_size = fastest_crossing(1200, num_ranks=num_ranks, cost_model=TINY, pp_size=pp_size)
    assert ring_size == best_k
    assert seconds == pytest.approx(4 * HAND_PER_LAYER[best_k], rel=1e-12)  # 2.36 s or 2.68 s
    # the floor is the crossing when it exceeds the work bound given, else that bound
    assert critical_path_floor(1.0, [1200, 30], num_ranks=num_ranks, cost_model=TINY,
                               pp_size=pp_size) == pytest.approx(seconds)
    assert critical_path_floor(9.0, [1200, 30], num_ranks=num_ranks, cost_model=TINY, pp_size=pp_size) == 9.0


# The same links, but 6 ranks per node and a node's own links at half the network's speed: a ring of 6
# inside a node is slower (per layer 0.01 + 0.2 + max(0.24, 22 x 200 / 1e4 + 0.16) = 0.81), one of 6
# across two nodes runs at the network's 2e4 bytes/s (0.59 again), and so does every ring of 7 and more.
TINY_NODES = CostModel.from_dict({**TINY.to_dict(), "ranks_per_node": 6, "intra_node_bandwidth": 1e4})


@pytest.mark.parametrize("pp_size", [1, 2, 4])
@pytest.mark.parametrize("cost_model, num_ranks, ring", [(TINY, 8, (0, 1, 2, 3, 4, 5)),
                                                         (TINY_NODES, 12, (0, 1, 2, 3, 4, 6))],
                         ids=["one-link", "network-faster"])
def test_the_document_alone_on_its_fastest_ring_reaches_the_floor(pp_size, cost_model, num_ranks, ring):
    """The floor is tight: the 1,200-token document alone on its fastest ring of 6 (across nodes where
    the network is the faster link), simulated op by op, finishes at 4 x 0.59 = 2.36 s (its chain,
    nothing waiting beside it), which is the floor."""
    plan = assemble_plan(policy="hand", lengths=[1200], rings=[ring], offload_ratios=[0.0],
                         schedule=[[[0]] if r in ring else [] for r in range(num_ranks)], capacity=1200,
                         cost_model=cost_model, pp_size=pp_size)
    simulated = simulate_step(plan, cost_model).compute_end
    assert simulated == pytest.approx(4 * HAND_PER_LAYER[6], rel=1e-12)
    assert fastest_crossing(1200, num_ranks=num_ranks, cost_model=cost_model, pp_size=pp_size) == (
        pytest.approx(simulated, rel=1e-12), 6)
