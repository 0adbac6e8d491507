"""Train the tiny Llama-style GPT with HDP on gloo CPU ranks, policy against policy: the demo and the bench.

Every rank runs `train_policies` (through `megatron_hdp.comm.launch.run_gloo`): it initializes HDP,
fits the cost model of *this* model on *this* machine, then builds one model per policy from the same seed
and trains the same global batches, planned by `make_plan`, the policies taking turns step by step (in a
random order every round). Rows of statistics come back from rank 0.
Synthetic documents follow ByteScale's long-tailed "byted" mix, scaled down (`length_scale`) and clipped to
`max_length` so that a CPU can train them.

Times mean "a cluster where each rank has a core of its own", which a host with fewer cores than ranks can
only measure indirectly: a rank blocked in a gloo wait uses no CPU (checked: a 2 s wait costs < 5 ms of
process time), so each rank's *process CPU time* of each phase of a step is what that phase takes on a
dedicated core, and `megatron_hdp.sim.replay.dedicated_step_time` adds the waits the plan implies (ring
members run a ring micro-batch together; the all-reduce waits for the last rank). The cost model is
fitted in the same currency, on the runtime's own micro-batches (`cpu_fit.fit_cost_model`: T(s) per layer from
whole documents, ring costs from ring micro-batches, each timed as a step's second micro-batch, the
jitter from the lead of ring micro-batches' slowest members), the gradient all-reduce from CPU seconds
of an all-reduce of the gradient buffer. The prediction of each step is `simulate_step(plan, cost_model,
rules=PolicyRules())` — our runtime runs balance's, static's and naive's plans with one pass per
micro-batch and no barrier between micro-batches — or, for `megatron-hybrid-cp`, which runs as Megatron
runs it (one pass per sub-sample, a barrier per group; its replay adds those barriers), Megatron's rules
(`POLICY_RULES`) on its grouped plan — plus the measured per-step work the
simulator does not model (plan check, collation, optimizer step).
The fit is timed once, before the steps, but a shared host's CPU seconds per unit of work change over a
run (other processes' load, contention, frequency): a fit timed under other conditions than the steps
mis-predicts every policy alike (the run-wide drift of issue 24). So a probe — one whole document of C
tokens per rank, timed like the fit — runs before and after the fit (their median: the fit's
conditions) and before and after each round of steps (their mean: the round's), and each step's
prediction is scaled by probe now / probe at the fit (`measure_speed_probe`); an
out-of-sample prediction divides by the probe of the run that fitted its model. Rows keep the unscaled
prediction too. A second probe times ring work (`measure_ring_probe`: the fit's block-overhead row), which
a change of the host's load slows by another factor than compute (gloo threads, kernel calls): the fit's
ring coefficients are scaled by how much more than the speed probe it moved (`_predicted_time`).
Wall time is reported too; it measures the total work of all ranks on the shared cores.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

import megatron_hdp.megatron  # noqa: F401  (registers megatron-hybrid-cp, which HYBRID_CP plans with)
from megatron_hdp.config import HDPConfig
from megatron_hdp.harness.cpu_fit import (fastest_busy_times, fit_cost_model, grad_buffer_bytes,
                                          measure_allreduce_bandwidth, measure_probes, measure_step_overhead)
from megatron_hdp.harness.cpu_spec import CpuRunSpec
from megatron_hdp.plan.cost.model import CostModel

logger = logging.getLogger(__name__)

HYBRID_CP = "megatron-hybrid-cp"
"""Megatron's Hybrid-CP as Megatron executes it: its scheduler's plan run one forward/backward pass per
sub-sample (<= C tokens per rank per pass), a barrier over all ranks after each group
(`megatron.comparison.per_subsample.per_subsample_plan`)."""
HYBRID_CP_GROUPED = "megatron-hybrid-cp-grouped"
"""Ours, not Megatron's: Megatron's grouping run through our runtime as one micro-batch per group and rank
(up to several times C tokens per pass, no barrier): the planner policy `megatron-hybrid-cp` as is."""


EP_UNAWARE = "balance-ep-unaware"
"""Ours, for comparison: `balance` planning every rank as if it ran alone (its cost model without expert
parallelism), run on the EP mesh, where the runtime pads each EP group to its largest count and the
group waits at every index for its slowest member. `balance` itself plans EP groups as units."""


def planner_policy(policy: str) -> str:
    """The `make_plan` policy behind a policy name of this module (`HYBRID_CP_GROUPED` is `HYBRID_CP`'s,
    `EP_UNAWARE` is `balance`)."""
    return {HYBRID_CP_GROUPED: HYBRID_CP, EP_UNAWARE: "balance"}.get(policy, policy)


def policy_cost_model(policy: str, cost_model: CostModel, *, ep_size: int) -> CostModel:
    """The cost model `policy` plans with on a mesh whose EP groups span `ep_size` HDP ranks: with them
    (what the runtime runs and the prediction times), or without for `EP_UNAWARE`."""
    return dataclasses.replace(cost_model, expert_parallel_size=1 if policy == EP_UNAWARE else ep_size)


@dataclass
class StepRow:
    """One step of one policy, as the demo prints it and the bench stores it."""

    policy: str
    step: int
    loss: float
    step_time: float
    """Seconds a cluster with one core per rank would take (measured busy time + the plan's waits)."""
    wall_time: float
    """Wall seconds of the step on this host (ranks share its cores: the total work, not the slowest)."""
    max_busy_time: float
    """CPU seconds of the busiest rank (a lower bound of `step_time`: no waits)."""
    predicted_time: float
    """The simulator's step time for this plan and the fitted cost model (our runtime's rules), plus the
    measured per-step work it does not model (`measure_step_overhead`: plan check, collation, optimizer).
    With a cost model given from outside the run (e.g. fitted by another run on another mix and seed),
    that model and that run's all-reduce bandwidth and step overhead: an out-of-sample prediction."""
    predicted_time_in_run_fit: float
    """The same prediction with this run's own fit and measurements (in-sample)."""
    speed_factor: float
    """Probe seconds over this step's round / probe seconds at the fit that predicts it (this run's, or
    the earlier run's for an out-of-sample prediction): `predicted_time` is scaled by it."""
    speed_factor_in_run: float
    """The same for this run's own fit (`predicted_time_in_run_fit` is scaled by it)."""
    planner_time: float
    """The planner's own estimate (`plan.est_step_time`)."""
    balance: float
    num_rings: int
    ring_sizes: dict = field(default_factory=dict)
    attention_bytes: int = 0
    num_microbatches: list = field(default_factory=list)
    num_sequences: int = 0
    num_tokens: int = 0
    per_rank: dict = field(default_factory=dict)
    """Per HDP rank: measured CPU seconds of micro-batches ("compute"), of the phases before and after
    them, and the simulator's busy seconds ("predicted_compute"): where a prediction error comes from."""
    predicted_time_without_alltoall: Optional[float] = None
    """`predicted_time` with the predicting fit's twin that folds the MoE all-to-all into b1 and
    expert_share, as the fit did before issue 41 (`fit_cost_model`): what the all-to-all term changes
    (`predicted_time` itself where the fit has no such term: dense or EP 1). None when the predicting fit
    came without its twin (a file written before issue 41)."""


def global_batches(spec: CpuRunSpec) -> list[list[int]]:
    """Lengths of each step's global batch (the same for every policy)."""
    from megatron_hdp.plan.lengths import sample_global_batch

    batches = []
    for step in range(spec.warmup_steps + spec.steps):
        raw = sample_global_batch(spec.mix, num_tokens=spec.tokens_per_step * spec.length_scale, seed=spec.seed + step)
        batches.append([int(min(spec.max_length, max(1, -(-n // spec.length_scale)))) for n in raw])
    return batches


def planned_batches(spec: CpuRunSpec, state, config: HDPConfig, cost_model: CostModel, policy: str):
    """(plan, read_tokens) of each step: read from `spec.data_prefix` by the HDP loader (each rank only its
    shards), else the synthetic `global_batches`. The same batches for every policy (same seed)."""
    from megatron_hdp.plan.planner import make_plan

    if spec.data_prefix is None:
        from megatron_hdp.harness.exactness import token_reader

        for step, lengths in enumerate(global_batches(spec)):
            plan = make_plan(lengths, num_ranks=state.hdp_size, config=config, cost_model=cost_model,
                             policy=planner_policy(policy))
            yield plan, token_reader(spec.seed + step, plan.lengths)  # rl-static-cp plans padded sequences
        return
    from megatron_hdp.data.loader import HDPDataLoader
    from megatron_hdp.megatron.datasets.sources import IndexedDocumentSource

    loader_config = dataclasses.replace(
        config, hdp_policy=planner_policy(policy), hdp_global_batch_tokens=spec.tokens_per_step, hdp_overlong_documents="truncate"
    )
    # prefetch=0: plan and read before each step, outside its timing, as the synthetic path does (the
    # demo's ranks already use every core); check_plans=False: HDPTrainer.step checks the plan digests.
    with HDPDataLoader(IndexedDocumentSource(spec.data_prefix), rank=state.hdp_rank, num_ranks=state.hdp_size,
                       config=loader_config, cost_model=cost_model, seed=spec.seed, max_length=spec.max_length,
                       prefetch=0, check_plans=False) as loader:
        for _ in range(spec.warmup_steps + spec.steps):
            step = next(loader)
            yield step.plan, step.read_tokens


def _model_config(spec: CpuRunSpec):
    from megatron_hdp.harness.model import tiny_llama_config

    return tiny_llama_config(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_moe_experts=spec.num_experts or None,
        moe_router_topk=spec.moe_router_topk,
    )


def _build(spec: CpuRunSpec, state):
    from megatron_hdp.harness.exactness import VOCAB_SIZE
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training
    from megatron_hdp.megatron.core_api.step import HDPTrainer

    torch.manual_seed(spec.seed)
    model = build_gpt(_model_config(spec), vocab_size=VOCAB_SIZE, max_sequence_length=spec.max_length)
    ddp, optimizer = wrap_for_training(model)
    return HDPTrainer(model=ddp, optimizer=optimizer, state=state)


def silence_megatron_warnings() -> None:
    """Ignore the warnings Megatron-Core raises from its own modules on a CPU gloo run (missing Transformer
    Engine / Apex / NVTX, deprecations); warnings from our code and from torch still show."""
    warnings.filterwarnings("ignore", module=r"megatron\.core(\.|$)")
    logging.getLogger("megatron").setLevel(logging.ERROR)


def _predicted_time(policy: str, plan, model: CostModel, *, grad_bytes: int, allreduce_bandwidth: float,
                    step_overhead: float, speed_probe: float, ring_probe: Optional[float], now: dict):
    """The simulator's timeline of `plan` (our runtime's rules for every plan it runs as planned; Megatron's
    for the one it runs per sub-sample), the predicted step time (+ the per-step work it does not model)
    scaled by the speed factor now["speed_probe"] / `speed_probe` (module doc), and that factor. The fit's
    ring coefficients are first scaled by how much more (or less) the ring probe moved than the speed
    probe since the fit (none without a ring probe on both sides)."""
    from megatron_hdp.sim.simulator import POLICY_RULES, PolicyRules, simulate_step

    speed = now["speed_probe"] / speed_probe
    if ring_probe and now.get("ring_probe"):
        ring = now["ring_probe"] / ring_probe / speed
        model = dataclasses.replace(model, ring_latency=model.ring_latency * ring,
                                    ring_block_overhead=model.ring_block_overhead * ring)
    rules = POLICY_RULES[HYBRID_CP] if policy == HYBRID_CP else PolicyRules()
    timeline = simulate_step(plan, model, grad_bytes=grad_bytes, allreduce_bandwidth=allreduce_bandwidth,
                             rules=rules)
    return timeline, (timeline.step_time + step_overhead) * speed, speed


def _measured_row(policy: str, step: int, plan, stats, busy_by_rank, grad_bytes: int, predict: dict,
                  in_run: dict, now: dict, run_plan=None, barriers=(), ep_size: int = 1) -> StepRow:
    """`plan` is the policy's plan; `run_plan` what ran (default: `plan`), with group `barriers`. Empty
    micro-batches of a `run_plan` are slots Megatron does not run: their measured times count as zero.
    `predict` and `in_run`: {"model", "allreduce_bandwidth", "step_overhead", "speed_probe", "ring_probe",
    "model_without_alltoall" (`fit_cost_model`'s twin, or None)} to predict with (the same dict unless a
    cost model came from outside the run); `now`: the probes of this step's round (`measure_probes`)."""
    from megatron_hdp.sim.replay import dedicated_step_time

    run_plan = run_plan or plan
    if run_plan is not plan:
        busy_by_rank = [
            dataclasses.replace(b, **{
                phase: tuple(0.0 if i < len(mbs) and not mbs[i].shards else t for i, t in enumerate(getattr(b, phase)))
                for phase in ("forward", "backward")
            })
            for b, mbs in zip(busy_by_rank, (r.microbatches for r in run_plan.ranks))
        ]
    dedicated = dedicated_step_time(
        run_plan,
        before=[b.before for b in busy_by_rank],
        forward=[b.forward for b in busy_by_rank],
        backward=[b.backward for b in busy_by_rank],
        after=[b.after for b in busy_by_rank],
        barriers_after=barriers,
        ep_size=ep_size,
    )
    busy = [b.before + sum(b.forward) + sum(b.backward) + b.after for b in busy_by_rank]
    twin = predict.get("model_without_alltoall")
    predict, in_run = ({k: v for k, v in timing.items() if k != "model_without_alltoall"}
                       for timing in (predict, in_run))
    timeline, predicted, speed = _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now, **predict)
    _, predicted_in_run, speed_in_run = _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now, **in_run)
    without_alltoall = None if twin is None else _predicted_time(policy, plan, grad_bytes=grad_bytes, now=now,
                                                                 **{**predict, "model": twin})[1]
    compute = [sum(b.forward) + sum(b.backward) for b in busy_by_rank]
    per_rank = {
        "compute": compute, "before": [b.before for b in busy_by_rank], "after": [b.after for b in busy_by_rank],
        "predicted_compute": (timeline.busy * speed).tolist(),
    }
    return StepRow(
        policy=policy, step=step, loss=stats.loss, step_time=dedicated, wall_time=stats.step_time,
        max_busy_time=max(busy), predicted_time=predicted, predicted_time_in_run_fit=predicted_in_run,
        speed_factor=speed, speed_factor_in_run=speed_in_run,
        planner_time=plan.est_step_time,
        balance=max(compute) / statistics.mean(compute), num_rings=stats.num_rings,
        ring_sizes=plan.summary().ring_sizes, attention_bytes=stats.attention_bytes,
        num_microbatches=stats.num_microbatches, num_sequences=len(plan.lengths), num_tokens=sum(plan.lengths),
        per_rank=per_rank, predicted_time_without_alltoall=without_alltoall,
    )


def train_policies(rank: int, world_size: int, spec: CpuRunSpec, cost_model: Optional[dict] = None,
                   measured: Optional[dict] = None) -> dict:
    """Per rank: fit the cost model, then train `spec.steps` steps under each policy, the policies taking
    turns step by step.

    `cost_model` (a CostModel dict), when given, plans and predicts instead of the fit, with the
    "allreduce_bandwidth" and "step_overhead" of `measured` where given (another run's; its
    "cost_model_without_alltoall", the twin of `fit_cost_model`, predicts `predicted_time_without_alltoall`):
    predictions out of sample; every row also carries the in-run fit's prediction. Returns {"planned_with":
    timing, "in_run_fit": timing, "grad_bytes": int, "rows": [StepRow as dict]} (rows filled on rank 0 only),
    a timing being {"cost_model": dict, "allreduce_bandwidth": float, "step_overhead": float, "speed_probe":
    float, "ring_probe", "cost_model_without_alltoall": dict or None}: what planned
    and predicted, and what this run measured (the same when nothing came from outside).
    """
    silence_megatron_warnings()
    from megatron_hdp.megatron.comparison.per_subsample import per_subsample_plan
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp

    state = initialize_hdp(seed=spec.seed, expert_model_parallel_size=spec.ep_size)
    config = HDPConfig(hdp=True, hdp_capacity=spec.capacity, hdp_offload=False)
    first = _build(spec, state)
    probes = [measure_probes(first, spec)]  # around the fit, so that their medians are the fit's conditions
    fitted, folded = fit_cost_model(first, spec)
    probes.append(measure_probes(first, spec))
    # the mesh's EP groups, coupled as the runtime couples them
    fitted, folded = map(first.planning_cost_model, (fitted, folded))
    model = first.planning_cost_model(CostModel.from_dict(cost_model)) if cost_model else fitted
    twin = (measured or {}).get("cost_model_without_alltoall") if cost_model else folded.to_dict()
    grad_bytes = grad_buffer_bytes(first)
    allreduce_bandwidth = measure_allreduce_bandwidth(grad_bytes)
    step_overhead = measure_step_overhead(first, grad_bytes=grad_bytes, allreduce_bandwidth=allreduce_bandwidth)
    probes.append(measure_probes(first, spec))
    in_run = {"model": fitted, "allreduce_bandwidth": allreduce_bandwidth, "step_overhead": step_overhead,
              "model_without_alltoall": folded,
              **{key: _median_or_none([p[key] for p in probes]) for key in probes[0]}}
    predict = {**in_run, "model": model, **{k: v for k, v in (measured or {}).items() if k in in_run},
               "model_without_alltoall": first.planning_cost_model(CostModel.from_dict(twin)) if twin else None}
    if measured and "ring_probe" not in measured:
        predict["ring_probe"] = None  # another run's fit without its ring probe: no ring rescaling
    rows = []
    # The policies take turns step by step (each its own model, built from the same seed), so that a
    # change of load on a shared host between the start and the end of the run weighs on every policy alike.
    # A step's timing repeats take turns too (A B A B, not A A B B): the host's speed drifts over seconds (two
    # policies running the same plan one after the other measured 0.88-1.17x apart), and each policy's fewest
    # CPU seconds then come from the same stretch of time as the others'. Each round runs the policies in a
    # fresh random order: a fixed cyclic order, even rotated, always runs each policy after the same one
    # (balance after static); identical plans then measured 0.97x (EP 4, 10 steps) and 1.04x (EP 2, 5 steps)
    # apart in the median, and no order should be a policy's alone.
    trainers = [_build(spec, state) for _ in spec.policies]
    batches = [planned_batches(spec, state, config, policy_cost_model(policy, model, ep_size=state.ep_size), policy)
               for policy in spec.policies]
    order = random.Random(spec.seed)
    for step, planned in enumerate(zip(*batches)):
        probe_before = measure_probes(first, spec)  # the host's speed over this round (module doc)
        turns = list(zip(spec.policies, trainers, planned))
        executed = {policy: per_subsample_plan(plan) if policy == HYBRID_CP else (plan, ())
                    for policy, _, (plan, _) in turns}  # (what runs, its group barriers)
        runs, stats = {policy: [] for policy in executed}, {}
        for _ in range(spec.timing_repeats if step >= spec.warmup_steps else 1):
            order.shuffle(turns)  # the same on every rank: one generator, seeded alike
            for policy, trainer, (_, read_tokens) in turns:
                done = trainer.step(executed[policy][0], read_tokens)
                runs[policy].append(trainer.last_busy)
                fastest = min(done.step_time, stats[policy].step_time) if policy in stats else done.step_time
                stats[policy] = dataclasses.replace(stats.get(policy, done), step_time=fastest)  # the first run's loss
        measured_round = []
        for policy, _, (plan, _) in turns:
            busy_by_rank = [None] * world_size
            dist.all_gather_object(busy_by_rank, fastest_busy_times(runs[policy]))
            measured_round.append((policy, plan, stats[policy], busy_by_rank, *executed[policy]))
        probe_after = measure_probes(first, spec)
        now = {key: _mean_or_none([probe_before[key], probe_after[key]]) for key in probe_before}
        if step >= spec.warmup_steps and rank == 0:
            for policy, plan, stats, busy_by_rank, run_plan, barriers in measured_round:
                row = _measured_row(policy, step - spec.warmup_steps, plan, stats, busy_by_rank, grad_bytes,
                                    predict, in_run, now, run_plan, barriers, ep_size=state.ep_size)
                rows.append(asdict(row))
    for generator in batches:
        generator.close()  # leaves the HDP loaders' contexts
    return {"planned_with": _timing_record(predict), "in_run_fit": _timing_record(in_run), "grad_bytes": grad_bytes,
            "rows": rows}


def _timing_record(timing: dict) -> dict:
    """A {"model": CostModel, "allreduce_bandwidth", "step_overhead", probes, "model_without_alltoall"} set as
    JSON-ready values."""
    twin = timing["model_without_alltoall"]
    return {"cost_model": timing["model"].to_dict(), "allreduce_bandwidth": timing["allreduce_bandwidth"],
            "step_overhead": timing["step_overhead"], "speed_probe": timing["speed_probe"],
            "ring_probe": timing["ring_probe"], "cost_model_without_alltoall": twin.to_dict() if twin else None}


def _median_or_none(values: list) -> Optional[float]:
    return None if None in values else statistics.median(values)


def _mean_or_none(values: list) -> Optional[float]:
    return None if None in values else statistics.mean(values)
