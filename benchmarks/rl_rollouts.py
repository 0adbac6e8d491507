"""RL rollouts in `megatron-hdp simulate`: HDP's balance against the RL frameworks' static CP and Megatron's
Dynamic-CP scheduler (issue 39), on the `rl-rollouts` mix.

    MEGATRON_LM_DIR=/tmp/mlm-dev python benchmarks/rl_rollouts.py [--steps 2] [--output results/rl_rollouts.json]

Cells: an 8B dense model (llama3-8b, TP 2) and a 30B-A3B MoE (qwen3-30b-a3b, TP 1, EP 8), on 64 and 256
H100s, at 32K and 128K maximum length (the response cap clips the mix), C from GPU memory as `simulate`
sets it. Each cell runs `sim.compare.compare_policies` (what `megatron-hdp simulate` prints) with the
policies `rl-static-cp` (`megatron_hdp/plan/policies/rl_static_cp.py`), `megatron-dynamic-cp` (needs
MEGATRON_LM_DIR, else its column says n/a) and `balance`, on the same sampled global batches. The table
gives tokens/s, balance's speedup over each, the work floor's over rl-static-cp (no schedule beats it:
the batch's compute spread over every GPU), and whether issue 39's targets (>= 1.6x over rl-static-cp,
>= 1.1x over Dynamic CP) hold.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
from pathlib import Path

import megatron_hdp.megatron  # noqa: F401  (registers megatron-dynamic-cp)
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies

from output import finish, print_new_rows

RESULTS = Path(__file__).resolve().parent / "results" / "rl_rollouts.json"
POLICIES = ("rl-static-cp", "megatron-dynamic-cp", "balance")
MODELS = {"llama3-8b": {"tp_size": 2, "ep_size": 1}, "qwen3-30b-a3b": {"tp_size": 1, "ep_size": 8}}
TARGETS = {"rl-static-cp": 1.6, "megatron-dynamic-cp": 1.1}


def run_cell(model: str, gpus: int, context: int, *, steps: int, seed: int, hardware: str) -> dict:
    """One cell: tokens/s of each policy and of the work floor, with the layout simulate used."""
    spec = ClusterSpec(model=model, num_gpus=gpus, hardware=hardware, **MODELS[model])
    comparison = compare_policies(spec, context=context, distribution="rl-rollouts", policies=POLICIES,
                                  steps=steps, seed=seed, progress=False)
    tps = {s.policy: (s.tokens_per_second if s.error is None else math.nan) for s in comparison.stats.values()}
    errors = {s.policy: s.error for s in comparison.stats.values() if s.error}
    return {"model": model, "gpus": gpus, "context": context, **MODELS[model], "hdp_ranks": spec.num_ranks,
            "capacity": spec.rank_capacity, "global_batch_tokens": comparison.global_batch_tokens,
            "tokens_per_second": tps, "work_floor_tokens_per_second": comparison.floor_tokens_per_second,
            "errors": errors, "stats": [vars(s) for s in comparison.stats.values()]}


def table(cells: list[dict]) -> str:
    """One row per cell: tokens/s, balance's speedups, the work floor's speedup over rl-static-cp."""
    lines = [f"{'model':<15}{'GPUs':>5}{'ctx':>6}{'ranks':>6}{'C':>7} {'rl-static-cp':>13}{'dyn-cp':>11}"
             f"{'balance':>11}  {'vs static-CP':>12}{'vs dyn-CP':>10}{'floor/static':>13}  targets", "-" * 124]
    for c in cells:
        tps = c["tokens_per_second"]
        ratios = {p: tps["balance"] / tps[p] for p in TARGETS}
        met = "/".join("n/a" if math.isnan(r) else ("yes" if r >= TARGETS[p] else "no") for p, r in ratios.items())
        cells_text = "".join(f"{tps[p]:>11,.0f}" if not math.isnan(tps[p]) else f"{'n/a':>11}" for p in POLICIES[1:])
        lines.append(f"{c['model']:<15}{c['gpus']:>5}{c['context'] // 1024:>5}K{c['hdp_ranks']:>6}{c['capacity']:>7} "
                     f"{tps['rl-static-cp']:>13,.0f}{cells_text}  {ratios['rl-static-cp']:>11.2f}x"
                     f"{ratios['megatron-dynamic-cp']:>9.2f}x{c['work_floor_tokens_per_second'] / tps['rl-static-cp']:>12.2f}x"
                     f"  {met}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="global batches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--contexts", default="32,128", help="maximum lengths in K tokens")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args(argv)
    cells = []
    for model in args.models.split(","):
        for gpus in map(int, args.gpus.split(",")):
            for context in (int(k) * 1024 for k in args.contexts.split(",")):
                cells.append(run_cell(model, gpus, context, steps=args.steps, seed=args.seed, hardware=args.hardware))
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
