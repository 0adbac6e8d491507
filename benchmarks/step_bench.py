"""HDP training step on gloo CPU ranks: step time and ring bytes of each policy on the same batches, and the
simulator's prediction next to the measurement.

    python benchmarks/step_bench.py                    # 8 ranks, C = 256, byted mix: every policy
    python benchmarks/step_bench.py --mix github --seed 1 --predict-from benchmarks/results/step_bench.json \
        --output benchmarks/results/step_bench_github.json  # out-of-sample: the byted run's fit predicts github
    python benchmarks/step_bench.py --experts 4 --ep 2 --policies balance,balance-ep-unaware,static \
        --output benchmarks/results/step_bench_moe_ep2.json          # MoE at EP 2 (then --predict-from it)

Policies: balance, static, naive (ours), megatron-hybrid-cp — Megatron's Hybrid-CP scheduler executed the
way Megatron executes it (one forward/backward pass per sub-sample, <= C tokens per rank per pass, a
barrier over all ranks after each group) — and megatron-hybrid-cp-grouped, ours: Megatron's grouping run
through our runtime as one micro-batch per group and rank (several times C tokens per pass, no barrier),
which is not what Megatron runs (`megatron_hdp.harness.cpu_training.HYBRID_CP_GROUPED`). `rl-static-cp`
is the RL frameworks' static CP (`megatron_hdp/plan/policies/rl_static_cp.py`; with `--mix rl-rollouts`).

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
reported next to it). Each step's prediction is scaled by the host's speed at that step against its
speed at the fit (a probe timed beside both, `cpu_fit.measure_speed_probe`): the fit and the steps
are timed at different moments of a shared host.

With `--experts N --ep E` the model is a tiny Mixtral-style MoE (N experts a layer, top-2 routing, the
experts of each layer over E ranks, whose all-to-all couples every micro-batch of an EP group), and the
policy `balance-ep-unaware` is balance planned as if every rank ran alone (the runtime then pads its EP
groups and they wait at every index), beside `balance` (EP groups planned as units) and static: speedups
are also given over it. The fit then measures this MoE model on this EP mesh, its predictions couple the
EP groups as the runtime does (`megatron_hdp.sim.replay` replays the measured phases the same way), and
it measures which share of the per-token work the all-to-all spreads over an EP group
(`CostModel.expert_share`, `cpu_fit.expert_share`) and the all-to-all's own rate on gloo
(`cpu_fit.measure_alltoall`, the cost model's all-to-all term); every row is also predicted by the
fit's twin that folds the all-to-all into b1 and the expert share as before issue 41
(`predicted_time_without_alltoall`, judged as "..._without_alltoall"): what the term changes.

The prediction is judged on what the simulator claims, ratios: per step, the predicted speedup of each
policy over static and over Megatron's Hybrid-CP against the measured one (`speedup_errors`), the
absolute step-time errors beside them. `--repeat N` runs the whole measurement (fit, then the policies
taking turns step by step, each of a step's `--timing-repeats` rounds in a random order) N times and
reports each figure as the median and range over the runs; with `--predict-from` a file of N runs, run i
predicts with run i's fit. The JSON keeps every run (its rows,
fit, load average) with the command and the date.
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
from megatron_hdp.harness.cpu_training import EP_UNAWARE, CpuRunSpec, policy_cost_model, train_policies
from megatron_hdp.plan.cost.model import CostModel

import repeats

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
    parser.add_argument("--hidden-size", type=int, default=64, help="the tiny model's hidden size")
    parser.add_argument("--ffn-hidden-size", type=int, default=128, help="its MLP (each expert's) hidden size")
    parser.add_argument("--experts", type=int, default=0,
                        help="MoE experts per layer (a tiny Mixtral-style model, top-2 routing); 0: dense")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel size (with --experts): the ranks of an EP group run every micro-batch "
                             f"together; add {EP_UNAWARE} to --policies for balance planned without EP")
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
    repeats.add_repeat_argument(parser)
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
    cost_model = dataclasses.replace(cost_model, expert_parallel_size=spec.ep_size)  # as the runtime couples
    out: dict[str, dict[str, dict]] = {}
    for mix in mixes:
        batches = global_batches(dataclasses.replace(spec, mix=mix))[spec.warmup_steps:]
        out[mix] = {}
        for policy in spec.policies:
            rules = POLICY_RULES[HYBRID_CP] if policy == HYBRID_CP else PolicyRules()
            rows = []
            for lengths in batches:
                plan = make_plan(lengths, num_ranks=ranks, config=config,
                                 cost_model=policy_cost_model(policy, cost_model, ep_size=spec.ep_size),
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


BASES = ("static", "megatron-hybrid-cp", EP_UNAWARE, "rl-static-cp")
"""The policies speedups are given over (those a run has): the static mesh, Megatron's Hybrid-CP as
Megatron runs it, with expert parallelism `balance` planned without it, and the RL frameworks' static CP."""


