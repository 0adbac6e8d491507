"""Policies side by side on a simulated cluster: sampled global batches -> plans -> simulated steps.

Every policy plans the *same* global batches (whole documents drawn from a length mix until the token
budget, clipped to the context length) with `make_plan`, and every plan runs through `simulate_step`
with the cluster's gradient all-reduce. Throughput is total tokens over total simulated time.

Two floors bound every policy from above in throughput: the work floor (`compute_floor`: the batch's
compute spread over every GPU) and the critical-path floor (`plan.timeline.bounds.critical_path_floor`: also no
step shorter than its longest document's fastest crossing of the pipeline). With PP the second can sit
well below the first in tokens/s, and only the second is a throughput some schedule might reach.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional, Sequence

from tqdm import tqdm

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.timeline.bounds import critical_path_floor, fastest_crossing
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.planner import make_plan, policy_function
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.simulator import StepTimeline, allreduce_time, simulate_step

logger = logging.getLogger(__name__)

DEFAULT_POLICIES = ("static", "megatron-hybrid-cp", "megatron-dynamic-cp", "naive", "balance")
BASELINE = "static"
MICROBATCHES_PER_RANK = 4
"""Default global batch: this many full micro-batches (C tokens) per HDP rank."""


@dataclass(frozen=True)
class PolicyStats:
    """One policy over the simulated steps (means over steps, throughput over all of them)."""

    policy: str
    tokens_per_second: float
    step_time: float
    balance: float
    """max / mean of per-rank busy time."""
    idle_fraction: float
    bubble_fraction: float
    """Share of rank time spent waiting for pipeline neighbours (PP bubbles), part of `idle_fraction`."""
    comm_fraction: float
    """Share of rank time spent in ring traffic not hidden under attention."""
    attention_gb_per_rank: float
    """Ring-attention GB one GPU sends per step."""
    plan_seconds: float
    """Wall time of the planner per step on this machine."""
    rings_across_nodes: float = 0.0
    """Rings per step whose ranks sit on more than one node (their traffic runs at the inter-node link)."""
    network_gb_per_rank: float = 0.0
    """Of the ring-attention GB per GPU, those sent between nodes."""
    speedup: Optional[float] = None
    """Throughput over the static baseline's (None without a baseline)."""
    error: Optional[str] = None
    """Why the policy cannot run this setup (then every number is NaN)."""
    of_work_floor: Optional[float] = None
    """Throughput over the work floor's (`Comparison.floor_tokens_per_second`)."""
    of_critical_path_floor: Optional[float] = None
    """Throughput over the critical-path floor's (`Comparison.critical_path_floor_tokens_per_second`)."""


@dataclass
class Comparison:
    """The result of `compare_policies`: stats per policy, and the first step's plans and timelines."""

    spec: ClusterSpec
    context: int
    distribution: str
    global_batch_tokens: int
    steps: int
    stats: dict[str, PolicyStats]
    floor_tokens_per_second: float
    """Tokens/s of `compute_floor` plus the all-reduce (the work floor): no placement can beat it under
    this cost model."""
    critical_path_floor_tokens_per_second: float
    """Tokens/s of `critical_path_floor` plus the all-reduce: no schedule of this execution can beat it."""
    floor_steps: list[dict]
    """Per step: the work floor, the longest document's fastest crossing and its ring size, in seconds
    without the all-reduce (`step_floors`), and the all-reduce ("allreduce_s")."""
    plans: dict[str, StepPlan] = field(repr=False)
    timelines: dict[str, StepTimeline] = field(repr=False)

    @property
    def floor_speedup(self) -> Optional[float]:
        """The floor's throughput over static's: the most any policy could gain here."""
        base = self.stats.get(BASELINE)
        if base is None or base.error is not None:
            return None
        return self.floor_tokens_per_second / base.tokens_per_second

    @property
    def critical_path_floor_speedup(self) -> Optional[float]:
        """The critical-path floor's throughput over static's."""
        base = self.stats.get(BASELINE)
        if base is None or base.error is not None:
            return None
        return self.critical_path_floor_tokens_per_second / base.tokens_per_second

    def to_dict(self) -> dict:
        return {
            "setup": {**asdict(self.spec), "num_ranks": self.spec.num_ranks, "capacity": self.spec.rank_capacity,
                      "context": self.context, "distribution": self.distribution,
                      "global_batch_tokens": self.global_batch_tokens, "steps": self.steps},
            "policies": {name: asdict(s) for name, s in self.stats.items()},
            "floor_tokens_per_second": self.floor_tokens_per_second,
            "floor_speedup": self.floor_speedup,
            "critical_path_floor_tokens_per_second": self.critical_path_floor_tokens_per_second,
            "critical_path_floor_speedup": self.critical_path_floor_speedup,
            "floor_steps": self.floor_steps,
        }


