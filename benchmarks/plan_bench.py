"""Planner benchmark: every policy on the same 32M-token global batches over 1,024 and 12,288 ranks.

    python benchmarks/plan_bench.py [--tokens 32M] [--ranks 1024,12288] [--capacity 16K] [--models llama-7b,llama3-8b]
        [--mixes byted,github,wikipedia,prolong,wlbllm] [--policies balance,naive,static,megatron-hybrid-cp]
        [--ranks-per-node none] [--ep 1] [--repeats 3] [--repeat 1] [--out benchmarks/results/plan_bench.json]

For each mix one batch is sampled (seeded) and planned by every policy at every rank count, under the
analytic cost model of each model: LLaMA-7B (the paper's; MHA, so a long document's ring traffic is
heavy) and Llama-3-8B (GQA, a quarter of the K/V bytes), with the topology unknown to the cost model
(`--ranks-per-node none`) or known (e.g. 8, as the Megatron runtime sets it: rings placed inside nodes,
timed on their slowest link). Reported
per plan: the predicted step time, its gap to `bounds.step_time_lower_bound`, balance (max / mean
predicted rank time), the lower bound's own balance (lower bound / mean: no plan's balance can be
better when one sequence alone is slower than the mean), rings and ring-attention traffic, and planner
time: wall and CPU time of the policy (best of --repeats for `balance`; a GC pass the plan causes is
included), of which timing and building StepPlans (`assemble.time_plan`, `TimedPlan.build`), `validate()`, and
`make_plan` ("make ms": policy + validate, what the data loader pays per step), each timed on its own.
CPU time is given because this 2-core machine is shared: wall time varies with the load (recorded in
the JSON).
`--repeat N` runs all of it N times (the plans are the same every run; the times are not) and reports
each time as median and range over the runs (`repeats.py`); the JSON keeps every run.
`--ep 1,8` plans each batch also with expert parallelism (EP groups of 8 consecutive ranks, planned as
units by `balance`: `plan.search.expert_units`), for its planner time beside the plan without EP.
Targets (issue 2): balance <= 1.05 for `balance`; a 1,024-rank plan in <= 100 ms and a 12,288-rank plan
in <= 1 s; `balance` faster than `megatron-hybrid-cp` on every mix.
`--features ep8,mla-auto-ep32,vpp10` times issue 41's cells instead (`FEATURE_CELLS`: EP, multi-latent
attention with auto ring kinds, VPP with 512 pipelines; `balance` only, github and byted) against their
budgets, into results/plan_bench_features.json, each cell with the host's pace just before it
(`host_pace.py`: a fixed workload's time over its reference; this host's pace drifts 1.0-2x by the hour).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

import megatron_hdp.megatron  # noqa: F401  (registers megatron-hybrid-cp)
from megatron_hdp.commands.plan import parse_count
from megatron_hdp.commands.plan_budget import estimate_plan
from megatron_hdp.config import POLICIES, HDPConfig
from megatron_hdp.plan.policies import balance_candidates
from megatron_hdp.plan.timeline import assemble
from megatron_hdp.plan.timeline.bounds import step_time_lower_bound
from megatron_hdp.plan.lengths import DISTRIBUTIONS, sample_global_batch
from megatron_hdp.plan.planner import make_plan, policy_function
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.sim.cluster import ClusterSpec
from host_pace import pace
from output import finish, print_new_rows
from repeats import add_repeat_argument, format_spread, over_runs, repeat_measurement

HERE = Path(__file__).resolve().parent


class _AssemblyClock:
    """Times the timing and building of StepPlans inside the policies (`assemble.time_plan` and
    `TimedPlan.build`, which `assemble_plan` is made of; `balance` times every candidate and builds one)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _timed(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def __enter__(self) -> "_AssemblyClock":
        self._originals = (assemble.time_plan, assemble.TimedPlan.build)
        assemble.time_plan = balance_candidates.time_plan = self._timed(assemble.time_plan)
        assemble.TimedPlan.build = self._timed(assemble.TimedPlan.build)
        return self

    def __exit__(self, *exc) -> None:
        assemble.time_plan = balance_candidates.time_plan = self._originals[0]
        assemble.TimedPlan.build = self._originals[1]


def measure(policy: str, lengths: list[int], *, num_ranks: int, config: HDPConfig, cost_model, repeats: int,
            pp_size: int = 1, vpp_size: int = 1) -> dict:
    """Plan once per repeat; keep the fastest run's timings and the plan's statistics.

    Each repeat times the policy call (wall and CPU: a plan's GC cost included, since `gc_paused` runs
    inside the call), `validate()` on its plan, and `make_plan` (the runtime's per-step call: policy +
    validate) separately. The previous repeat's plan is released before the clock starts, so freeing
    ~100K objects of an earlier plan is not charged to the next one.
    """
    function = policy_function(policy)
    stages = {"pp_size": pp_size, **({"vpp_size": vpp_size} if vpp_size > 1 else {})}
    best = None
    fastest_validate = fastest_make = float("inf")
    for _ in range(repeats):
        plan = None
        with _AssemblyClock() as clock:
            wall, cpu = time.perf_counter(), time.process_time()
            plan = function(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, **stages)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        start = time.perf_counter()
        plan.validate()
        fastest_validate = min(fastest_validate, time.perf_counter() - start)
        if best is None or wall < best[0]:
            best = (wall, cpu, clock.seconds, plan)
        plan = None
        start = time.perf_counter()
        plan = make_plan(lengths, num_ranks=num_ranks, config=config, cost_model=cost_model, policy=policy, **stages)
        fastest_make = min(fastest_make, time.perf_counter() - start)
        plan = None
    wall, cpu, assembly, plan = best
    stats = plan.summary(cost_model)
    bound = step_time_lower_bound(lengths, num_ranks=num_ranks, capacity=config.hdp_capacity, cost_model=cost_model,
                                  pp_size=pp_size, max_offload_ratio=config.max_offload_ratio)
    mean = float(np.mean([r.est_time for r in plan.ranks]))
    return {
        "step_s": plan.est_step_time,
        "lower_bound_s": bound,
        "gap": plan.est_step_time / bound - 1,
        "balance": stats.balance,
        "balance_floor": max(1.0, bound / mean),
        "rings": stats.num_rings,
        "max_ring": max(stats.ring_sizes, default=1),
        "ring_tb": stats.attention_bytes / 1e12,
        "microbatches": [stats.min_microbatches, stats.max_microbatches],
        "offloaded": sum(1 for s in plan.sequences if s.offload_ratio > 0),
        "wall_ms": 1e3 * wall,
        "cpu_ms": 1e3 * cpu,
        "assemble_ms": 1e3 * assembly,
        "validate_ms": 1e3 * fastest_validate,
        "make_plan_ms": 1e3 * fastest_make,
    }


HEAD = f"{'model':<13}{'mix':<10}{'ranks':>6}{'rpn':>5}{'ep':>4} {'policy':<19}"


def _row_head(r: dict) -> str:
    return (f"{r['model']:<13}{r['mix']:<10}{r['ranks']:>6}{str(r.get('ranks_per_node') or '-'):>5}"
            f"{r.get('ep', 1):>4} {r['policy']:<19}")


def table(records: list[dict]) -> str:
    header = (f"{HEAD}{'step s':>9}{'vs LB':>8}{'bal':>7}{'bal LB':>7}"
              f"{'rings':>6}{'ring TB':>9}{'wall ms':>9}{'cpu ms':>8}{'asm ms':>8}{'val ms':>8}{'make ms':>9}")
    lines = [header, "-" * len(header)]
    for r in records:
        head = _row_head(r)
        if "error" in r:
            lines.append(head + f"n/a: {r['error'][:70]}")
            continue
        lines.append(head + f"{r['step_s']:>9.3f}{'+%.1f%%' % (100 * r['gap']):>8}{r['balance']:>7.3f}"
                     f"{r['balance_floor']:>7.3f}{r['rings']:>6}{r['ring_tb']:>9.1f}{r['wall_ms']:>9.0f}"
                     f"{r['cpu_ms']:>8.0f}{r['assemble_ms']:>8.0f}{r['validate_ms']:>8.0f}{r['make_plan_ms']:>9.0f}")
    return "\n".join(lines)


def spread_table(records: list[dict]) -> str:
    """The planner's times over the runs (`repeats.over_runs`'s spread), ms as median [min, max]."""
    times = ("wall_ms", "cpu_ms", "make_plan_ms")
    header = HEAD + "".join(f"{t:>22}" for t in times)
    lines = [header, "-" * len(header)]
    for r in records:
        if "error" not in r:
            lines.append(_row_head(r) + "".join(f"{format_spread(r[t], '{:.0f}'):>22}" for t in times))
    return "\n".join(lines)


def plan_all(args: argparse.Namespace, cost_models: dict, batches: dict[str, list[int]]) -> list[dict]:
    """One run: every model x mix x ranks x topology x policy, each row printed as it is measured."""
    config = HDPConfig(hdp=True, hdp_capacity=args.capacity)
    topologies = [None if n.lower() == "none" else int(n) for n in args.ranks_per_node.split(",")]
    records = []
    for model, mix in ((m, x) for m in cost_models for x in args.mixes.split(",")):
        lengths = batches[mix]
        grid = ((int(r), n, int(e)) for r in args.ranks.split(",") for n in topologies for e in args.ep.split(","))
        for num_ranks, ranks_per_node, ep in grid:
            cost_model = dataclasses.replace(cost_models[model], ranks_per_node=ranks_per_node, expert_parallel_size=ep)
            for policy in args.policies.split(","):
                record = {"model": model, "mix": mix, "ranks": num_ranks, "ranks_per_node": ranks_per_node, "ep": ep,
                          "policy": policy, "sequences": len(lengths), "tokens": int(sum(lengths)),
                          "longest": int(max(lengths))}
                refusal = estimate_plan(policy, lengths, num_ranks=num_ranks, capacity=args.capacity).refusal(
                    max_shards=10**9, max_seconds=args.max_plan_seconds)
                if refusal:
                    record["error"] = refusal
                else:
                    try:
                        record.update(measure(policy, lengths, num_ranks=num_ranks, config=config,
                                              cost_model=cost_model, repeats=args.repeats if policy == "balance" else 1))
                    except (ValueError, ImportError) as error:
                        record["error"] = str(error)
                records.append(record)
                print_new_rows(table, [record])
    return records


FEATURE_CELLS = {
    # name: (model, TP, PP, VPP, EP, HDP ranks); the ring kind is the cost model's ("auto": per ring group the
    # faster of the K/V and the latent ring, which is multi-latent attention's choice)
    "ep1": ("llama-7b", 1, 1, 1, 1, (1024, 16384)),
    "ep8": ("llama-7b", 1, 1, 1, 8, (1024, 16384)),
    "ep32": ("llama-7b", 1, 1, 1, 32, (1024, 16384)),
    "mixtral-ep8": ("mixtral-8x7b", 1, 1, 1, 8, (1024, 16384)),
    "mla-auto": ("deepseek-v3", 8, 1, 1, 1, (1024, 16384)),
    "mla-auto-ep32": ("deepseek-v3", 8, 1, 1, 32, (1024, 16384)),
    "vpp4": ("llama-70b", 8, 4, 4, 1, (512,)),
    "vpp10": ("llama-70b", 8, 4, 10, 1, (512,)),
}
"""`--features`: issue 41's cells, `balance` with every feature on. EP couples HDP ranks in groups of EP
(`plan.search.expert_units`): llama-7b's with the topology unknown to the cost model (plan_bench's own rows),
Mixtral-8x7B's on nodes of 8 (the experts' all-to-all inside a node, as Megatron places EP 8); MLA cells plan DeepSeek-V3 with auto ring kinds; VPP cells plan 512 pipelines
of 4 stages (llama-70b on 16,384 GPUs, TP 8, as benchmarks/vpp_table.py) with C from GPU memory."""

FEATURE_MIXES = "github,byted"

FEATURE_BUDGET_MS = {512: 1000.0, 1024: 100.0, 16384: 300.0}
"""Issue 41's budgets for balance's CPU time (median): by HDP ranks (512: the VPP cells' pipelines)."""


def plan_features(args: argparse.Namespace, batches: dict[str, list[int]]) -> list[dict]:
    """One run of the feature cells (`FEATURE_CELLS`) over every mix: `balance` timed once per cell (policy,
    validate, make_plan), each row printed as it is measured."""
    records = []
    for name in args.features.split(","):
        if name not in FEATURE_CELLS:
            raise ValueError(f"--features {name!r} is not one of {', '.join(FEATURE_CELLS)}")
        model, tp, pp, vpp, ep, rank_counts = FEATURE_CELLS[name]
        for mix, num_ranks in ((m, r) for m in args.mixes.split(",") for r in rank_counts):
            spec = ClusterSpec(model, num_gpus=num_ranks * tp * pp, tp_size=tp, pp_size=pp, vpp_size=vpp)
            capacity = spec.memory_capacity() if pp > 1 else args.capacity
            cost_model = dataclasses.replace(spec.cost_model(), expert_parallel_size=ep)
            if model == "llama-7b":  # plan_bench's own rows: topology unknown to the cost model
                cost_model = dataclasses.replace(cost_model, ranks_per_node=None)
            lengths = batches[mix]
            record = {"cell": name, "model": model, "mix": mix, "ranks": num_ranks, "pp": pp, "vpp": vpp, "ep": ep,
                      "capacity": capacity, "ring_kind": cost_model.ring_kind, "policy": "balance",
                      "sequences": len(lengths), "budget_ms": FEATURE_BUDGET_MS[num_ranks]}
            record.update(pace())  # the host's pace just before, beside the CPU time it qualifies
            record.update(measure("balance", lengths, num_ranks=num_ranks, config=HDPConfig(hdp=True, hdp_capacity=capacity),
                                  cost_model=cost_model, repeats=1, pp_size=pp, vpp_size=vpp))
            records.append(record)
            print_new_rows(features_table, [record])
    return records


FEATURE_HEAD = f"{'cell':<14}{'model':<12}{'mix':<8}{'ranks':>6}{'pp':>3}{'vpp':>4}{'ep':>4}"


def features_table(records: list[dict]) -> str:
    """The feature cells: plan quality and balance's CPU and make_plan times against the budget."""
    header = (f"{FEATURE_HEAD}{'step s':>9}{'vs LB':>8}{'bal':>7}{'rings':>7}{'cpu ms':>8}{'make ms':>9}{'budget':>8}"
              f"{'pace':>6}")
    lines = [header, "-" * len(header)]
    for r in records:
        lines.append(f"{r['cell']:<14}{r['model']:<12}{r['mix']:<8}{r['ranks']:>6}{r['pp']:>3}{r['vpp']:>4}{r['ep']:>4}"
                     f"{r['step_s']:>9.3f}{'+%.1f%%' % (100 * r['gap']):>8}{r['balance']:>7.3f}{r['rings']:>7}"
                     f"{r['cpu_ms']:>8.0f}{r['make_plan_ms']:>9.0f}{r['budget_ms']:>8.0f}{r['pace']:>6.2f}")
    return "\n".join(lines)


def features_spread_table(records: list[dict]) -> str:
    """The feature cells' times over the runs, ms as median [min, max]."""
    times = ("cpu_ms", "make_plan_ms")
    header = FEATURE_HEAD + "".join(f"{t:>22}" for t in times) + f"{'budget':>8}{'pace':>22}"
    lines = [header, "-" * len(header)]
    for r in records:
        lines.append(f"{r['cell']:<14}{r['model']:<12}{r['mix']:<8}{r['ranks']:>6}{r['pp']:>3}{r['vpp']:>4}{r['ep']:>4}"
                     + "".join(f"{format_spread(r[t], '{:.0f}'):>22}" for t in times) + f"{r['budget_ms']:>8.0f}"
                     + f"{format_spread(r['pace'], '{:.2f}'):>22}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=parse_count, default=parse_count("32M"))
    parser.add_argument("--ranks", default="1024,12288")
    parser.add_argument("--capacity", type=parse_count, default=parse_count("16K"))
    parser.add_argument("--models", default="llama-7b,llama3-8b")
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--mixes", default=None, help=f"comma list of length mixes (default: all, "
                        f"{','.join(DISTRIBUTIONS)}; with --features {FEATURE_MIXES})")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--ranks-per-node", default="none",
                        help="comma list of HDP ranks per node for the cost model; none: topology unknown")
    parser.add_argument("--ep", default="1",
                        help="comma list of expert-parallel sizes (HDP ranks an MoE all-to-all couples) to plan with")
    parser.add_argument("--repeats", type=int, default=3,
                        help="plans of `balance` per batch within a run, the fastest kept (--repeat: whole runs)")
    add_repeat_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-plan-seconds", type=float, default=300.0,
                        help="skip a policy whose planning `plan_budget.estimate_plan` puts above this (n/a row)")
    parser.add_argument("--features", default=None,
                        help=f"comma list of feature cells to time instead of the grid ({', '.join(FEATURE_CELLS)})")
    parser.add_argument("--out", default=None, help="result JSON (default: results/plan_bench.json, with "
                        "--features results/plan_bench_features.json)")
    args = parser.parse_args(argv)
    args.mixes = args.mixes or (FEATURE_MIXES if args.features else ",".join(DISTRIBUTIONS))

    cost_models = {m: analytic_cost_model(m, args.hardware, tp_size=args.tp) for m in args.models.split(",")}
    batches = {mix: sample_global_batch(mix, num_tokens=args.tokens, seed=args.seed) for mix in args.mixes.split(",")}
    load_before = os.getloadavg()
    if args.features:
        runs = repeat_measurement(lambda: {"records": plan_features(args, batches)}, args.repeat)
        rows, spread_rows = features_table, features_spread_table
    else:
        runs = repeat_measurement(lambda: {"records": plan_all(args, cost_models, batches)}, args.repeat)
        rows, spread_rows = table, spread_table
    combined = over_runs(runs)
    text = rows(combined["records"])
    if args.repeat > 1:
        text += f"\n\nover {args.repeat} runs, median [min, max]:\n" + spread_rows(combined["spread"]["records"])
    result = {
        "benchmark": "plan_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/plan_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
                    "python": platform.python_version(), "numpy": np.__version__},
        "setup": {"tokens": args.tokens, "capacity": args.capacity, "hardware": args.hardware, "tp": args.tp,
                  "seed": args.seed, "cost_models": {m: cm.to_dict() for m, cm in cost_models.items()}},
        **combined,
    }
    default = "plan_bench_features.json" if args.features else "plan_bench.json"
    finish(text, result, args.out or str(HERE / "results" / default))
    return 0


if __name__ == "__main__":
    sys.exit(main())
