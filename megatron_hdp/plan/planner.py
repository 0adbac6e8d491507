"""The planner's one entry point: lengths of a global batch in, a validated StepPlan out.

Policies are looked up by name in `POLICIES` (module path, function name), imported lazily so that
`megatron-hybrid-cp` and `megatron-dynamic-cp` — adapters over Megatron's own schedulers (the installed
megatron-core's, and a Megatron-LM dev checkout's in a child process) — are loaded only when asked for
and the rest of `plan/` stays free of torch and Megatron.
"""

from __future__ import annotations

import importlib
import numbers
from typing import Callable, Sequence

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost_model import CostModel
from megatron_hdp.plan.step_plan import StepPlan

# policy name -> (module, function); each function has the signature of `make_plan` below minus `policy`.
POLICIES: dict[str, tuple[str, str]] = {
    "balance": ("megatron_hdp.plan.balance", "plan_balance"),
    "naive": ("megatron_hdp.plan.baselines", "plan_naive"),
    "naive-offload": ("megatron_hdp.plan.baselines", "plan_naive_offload"),
    "static": ("megatron_hdp.plan.baselines", "plan_static"),
    "megatron-hybrid-cp": ("megatron_hdp.megatron.hybrid_cp_policy", "plan_megatron_hybrid_cp"),
    "megatron-dynamic-cp": ("megatron_hdp.megatron.dynamic_cp_policy", "plan_megatron_dynamic_cp"),
}

VIRTUAL_STAGE_POLICIES = ("balance", "naive", "naive-offload", "static", "megatron-dynamic-cp")
"""Policies whose function takes `vpp_size` (plans for Megatron's interleaved schedule)."""


def policy_function(name: str) -> Callable[..., StepPlan]:
    """The planning function registered for policy `name`."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    module, function = POLICIES[name]
    return getattr(importlib.import_module(module), function)


def _is_integer(value: object) -> bool:
    """An integer count (Python or numpy; an integral float such as 5.0 too), never a bool."""
    if isinstance(value, bool):
        return False
    return isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())


def make_plan(
    lengths: Sequence[int],
    *,
    num_ranks: int,
    config: HDPConfig,
    cost_model: CostModel,
    pp_size: int = 1,
    vpp_size: int = 1,
    policy: str | None = None,
) -> StepPlan:
    """Plan one global batch of documents with these `lengths` over `num_ranks` HDP ranks.

    `policy` overrides `config.hdp_policy` (to compare policies side by side on one batch). `vpp_size`:
    model chunks per pipeline stage (Megatron's interleaved schedule when > 1). The plan is validated
    before it is returned; impossible inputs raise ValueError naming the offending value.
    """
    for name, value in (("num_ranks", num_ranks), ("pp_size", pp_size), ("vpp_size", vpp_size)):
        if not _is_integer(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    num_ranks, pp_size, vpp_size = int(num_ranks), int(pp_size), int(vpp_size)
    name = policy or config.hdp_policy
    extra = {}
    if vpp_size > 1:
        if pp_size == 1:
            raise ValueError(f"vpp_size={vpp_size} needs pipeline parallelism (pp_size > 1); set vpp_size to 1")
        if cost_model.num_layers % (pp_size * vpp_size):
            raise ValueError(f"pp_size {pp_size} x vpp_size {vpp_size} does not divide the model's "
                             f"{cost_model.num_layers} layers")
        if name not in VIRTUAL_STAGE_POLICIES:
            raise ValueError(f"policy {name!r} does not plan virtual pipeline stages (vpp_size={vpp_size}); "
                             f"use one of {', '.join(VIRTUAL_STAGE_POLICIES)} or vpp_size 1")
        extra = {"vpp_size": vpp_size}
    lengths = list(lengths)
    if not lengths:
        raise ValueError("cannot plan an empty global batch (no sequences)")
    bad = [n for n in lengths if not _is_integer(n)]
    if bad:
        raise ValueError(f"sequence lengths must be integers, got {bad[:5]}")
    bad = [n for n in lengths if n < 1]
    if bad:
        raise ValueError(f"sequence lengths must be >= 1, got {bad[:5]}")
    lengths = [int(n) for n in lengths]
    plan = policy_function(name)(
        lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, pp_size=pp_size, **extra
    )
    return plan.validate()
