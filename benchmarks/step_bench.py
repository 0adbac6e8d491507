"""HDP training step on gloo CPU ranks: step time and ring bytes of each policy on the same batches, and the
simulator's prediction next to the measurement.

    python benchmarks/step_bench.py                    # 8 ranks, C = 256: balance vs static vs megatron-hybrid-cp
    python benchmarks/step_bench.py --ranks 4 --capacity 512

The tiny Llama-style GPT (Megatron-Core, HDP core attention) trains the same global batches — ByteScale's
long-tailed "byted" mix scaled down, clipped to --max-length, with --capacity so that several documents
need rings and static's CP group spans every rank (CP = max length / C) — under each policy, one after the
other in the same processes (`megatron_hdp.megatron.cpu_training`, which documents the method). Step time
is that of a cluster with one core per rank: each rank's CPU seconds of each phase (a rank blocked in a
gloo wait uses none), composed through the plan's ring waits (`megatron_hdp.sim.replay`); wall time on
this host (ranks sharing its cores: the total work) next to it. The prediction is `simulate_step` with the
cost model fitted inside the run on this model and this CPU, and our runtime's rules for every policy.
Medians over the reported steps go to benchmarks/results/step_bench.json with the command and the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.megatron.cpu_training import CpuRunSpec, train_policies
from megatron_hdp.plan.cost_model import CostModel

RESULTS = Path(__file__).resolve().parent / "results" / "step_bench.json"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8, help="gloo ranks (may exceed the cores: see the doc)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--capacity", type=int, default=256, help="C; max length / C = static's CP")
    parser.add_argument("--tokens-per-step", type=int, default=8192)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--policies", default="balance,static,megatron-hybrid-cp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing-repeats", type=int, default=2,
                        help="runs of each step; each phase keeps its fewest CPU seconds (as the fit)")
    parser.add_argument("--cost-model", default=None,
                        help="CostModel JSON (`megatron-hdp calibrate --output`) to plan and predict with instead of "
                             "the in-run fit, e.g. kernel timings calibrated on the model's shape")
    parser.add_argument("--output", default=str(RESULTS))
    return parser.parse_args(argv)


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
            "planner_time_s": median("planner_time"),
            "balance": median("balance"),
            "microbatches_max": statistics.median(max(r["num_microbatches"]) for r in mine),
            "rings_per_step": median("num_rings"),
            "attention_mib_per_step": median("attention_bytes") / 2**20,
        }
    return out


def format_table(summary: dict[str, dict]) -> str:
    """The results table, with the speedup over `static` of the dedicated-core step time."""
    base = summary.get("static", {}).get("step_time_s")
    header = (f"{'policy':<20} {'step s':>8} {'pred s':>8} {'pred err':>9} {'wall s':>8} {'busy s':>8} "
              f"{'balance':>8} {'max mb':>7} {'rings':>6} {'attn MiB':>9} {'vs static':>10}")
    lines = [header, "-" * len(header)]
    for policy, s in summary.items():
        speedup = f"{base / s['step_time_s']:.2f}x" if base else "-"
        lines.append(
            f"{policy:<20} {s['step_time_s']:>8.3f} {s['predicted_time_s']:>8.3f} {s['prediction_error']:>+9.1%} "
            f"{s['wall_time_s']:>8.3f} {s['max_busy_time_s']:>8.3f} {s['balance']:>8.2f} "
            f"{s['microbatches_max']:>7.0f} {s['rings_per_step']:>6.1f} {s['attention_mib_per_step']:>9.2f} "
            f"{speedup:>10}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    spec = CpuRunSpec(
        policies=tuple(policies), steps=args.steps, capacity=args.capacity, tokens_per_step=args.tokens_per_step,
        max_length=args.max_length, seed=args.seed, timing_repeats=args.timing_repeats,
    )
    cost_model = CostModel.from_json(args.cost_model).to_dict() if args.cost_model else None
    result = run_gloo(train_policies, args.ranks, spec, cost_model, timeout_s=1800)[0]
    summary = summarize(result["rows"], policies)
    print(format_table(summary))
    record = {
        "command": "python benchmarks/step_bench.py " + " ".join(argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "ranks": args.ranks},
        "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(spec).items()},
        "cost_model": result["cost_model"],
        "grad_bytes": result["grad_bytes"],
        "allreduce_bandwidth": result["allreduce_bandwidth"],
        "step_overhead": result["step_overhead"],
        "summary": summary,
        "rows": result["rows"],
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
