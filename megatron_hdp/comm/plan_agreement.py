"""The plan-agreement check: every rank of the HDP domain must run the same StepPlan.

A rank whose dataset, seed, consumed samples or config differ plans a different global batch; its rings
would then wait on peers that never come. An all-gather of the plan digests before the step's first ring
turns that hang into an error on every rank, naming which ranks hold which plan.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch.distributed as dist

from megatron_hdp.plan.step_plan import StepPlan


class PlanMismatchError(ValueError, RuntimeError):
    """Ranks of one HDP domain hold different step plans (or some rejected theirs): a user error (ValueError);
    also a RuntimeError, what the loader raised before the trainer and the loader shared one check."""


def check_plan_agreement(
    plan: StepPlan, *, group: Any = None, check: Optional[Callable[[StepPlan], None]] = None
) -> None:
    """Raise on every rank of `group` unless every rank holds the same, locally acceptable plan.

    The one plan-agreement check of the project (the data loader runs it before handing out a step unless
    built with check_plans=False; `HDPTrainer.step` runs it on every step). `check(plan)`, when given,
    runs first on this rank (validation, domain size); a ValueError from it is re-raised here only after
    this rank has joined the digest all-gather with a blank digest, so that no peer hangs in it, and the
    peers raise PlanMismatchError naming this rank as one that rejected the plan. Digests that differ
    raise PlanMismatchError on every rank, naming which ranks hold which digest. Without an initialized
    default process group only `check` runs (single-process use).
    """
    error: Optional[ValueError] = None
    digest = ""
    try:
        if check is not None:
            check(plan)
        digest = plan.digest()
    except ValueError as err:
        error = err
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise error
        return
    digests: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    if error is not None:
        raise error
    if len(set(digests)) > 1:
        by_digest: dict[str, list[int]] = {}
        for rank, other in enumerate(digests):
            by_digest.setdefault(str(other)[:12] or "rejected", []).append(rank)
        raise PlanMismatchError(
            f"step plans differ across ranks: ranks planned different global batches (plan digest -> ranks in "
            f"the group: {by_digest}); every rank of the HDP domain must use the same dataset, seed, "
            "consumed_samples, HDP config and policy"
        )
