"""The micro-batch counts the runtime runs with virtual pipeline stages (`data.prepare.pipeline_counts`)
and its check of them against THE RING RULE (`plan.timeline.interleaved`) before any P2P.

The independent reference is `plan.timeline.interleaved.deadlock_cycle`: a brute-force wait-for graph over every
op of every rank. Counts Megatron would run but that break the rule deadlock there, and the runtime's
check refuses them with a ValueError on every rank (same plan, same counts) instead of entering the
schedule. No processes: the counts are pure functions of the plan and the rank's HDPState.
"""

import dataclasses
from types import SimpleNamespace

import pytest

from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.comm.domain import HDPState
from megatron_hdp.data import prepare
from megatron_hdp.plan.timeline.interleaved import deadlock_cycle, megatron_constraint_error


def _state(*, hdp_rank=0, hdp_size=2, ep_size=1, vpp_size=2, pp_size=2) -> HDPState:
    first = hdp_rank - hdp_rank % ep_size
    return HDPState(hdp_rank=hdp_rank, hdp_global_ranks=tuple(range(hdp_size)), tp_size=1, pp_size=pp_size,
                    pp_rank=0, vpp_size=vpp_size, ep_size=ep_size, ep_hdp_ranks=tuple(range(first, first + ep_size)))


def _plan(counts, rings, num_ranks=2):
    """A plan where rank r holds whole one-token documents in slots 0..counts[r]-1, plus a 4-token ring
    sequence at each (slot, members) of `rings`."""
    lengths, placed, slots = [], [], []
    for slot, members in rings:
        lengths.append(4), placed.append(tuple(members)), slots.append(slot)
    for rank, count in enumerate(counts):
        for slot in range(count):
            lengths.append(1), placed.append((rank,)), slots.append(slot)
    return plan_from_rings(lengths, placed, slots, num_ranks=num_ranks, capacity=sum(lengths), pp_size=2,
                           vpp_size=2)


def test_rule_pads_only_where_a_cycle_would_form():
    """G = 3 > PP = 2: counts 6 and 5 both run in Megatron, but with rings at micro-batches 0 and 3 they
    deadlock; the runtime runs 6 and 6. Counts 4 and 2 with rings at 0 and 1 run as 5 and 3."""
    rings = [(0, (0, 1)), (3, (1, 0))]
    assert deadlock_cycle([6, 5], rings=rings, pp_size=2, vpp_size=2, group_size=3)
    assert prepare.check_pipeline_counts(_plan([6, 5], rings), state=_state(), group_size=3) == [6, 6]
    counts = prepare.check_pipeline_counts(_plan([4, 2], [(0, (0, 1)), (1, (1, 0))]), state=_state(), group_size=3)
    assert counts == [5, 3]
    assert not deadlock_cycle(counts, rings=[(0, (0, 1)), (1, (1, 0))], pp_size=2, vpp_size=2, group_size=3)
    assert all(megatron_constraint_error(n, pp_size=2, vpp_size=2, group_size=3) is None for n in counts)


def test_unlinked_pipelines_keep_their_own_counts_and_ep_groups_run_one():
    """Without a ring between them, pipelines run their own least counts; an EP group runs one count."""
    plan = _plan([5, 1, 2, 3], [], num_ranks=4)
    assert prepare.pipeline_counts(plan, state=_state(hdp_size=4), group_size=2) == [6, 2, 2, 4]
    assert prepare.pipeline_counts(plan, state=_state(hdp_size=4, ep_size=2), group_size=2) == [6, 6, 4, 4]
    assert prepare.pipeline_counts(plan, state=_state(hdp_size=4, vpp_size=1), group_size=2) == [5, 1, 2, 3]  # 1F1B


def test_1f1b_pipelines_linked_by_rings_run_their_own_counts():
    """1F1B (no virtual stages): pipelines of 5 and 2 micro-batches with rings at 0 and 1 run 5 and 2 (the
    wait-for graph stays acyclic), and the check passes them before any P2P."""
    rings = [(0, (0, 1)), (1, (1, 0))]
    plan = _plan([5, 2], rings)
    plan = dataclasses.replace(plan, vpp_size=1).validate()
    assert prepare.check_pipeline_counts(plan, state=_state(vpp_size=1)) == [5, 2]
    assert not deadlock_cycle([5, 2], rings=rings, pp_size=2)


def test_the_plans_group_size_is_the_one_the_step_runs():
    """A plan carrying G runs with it (written into Megatron's config, which the interleaved schedule reads
    at each call); a plan without one runs the G configured before the first step, not the last plan's."""
    from megatron_hdp.megatron.core_api.step import step_group_size

    config = SimpleNamespace(microbatch_group_size_per_vp_stage=2)
    plan = _plan([4, 2], [(0, (0, 1)), (1, (1, 0))])
    with_g = dataclasses.replace(plan, group_size=3).validate()
    assert step_group_size(with_g, config) == 3 == config.microbatch_group_size_per_vp_stage
    assert prepare.check_pipeline_counts(with_g, state=_state(), group_size=3) == [5, 3]
    assert step_group_size(plan, config) == 2 == config.microbatch_group_size_per_vp_stage
    assert prepare.check_pipeline_counts(plan, state=_state(), group_size=2) == [4, 2]


def test_counts_that_break_the_ring_rule_are_refused_before_the_schedule(monkeypatch):
    """A padding that ignores the rings (each pipeline's least count Megatron runs) gives 6 and 5: the
    check names the rule and the counts instead of letting the ring P2P deadlock."""
    def per_pipeline(counts, *, pp_size, vpp_size, group_size, rings):
        least = []
        for n in counts:
            n = max(n, 1)
            while megatron_constraint_error(n, pp_size=pp_size, vpp_size=vpp_size, group_size=group_size):
                n += 1
            least.append(n)
        return least

    from megatron_hdp.plan.timeline import timing

    monkeypatch.setattr(timing, "padded_counts", per_pipeline)
    plan = _plan([6, 5], [(0, (0, 1)), (3, (1, 0))])
    with pytest.raises(ValueError, match=r"counts \[6, 5\] of the pipelines break the ring rule"):
        prepare.check_pipeline_counts(plan, state=_state(hdp_rank=1), group_size=3)
