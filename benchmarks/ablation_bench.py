"""ByteScale's ablation on the simulator: static -> + dynamic communication -> + selective offload -> + balance.

    python benchmarks/ablation_bench.py                              # llama-7b, 1,024 GPUs, 2M, byted and github
    python benchmarks/ablation_bench.py --ring-bandwidths 50e9,12.5e9 --steps 2
    python benchmarks/ablation_bench.py --model mixtral-8x7b --ep 8 --out mixtral_ep8.json

ByteScale (arXiv 2502.21231) adds its techniques one at a time on LLaMA-7B, 1,024 GPUs, 2M context and
reports the speedup over the static mesh after each (as issue 23 quotes them: dynamic communication
1.59x, + selective offload 2.01x, + balance 3.69x, + remote data loader 3.89x). Each step here is a
policy planned on the same sampled batches and timed by the same simulator (`sim.compare.compare_policies`):

- static: Megatron's DP x CP mesh (`static`);
- + dynamic communication: ByteScale's naive HDP, Algorithm 1 (`naive`: D(s) = ceil(s / C), no offload,
  token-balanced placement);
- + selective offload: the same placement on Eq. 3 sharding (`naive-offload`);
- + balance: our balance scheduler with offload (`balance`);
- (+ remote data loader: not modelled; the simulator charges no data loading to any policy.)

One row more, `balance` without offload, separates what offload adds once placement is compute-aware.
`--model` and `--ep` run the ablation on another model on the same 1,024 GPUs (a MoE one with its experts
over EP ranks, whose HDP ranks the MoE all-to-all couples in every micro-batch: `ClusterSpec.ep_size`); the
published column is LLaMA-7B's.
Writes benchmarks/results/ablation_bench.json (command, date, every number) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

from megatron_hdp.plan.cost.presets import model_shape
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies
from output import finish, print_new_rows

HERE = Path(__file__).resolve().parent
CONTEXT = 2048 * 1024

STEPS = (
    ("static", "static", True),
    ("+ dynamic communication", "naive", True),
    ("+ selective offload", "naive-offload", True),
    ("+ balance", "balance", True),
    ("(balance without offload)", "balance", False),
)
"""(ablation step, policy, offload allowed)."""

PUBLISHED = {"static": 1.0, "+ dynamic communication": 1.59, "+ selective offload": 2.01, "+ balance": 3.69,
             "+ remote data loader": 3.89}
"""ByteScale's cumulative speedups over static, LLaMA-7B / 1,024 GPUs / 2M, as issue 23 quotes them (the
paper's figure could not be read from this workplace, so which mix they belong to is not recorded)."""


def run_mix(mix: str, *, ring_bandwidth: float | None, steps: int, seed: int, model: str = "llama-7b",
            ep_size: int = 1) -> dict:
    """Every ablation step on `steps` batches of `mix`, same batches for all (same seed)."""
    spec = ClusterSpec(model, num_gpus=1024, tp_size=8, ring_bandwidth=ring_bandwidth, ep_size=ep_size)
    results: dict[str, dict] = {}
    for offload in (True, False):
        policies = sorted({"static"} | {policy for _, policy, allowed in STEPS if allowed == offload})
        comparison = compare_policies(spec, context=CONTEXT, distribution=mix, policies=policies,
                                      steps=steps, seed=seed, offload=offload, progress=False)
        for step, policy, allowed in STEPS:
            if allowed != offload:
                continue
            stats = comparison.stats[policy]
            results[step] = {"policy": policy, "offload": offload, "speedup": stats.speedup,
                             "tokens_per_second": stats.tokens_per_second, "step_s": stats.step_time,
                             "idle": stats.idle_fraction, "exposed_comm": stats.comm_fraction,
                             "balance": stats.balance, "ring_gb_per_gpu": stats.attention_gb_per_rank,
                             "error": stats.error}
        floor = comparison.floor_speedup
    return {"mix": mix, "ring_bandwidth": spec.cost_model().ring_bandwidth, "capacity": spec.rank_capacity,
            "num_ranks": spec.num_ranks, "steps": results, "compute_floor_speedup": floor}


def table(runs: list[dict]) -> str:
    lines = ["| mix | ring link GB/s | step | policy | speedup (ours) | published | step s | idle | ring GB/GPU |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for run in runs:
        gbps = f"{run['ring_bandwidth'] / 1e9:g}"
        for step, row in run["steps"].items():
            if row["error"]:
                lines.append(f"| {run['mix']} | {gbps} | {step} | {row['policy']} | n/a: {row['error']} | | | | |")
                continue
            published = f"{PUBLISHED[step]:.2f}x" if step in PUBLISHED else "-"
            lines.append(f"| {run['mix']} | {gbps} | {step} | {row['policy']} | {row['speedup']:.2f}x | {published} | "
                         f"{row['step_s']:.1f} | {row['idle']:.0%} | {row['ring_gb_per_gpu']:,.0f} |")
        lines.append(f"| {run['mix']} | {gbps} | + remote data loader | (not modelled) | - | "
                     f"{PUBLISHED['+ remote data loader']:.2f}x | | | |")
        lines.append(f"| {run['mix']} | {gbps} | compute floor | - | {run['compute_floor_speedup']:.2f}x | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", default="byted,github")
    parser.add_argument("--ring-bandwidths", default="default",
                        help="comma list of bytes/s of a ring link ('default': the H100 preset's 50e9)")
    parser.add_argument("--steps", type=int, default=2, help="sampled global batches per mix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="llama-7b", help="model preset (plan/cost/presets.py MODELS)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (a MoE --model)")
    parser.add_argument("--out", default=str(HERE / "results" / "ablation_bench.json"))
    args = parser.parse_args(argv)
    if args.ep > 1 and not model_shape(args.model).num_experts:
        parser.error(f"--ep {args.ep} needs a MoE --model; {args.model} has no experts")
    started = time.perf_counter()
    bandwidths = [None if b == "default" else float(b) for b in args.ring_bandwidths.split(",")]
    runs = []
    for bandwidth in bandwidths:
        for mix in args.mixes.split(","):
            runs.append(run_mix(mix, ring_bandwidth=bandwidth, steps=args.steps, seed=args.seed, model=args.model,
                                ep_size=args.ep))
            print_new_rows(table, runs[-1:])
    result = {
        "benchmark": "ablation_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/ablation_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "setup": {"model": args.model, "gpus": 1024, "tp": 8, "pp": 1, "ep": args.ep, "context": CONTEXT, "steps": args.steps,
                  "seed": args.seed, "python": platform.python_version()},
        "published": PUBLISHED,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    finish(table(runs), result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
