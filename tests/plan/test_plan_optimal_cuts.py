"""The exact planner's chain rows (`optimal_cuts`) and its solve in stages (`optimal_stages`) against the
brute force of test_plan_brute_force, which shares no code with them.

The brute force enumerates every ring member set, ring order and whole-document position (timed with
the cost model), relaxing the runtime's rule that a ring sits at one micro-batch index on all members,
so its optimum is at most the exact planner's; rings that share a rank never overlap in it either, so
the chain rows hold there too. `brute_force(..., incumbent=x)` returns x unless some plan is faster, so
one call with the incumbent just below the bound checks that no plan beats it, and one just above it
that a plan reaches it.
"""

from __future__ import annotations

import pytest

from megatron_hdp.plan.cost.sharding import max_member_tokens
from megatron_hdp.plan.policies.optimal_bound import assignment_bound
from test_plan_brute_force import CAPACITY, CM, _ring_time, brute_force


def _slot_free_bound(lengths: list[int], num_ranks: int) -> float:
    """`assignment_bound` (seconds) with the slot times per ring size as the brute force times them (whole:
    one micro-batch of the document), in milliseconds as `optimal` passes them (in seconds HiGHS's
    tolerances let it call a plan 0.64 ms above the optimum optimal)."""
    ms = 1e3
    times = [{1: ms * CM.microbatch_time([(n, n, (0,))])} if n <= CAPACITY else
             {k: ms * _ring_time(n, tuple(range(k))) for k in range(2, num_ranks + 1)
              if max_member_tokens(n, k) <= CAPACITY} for n in lengths]
    return assignment_bound(lengths, times, num_ranks=num_ranks, capacity=CAPACITY,
                            overhead=ms * CM.microbatch_time([]), big=1e4, time_limit=30.0).bound / ms


def test_chain_rows_lift_the_slot_free_bound_to_the_brute_force_optimum():
    """A document that needs 3 of 4 ranks and three that need 2 (a seeded draw): the best plan runs 1,417
    then 1,443 tokens on ranks {0, 3} while 1,609 runs on {1, 2}, then 2,333 on {0, 1, 2}: the chain of
    rank 3 (both rings of 2 through it, and the ring of 3 that overlaps every ring of 2). Without the chain
    rows the slot-free bound sat at 205.8 ms (rank 3 held the two rings beside the ring of 3), 16% below
    the optimum; with them it is that chain, and no plan of the brute force is faster."""
    lengths = [2333, 1417, 1609, 1443]
    bound = _slot_free_bound(lengths, 4)
    chain = _ring_time(2333, (0, 1, 2)) + _ring_time(1417, (0, 3)) + _ring_time(1443, (0, 3))
    assert bound == pytest.approx(chain, rel=1e-9)
    below = bound * (1 - 1e-9)
    assert brute_force(4, lengths, incumbent=below) == below  # no plan is faster than the bound