def compute_floor(lengths: Sequence[int], cost_model: CostModel, *, num_ranks: int, pp_size: int) -> float:
    """Seconds of compute no plan of this batch can go below, whatever its placement.

    Every GPU does at most 1/(pp x HDP ranks) of the batch's compute (attention and linear work, which no
    placement changes, and under expert parallelism the MoE all-to-all's transfers each token's holder
    waits for: `plan.timeline.bounds`), with no ring traffic, offload, waits or bubbles. With PP one more limit holds: a
    micro-batch passes the stages one after another, so a document spread over all HDP ranks (rings
    span at most that many pipelines) still keeps its pipelines busy for 1/HDP of its whole-model
    compute. One long document can therefore set the floor on its own when PP > 1.
    """
    alltoall = cost_model.expert_alltoall_seconds_per_token()
    per_document = [cost_model.layer_compute_time(seq_len=n, num_tokens=n) * cost_model.num_layers + alltoall * n
                    for n in lengths]
    return max(sum(per_document) / (pp_size * num_ranks), max(per_document, default=0.0) / num_ranks)


def step_floors(lengths: Sequence[int], cost_model: CostModel, *, num_ranks: int, pp_size: int) -> dict:
    """One batch's floors in seconds, without the all-reduce: "work_s" (`compute_floor`), "crossing_s" and
    "crossing_ring_size" (the longest document's `fastest_crossing`), "critical_path_s" (the larger,
    `critical_path_floor`)."""
    work = compute_floor(lengths, cost_model, num_ranks=num_ranks, pp_size=pp_size)
    crossing, ring_size = fastest_crossing(int(max(lengths)), num_ranks=num_ranks, cost_model=cost_model,
                                           pp_size=pp_size)
    critical = critical_path_floor(work, lengths, num_ranks=num_ranks, cost_model=cost_model, pp_size=pp_size)
    return {"work_s": work, "crossing_s": crossing, "crossing_ring_size": ring_size, "critical_path_s": critical}


def _failed(policy: str, error: str) -> PolicyStats:
    nan = math.nan
    return PolicyStats(policy, nan, nan, nan, nan, nan, nan, nan, nan, error=error)


