"""HDP training step on gloo CPU ranks: step time and ring bytes of each policy on the same batches, and the
simulator's prediction next to the measurement.

    python benchmarks/step_bench.py                    # 8 ranks, C = 256, byted mix: every policy
    python benchmarks/step_bench.py --mix github --seed 1 --predict-from benchmarks/results/step_bench.json \
        --output benchmarks/results/step_bench_github.json  # out-of-sample: the byted run's fit predicts github

Policies: balance, static, naive (ours), megatron-hybrid-cp — Megatron's Hybrid-CP scheduler executed the
way Megatron executes it (one forward/backward pass per sub-sample, <= C tokens per rank per pass, a
barrier over all ranks after each group) — and megatron-hybrid-cp-grouped, ours: Megatron's grouping run
through our runtime as one micro-batch per group and rank (several times C tokens per pass, no barrier),
which is not what Megatron runs (`megatron_hdp.harness.cpu_training.HYBRID_CP_GROUPED`).

The tiny Llama-style GPT (Megatron-Core, HDP core attention) trains the same global batches — ByteScale's
long-tailed "byted" mix scaled down, clipped to --max-length, with --capacity so that several documents
need rings and static's CP group spans every rank (CP = max length / C) — under each policy, one after the
other in the same processes (`megatron_hdp.harness.cpu_training`, which documents the method). Step time
is that of a cluster with one core per rank: each rank's CPU seconds of each phase (a rank blocked in a
gloo wait uses none), composed through the plan's ring waits (`megatron_hdp.sim.replay`); wall time on
this host (ranks sharing its cores: the total work) next to it. The prediction is `simulate_step` with the
cost model fitted inside the run on this model and this CPU (in-sample), or with `--predict-from` the cost
model, all-reduce bandwidth and step overhead that an earlier run on another mix and seed fitted and
measured itself (its `in_run_fit`, whatever it planned with: out-of-sample; the in-run fit's error is
reported next to it). Medians over the reported steps go to
benchmarks/results/step_bench.json with the command, the date and the host's load.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.harness.cpu_training import CpuRunSpec, train_policies
from megatron_hdp.plan.cost_model import CostModel

RESULTS = Path(__file__).resolve().parent / "results" / "step_bench.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="gloo ranks (may exceed the cores: see the doc)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=256, help="C; max length / C = static's CP")
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--policies", default="balance,static,naive,megatron-hybrid-cp,megatron-hybrid-cp-grouped")
    parser.add_argument("--mix", default="byted", help="length mix (plan/lengths.py), scaled down by 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-repeats", type=int, default=2,
                        help="runs of each step; each phase keeps its fewest CPU seconds (as the fit)")
    parser.add_argument("--cost-model", default=None,
                        help="CostModel JSON (`megatron-hdp calibrate --output`) to plan and predict with instead of "
                             "the in-run fit, e.g. kernel timings calibrated on the model's shape")
    parser.add_argument("--predict-from", default=None,
                        help="a step_bench result JSON of another run: plan and predict with the cost model, "
                             "all-reduce bandwidth and step overhead it fitted itself (out-of-sample prediction)")
    parser.add_argument("--simulate-only", action="store_true",
                        help="no training: the simulator's breakdown of every policy on the batches of --mixes, "
                             "with the cost model, all-reduce bandwidth and step overhead of --predict-from")
    parser.add_argument("--mixes", default="byted,github", help="mixes of the simulated breakdown")
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


def simulated_breakdown(spec: CpuRunSpec, mixes: list[str], cost_model: CostModel, *, ranks: int, grad_bytes: int,
                        allreduce_bandwidth: float, step_overhead: float) -> dict[str, dict[str, dict]]:
    """Per mix and policy, medians over the steps' batches of the simulator's step time and where it goes:
    the busiest rank's compute (kernels + per-pass overhead g), its exposed ring time, the waits (rings,
    group barriers: step - busiest rank's work - all-reduce), passes per rank, the all-reduce. Megatron's
    Hybrid-CP with Megatron's rules (one pass per sub-sample, a barrier per group)."""
    from megatron_hdp.config import HDPConfig
    from megatron_hdp.harness.cpu_training import HYBRID_CP, global_batches, planner_policy
    from megatron_hdp.plan.planner import make_plan
    from megatron_hdp.sim.simulator import POLICY_RULES, PolicyRules, simulate_step

    config = HDPConfig(hdp=True, hdp_capacity=spec.capacity, hdp_offload=False)
    out: dict[str, dict[str, dict]] = {}
    for mix in mixes:
        batches = global_batches(dataclasses.replace(spec, mix=mix))[spec.warmup_steps:]
        out[mix] = {}
        for policy in spec.policies:
            rules = POLICY_RULES[HYBRID_CP] if policy == HYBRID_CP else PolicyRules()
            rows = []
            for lengths in batches:
                plan = make_plan(lengths, num_ranks=ranks, config=config, cost_model=cost_model,
                                 policy=planner_policy(policy))
                t = simulate_step(plan, cost_model, grad_bytes=grad_bytes, allreduce_bandwidth=allreduce_bandwidth,
                                  rules=rules)
                slowest = int(t.busy.argmax())
                passes = [sum(max(1, len(mb.shards)) if policy == HYBRID_CP else 1 for mb in r.microbatches)
                          for r in plan.ranks]
                rows.append({"step_time_s": t.step_time + step_overhead, "busiest_compute_s": float(t.compute[slowest]),
                             "busiest_ring_exposed_s": float(t.comm[slowest]),
                             "waits_s": t.compute_end - float(t.busy.max()), "allreduce_s": t.allreduce_time,
                             "passes_max": max(passes), "passes_total": sum(passes)})
            out[mix][policy] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return out


