"""`balance` against a brute-force optimum on small instances with rings, and with expert parallelism.

Instances: 2-4 ranks, 3-7 documents, C = 1024 tokens, one to three documents longer than C (they need
rings), no offload, a cost model whose ring traffic is partly exposed. The brute force enumerates every
ring for each long document (every member set of every size from D(s) to all ranks), every order of the
rings, and every position of every whole document (on any rank, before any of its rings or after them),
timing each candidate with the planner's own model: ring micro-batches start when their last member is
ready and end together (`plan.timeline.timing`), micro-batch times from `CostModel.microbatch_time`, whole
documents before a ring packed at the best possible micro-batch count (ceil(tokens / C)). It relaxes
the runtime's rule that a ring sits at the same micro-batch index on every member (a plan must pad to
meet it), so its optimum is at most the true one and `balance` is held to a stricter reference. A
branch-and-bound cut (times only grow as documents are added) keeps it exhaustive and fast.

Measured on the 200 seeded instances, `balance`'s plans re-timed by the simulator: within 5% on all of
them, worst 1.030 (seed 55); the test asserts all 200 within 5% and the worst <= 1.035. With the
aligned-only ring placement it had before `place_rings_by_time`: 94.5% and worst 1.39 (the test fails).

With expert parallelism (`ep_optimum`): 4 or 6 ranks in EP groups of 2 or 4, 3-7 whole documents of at
most C tokens. An EP group runs micro-batch i of all its members together (the MoE all-to-all), so its
time is the sum over indices of the slowest member's micro-batch (every member runs the group's count).
The brute force enumerates every split of the documents over the groups and, per group, every partition
of its documents into micro-batches of <= C tokens; a group's micro-batches are best run e at a time in
order of time (the largest sets an index, so the next e - 1 largest go beside it: an exchange argument),
so that is all it needs. Measured on 200 seeded instances: EP-aware `balance` within 1% on all (worst
1.0069, seed 55); `balance` planning without EP (its plan run with the EP coupling) worst 1.20, 95.5%
within 5% (the test fails it).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.zigzag import zigzag_chunks
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import max_member_tokens, whole_times
from megatron_hdp.sim.simulator import PolicyRules, simulate_step
from plan_reference import set_partitions

CAPACITY = 1024
CM = CostModel.from_dict({**analytic_cost_model("llama-7b", tp_size=8).to_dict(), "ring_bandwidth": 5e9,
                          "ring_latency": 2e-5})
INSTANCES = 200


def _instance(seed: int) -> tuple[int, list[int]]:
    rng = np.random.default_rng(seed)
    num_ranks = int(rng.integers(2, 5))
    num_long = int(rng.integers(1, 4))
    num_docs = int(rng.integers(num_long + 2, 8))
    longest = min(3 * CAPACITY, num_ranks * CAPACITY)
    lengths = rng.integers(CAPACITY + 1, longest + 1, size=num_long).tolist()
    lengths += rng.integers(50, CAPACITY + 1, size=num_docs - num_long).tolist()
    lengths = [n for n in lengths if n <= CAPACITY or max_member_tokens(n, num_ranks) <= CAPACITY]
    return num_ranks, lengths


def _ring_time(length: int, members: tuple[int, ...]) -> float:
    """The ring micro-batch's time: its slowest member (zigzag members hold slightly different tokens)."""
    k = len(members)
    return max(CM.microbatch_time([(length, sum(b - a for a, b in zigzag_chunks(length, k, p)), members)])
               for p in range(k))


