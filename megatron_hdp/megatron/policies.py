"""The planner policies of the Megatron layer, registered with plan/'s registry when this package loads.

`megatron-hybrid-cp` (`hybrid_cp_policy`) calls Megatron-Core's own scheduler, so plan/ cannot import
it; it is registered here, and its module (which imports Megatron-Core) is loaded on its first plan, so
that importing `megatron_hdp.megatron` stays cheap and works where Megatron-Core is not installed.
"""

from __future__ import annotations

from typing import Sequence

from megatron_hdp.plan.planner import register_policy
from megatron_hdp.plan.step_plan import StepPlan


def plan_megatron_hybrid_cp(lengths: Sequence[int], **kwargs) -> StepPlan:
    """Policy `megatron-hybrid-cp`: `hybrid_cp_policy.plan_megatron_hybrid_cp`, imported on first use."""
    from megatron_hdp.megatron.hybrid_cp_policy import plan_megatron_hybrid_cp as plan

    return plan(lengths, **kwargs)


register_policy("megatron-hybrid-cp", plan_megatron_hybrid_cp)