def speedup_errors(rows: list[dict], key: str, base: str) -> dict:
    """Per step and policy (other than `base`): the predicted speedup over `base` on the same batch
    (predicted `base` time / predicted policy time, `key` the prediction) against the measured one,
    |predicted / measured - 1|: median over steps and worst, and every step's pair of speedups."""
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], {})[r["policy"]] = r
    pairs = []
    for step, policies in sorted(by_step.items()):
        if base not in policies:
            continue
        for policy, r in policies.items():
            if policy != base:
                measured = policies[base]["step_time"] / r["step_time"]
                predicted = policies[base][key] / r[key]
                pairs.append({"step": step, "policy": policy, "measured": measured, "predicted": predicted})
    if not pairs:
        return {}
    errors = [abs(p["predicted"] / p["measured"] - 1) for p in pairs]
    return {"median_abs_error": statistics.median(errors), "worst_abs_error": max(errors), "steps": len(errors),
            "speedups": pairs}


def judge_prediction(rows: list[dict], out_of_sample: bool) -> dict:
    """In sample (this run's fit) and, when predicted from another run, out of sample: the speedup errors
    over static and over Megatron's Hybrid-CP, and the absolute step-time errors beside them; scaled by the
    speed probe, and the absolute errors unscaled (what the fit alone predicts: the drift). With MoE, the
    same for the predicting fit's twin without the all-to-all term ("..._without_alltoall": before issue 41)."""
    keys = {"in_sample": "predicted_time_in_run_fit"}
    if out_of_sample:
        keys["out_of_sample"] = "predicted_time"
    if all(r.get("predicted_time_without_alltoall") is not None for r in rows):
        keys[f"{'out_of' if out_of_sample else 'in'}_sample_without_alltoall"] = "predicted_time_without_alltoall"
    out = {}
    for name, key in keys.items():
        speed = "speed_factor_in_run" if key == "predicted_time_in_run_fit" else "speed_factor"
        unscaled = [{**r, key: r[key] / r[speed]} for r in rows]
        out[name] = {"step_time": prediction_errors(rows, key),
                     "step_time_unscaled": prediction_errors(unscaled, key),
                     **{f"speedup_over_{base}": speedup_errors(rows, key, base)
                        for base in BASES}}
    return out


def over_runs(runs: list[dict]) -> dict:
    """Each summary figure and each prediction figure of the runs as median and range (`repeats.spread`)."""
    summary = {policy: {k: repeats.spread([r["summary"][policy][k] for r in runs]) for k in runs[0]["summary"][policy]}
               for policy in runs[0]["summary"]}
    for policy in summary:  # the speedups, per run, of each policy over the two bases
        for base in BASES:
            if base in runs[0]["summary"]:
                summary[policy][f"speedup_over_{base}"] = repeats.spread(
                    [r["summary"][base]["step_time_s"] / r["summary"][policy]["step_time_s"] for r in runs])
    prediction = {}
    for name in runs[0]["prediction"]:
        prediction[name] = {}
        for figure, errors in runs[0]["prediction"][name].items():
            if errors:
                prediction[name][figure] = {k: repeats.spread([r["prediction"][name][figure][k] for r in runs])
                                            for k in ("median_abs_error", "worst_abs_error")}
    return {"summary": summary, "prediction": prediction}


def format_spread(label: str, figure: dict, unit: str = "%") -> str:
    """`label median [min, max]` of one figure over the runs, as a percentage, a speedup (x) or seconds (s)."""
    return f"{label} {repeats.format_spread(figure, {'%': '{:.1%}', 'x': '{:.2f}x', 's': '{:.3f}'}[unit])}"


def format_prediction(prediction: dict) -> str:
    """One line per sample and figure: the median and the worst step's |error|, of one run or (from
    `over_runs`) as median [range] over the runs."""
    lines = []
    for name, figures in prediction.items():
        for figure, errors in figures.items():
            if not errors:
                continue
            median, worst = errors["median_abs_error"], errors["worst_abs_error"]
            if isinstance(median, dict):
                lines.append(f"{name} {figure}: {format_spread('median |error|', median)}, "
                             f"{format_spread('worst step', worst)}")
            else:
                lines.append(f"{name} {figure}: median |error| {median:.1%}, worst step {worst:.1%} "
                             f"over {errors['steps']} steps")
    return "\n".join(lines)


