"""dedicated_step_time: measured per-rank phases composed through the plan's ring waits."""

from __future__ import annotations

import random

import pytest

from megatron_hdp.plan.hand_plan import plan_from_rings
from megatron_hdp.sim.replay import dedicated_step_time


def test_hand_timeline() -> None:
    # rank 0, 1: seq 0 on ring (0, 1) at index 0; rank 2: seq 1 whole at 0; rank 0: seq 2 whole at index 1
    plan = plan_from_rings([8, 4, 4], [(0, 1), (2,), (0,)], [0, 0, 1], num_ranks=3, capacity=8)
    before = [0.1, 0.3, 0.0]
    forward = [[1.0, 0.5], [2.0], [4.0]]
    backward = [[1.0, 0.25], [3.0], [1.0]]
    after = [0.2, 0.1, 0.05]
    # ring F: starts max(0.1, 0.3) = 0.3, ends 0.3 + max(1, 2) = 2.3; ring B ends 2.3 + max(1, 3) = 5.3;
    # rank 0 then runs index 1 alone: 5.3 + 0.75 = 6.05; rank 2: 0 + 4 + 1 = 5; all-reduce: 6.05 + 0.2
    got = dedicated_step_time(plan, before=before, forward=forward, backward=backward, after=after)
    assert got == pytest.approx(6.25)


def test_limits_without_and_with_rings() -> None:
    """No rings: the slowest rank's own sum. One ring of all ranks at every index: sum of per-index maxima."""
    rng = random.Random(0)
    n, m = 4, 3
    times = lambda: [[rng.uniform(0.1, 1.0) for _ in range(m)] for _ in range(n)]  # noqa: E731
    before, after = [rng.uniform(0, 0.1) for _ in range(n)], [rng.uniform(0, 0.1) for _ in range(n)]
    forward, backward = times(), times()
    alone = plan_from_rings([4] * (n * m), [(r,) for r in range(n) for _ in range(m)],
                            [i for _ in range(n) for i in range(m)], num_ranks=n, capacity=4)
    got = dedicated_step_time(alone, before=before, forward=forward, backward=backward, after=after)
    assert got == pytest.approx(max(before[r] + sum(forward[r]) + sum(backward[r]) for r in range(n)) + max(after))
    ring = plan_from_rings([64] * m, [tuple(range(n))] * m, list(range(m)), num_ranks=n, capacity=64)
    got = dedicated_step_time(ring, before=before, forward=forward, backward=backward, after=after)
    expected = max(before) + sum(max(forward[r][i] for r in range(n)) + max(backward[r][i] for r in range(n))
                                 for i in range(m)) + max(after)
    assert got == pytest.approx(expected)


def test_expert_parallel_groups_run_every_index_together() -> None:
    """EP 2 on 4 ranks, whole documents only: ranks 0 and 1 (and 2 and 3) run each index together, the
    group's shorter member its padding micro-batch beside the other's second; computed by hand."""
    plan = plan_from_rings([4, 4, 4, 4, 4], [(0,), (0,), (1,), (2,), (3,)], [0, 1, 0, 0, 0], num_ranks=4, capacity=4)
    before, after = [0.0, 0.5, 0.0, 0.0], [0.1, 0.1, 0.1, 0.3]
    forward = [[1.0, 2.0], [1.5, 0.1], [3.0], [1.0]]  # rank 1 ran a padding micro-batch (0.1 s) at index 1
    backward = [[1.0, 1.0], [1.0, 0.1], [1.0], [2.0]]
    # group (0, 1): F0 0.5 + 1.5 = 2.0, B0 + 1.0 = 3.0, F1 + 2.0 = 5.0, B1 + 1.0 = 6.0; group (2, 3): 4.0 and 3.0
    # (F0 ends 3.0, B0 5.0); the last rank ends at 6.0, plus the slowest all-reduce, 0.3
    got = dedicated_step_time(plan, before=before, forward=forward, backward=backward, after=after, ep_size=2)
    assert got == pytest.approx(6.3)
    alone = max(b + sum(f) + sum(w) for b, f, w in zip(before, forward, backward))  # without EP: 5.0, rank 0
    assert dedicated_step_time(plan, before=before, forward=forward, backward=backward, after=after) == pytest.approx(
        alone + 0.3)


def test_rejects_mismatched_measurements() -> None:
    plan = plan_from_rings([8], [(0, 1)], [0], num_ranks=2, capacity=8)
    with pytest.raises(ValueError, match="forward has 1 entries"):
        dedicated_step_time(plan, before=[0, 0], forward=[[1.0]], backward=[[1.0], [1.0]], after=[0, 0])
    with pytest.raises(ValueError, match="rank 1: 0 forward"):
        dedicated_step_time(plan, before=[0, 0], forward=[[1.0], []], backward=[[1.0], []], after=[0, 0])
