"""Megatron's pipeline op order (`plan.timeline.interleaved`) against Megatron-core's own schedule functions, and
the ring rule: plans that satisfy it pass the global wait-for-graph check, a plan that breaks it
deadlocks there, and `padded_counts` gives the least counts that satisfy it."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.plan.timeline import interleaved as il

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def megatron_order(num: int, pp: int, stage: int, vpp: int, group: int) -> list[tuple[str, int, int]]:
    """The op order of forward_backward_pipelining_with(out)_interleaving, rebuilt from Megatron's own
    get_schedule_table and get_pp_rank_microbatches and the loop shape of the schedule (warm-up
    forwards k; steady forward k + W then backward k; cool-down backwards; a backward's chunk is
    num_model_chunks - chunk - 1, get_model_chunk_id(forward=False))."""
    comm = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: stage),
                           virtual_pipeline_model_parallel_size=None if vpp == 1 else vpp)
    total, _, warmup, remaining = schedules.get_pp_rank_microbatches(num, vpp, group, p2p_communicator=comm)
    table = schedules.get_schedule_table(num, vpp, group)
    assert total == len(table) == warmup + remaining

    def f(k):
        return ("F", table[k][1], table[k][0])

    def b(k):
        return ("B", vpp - 1 - table[k][1], table[k][0])

    order = [f(k) for k in range(warmup)]
    for k in range(remaining):
        order += [f(k + warmup), b(k)]
    return order + [b(k) for k in range(remaining, total)]


def valid_cases():
    for pp, vpp in itertools.product((2, 3, 4, 8), (1, 2, 3, 4)):
        for group in range(pp, pp + 4) if vpp > 1 else (pp,):
            for num in range(1, 3 * group + 3):
                if il.megatron_constraint_error(num, pp_size=pp, vpp_size=vpp, group_size=group) is None:
                    yield pp, vpp, group, num


def test_stage_order_is_megatrons():
    cases = list(valid_cases())
    assert len(cases) > 300
    for pp, vpp, group, num in cases:
        for stage in range(pp):
            expected = megatron_order(num, pp, stage, vpp, group)
            assert il.stage_order(num, pp_size=pp, stage=stage, vpp_size=vpp, group_size=group) == expected


def test_schedule_table_is_megatrons_for_any_count():
    for num, vpp, group in itertools.product(range(1, 20), range(1, 5), range(1, 8)):
        assert il.schedule_table(num, vpp_size=vpp, group_size=group) == list(
            schedules.get_schedule_table(num, vpp, group))


def test_constraints_are_megatrons():
    """Megatron's docstring example (PP 2, VP 2, G 3, N 5) runs; a last group of 1 < pp and a group
    larger than the count are refused, as forward_backward_pipelining_with_interleaving refuses them."""
    assert il.megatron_constraint_error(5, pp_size=2, vpp_size=2, group_size=3) is None
    assert "last group" in il.megatron_constraint_error(7, pp_size=2, vpp_size=2, group_size=3)
    assert "group size" in il.megatron_constraint_error(2, pp_size=4, vpp_size=2)
    assert il.megatron_constraint_error(6, pp_size=4, vpp_size=2) is not None  # default G = pp: multiples of pp
    assert il.megatron_constraint_error(3, pp_size=4, vpp_size=1) is None


BREAKS_THE_RULE = dict(counts=[8, 6], rings=[(0, (0, 1)), (4, (0, 1))], pp_size=2, vpp_size=2, group_size=4)
"""Rings at micro-batches 0 and 4 of two pipelines of 8 and 6 (6 = 4 + 2 is a count Megatron runs with
pp 2, its last group [4, 5] holding 2). Micro-batch 4 sits in a full group [4..7] on pipeline 0 and in the
short last group on pipeline 1, so its chunk-1 forward has virtual id 12 on one and 10 on the other:
stage 0 of pipeline 1 runs F(chunk 1, mb 4) before B(chunk 0, mb 0), stage 0 of pipeline 0 after it. Both
ops are ring rendezvous: a cycle (found by brute force over small plans; one ring alone never deadlocks)."""


def test_the_checker_finds_the_cycle_of_a_plan_that_breaks_the_rule():
    assert not il.satisfies_ring_rule(**{k: v for k, v in BREAKS_THE_RULE.items()})
    cycle = il.deadlock_cycle(**BREAKS_THE_RULE)
    assert cycle is not None
    assert {pipeline for pipeline, _, _ in cycle} == {0, 1}  # the cycle runs through both pipelines
    padded = il.padded_counts(BREAKS_THE_RULE["counts"], pp_size=2, vpp_size=2, group_size=4,
                              rings=BREAKS_THE_RULE["rings"])
    assert padded == [8, 8]
    assert il.deadlock_free(**{**BREAKS_THE_RULE, "counts": padded})


def test_without_rings_nothing_deadlocks():
    """Each pipeline alone is Megatron's schedule: acyclic (the checker's own baseline)."""
    for pp, vpp, group, num in list(valid_cases())[::7]:
        assert il.deadlock_free([num], rings=[], pp_size=pp, vpp_size=vpp, group_size=group)


@st.composite
def ring_plans(draw):
    pp = draw(st.integers(2, 4))
    vpp = draw(st.integers(1, 3))
    group = draw(st.integers(pp, pp + 3)) if vpp > 1 else pp
    num_pipelines = draw(st.integers(2, 4))
    counts = draw(st.lists(st.integers(0, 3 * group + 1), min_size=num_pipelines, max_size=num_pipelines))
    num_rings = draw(st.integers(1, 4))
    members = [draw(st.lists(st.integers(0, num_pipelines - 1), min_size=2, max_size=num_pipelines, unique=True))
               for _ in range(num_rings)]
    return pp, vpp, group, counts, members, draw(st.randoms(use_true_random=False))


@settings(max_examples=150, deadline=None)
@given(ring_plans())
def test_padded_plans_satisfy_megatron_and_the_rule_and_never_deadlock(case):
    pp, vpp, group, counts, members, rnd = case
    # a ring sits at an index every member runs after padding; padding first, with the rings' links
    links = [(0, m) for m in members]
    padded = il.padded_counts(counts, pp_size=pp, vpp_size=vpp, group_size=group, rings=links)
    rings = [(rnd.randrange(min(padded[p] for p in m)), m) for m in members]
    assert all(n >= max(c, 1) for n, c in zip(padded, counts))
    for n in padded:
        assert il.megatron_constraint_error(n, pp_size=pp, vpp_size=vpp, group_size=group) is None
    assert il.deadlock_free(padded, rings=rings, pp_size=pp, vpp_size=vpp, group_size=group)
    assert il.satisfies_ring_rule(padded, rings=rings, pp_size=pp, vpp_size=vpp, group_size=group)


@settings(max_examples=150, deadline=None)
@given(ring_plans())
def test_every_plan_satisfying_the_rule_is_deadlock_free(case):
    """Counts drawn directly among those Megatron runs; whenever they satisfy the rule, the wait-for graph
    is acyclic (the rule is the module's sufficient condition, checked by brute force)."""
    pp, vpp, group, counts, members, rnd = case
    counts = [n for n in (max(c, group if vpp > 1 else 1) for c in counts)]
    if any(il.megatron_constraint_error(n, pp_size=pp, vpp_size=vpp, group_size=group) for n in counts):
        return
    rings = [(rnd.randrange(min(counts[p] for p in m)), m) for m in members]
    if il.satisfies_ring_rule(counts, rings=rings, pp_size=pp, vpp_size=vpp, group_size=group):
        assert il.deadlock_free(counts, rings=rings, pp_size=pp, vpp_size=vpp, group_size=group)


def test_padding_is_least():
    """Brute force over every count vector at or above the plan's: none with a smaller total satisfies
    Megatron's constraints and the rule."""
    pp, vpp, group = 2, 2, 3
    for counts in itertools.product(range(0, 8), repeat=3):
        rings = [(0, (0, 1))]
        padded = il.padded_counts(list(counts), pp_size=pp, vpp_size=vpp, group_size=group, rings=rings)
        ranges = [range(max(c, 1), 12) for c in counts]
        best = min(sum(v) for v in itertools.product(*ranges)
                   if all(il.megatron_constraint_error(n, pp_size=pp, vpp_size=vpp, group_size=group) is None
                          for n in v)
                   and il.satisfies_ring_rule(v, rings=rings, pp_size=pp, vpp_size=vpp, group_size=group))
        assert sum(padded) == best, (counts, padded)


def test_one_f_one_b_needs_no_padding():
    assert il.padded_counts([0, 3, 5], pp_size=4, rings=[(0, (1, 2))]) == [1, 3, 5]
    assert il.deadlock_free([3, 5, 2], rings=[(1, (0, 1, 2)), (2, (0, 1))], pp_size=4)


def test_one_f_one_b_order_of_a_shorter_pipeline_is_the_longer_ones_restricted():
    """The prefix order the 1F1B argument rests on (module doc), on Megatron's order (`stage_order`, checked
    against Megatron's functions above): also where the shorter pipeline's warm-up is capped (N < pp - s)."""
    for pp in (2, 3, 4, 8):
        for most in range(1, 2 * pp + 2):
            for num in range(1, most + 1):
                for stage in range(pp):
                    longer = il.stage_order(most, pp_size=pp, stage=stage)
                    assert il.stage_order(num, pp_size=pp, stage=stage) == [op for op in longer if op[2] < num]


def test_one_f_one_b_rings_at_one_index_never_deadlock_whatever_the_counts():
    """Brute force: every count vector of 3 pipelines (1..pp + 2 micro-batches) with every pair and the
    triple ringed at every index all members run, two rings at once: the wait-for graph is acyclic, so
    `padded_counts` (no 1F1B padding) is safe. The rule's one condition is one index per ring."""
    groups = [(0, 1), (1, 2), (0, 2), (0, 1, 2)]
    for pp in (2, 4):
        for counts in itertools.product(range(1, pp + 3), repeat=3):
            rings = [(m, g) for g in groups for m in range(min(counts[p] for p in g))]
            for pair in itertools.combinations(rings, 2):
                assert il.deadlock_free(list(counts), rings=pair, pp_size=pp), (pp, counts, pair)


def test_the_checker_finds_the_cycle_of_rings_held_at_different_indices_in_1f1b():
    """The planted fault of the 1F1B rule: ring A at micro-batch 0 of pipeline 0 but 1 of pipeline 1,
    ring B the other way round. Each pipeline runs its micro-batch 0 first, so each waits in A (resp. B)
    for the other: a cycle, which one index per ring (StepPlan.validate) rules out."""
    crossed = [((0, 1), (0, 1)), ((1, 0), (0, 1))]
    cycle = il.deadlock_cycle([2, 2], rings=crossed, pp_size=2)
    assert cycle is not None and {pipeline for pipeline, _, _ in cycle} == {0, 1}
    assert il.deadlock_free([2, 2], rings=[((0, 0), (0, 1)), ((1, 1), (0, 1))], pp_size=2)


def test_a_larger_group_keeps_more_activations_and_light_microbatches_fit_it():
    """`resident_peak` by hand: 1F1B stage 0 keeps pp micro-batches; the interleaved schedule with G = pp
    keeps 2 (pp - 1) + (v - 1) pp + 1 chunks (the budget C was sized for); a larger G keeps more, which
    full micro-batches overflow and light ones (a long document's ring shards) do not."""
    assert il.resident_peak([10.0] * 6, pp_size=4) == 40.0 == il.activation_budget(10, pp_size=4)
    budget = il.activation_budget(10, pp_size=4, vpp_size=2)
    assert budget == (6 + 4 + 1) * 10 / 2
    assert il.resident_peak([10.0] * 8, pp_size=4, vpp_size=2) == budget
    assert il.resident_peak([10.0] * 10, pp_size=4, vpp_size=2, group_size=5) > budget
    assert not il.group_size_fits([10] * 10, capacity=10, pp_size=4, vpp_size=2, group_size=5)
    assert il.group_size_fits([4] * 5 + [10] * 5, capacity=10, pp_size=4, vpp_size=2, group_size=5)


def test_resident_peaks_of_many_pipelines_are_each_pipeline_run_op_by_op():
    """`resident_peaks` (numpy over the pipelines of one count) against the stage walked op by op here,
    for uneven counts and integer or float tokens: the same floats, not only the same verdict."""
    rng = np.random.default_rng(16)
    for pp, vpp, group, counts in [(2, 1, None, [1, 3, 7, 2, 0]), (4, 2, None, [4, 8, 12, 4]),
                                   (4, 10, 5, [5, 10, 13, 5]), (3, 3, 4, [4, 8, 7])]:
        tokens = [rng.integers(0, 20_000, size=n).tolist() if i % 2 else rng.uniform(0, 2e4, size=n).tolist()
                  for i, n in enumerate(counts)]
        expected = []
        for pipeline_tokens in tokens:
            peak = 0.0
            for stage in range(pp):
                held = 0.0
                for kind, _, mb in il.stage_order(len(pipeline_tokens), pp_size=pp, stage=stage, vpp_size=vpp,
                                                  group_size=group):
                    held = held + pipeline_tokens[mb] / vpp if kind == "F" else held - pipeline_tokens[mb] / vpp
                    peak = max(peak, held)
            expected.append(peak)
        assert il.resident_peaks(tokens, pp_size=pp, vpp_size=vpp, group_size=group).tolist() == expected


def test_ring_outside_a_members_count_is_refused():
    with pytest.raises(ValueError, match="micro-batch 5"):
        il.deadlock_cycle([4, 8], rings=[(5, (0, 1))], pp_size=2, vpp_size=2)