def compare_policies(
    spec: ClusterSpec,
    *,
    context: int,
    distribution: str,
    global_batch_tokens: Optional[int] = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    steps: int = 1,
    seed: int = 0,
    offload: bool = True,
    progress: bool = True,
    cost_model: Optional[CostModel] = None,
) -> Comparison:
    """Simulate `steps` global batches of `distribution` under each policy (see the module docstring).
    `cost_model`: plan and simulate with it instead of `spec.cost_model()` (e.g. one coupling no EP
    groups, to see what the coupling costs on the same cluster).

    A policy that cannot plan this setup (e.g. megatron-hybrid-cp with PP) is reported with its reason
    instead of stopping the others; a name not in the planner's registry is a ValueError at once (a policy
    of a layer above plan/, such as the default's megatron-hybrid-cp, registers when its package is imported).
    """
    spec.check_context(context)
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    if not policies:
        raise ValueError("no policies to compare")
    policies = list(dict.fromkeys(policies))  # a policy named twice would count its tokens and time twice
    for policy in policies:
        policy_function(policy)  # an unregistered name stops here, not reported as a policy that cannot plan
    capacity = spec.rank_capacity
    budget = global_batch_tokens or MICROBATCHES_PER_RANK * capacity * spec.num_ranks
    if budget <= 0:
        raise ValueError(f"global_batch_tokens must be positive, got {budget}")
    cost_model = cost_model or spec.cost_model()
    config = HDPConfig(hdp_capacity=capacity, hdp_offload=offload)
    totals = {p: {"tokens": 0, "time": 0.0, "balance": 0.0, "idle": 0.0, "bubble": 0.0, "comm": 0.0, "bytes": 0.0,
                  "plan": 0.0, "across": 0.0, "network": 0.0}
              for p in policies}
    errors: dict[str, str] = {}
    plans: dict[str, StepPlan] = {}
    timelines: dict[str, StepTimeline] = {}
    floor = {"tokens": 0, "time": 0.0, "critical": 0.0}
    floor_steps = []
    allreduce = allreduce_time(grad_bytes=spec.grad_bytes, num_ranks=spec.num_ranks,
                               bandwidth=spec.grad_allreduce_bandwidth)
    for step in tqdm(range(steps), desc=f"simulate {distribution} {context} tokens", disable=not progress, unit="step"):
        lengths = sample_global_batch(distribution, num_tokens=budget, seed=seed + step, max_length=context)
        floor["tokens"] += sum(lengths)
        floors = step_floors(lengths, cost_model, num_ranks=spec.num_ranks, pp_size=spec.pp_size)
        floor_steps.append({**floors, "allreduce_s": allreduce})
        floor["time"] += floors["work_s"] + allreduce
        floor["critical"] += floors["critical_path_s"] + allreduce
        for policy in policies:
            if policy in errors:
                continue
            started = time.perf_counter()
            try:
                plan = make_plan(lengths, num_ranks=spec.num_ranks, config=config, cost_model=cost_model,
                                 pp_size=spec.pp_size, vpp_size=spec.vpp_size, policy=policy)
            except ValueError as error:
                logger.warning("policy %s cannot run this setup: %s", policy, error)
                errors[policy] = str(error)
                continue
            planned = time.perf_counter() - started
            timeline = simulate_step(plan, cost_model, grad_bytes=spec.grad_bytes,
                                     allreduce_bandwidth=spec.grad_allreduce_bandwidth)
            if step == 0:
                plans[policy], timelines[policy] = plan, timeline
            total = totals[policy]
            total["tokens"] += timeline.num_tokens
            total["time"] += timeline.step_time
            total["balance"] += timeline.balance
            total["idle"] += timeline.idle_fraction
            total["bubble"] += timeline.bubble_fraction
            total["comm"] += float(timeline.comm.mean()) / timeline.compute_end if timeline.compute_end else 0.0
            total["bytes"] += timeline.attention_bytes / spec.num_ranks
            total["plan"] += planned
            summary = plan.summary(cost_model)
            total["across"] += summary.rings_across_nodes
            total["network"] += summary.network_bytes / spec.num_ranks
    stats = {}
    for policy, total in totals.items():
        if policy in errors:
            stats[policy] = _failed(policy, errors[policy])
            continue
        stats[policy] = PolicyStats(
            policy=policy,
            tokens_per_second=total["tokens"] / total["time"],
            step_time=total["time"] / steps,
            balance=total["balance"] / steps,
            idle_fraction=total["idle"] / steps,
            bubble_fraction=total["bubble"] / steps,
            comm_fraction=total["comm"] / steps,
            attention_gb_per_rank=total["bytes"] / steps / 1e9,
            plan_seconds=total["plan"] / steps,
            rings_across_nodes=total["across"] / steps,
            network_gb_per_rank=total["network"] / steps / 1e9,
        )
    floor_tps = floor["tokens"] / floor["time"]
    critical_tps = floor["tokens"] / floor["critical"]
    base = stats.get(BASELINE)
    baseline = base.tokens_per_second if base is not None and base.error is None else None
    stats = {name: _with_ratios(s, baseline, floor_tps, critical_tps) for name, s in stats.items()}
    return Comparison(spec, context, distribution, budget, steps, stats, floor_tps, critical_tps, floor_steps,
                      plans, timelines)