def format_breakdown(breakdown: dict[str, dict[str, dict]]) -> str:
    """The simulated breakdown, one block per mix, with balance's speedup over each policy."""
    lines = []
    for mix, policies in breakdown.items():
        balance = policies.get("balance", {}).get("step_time_s")
        lines.append(f"simulated, mix {mix}: {'policy':<26} {'step s':>8} {'compute':>8} {'ring':>7} {'waits':>7} "
                     f"{'allred':>7} {'passes':>7} {'balance x':>9}")
        for policy, b in policies.items():
            ratio = f"{b['step_time_s'] / balance:.2f}x" if balance else "-"
            lines.append(f"{'':<18}{policy:<26} {b['step_time_s']:>8.3f} {b['busiest_compute_s']:>8.3f} "
                         f"{b['busiest_ring_exposed_s']:>7.3f} {b['waits_s']:>7.3f} {b['allreduce_s']:>7.3f} "
                         f"{b['passes_max']:>7.0f} {ratio:>9}")
    return "\n".join(lines)


def summarize(rows: list[dict], policies: list[str]) -> dict[str, dict]:
    """Medians per policy over its reported steps: dedicated-core and wall step time, prediction and its
    error, balance, rings, ring bytes."""
    out = {}
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]

        def median(key: str) -> float:
            return statistics.median(r[key] for r in mine)

        out[policy] = {
            "step_time_s": median("step_time"),
            "wall_time_s": median("wall_time"),
            "max_busy_time_s": median("max_busy_time"),
            "predicted_time_s": median("predicted_time"),
            "prediction_error": statistics.median(
                (r["predicted_time"] - r["step_time"]) / r["step_time"] for r in mine
            ),
            "in_run_fit_prediction_error": statistics.median(
                (r["predicted_time_in_run_fit"] - r["step_time"]) / r["step_time"] for r in mine
            ),
            "planner_time_s": median("planner_time"),
            "balance": median("balance"),
            "microbatches_max": statistics.median(max(r["num_microbatches"]) for r in mine),
            "rings_per_step": median("num_rings"),
            "attention_mib_per_step": median("attention_bytes") / 2**20,
        }
    return out


def prediction_errors(rows: list[dict], key: str) -> dict:
    """|predicted - measured| / measured of every reported step of every policy: median and worst."""
    errors = [abs(r[key] - r["step_time"]) / r["step_time"] for r in rows]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors), "steps": len(errors)}


