"""The planner's one entry point: lengths of a global batch in, a validated StepPlan out.

Policies live in a registry, name -> planning function (the signature of `make_plan` minus `policy`).
plan/ registers its own (`balance`, `naive`, `naive-offload`, `static`, `rl-static-cp`, and `optimal`, the
exact plan of a small pool); a policy that needs more than plan/ may use —
`megatron-hybrid-cp` and `megatron-dynamic-cp`, adapters over Megatron's own schedulers — is registered by the layer that
holds it, when that layer is imported, through `register_policy`. plan/ names no upper layer, not even
as a module path in a string: the import that registers a policy is always visible in the layer that
owns it. A new policy of an upper layer adds one `register_policy` call there; the registry stays a dict.
Code that offers every policy (the CLI, the simulator's callers) imports the registering package first.
"""

from __future__ import annotations

import numbers
from typing import Callable, Sequence

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.policies.balance import plan_balance
from megatron_hdp.plan.policies.baselines import plan_naive, plan_naive_offload, plan_static
from megatron_hdp.plan.policies.optimal import plan_optimal
from megatron_hdp.plan.policies.rl_static_cp import plan_rl_static_cp
from megatron_hdp.plan.step_plan import StepPlan

PolicyFunction = Callable[..., StepPlan]
"""(lengths, *, num_ranks, config, cost_model, pp_size) -> StepPlan, as `make_plan` without `policy`."""

POLICIES: dict[str, PolicyFunction] = {
    "balance": plan_balance, "naive": plan_naive, "naive-offload": plan_naive_offload, "static": plan_static,
    "rl-static-cp": plan_rl_static_cp, "optimal": plan_optimal,
}
"""The registry: policy name -> planning function. Add to it with `register_policy`."""

VIRTUAL_STAGE_POLICIES = ("balance", "naive", "naive-offload", "static", "megatron-dynamic-cp")
"""Policies whose function takes `vpp_size` (plans for Megatron's interleaved schedule)."""

KV_RING_ONLY_POLICIES = ("megatron-hybrid-cp",)
"""Policies whose plans give every ring the K/V kind whatever the cost model's `ring_kind` (Megatron's
Hybrid-CP scheduler runs TE's K/V ring); the others give each ring the kind the cost model picks
(`plan.timeline.assemble`)."""


def register_policy(name: str, function: PolicyFunction) -> None:
    """Make `function` the planning function of policy `name` (idempotent; a second function for a
    registered name is a ValueError, so two layers cannot silently claim one policy)."""
    registered = POLICIES.get(name)
    if registered is not None and registered is not function:
        raise ValueError(f"policy {name!r} is already registered (by {registered.__module__}); pick another name")
    POLICIES[name] = function


def policy_function(name: str) -> PolicyFunction:
    """The planning function registered for policy `name`."""
    if name not in POLICIES:
        raise ValueError(
            f"unknown policy {name!r}; registered: {', '.join(POLICIES)} (a policy of a layer above plan/ "
            "registers itself when its package is imported: import it before planning)"
        )
    return POLICIES[name]


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
