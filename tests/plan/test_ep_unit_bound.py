"""The EP-unit bound (`plan/timeline/ep_unit_bound.py`) against plans timed by the cost model's timeline.

The reference is the timeline itself (`assemble.time_plan`) on plans the bound knows nothing of: random
plans of the bound's class (rings of at most e ranks inside one EP group, micro-batches within C but for
one piece over C alone), built here row by row with random ring sizes and places, and balance's plans.
No plan may be faster than the bound; the bound is at least the work floor, and equals it without
documents over C.
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.sharding import max_member_tokens, needed_offload_ratio, ring_offload_ratio, whole_times
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.timeline import ep_unit_bound as bound_module
from megatron_hdp.plan.timeline.assemble import time_plan
from megatron_hdp.plan.timeline.ep_unit_bound import ep_unit_bound, in_bound_class
from megatron_hdp.sim.cluster import ClusterSpec
from plan_reference import set_partitions

RANKS, EP = 16, 4  # DeepSeek-V3's cost model at 2,048 GPUs (TP 8, C = 16K), on 16 HDP ranks in 4 EP groups of 4


@pytest.fixture(scope="module")
def setting():
    spec = ClusterSpec(model="deepseek-v3", num_gpus=2048, tp_size=8, ep_size=32)
    return dataclasses.replace(spec.cost_model(), expert_parallel_size=EP), spec.rank_capacity, RANKS


def batch(capacity: int, seed: int) -> list[int]:
    """Documents from 0.05 C to 5 C, about 1.5 C-token micro-batches a rank of 16."""
    rng = random.Random(seed)
    lengths, total = [], 0
    while total < 24 * capacity:
        lengths.append(int(capacity * (5.0 if rng.random() < 0.06 else rng.choice([0.05, 0.3, 0.9, 1.4, 2.6])) *
                           rng.uniform(0.8, 1.0)))
        total += lengths[-1]
    return lengths


def random_plan(lengths: list[int], *, cost_model, capacity: int, num_ranks: int, seed: int):
    """The timed step of a random plan of the bound's class: each document (longest first) on a random ring
    size of at most e members (1: whole), into a random row of a random EP group with lanes that take it
    (pieces over C only on empty lanes, alone; the others while the lane stays within C), else a new row."""
    rng = random.Random(seed)
    units: list[list[list[list[int]]]] = [[] for _ in range(num_ranks // EP)]  # unit -> rows -> lanes -> seqs
    held: list[list[list[int]]] = [[] for _ in units]  # tokens per lane of each row (-1: a piece over C)
    rings: list[tuple[int, ...]] = [()] * len(lengths)
    ratios = [0.0] * len(lengths)
    for seq in sorted(range(len(lengths)), key=lambda s: -lengths[s]):
        s = lengths[seq]
        k = rng.choice([k for k in range(1, EP + 1) if k == 1 or 2 * k <= s])
        t = max_member_tokens(s, k)
        ratios[seq] = (ring_offload_ratio(cost_model, length=s, ring_size=k, capacity=capacity) if k > 1 else
                       needed_offload_ratio(cost_model, num_tokens=s, capacity=capacity))
        unit = rng.randrange(len(units))
        options = []
        for r, lanes in enumerate(held[unit]):
            ok = [lane for lane in range(EP) if (lanes[lane] == 0 if t > capacity else 0 <= lanes[lane] and
                                                  lanes[lane] + t <= capacity)]
            if len(ok) >= k:
                options.append((r, ok))
        if not options or rng.random() < 0.3:
            units[unit].append([[] for _ in range(EP)])
            held[unit].append([0] * EP)
            options = [(len(held[unit]) - 1, list(range(EP)))]
        r, ok = rng.choice(options)
        lanes = sorted(rng.sample(ok, k))
        for lane in lanes:
            units[unit][r][lane].append(seq)
            held[unit][r][lane] = -1 if t > capacity else held[unit][r][lane] + t
        rings[seq] = tuple(unit * EP + lane for lane in lanes)
    for rows in units:
        rng.shuffle(rows)
    schedule = [[list(row[lane]) for row in units[unit]] for unit in range(len(units)) for lane in range(EP)]
    return time_plan(policy="random", lengths=lengths, rings=rings, offload_ratios=ratios, schedule=schedule,
                     capacity=capacity, cost_model=cost_model)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_plan_of_the_class_beats_the_bound(setting, seed):
    cost_model, capacity, num_ranks = setting
    lengths = batch(capacity, seed)
    bound = ep_unit_bound(lengths, cost_model, num_ranks=num_ranks, capacity=capacity)
    assert bound.seconds >= bound.work_floor
    plan = make_plan(lengths, num_ranks=num_ranks, config=HDPConfig(hdp_capacity=capacity), cost_model=cost_model,
                     policy="balance")
    assert in_bound_class(plan, ep_size=EP)
    steps = [plan.est_step_time] + [random_plan(lengths, cost_model=cost_model, capacity=capacity,
                                                num_ranks=num_ranks, seed=100 * seed + i).est_step_time
                                    for i in range(40)]
    assert min(steps) >= bound.seconds * (1 - 1e-9), (min(steps), bound)
    assert bound.seconds > bound.work_floor * 1.001  # documents over C force a loss the floor does not see


def test_without_documents_over_c_the_bound_is_the_work_floor(setting):
    cost_model, capacity, num_ranks = setting
    lengths = [capacity // 4] * 64
    bound = ep_unit_bound(lengths, cost_model, num_ranks=num_ranks, capacity=capacity)
    assert bound.seconds == bound.work_floor


def test_the_class_is_what_the_bound_assumes(setting):
    """Random plans of the class are in it; the same plan with one ring moved across two EP groups is not,
    nor with a whole document added to a micro-batch over C."""
    cost_model, capacity, num_ranks = setting
    lengths = batch(capacity, 0)
    timed = random_plan(lengths, cost_model=cost_model, capacity=capacity, num_ranks=num_ranks, seed=7)
    assert in_bound_class(timed.build(), ep_size=EP)
    seq = next(s for s, ring in enumerate(timed.rings) if len(ring) == 2)
    a, b = timed.rings[seq]
    moved = (b + EP) % num_ranks if (b + EP) % num_ranks != a else (b + 2 * EP) % num_ranks
    schedule = [list(map(list, rank)) for rank in timed.schedule]
    index = next(i for i, mb in enumerate(schedule[b]) if seq in mb)
    schedule[b][index].remove(seq)
    while len(schedule[moved]) <= index:
        schedule[moved].append([])
    schedule[moved][index].append(seq)
    rings = list(timed.rings)
    rings[seq] = tuple(sorted((a, moved)))
    across = time_plan(policy="random", lengths=lengths, rings=rings, offload_ratios=timed.offload_ratios,
                       schedule=schedule, capacity=capacity, cost_model=cost_model)
    assert not in_bound_class(across.build(), ep_size=EP)


def best_small_plan(lengths: list[int], *, cost_model, capacity: int, num_ranks: int, ep: int) -> float:
    """The least timed step over every plan of the class for a handful of documents on two EP groups of
    `ep` = 2 lanes: documents over C whole (offloaded, alone) or on a ring of both lanes, the others whole;
    every partition into rows, every row to either group, every lane choice, each plan timed."""
    assert num_ranks == 2 * ep == 4
    heavy = [s for s in range(len(lengths)) if lengths[s] > capacity]
    best = float("inf")
    for sizes in itertools.product([1, 2], repeat=len(heavy)):
        ring_size = dict(zip(heavy, sizes))
        for partition in set_partitions(list(range(len(lengths)))):
            for units in itertools.product(range(2), repeat=len(partition)):
                whole = [s for row in partition for s in row if ring_size.get(s, 1) == 1]
                for lanes in itertools.product(range(ep), repeat=len(whole)):
                    lane_of = dict(zip(whole, lanes))
                    rows = [[[], []] for _ in partition]
                    fits = True
                    for r, row in enumerate(partition):
                        for s in row:
                            for lane in ([0, 1] if ring_size.get(s, 1) == 2 else [lane_of[s]]):
                                rows[r][lane].append(s)
                        for lane in rows[r]:
                            tokens = sum(lengths[s] if ring_size.get(s, 1) == 1 else
                                         max_member_tokens(lengths[s], 2) for s in lane)
                            if tokens > capacity and len(lane) > 1:
                                fits = False
                    if not fits:
                        continue
                    schedule = [[rows[r][lane] for r in range(len(partition)) if units[r] == u]
                                for u in range(2) for lane in range(ep)]
                    row_of = {s: r for r, row in enumerate(partition) for s in row}
                    rings = [tuple(units[row_of[s]] * ep + lane for lane in range(ep)) if ring_size.get(s, 1) == 2
                             else (units[row_of[s]] * ep + lane_of[s],) for s in range(len(lengths))]
                    ratios = [ring_offload_ratio(cost_model, length=lengths[s], ring_size=2, capacity=capacity)
                              if ring_size.get(s, 1) == 2 else
                              needed_offload_ratio(cost_model, num_tokens=lengths[s], capacity=capacity)
                              for s in range(len(lengths))]
                    best = min(best, time_plan(policy="brute", lengths=lengths, rings=rings, offload_ratios=ratios,
                                               schedule=schedule, capacity=capacity,
                                               cost_model=cost_model).est_step_time)
    return best


@pytest.mark.parametrize("lengths", [[40_000, 36_000, 9_000, 5_000, 3_000], [50_000, 20_000, 14_000, 8_000, 2_000]])
def test_the_bound_is_below_the_best_plan_of_a_small_batch(setting, lengths):
    """Two EP groups of 2 lanes, five documents, two over C: the best plan by exhaustion, each timed."""
    cost_model, capacity, _ = setting
    cost_model = dataclasses.replace(cost_model, expert_parallel_size=2)
    best = best_small_plan(lengths, cost_model=cost_model, capacity=capacity, num_ranks=4, ep=2)
    bound = ep_unit_bound(lengths, cost_model, num_ranks=4, capacity=capacity)
    assert bound.work_floor <= bound.seconds <= best * (1 + 1e-9), (bound, best)


@pytest.mark.parametrize("length", [72_000, 90_000])
def test_a_row_the_bound_can_see_exactly_is_timed_at_its_term(setting, length):
    """One EP group of 4 lanes, one row: a document over C on a ring of 3 (members of 24-30K tokens,
    offloaded, their ring traffic hidden under attention) and the fourth lane filled to exactly C with
    2,048-token documents (the light documents' own seconds a token, rho, exactly). Every fact the bound
    uses holds with equality here, so the timed step less the work floor, over the 4 ranks, is the row's
    term plus 4 micro-batch overheads (a fault in any of the term's parts shows)."""
    cost_model, capacity, _ = setting
    lengths = [length] + [2048] * 8
    rings = [(0, 1, 2)] + [(3,)] * 8
    ratios = [ring_offload_ratio(cost_model, length=length, ring_size=3, capacity=capacity)] + [0.0] * 8
    schedule = [[[0]], [[0]], [[0]], [list(range(1, 9))]]
    step = time_plan(policy="row", lengths=lengths, rings=rings, offload_ratios=ratios, schedule=schedule,
                     capacity=capacity, cost_model=cost_model).est_step_time
    bound = ep_unit_bound(lengths, cost_model, num_ranks=4, capacity=capacity)
    overhead = cost_model.microbatch_time([], pp_size=1)
    spt = cost_model.expert_seconds_per_token()
    rho = (float(whole_times([2048], cost_model=cost_model)[0]) - spt * 2048) / 2048
    items = bound_module._build_items(np.array([length]), np.array([1]), 2048, cost_model=cost_model,
                                      capacity=capacity, rho=rho)
    ring_of_3 = [j for j in range(len(items.kind)) if items.units[j] == 3 * bound_module.QUANTA]
    term = bound_module._column_cost(items, ring_of_3, e=4, capacity=capacity, rho=rho,
                                     a2a=cost_model.expert_alltoall_seconds_per_token())
    assert (step - bound.work_floor) * 4 == pytest.approx(term + 4 * overhead, rel=1e-9)
    assert bound.seconds <= step
