"""Chains of rings that cannot overlap in time: rows on the step for the exact planner's MILPs.

Two rings that share a rank run at different slots on it, and a ring's slot occupies each member from
the ring's start to its end (`optimal`'s module doc), so the two rings' times do not overlap. Rings that
pairwise share a rank therefore run one after another, and the step is at least their summed times.
Which rings those are depends on the ranks the plan gives them; for a rank r and a width m with
2 <= m <= (D + 1) // 2 on a pool of D ranks, these rings pairwise share a rank, whatever the plan:

- the rings through r of at least m ranks (two of them share r);
- the rings not through r wider than D - m: one of them and one through r hold more than
  (D - m) + m = D ranks together, more than the pool has, and two of them at least
  2 (D - m + 1) > D ranks, because m < D / 2 + 1.

So step >= sum of T(s, k) over the rings through r of >= m ranks and the rings not through r of
> D - m ranks. The slot-free bound (`optimal_bound`) without these rows let a rank outside a ring of 3
on 4 ranks hold three rings of 2, each overlapping the ring of 3 and each other; the issue's 10-document
case under the H100 mesh model sat 1.8% below its optimum there, and with them the bound meets it.
"""

from __future__ import annotations

from typing import Mapping, Sequence


def chain_rows(times: Sequence[Mapping[int, float]], *, w: Sequence[Mapping[int, int]],
               y: Mapping[tuple[int, int, int], int], num_ranks: int) -> list[dict[int, float]]:
    """The module doc's chains as rows `sum(coefficient x column) <= step`: per rank r and width m, the
    time T(s, k) = `times[s][k]` on y[s, k, r] (rank r a member of s's ring of k ranks) for k >= m, and on
    w[s][k] - y[s, k, r] (s on a ring of k ranks without r) for k > D - m. `w[s][k]` is the column of
    document s on a ring of k ranks, `y` has a column for every ring size k > 1 of w and every rank."""
    rows = []
    for r in range(num_ranks):
        for most in range(2, (num_ranks + 1) // 2 + 1):
            row: dict[int, float] = {}
            for s, sizes in enumerate(w):
                for k in (k for k in sizes if k > 1):
                    through = times[s][k] if k >= most else 0.0
                    around = times[s][k] if k > num_ranks - most else 0.0
                    if around:
                        row[sizes[k]] = around
                    if through - around:
                        row[y[s, k, r]] = through - around
            if row:
                rows.append(row)
    return rows
