"""The planner policies of the Megatron layer, registered with plan/'s registry when this package loads.

`megatron-hybrid-cp` (`hybrid_cp_policy`) calls Megatron-Core's own scheduler and `megatron-dynamic-cp`
(`dynamic_cp_policy`) Megatron-LM dev's, so plan/ cannot import them; they are registered here, and each
module (which imports Megatron-Core) is loaded on its first plan, so
that importing `megatron_hdp.megatron` stays cheap and works where Megatron-Core is not installed.
"""

from __future__ import annotations

from typing import Sequence

from megatron_hdp.plan.planner import register_policy
from megatron_hdp.plan.step_plan import StepPlan


def plan_megatron_hybrid_cp(lengths: Sequence[int], **kwargs) -> StepPlan:
    """Policy `megatron-hybrid-cp`: `hybrid_cp_policy.plan_megatron_hybrid_cp`, imported on first use."""
    from megatron_hdp.megatron.comparison.hybrid_cp import plan_megatron_hybrid_cp as plan

    return plan(lengths, **kwargs)


register_policy("megatron-hybrid-cp", plan_megatron_hybrid_cp)


def plan_megatron_dynamic_cp(lengths: Sequence[int], **kwargs) -> StepPlan:
    """Policy `megatron-dynamic-cp`: `dynamic_cp_policy.plan_megatron_dynamic_cp` (Megatron-LM dev's
    scheduler, run from the checkout `MEGATRON_LM_DIR` names), imported on first use."""
    from megatron_hdp.megatron.comparison.dynamic_cp import plan_megatron_dynamic_cp as plan

    return plan(lengths, **kwargs)


register_policy("megatron-dynamic-cp", plan_megatron_dynamic_cp)