def format_table(summary: dict[str, dict]) -> str:
    """The results table, with the speedups of the dedicated-core step time over `static` and over
    Megatron's Hybrid-CP as Megatron runs it."""
    bases = {name: summary.get(name, {}).get("step_time_s") for name in ("static", "megatron-hybrid-cp")}
    header = (f"{'policy':<26} {'step s':>8} {'pred s':>8} {'pred err':>9} {'fit err':>8} {'wall s':>8} "
              f"{'busy s':>8} {'balance':>8} {'max mb':>7} {'rings':>6} {'attn MiB':>9} {'vs static':>10} "
              f"{'vs hcp':>7}")
    lines = [header, "-" * len(header)]
    for policy, s in summary.items():
        speedups = [f"{base / s['step_time_s']:.2f}x" if base else "-" for base in bases.values()]
        lines.append(
            f"{policy:<26} {s['step_time_s']:>8.3f} {s['predicted_time_s']:>8.3f} {s['prediction_error']:>+9.1%} "
            f"{s['in_run_fit_prediction_error']:>+8.1%} {s['wall_time_s']:>8.3f} {s['max_busy_time_s']:>8.3f} "
            f"{s['balance']:>8.2f} {s['microbatches_max']:>7.0f} {s['rings_per_step']:>6.1f} "
            f"{s['attention_mib_per_step']:>9.2f} {speedups[0]:>10} {speedups[1]:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    spec = CpuRunSpec(
        policies=tuple(policies), steps=args.steps, capacity=args.capacity, tokens_per_step=args.tokens_per_step,
        max_length=args.max_length, seed=args.seed, timing_repeats=args.timing_repeats, mix=args.mix,
    )
    cost_model = CostModel.from_json(args.cost_model).to_dict() if args.cost_model else None
    measured, fitted_on = None, None
    if args.predict_from:
        earlier = json.loads(Path(args.predict_from).read_text())
        if "in_run_fit" not in earlier:
            raise ValueError(f"--predict-from {args.predict_from} has no in_run_fit (written by an older step_bench)")
        # what that run fitted and measured itself, not what it planned with (itself maybe another run's)
        cost_model = CostModel.from_dict(earlier["in_run_fit"]["cost_model"]).to_dict()
        measured = {k: earlier["in_run_fit"][k] for k in ("allreduce_bandwidth", "step_overhead")}
        fitted_on = {"file": args.predict_from, "mix": earlier["spec"]["mix"], "seed": earlier["spec"]["seed"],
                     "date": earlier["date"]}
        if (fitted_on["mix"], fitted_on["seed"]) == (args.mix, args.seed) and not args.simulate_only:
            raise ValueError(f"--predict-from {args.predict_from} ran the same mix and seed ({args.mix}, {args.seed}): "
                             "that is not out of sample")
    if args.simulate_only:
        if not args.predict_from:
            raise ValueError("--simulate-only needs --predict-from (the run whose cost model to simulate with)")
        breakdown = simulated_breakdown(spec, [m.strip() for m in args.mixes.split(",")], CostModel.from_dict(cost_model),
                                        ranks=args.ranks, grad_bytes=earlier["grad_bytes"], **measured)
        print(format_breakdown(breakdown))
        record = {"command": "python benchmarks/step_bench.py " + " ".join(argv),
                  "date": datetime.datetime.now().isoformat(timespec="seconds"), "cost_model_from": fitted_on,
                  "cost_model": cost_model, **measured, "grad_bytes": earlier["grad_bytes"],
                  "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(spec).items()},
                  "simulated_breakdown": breakdown}
        Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.output}")
        return 0
    load_before = os.getloadavg()
    result = run_gloo(train_policies, args.ranks, spec, cost_model, measured, timeout_s=3600)[0]
    summary = summarize(result["rows"], policies)
    print(format_table(summary))
    prediction = {"in_sample": prediction_errors(result["rows"], "predicted_time_in_run_fit")}
    if fitted_on:
        prediction["out_of_sample"] = {"fitted_on": fitted_on, **prediction_errors(result["rows"], "predicted_time")}
    for name, errors in prediction.items():
        print(f"{name}: median |error| {errors['median_abs_error']:.1%}, worst {errors['worst_abs_error']:.1%} "
              f"over {errors['steps']} steps")
    record = {
        "command": "python benchmarks/step_bench.py " + " ".join(argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "ranks": args.ranks,
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(spec).items()},
        "planned_with": result["planned_with"],
        "in_run_fit": result["in_run_fit"],
        "prediction": prediction,
        "grad_bytes": result["grad_bytes"],
        "summary": summary,
        "rows": result["rows"],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