def brute_force(num_ranks: int, lengths: list[int], incumbent: float) -> float:
    """Least step time over every ring choice, ring order and whole-document position (module doc)."""
    long_ids = [i for i, n in enumerate(lengths) if n > CAPACITY]
    whole_ids = sorted((i for i, n in enumerate(lengths) if n <= CAPACITY), key=lambda i: -lengths[i])
    weight = whole_times(lengths, cost_model=CM)
    overhead = CM.microbatch_time([])
    choices = {}
    for seq in long_ids:
        fewest = next(k for k in range(2, num_ranks + 1) if max_member_tokens(lengths[seq], k) <= CAPACITY)
        choices[seq] = [m for k in range(fewest, num_ranks + 1) for m in itertools.combinations(range(num_ranks), k)]
    best = incumbent
    for rings in itertools.product(*(choices[s] for s in long_ids)):
        for order in itertools.permutations(range(len(long_ids))):
            ring_seq = [(rings[j], _ring_time(lengths[long_ids[j]], rings[j])) for j in order]
            slots = [[j for j, (members, _) in enumerate(ring_seq) if r in members] for r in range(num_ranks)]
            # gap g of rank r: before its g-th ring (g = len(slots[r]): after its last)
            gaps = [(r, g) for r in range(num_ranks) for g in range(len(slots[r]) + 1)]
            load = {gap: [0.0, 0] for gap in gaps}

            def step() -> float:
                clock = [0.0] * num_ranks
                seen = [0] * num_ranks
                for members, time in ring_seq:
                    ready = []
                    for r in members:
                        seconds, tokens = load[(r, seen[r])]
                        ready.append(clock[r] + seconds + overhead * -(-tokens // CAPACITY))
                        seen[r] += 1
                    end = max(ready) + time
                    for r in members:
                        clock[r] = end
                finish = 0.0
                for r in range(num_ranks):
                    seconds, tokens = load[(r, seen[r])]
                    finish = max(finish, clock[r] + seconds + overhead * -(-tokens // CAPACITY))
                return finish

            def place(i: int) -> None:
                nonlocal best
                current = step()
                if current >= best:
                    return
                if i == len(whole_ids):
                    best = current
                    return
                seq = whole_ids[i]
                for gap in gaps:
                    load[gap][0] += weight[seq]
                    load[gap][1] += lengths[seq]
                    place(i + 1)
                    load[gap][0] -= weight[seq]
                    load[gap][1] -= lengths[seq]

            place(0)
    return best


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
def test_brute_force_finds_the_hand_optimum(num_ranks):
    """Sanity of the reference on every size: one long document and one short one per rank; the best is
    the ring over all ranks with the short ones after it, or a smaller ring with short ones beside it."""
    lengths = [CAPACITY + 1] + [200] * num_ranks
    weight = whole_times(lengths, cost_model=CM)
    overhead = CM.microbatch_time([])
    ring_all = _ring_time(lengths[0], tuple(range(num_ranks))) + overhead + weight[1]
    ring_two = _ring_time(lengths[0], (0, 1))
    short_elsewhere = overhead * 2 + 2 * weight[1] if num_ranks == 2 else overhead + weight[1]
    candidates = [ring_all, ring_two + overhead + weight[1] if num_ranks > 2 else ring_two + short_elsewhere]
    got = brute_force(num_ranks, lengths, incumbent=float("inf"))
    assert got <= min(candidates) * (1 + 1e-12)
    assert got > 0


def test_balance_is_within_five_percent_of_the_brute_force_optimum():
    """Every instance within 5% and the worst near the 1.030 measured (module doc), `balance`'s plan
    re-timed by the simulator (not its own `est_step_time`, which would also seed the brute force)."""
    config = HDPConfig(hdp_capacity=CAPACITY, hdp_offload=False)
    ratios, sizes = [], set()
    for seed in range(INSTANCES):
        num_ranks, lengths = _instance(seed)
        sizes.add(num_ranks)
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=CM, policy="balance")
        simulated = simulate_step(plan, CM, rules=PolicyRules(), grad_bytes=0).compute_end
        optimum = brute_force(num_ranks, lengths, incumbent=simulated * (1 + 1e-9))
        ratios.append(simulated / optimum)
    ratios = np.array(ratios)
    worst = int(np.argmax(ratios))
    assert sizes == {2, 3, 4}
    where = f"{np.mean(ratios <= 1.05):.1%} within 5%; worst {ratios[worst]:.3f} on seed {worst}: {_instance(worst)}"
    assert np.all(ratios <= 1.05), where
    assert ratios[worst] <= 1.035, where
    print(f"balance / brute force over {INSTANCES} instances: median {np.median(ratios):.4f}, "
          f"{np.mean(ratios <= 1.05):.1%} within 5%, worst {ratios[worst]:.4f} (seed {worst})")


def ep_optimum(num_ranks: int, ep_size: int, lengths: list[int]) -> float:
    """Least step time of whole documents on EP groups of `ep_size` consecutive ranks (module doc)."""
    weight = whole_times(lengths, cost_model=CM).tolist()
    overhead = CM.microbatch_time([])

    @functools.lru_cache(maxsize=None)
    def group_time(docs: tuple[int, ...]) -> float:
        if not docs:
            return overhead  # a group without documents runs one empty micro-batch
        best = float("inf")
        for blocks in set_partitions(list(docs)):
            if all(sum(lengths[d] for d in block) <= CAPACITY for block in blocks):
                times = sorted((overhead + sum(weight[d] for d in block) for block in blocks), reverse=True)
                best = min(best, sum(times[::ep_size]))
        return best

    groups = num_ranks // ep_size
    return min(max(group_time(tuple(d for d, g in enumerate(split) if g == group)) for group in range(groups))
               for split in itertools.product(range(groups), repeat=len(lengths)) if split[0] == 0)


def _ep_instance(seed: int) -> tuple[int, int, list[int]]:
    rng = np.random.default_rng(seed)
    ep_size = int(rng.choice([2, 4]))
    num_ranks = 4 if ep_size == 4 else int(rng.choice([4, 6]))
    return num_ranks, ep_size, rng.integers(50, CAPACITY + 1, size=int(rng.integers(3, 8))).tolist()


def test_balance_with_expert_parallelism_is_within_one_percent_of_the_brute_force_optimum():
    """Every instance within 1% of `ep_optimum` (measured worst 1.0069, module doc); the same planner
    without EP (its plans run with the EP coupling) is more than 5% off on some: the test has teeth."""
    config = HDPConfig(hdp_capacity=CAPACITY, hdp_offload=False)
    aware, unaware = [], []
    for seed in range(INSTANCES):
        num_ranks, ep_size, lengths = _ep_instance(seed)
        ep = dataclasses.replace(CM, expert_parallel_size=ep_size)
        optimum = ep_optimum(num_ranks, ep_size, lengths)
        for ratios, cost_model in ((aware, ep), (unaware, CM)):
            plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, policy="balance")
            ratios.append(simulate_step(plan, ep, rules=PolicyRules(), grad_bytes=0).compute_end / optimum)
    aware, unaware = np.array(aware), np.array(unaware)
    worst = int(np.argmax(aware))
    assert aware.min() >= 1 - 1e-9  # the brute force is exhaustive
    assert aware[worst] <= 1.01, f"worst {aware[worst]:.4f} on seed {worst}: {_ep_instance(worst)}"
    assert unaware.max() > 1.05