def _with_ratios(stats: PolicyStats, baseline: Optional[float], floor: float, critical: float) -> PolicyStats:
    """`stats` with its throughput over static's (`baseline`, None: no baseline) and over both floors'."""
    if stats.error is not None:
        return stats
    tps = stats.tokens_per_second
    return replace(stats, speedup=tps / baseline if baseline is not None else None, of_work_floor=tps / floor,
                   of_critical_path_floor=tps / critical)


def throughput_sweep(
    spec: ClusterSpec, *, contexts: Sequence[int], progress: bool = True, **kwargs
) -> dict[str, list[float]]:
    """Tokens/s per policy at each context length (NaN where the policy or the pool cannot run it)."""
    curves: dict[str, list[float]] = {}
    for context in tqdm(contexts, desc="contexts", disable=not progress, unit="context"):
        comparison = compare_policies(spec, context=context, progress=False, **kwargs)
        for name, stats in comparison.stats.items():
            curves.setdefault(name, []).append(stats.tokens_per_second)
    return curves


def format_table(comparison: Comparison) -> str:
    """The comparison as a markdown table."""
    rows = ["| policy | tokens/s | speedup vs static | of work floor | of critical-path floor | step s "
            "| balance (max/mean) | idle | of which bubble | exposed comm | attention GB/GPU | rings across nodes "
            "| network GB/GPU | plan s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in comparison.stats.values():
        if s.error:
            rows.append(f"| {s.policy} | n/a: {s.error} | | | | | | | | | | | | |")
            continue
        speedup = f"{s.speedup:.2f}x" if s.speedup is not None else "-"
        rows.append(f"| {s.policy} | {s.tokens_per_second:,.0f} | {speedup} | {s.of_work_floor:.0%} | "
                    f"{s.of_critical_path_floor:.0%} | {s.step_time:.2f} | {s.balance:.2f} | "
                    f"{s.idle_fraction:.1%} | {s.bubble_fraction:.1%} | {s.comm_fraction:.1%} | "
                    f"{s.attention_gb_per_rank:.1f} | "
                    f"{s.rings_across_nodes:.1f} | {s.network_gb_per_rank:.1f} | {s.plan_seconds:.2f} |")
    steps = comparison.floor_steps
    for name, tps, bound, key in (
            ("work floor", comparison.floor_tokens_per_second, comparison.floor_speedup, "work_s"),
            ("critical-path floor", comparison.critical_path_floor_tokens_per_second,
             comparison.critical_path_floor_speedup, "critical_path_s")):
        seconds = sum(f[key] + f["allreduce_s"] for f in steps) / len(steps)
        rows.append(f"| ({name}) | {tps:,.0f} | {f'{bound:.2f}x' if bound is not None else '-'} | | | "
                    f"{seconds:.2f} | | | | | | | | |")
    rows.append("\nWork floor: the batch's compute over every GPU. Critical-path floor: that, or the longest "
                "document's fastest forward and backward across every pipeline stage when longer; per step "
                + ", ".join(f"{f['crossing_s']:.2f} s on a ring of {f['crossing_ring_size']} against "
                            f"{f['work_s']:.2f} s of work" for f in steps) + ".")
    return "\n".join(rows)
