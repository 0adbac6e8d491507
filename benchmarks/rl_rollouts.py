"""RL rollouts in `megatron-hdp simulate`: HDP's balance against the RL frameworks' static CP and Megatron's
Dynamic-CP scheduler (issue 39), on the `rl-rollouts` mix.

    MEGATRON_LM_DIR=/tmp/mlm-dev python benchmarks/rl_rollouts.py [--steps 2] [--output results/rl_rollouts.json]
    python benchmarks/rl_rollouts.py --combine-step-runs RUN1.json ... --output results/step_bench_rl_rollouts.json

Cells (`LAYOUTS`): an 8B dense model (llama3-8b, TP 2 and TP 1) and a 30B-A3B MoE (qwen3-30b-a3b, TP 1,
EP 8), on 64 and 256 H100s, at 32K and 128K maximum length (the response cap clips the mix), C from GPU memory as `simulate`
sets it. Each cell runs `sim.compare.compare_policies` (what `megatron-hdp simulate` prints) with the
policies `rl-static-cp` (`megatron_hdp/plan/policies/rl_static_cp.py`), `megatron-dynamic-cp` (needs
MEGATRON_LM_DIR, else its column says n/a) and `balance`, on the same sampled global batches. The table
gives tokens/s, balance's speedup over each, the work floor's over each (no schedule beats it: the
batch's compute spread over every GPU), balance's share of the floor, and whether issue 39's targets
(>= 1.6x over rl-static-cp, >= 1.1x over Dynamic CP) hold: "yes", "no", or "floor" where the floor itself
is under the target, so that no schedule could meet it in that cell.

`--combine-step-runs` gathers `step_bench.py --mix rl-rollouts --policies balance,rl-static-cp` runs (one
file each, so that each survives a shared host's slowness) into one result: per run the measured speedup of
balance over rl-static-cp (median step times) and the prediction's, and step_bench's per-step speedup
errors (`step_bench.judge_prediction`), then medians and ranges over the runs (`step_bench.over_runs`) and
the median of the runs' measured and predicted speedups (`speedup_medians`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import megatron_hdp.megatron  # noqa: F401  (registers megatron-dynamic-cp)
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies

from output import finish, print_new_rows

RESULTS = Path(__file__).resolve().parent / "results" / "rl_rollouts.json"
POLICIES = ("rl-static-cp", "megatron-dynamic-cp", "balance")
LAYOUTS = (("llama3-8b", {"tp_size": 2, "ep_size": 1}), ("llama3-8b", {"tp_size": 1, "ep_size": 1}),
           ("qwen3-30b-a3b", {"tp_size": 1, "ep_size": 8}))
"""(model, parallel layout) pairs: the 8B at both TP sizes an 8B RL run uses (TP 1 leaves a GPU fewer
tokens, C, so the frameworks' static CP grows), the MoE at EP 8."""
TARGETS = {"rl-static-cp": 1.6, "megatron-dynamic-cp": 1.1}


def run_cell(model: str, layout: dict, gpus: int, context: int, *, steps: int, seed: int, hardware: str) -> dict:
    """One cell: tokens/s of each policy and of the work floor, with the layout simulate used."""
    spec = ClusterSpec(model=model, num_gpus=gpus, hardware=hardware, **layout)
    comparison = compare_policies(spec, context=context, distribution="rl-rollouts", policies=POLICIES,
                                  steps=steps, seed=seed, progress=False)
    tps = {s.policy: (s.tokens_per_second if s.error is None else math.nan) for s in comparison.stats.values()}
    errors = {s.policy: s.error for s in comparison.stats.values() if s.error}
    return {"model": model, "gpus": gpus, "context": context, **layout, "hdp_ranks": spec.num_ranks,
            "capacity": spec.rank_capacity, "global_batch_tokens": comparison.global_batch_tokens,
            "tokens_per_second": tps, "work_floor_tokens_per_second": comparison.floor_tokens_per_second,
            "errors": errors, "stats": [vars(s) for s in comparison.stats.values()]}


def judge(balance_speedup: float, floor_speedup: float, target: float) -> str:
    """'yes' when balance meets `target` over a baseline; else 'no', or 'floor' when not even the work floor
    is `target` over it (no schedule could meet it); 'n/a' without the baseline."""
    if math.isnan(balance_speedup):
        return "n/a"
    return "yes" if balance_speedup >= target else ("floor" if floor_speedup < target else "no")


def table(cells: list[dict]) -> str:
    """One row per cell: tokens/s, balance's speedups, the work floor's over each baseline, the targets."""
    lines = [f"{'model':<15}{'TP':>3}{'GPUs':>5}{'ctx':>6}{'ranks':>6}{'C':>7} {'rl-static-cp':>13}{'dyn-cp':>11}"
             f"{'balance':>11}  {'vs static-CP':>12}{'vs dyn-CP':>10}{'floor/static':>13}{'floor/dyn':>10}"
             f"{'of floor':>9}  targets", "-" * 146]
    for c in cells:
        tps, floor = c["tokens_per_second"], c["work_floor_tokens_per_second"]
        ratios = {p: tps["balance"] / tps[p] for p in TARGETS}
        met = "/".join(judge(r, floor / tps[p], TARGETS[p]) for p, r in ratios.items())
        cells_text = "".join(f"{tps[p]:>11,.0f}" if not math.isnan(tps[p]) else f"{'n/a':>11}" for p in POLICIES[1:])
        lines.append(f"{c['model']:<15}{c['tp_size']:>3}{c['gpus']:>5}{c['context'] // 1024:>5}K{c['hdp_ranks']:>6}"
                     f"{c['capacity']:>7} {tps['rl-static-cp']:>13,.0f}{cells_text}  {ratios['rl-static-cp']:>11.2f}x"
                     f"{ratios['megatron-dynamic-cp']:>9.2f}x{floor / tps['rl-static-cp']:>12.2f}x"
                     f"{floor / tps['megatron-dynamic-cp']:>9.2f}x{tps['balance'] / floor:>9.1%}  {met}")
    return "\n".join(lines)


def combine_step_runs(paths: list[str], output: str) -> dict:
    """The step_bench runs in `paths` as one result (module doc); prints a row per run and the medians."""
    import step_bench

    runs, first = [], None
    for path in paths:
        record = json.loads(Path(path).read_text())
        first = first or record
        for run in record["runs"]:
            run["file"] = path
            run["prediction"] = step_bench.judge_prediction(run["rows"], out_of_sample=bool(record["cost_model_from"]))
            runs.append(run)
    print(f"{'run':<34}{'balance s':>10}{'static-CP s':>12}{'measured':>9}{'predicted':>10}{'error':>8}"
          f"{'per-step |error| median':>25}")
    for run in runs:
        s = run["summary"]
        measured = s["rl-static-cp"]["step_time_s"] / s["balance"]["step_time_s"]
        predicted = s["rl-static-cp"]["predicted_time_s"] / s["balance"]["predicted_time_s"]
        sample = "out_of_sample" if "out_of_sample" in run["prediction"] else "in_sample"
        per_step = run["prediction"][sample]["speedup_over_rl-static-cp"]["median_abs_error"]
        run["speedup"] = {"measured": measured, "predicted": predicted, "sample": sample}
        print(f"{Path(run['file']).name:<34}{s['balance']['step_time_s']:>10.3f}{s['rl-static-cp']['step_time_s']:>12.3f}"
              f"{measured:>8.2f}x{predicted:>9.2f}x{predicted / measured - 1:>+8.1%}{per_step:>25.1%}")
    combined = step_bench.over_runs(runs)
    medians = {key: statistics.median(run["speedup"][key] for run in runs) for key in ("measured", "predicted")}
    combined["speedup_medians"] = {**medians, "error": medians["predicted"] / medians["measured"] - 1}
    print(f"median of the runs' speedups: measured {medians['measured']:.2f}x, predicted {medians['predicted']:.2f}x "
          f"({combined['speedup_medians']['error']:+.1%})")
    print(f"over {len(runs)} runs, median [range]:")
    for policy, figures in combined["summary"].items():
        print(f"  {policy:<14} step s {step_bench.repeats.format_spread(figures['step_time_s'], '{:.3f}')}")
    print(step_bench.format_prediction(combined["prediction"]))
    result = {"command": "python benchmarks/rl_rollouts.py --combine-step-runs " + " ".join(paths),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "files": paths,
              "runs_command": first["command"], "spec": first["spec"], "cost_model_from": first["cost_model_from"],
              **combined, "runs": runs}
    Path(output).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {output}")
    return result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="global batches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--contexts", default="32,128", help="maximum lengths in K tokens")
    parser.add_argument("--models", default=",".join(dict(LAYOUTS)), help="models of `LAYOUTS` to run")
    parser.add_argument("--combine-step-runs", nargs="+", default=None, metavar="RUN.json",
                        help="gather step_bench runs of balance and rl-static-cp (module doc) instead of simulating")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.combine_step_runs:
        combine_step_runs(args.combine_step_runs, args.output)
        return 0
    cells = []
    for model, layout in (entry for entry in LAYOUTS if entry[0] in args.models.split(",")):
        for gpus in map(int, args.gpus.split(",")):
            for context in (int(k) * 1024 for k in args.contexts.split(",")):
                cells.append(run_cell(model, layout, gpus, context, steps=args.steps, seed=args.seed,
                                      hardware=args.hardware))
                if len(cells) == 1:
                    print("\n".join(table(cells).splitlines()[:2]))
                print_new_rows(table, cells[-1:])
    result = {"command": "python benchmarks/rl_rollouts.py " + " ".join(argv),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "hardware": args.hardware,
              "steps": args.steps, "seed": args.seed, "targets": TARGETS, "cells": cells}
    finish(table(cells), result, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
