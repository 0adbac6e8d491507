"""How large and how slow each policy's plan of a batch would be, estimated before planning it.

`megatron-hdp plan` skips a policy whose plan would not fit the limits (with a one-line reason) instead
of running for minutes into gigabytes: at 16,384 ranks the `static` plan of a 256M-token batch holds ~9M
shards (every sequence split over the CP group of the longest one), and Megatron's `BalancedCPScheduler`
(`megatron-hybrid-cp`) and `DefaultDynamicCPScheduler` (`megatron-dynamic-cp`) loop in Python over
ranks x sequences; the RL frameworks' scheme (`rl-static-cp`) puts every sequence on a CP ring too
(github at 16,384 ranks: 4.4M shards, 28 s).

The estimates are upper-bound-minded, measured on a shared 2-core CPU machine (plan/* at 16 to 256M tokens,
1,024 to 16,384 ranks): a shard costs ~0.6 KB while planned and validated, and the constants below
are the seconds measured there, rounded up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

BYTES_PER_SHARD = 600
SECONDS_PER_SHARD = {"static": 2e-5, "default": 6e-5}
SECONDS_PER_RANK = 3e-5
HYBRID_CP_SECONDS_PER_RANK_SEQUENCE = 2.5e-6
"""Megatron's scheduler: 0.5 s at 256 ranks x 1.1K sequences, 11 s at 2,048 x 2.2K."""
DYNAMIC_CP_SECONDS_PER_RANK_SEQUENCE = 2.5e-5
"""Megatron-LM dev's DefaultDynamicCPScheduler (a child process): 5 s at 128 ranks x 3.3K sequences,
26 s at 128 x 8.6K, 52 s at 1,024 x 3.3K; plus ~5 s once to import the checkout."""


@dataclass(frozen=True)
class PlanEstimate:
    """What planning one batch with one policy would cost."""

    policy: str
    num_shards: int
    seconds: float

    @property
    def gigabytes(self) -> float:
        return self.num_shards * BYTES_PER_SHARD / 1e9

    def refusal(self, *, max_shards: int, max_seconds: float) -> str | None:
        """Why this plan is not attempted under the limits (naming the flag that raises them), or None."""
        size = f"~{self.num_shards:,} shards (~{self.gigabytes:.1f} GB) and ~{self.seconds:.0f} s"
        if self.num_shards > max_shards:
            return f"skipped: its plan is estimated at {size}, over --max-shards {max_shards:,}; plan fewer --tokens"
        if self.seconds > max_seconds:
            return (f"skipped: its plan is estimated at {size}, over --max-plan-seconds {max_seconds:g}; "
                    "plan fewer --tokens")
        return None


def estimate_plan(policy: str, lengths: Sequence[int], *, num_ranks: int, capacity: int) -> PlanEstimate:
    """Shards and planning seconds of `policy` on this batch (a policy that will refuse it estimates small)."""
    from megatron_hdp.plan.policies.baselines import static_cp_size
    from megatron_hdp.plan.policies.rl_static_cp import rl_cp_size

    lengths = np.asarray(lengths, dtype=np.int64)
    ring_sizes = np.maximum(1, -(-lengths // capacity))  # D(s) without offloading: the most ranks one needs
    if policy in ("static", "rl-static-cp"):  # every sequence on the one CP group of the longest
        cp_size = static_cp_size if policy == "static" else rl_cp_size
        try:
            cp = cp_size(int(lengths.max(initial=1)), capacity=capacity, num_ranks=num_ranks)
        except ValueError:
            cp = 1  # the policy refuses this batch at once
        shards = len(lengths) * cp
        seconds = shards * SECONDS_PER_SHARD["static"]
    elif policy in ("megatron-hybrid-cp", "megatron-dynamic-cp"):
        shards = int((2 ** np.ceil(np.log2(ring_sizes))).sum())  # power-of-two CP groups
        per_pair = (HYBRID_CP_SECONDS_PER_RANK_SEQUENCE if policy == "megatron-hybrid-cp"
                    else DYNAMIC_CP_SECONDS_PER_RANK_SEQUENCE)
        seconds = per_pair * num_ranks * len(lengths) + shards * SECONDS_PER_SHARD["default"]
    else:
        shards = int(ring_sizes.sum())
        seconds = shards * SECONDS_PER_SHARD["default"]
    return PlanEstimate(policy, shards, seconds + SECONDS_PER_RANK * num_ranks)
