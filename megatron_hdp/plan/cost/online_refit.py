"""A cost model that learns from the run: refit the compute coefficients (a1, b1, g) from measured times.

Every step each rank measures its compute time (`megatron_hdp.comm.telemetry`), and the step's plan
says what that rank computed. Under the cost model (`CostModel.microbatch_time`, ring traffic hidden
under attention) a rank's compute is linear in the coefficients:

    compute(rank) = (a1 * sum(s * t) + b1 * sum(t) + g * micro-batches) * layers / pp

summed over the rank's shards (t tokens of a document of s tokens) and micro-batches; under expert
parallelism a rank's b1 work at micro-batch index i is (1 - x) t_i of its own tokens plus x times its
EP group's mean tokens at i (x = `expert_share`: the all-to-all spreads the routed experts' work,
`plan.cost.experts.spread_expert_work`; the all-to-all's own transfers, a known term, are taken off the
measured times: `alltoall_seconds`). `OnlineRefit`
keeps the last `window` (features, measured) rows, and after `warmup_steps` refits the coefficients
with the project's one fit (`plan.cost.fit.fit_relative`: non-negative least squares on relative error, each
row divided by its measured time, so long and short steps weigh alike), dropping rows whose relative
residual is more than `outlier_mads` median absolute deviations from the median (a rank preempted, a GC
pause). Each update moves each coefficient by at most a factor `max_step`, so one bad step cannot throw
the planner off. Everything else of the cost model (memory, bandwidths) is kept; a resumed run keeps
only the learned a1, b1, g and puts them on the cost model of its own flags (`from_state_dict`,
`load_refit`), so a resume with another ring kind, node size or EP plans with those. Pure numpy/scipy: it
runs on every rank with the same gathered input, so every rank plans with the same model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.fit import COMPUTE_COEFFICIENTS, fit_relative, fitted_cost_model
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.plan.cost.experts import spread_expert_work


@dataclass(frozen=True)
class RefitSettings:
    """How fast and how carefully the cost model follows the measurements."""

    warmup_steps: int = 2
    """Steps measured before the first update (the first steps pay for allocation and warm-up)."""
    window: int = 512
    """Most recent (rank, step) rows the fit uses."""
    max_step: float = 2.0
    """Largest factor by which one update may multiply or divide a coefficient."""
    outlier_mads: float = 5.0
    """Rows whose relative residual lies further than this many median absolute deviations from the
    median are dropped from the fit."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.window < len(COMPUTE_COEFFICIENTS):
            raise ValueError(f"window must be >= {len(COMPUTE_COEFFICIENTS)}, got {self.window}")
        if self.max_step <= 1.0:
            raise ValueError(f"max_step must be > 1, got {self.max_step}")
        if self.outlier_mads <= 0:
            raise ValueError(f"outlier_mads must be > 0, got {self.outlier_mads}")


def compute_features(plan: StepPlan | dict, *, num_layers: int, expert_parallel_size: int = 1,
                     expert_share: float = 0.0) -> np.ndarray:
    """[ranks, 3]: per rank, the multipliers of (a1, b1, g) in its predicted compute for `plan`: its
    tokens' b1 work with the share `expert_share` of it spread over each group of `expert_parallel_size`
    HDP ranks at every micro-batch index (module docstring; `CostModel.expert_parallel_size`, `expert_share`).

    `plan` is a StepPlan or its JSON dict (as saved by --hdp-save-plans).
    """
    plan = _plan_of(plan)
    lengths = {seq.id: seq.length for seq in plan.sequences}
    layers = num_layers / plan.pp_size
    features = np.zeros((plan.num_ranks, len(COMPUTE_COEFFICIENTS)))
    for rank in range(plan.num_ranks):
        for mb in plan.microbatches(rank):
            for shard in mb.shards:
                features[rank, 0] += lengths[shard.seq] * shard.num_tokens
            features[rank, 2] += 1
    tokens = _padded_tokens(plan)
    spread = spread_expert_work(tokens, tokens, ep_size=expert_parallel_size, seconds_per_token=expert_share)
    features[:, 1] = [sum(row) for row in spread]
    return features * layers


def alltoall_seconds(plan: StepPlan | dict, model: CostModel) -> np.ndarray:
    """[ranks]: the MoE all-to-all's own seconds in each rank's predicted compute for `plan` under `model`
    (`CostModel.expert_alltoall_seconds_per_token`): a known term, not one the refit learns, so it is
    taken off the measured times before the fit."""
    plan = _plan_of(plan)
    tokens = _padded_tokens(plan)
    zeros = [[0.0] * len(row) for row in tokens]
    per_token = model.expert_alltoall_seconds_per_token(pp_size=plan.pp_size)
    spread = spread_expert_work(zeros, tokens, ep_size=model.expert_parallel_size, seconds_per_token=0.0,
                                alltoall_seconds_per_token=per_token)
    return np.array([sum(row) for row in spread])