def format_table(summary: dict[str, dict]) -> str:
    """The results table, with the speedups of the dedicated-core step time over `static`, over Megatron's
    Hybrid-CP as Megatron runs it, over EP-unaware balance and over the RL frameworks' static CP ("-"
    where the run has no such policy)."""
    bases = {name: summary.get(name, {}).get("step_time_s") for name in BASES}
    header = (f"{'policy':<26} {'step s':>8} {'pred s':>8} {'pred err':>9} {'fit err':>8} {'wall s':>8} "
              f"{'busy s':>8} {'balance':>8} {'max mb':>7} {'rings':>6} {'attn MiB':>9} {'vs static':>10} "
              f"{'vs hcp':>7} {'vs ep-unaware':>14} {'vs rl-static-cp':>15}")
    lines = [header, "-" * len(header)]
    for policy, s in summary.items():
        speedups = [f"{base / s['step_time_s']:.2f}x" if base else "-" for base in bases.values()]
        lines.append(
            f"{policy:<26} {s['step_time_s']:>8.3f} {s['predicted_time_s']:>8.3f} {s['prediction_error']:>+9.1%} "
            f"{s['in_run_fit_prediction_error']:>+8.1%} {s['wall_time_s']:>8.3f} {s['max_busy_time_s']:>8.3f} "
            f"{s['balance']:>8.2f} {s['microbatches_max']:>7.0f} {s['rings_per_step']:>6.1f} "
            f"{s['attention_mib_per_step']:>9.2f} {speedups[0]:>10} {speedups[1]:>7} {speedups[2]:>14} {speedups[3]:>15}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    spec = CpuRunSpec(
        policies=tuple(policies), steps=args.steps, capacity=args.capacity, tokens_per_step=args.tokens_per_step,
        max_length=args.max_length, seed=args.seed, timing_repeats=args.timing_repeats, mix=args.mix,
        num_experts=args.experts, ep_size=args.ep, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
    )
    cost_model = CostModel.from_json(args.cost_model).to_dict() if args.cost_model else None
    measured, fitted_on = None, None
    if args.predict_from:
        earlier = json.loads(Path(args.predict_from).read_text())
        if "in_run_fit" not in earlier:
            raise ValueError(f"--predict-from {args.predict_from} has no in_run_fit (written by an older step_bench)")
        # what that run fitted and measured itself, not what it planned with (itself maybe another run's)
        fits = [run["in_run_fit"] for run in earlier.get("runs", [earlier])]
        cost_model = CostModel.from_dict(fits[0]["cost_model"]).to_dict()
        measured = {k: fits[0][k] for k in ("allreduce_bandwidth", "step_overhead")}
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
    runs = []
    for index in range(args.repeat):
        if fitted_on:  # run i predicts with the earlier file's run i (its fit and its speed probe)
            fit = fits[index % len(fits)]
            cost_model = CostModel.from_dict(fit["cost_model"]).to_dict()
            measured = {k: fit[k] for k in ("allreduce_bandwidth", "step_overhead", "speed_probe", "ring_probe",
                                            "cost_model_without_alltoall") if k in fit}
        load_before = os.getloadavg()
        result = run_gloo(train_policies, args.ranks, spec, cost_model, measured, timeout_s=3600)[0]
        summary = summarize(result["rows"], policies)
        prediction = judge_prediction(result["rows"], out_of_sample=bool(fitted_on))
        print(f"run {index + 1} of {args.repeat} (load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})")
        print(format_table(summary))
        print(format_prediction(prediction))
        runs.append({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                     "load_average_before": load_before, "load_average_after": os.getloadavg(),
                     "fitted_on_run": index % len(fits) if fitted_on else None,
                     "planned_with": result["planned_with"], "in_run_fit": result["in_run_fit"],
                     "prediction": prediction, "summary": summary, "rows": result["rows"]})
    combined = over_runs(runs)
    if args.repeat > 1:
        print(f"over {args.repeat} runs: median [range]")
        for policy, s in combined["summary"].items():
            parts = [format_spread("step s", s["step_time_s"], unit="s")]
            parts += [format_spread(f"vs {base}", s[f"speedup_over_{base}"], unit="x")
                      for base in BASES if f"speedup_over_{base}" in s]
            print(f"  {policy:<26} " + ", ".join(parts))
        print(format_prediction(combined["prediction"]))
    record = {
        "command": "python benchmarks/step_bench.py " + " ".join(argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "ranks": args.ranks},
        "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(spec).items()},
        "cost_model_from": fitted_on,
        "in_run_fit": runs[0]["in_run_fit"],
        "grad_bytes": result["grad_bytes"],
        **combined,
        "runs": runs,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
