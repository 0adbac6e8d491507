"""Ring sizes one rank apart: the hill climb balance runs on small pools after its widening targets.

Ring widening (`widening`) gives every long sequence the smallest ring meeting one step-time target, so
the rings of a plan all sit near one member time. The exact planner (`plan.policies.optimal`) showed
plans that no single target gives: on 6 ranks, rings of 3 for sequences of 3,968, 4,877 and 6,062 tokens
(a target that puts the first two on 3 ranks puts the third on 4), 14% faster than balance's best
(benchmarks/optimal_gap.py, case 140). `neighbours` lists the options one ring size away from a plan's:
each distinct long length one rank wider or narrower (never below D(s), above the pool or s // 2, nor
where memory refuses it), for a caller that builds them and keeps the fastest, and repeats from there.
"""

from __future__ import annotations

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.sharding import fits, max_member_tokens, needed_offload_ratio


def ring_offload(length: int, size: int, *, cost_model: CostModel, capacity: int, max_offload_ratio: float,
                 pp_size: int) -> float | None:
    """The offload ratio the fullest member of a ring of `size` ranks needs for a sequence of `length`
    tokens to fit `capacity`, or None when no allowed ratio makes it fit."""
    held = max_member_tokens(length, size)
    if not fits(cost_model, seq_len=length, ring_size=size, num_tokens=held, capacity=capacity,
                max_offload_ratio=max_offload_ratio, pp_size=pp_size):
        return None
    return needed_offload_ratio(cost_model, num_tokens=held, capacity=capacity)


def neighbours(lengths: np.ndarray, ring_sizes: np.ndarray, offload_ratios: np.ndarray, *, fewest: np.ndarray,
               num_ranks: int, capacity: int, cost_model: CostModel, max_offload_ratio: float,
               pp_size: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ring_sizes, offload_ratios) options with all sequences of one long length on rings one rank wider
    or narrower than `ring_sizes` (module doc); `fewest` is D(s) per sequence."""
    options = []
    for s in np.unique(lengths[ring_sizes > 1]).tolist():
        holders = np.flatnonzero(lengths == s)
        k = int(ring_sizes[holders[0]])
        for size in (k - 1, k + 1):
            if size < max(2, int(fewest[holders[0]])) or size > min(num_ranks, s // 2):
                continue
            ratio = ring_offload(s, size, cost_model=cost_model, capacity=capacity,
                                 max_offload_ratio=max_offload_ratio, pp_size=pp_size)
            if ratio is None:
                continue
            sizes, ratios = ring_sizes.copy(), offload_ratios.copy()
            sizes[holders], ratios[holders] = size, ratio
            options.append((sizes, ratios))
    return options