def _plan_of(plan: StepPlan | dict) -> StepPlan:
    return StepPlan.from_dict(plan) if isinstance(plan, dict) else plan


def _padded_tokens(plan: StepPlan) -> list[list[float]]:
    """Tokens of each rank's micro-batches, every rank padded to the largest count with empty ones (a rank
    short of an EP partner's count runs padding: 0 tokens)."""
    tokens = [[float(mb.num_tokens) for mb in plan.microbatches(rank)] for rank in range(plan.num_ranks)]
    width = max(map(len, tokens), default=0)
    return [row + [0.0] * (width - len(row)) for row in tokens]


class OnlineRefit:
    """Learns the compute coefficients of `model` from (plan, per-rank measured compute) step by step."""

    def __init__(self, model: CostModel, settings: Optional[RefitSettings] = None) -> None:
        self.model = model
        self.settings = settings or RefitSettings()
        self.steps_seen = 0
        self.updates = 0
        self._features: list[np.ndarray] = []
        self._measured: list[np.ndarray] = []

    def observe(self, plan: StepPlan | dict, compute_seconds: Sequence[float]) -> CostModel:
        """Add one step (its plan and each rank's measured compute seconds); return the current model,
        refitted once the warm-up is over."""
        features = compute_features(plan, num_layers=self.model.num_layers,
                                    expert_parallel_size=self.model.expert_parallel_size,
                                    expert_share=self.model.expert_share)
        measured = np.asarray(compute_seconds, dtype=float)
        if measured.shape != (features.shape[0],):
            raise ValueError(f"{measured.shape[0]} measured times for a plan of {features.shape[0]} ranks")
        measured = measured - alltoall_seconds(plan, self.model)
        self.steps_seen += 1
        if self.steps_seen <= self.settings.warmup_steps:
            return self.model
        self._features.append(features)
        self._measured.append(measured)
        rows = np.concatenate(self._features), np.concatenate(self._measured)
        excess = len(rows[1]) - self.settings.window
        if excess > 0:
            rows = rows[0][excess:], rows[1][excess:]
            self._features, self._measured = [rows[0]], [rows[1]]
        fitted = fit_relative(*rows, outlier_mads=self.settings.outlier_mads)
        self.model = self._bounded_update(fitted)
        self.updates += 1
        return self.model

    def _bounded_update(self, fitted: np.ndarray) -> CostModel:
        step = self.settings.max_step
        bounded = []
        for name, target in zip(COMPUTE_COEFFICIENTS, fitted):
            old = getattr(self.model, name)
            bounded.append(float(np.clip(target, old / step, old * step)) if old > 0 else float(target))
        return fitted_cost_model(bounded, base=self.model)

    def state_dict(self) -> dict[str, Any]:
        """The learned model and the refit's progress, JSON-ready (saved with each checkpoint; the whole
        model, for `megatron-hdp calibrate --from-run` to export)."""
        return {"cost_model": self.model.to_dict(), "steps_seen": self.steps_seen, "updates": self.updates}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], *, model: CostModel,
                        settings: Optional[RefitSettings] = None) -> "OnlineRefit":
        """Resume from `state_dict()` output onto `model`, the cost model of the resuming run's flags: what
        the refit learned (its a1, b1, g) replaces `model`'s, nothing else of the saved model is read; past
        the warm-up (the window of rows is not kept: the first updates after a resume use the new steps
        only)."""
        saved = state["cost_model"]
        refit = cls(fitted_cost_model([saved[name] for name in COMPUTE_COEFFICIENTS], base=model), settings)
        refit.steps_seen, refit.updates = int(state["steps_seen"]), int(state["updates"])
        return refit


REFIT_FILE = "hdp_cost_model.json"
"""The learned cost model in a checkpoint directory (`OnlineRefit.state_dict`, rewritten at each save)."""


def save_refit(refit: OnlineRefit, directory: str | Path, *, iteration: int) -> Path:
    """Write the refit's state to `directory`/hdp_cost_model.json (the latest) and a copy for `iteration`."""
    text = json.dumps({**refit.state_dict(), "iteration": iteration}, indent=2) + "\n"
    Path(directory).mkdir(parents=True, exist_ok=True)
    Path(directory, f"hdp_cost_model_iter_{iteration:07d}.json").write_text(text)
    latest = Path(directory, REFIT_FILE)
    latest.write_text(text)
    return latest


def load_refit(directory: str | Path, *, model: CostModel,
               settings: Optional[RefitSettings] = None) -> Optional[OnlineRefit]:
    """The refit saved in `directory` by `save_refit`, resumed onto `model` (`OnlineRefit.from_state_dict`),
    or None when there is none."""
    path = Path(directory, REFIT_FILE)
    if not path.is_file():
        return None
    return OnlineRefit.from_state_dict(json.loads(path.read_text()), model=model, settings=settings)
