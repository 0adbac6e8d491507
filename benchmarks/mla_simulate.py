"""DeepSeek-V3 under HDP on the simulator: static CP (K/V ring), balance with K/V rings, balance with latent rings.

    python benchmarks/mla_simulate.py                         # 2,048 H100s, TP 8, EP 32, 128K..1M, byted + github
    python benchmarks/mla_simulate.py --gpus 4096 --contexts 1M --steps 1

Multi-latent attention lets every split document run a K/V ring (K and V circulate, what TE's CP does)
or a latent ring (the 576-wide latent and RoPE key circulate and every member up-projects them,
`attention/latent_ring.py`). Per context length, the same sampled global batches are planned and
simulated with the ring kind forced each way (`CostModel.ring_kind`): static DP x CP with K/V rings
(Megatron's mesh with TE's ring), balance with K/V rings, balance with latent rings (and static with
latent rings, for reference), and both floors (the work floor; the critical-path floor, which depends on
the ring kind through the longest document's fastest crossing). Issue 34's target: balance with latent
rings at least 1.3x faster than balance with K/V rings wherever K/V rings are traffic-bound; each row
says how traffic-bound the K/V plan's rings are (`kv_traffic`: the share of its ring calls whose K/V
traffic exceeds their attention, and the share of its ring time that traffic leaves exposed), and how
traffic-bound the rings that balance takes with latent rings would be as K/V rings. Writes
benchmarks/results/mla_simulate.json (with the command and the date) and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import finish  # noqa: E402

from megatron_hdp.plan.cost.model import CostModel  # noqa: E402
from megatron_hdp.plan.step_plan import StepPlan  # noqa: E402
from megatron_hdp.sim.cluster import ClusterSpec, format_tokens  # noqa: E402
from megatron_hdp.sim.compare import compare_policies  # noqa: E402
from megatron_hdp.commands.arguments import parse_count  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "mla_simulate.json"
TARGET = 1.3
"""Issue 34: balance with latent rings over balance with K/V rings, where K/V rings are traffic-bound."""


def kv_traffic(plan: StepPlan, cost: CostModel) -> dict:
    """How traffic-bound a plan's K/V rings are: per ring call (the sequences on one ring in one
    micro-batch, timed at its first member), whether its K/V traffic exceeds its attention, and the share
    of all ring calls' overlapped time (max(attention, traffic)) that traffic leaves exposed."""
    calls: dict[tuple[int, tuple[int, ...]], list[float]] = {}
    for schedule in plan.ranks:
        for index, mb in enumerate(schedule.microbatches):
            for shard in mb.shards:
                seq = plan.sequences[shard.seq]
                if len(seq.ring) > 1 and seq.ring[0] == schedule.rank:
                    call = calls.setdefault((index, seq.ring), [0.0, 0.0])
                    call[0] += shard.num_tokens
                    call[1] += cost.a1 * seq.length * shard.num_tokens
    bound = exposed = overlapped = 0.0
    for (_, ring), (tokens, attention) in calls.items():
        traffic = cost.layer_ring_comm_time(num_tokens=tokens, ring_size=len(ring),
                                            bandwidth=cost.ring_link_bandwidth(ring), kind="kv")
        bound += traffic > attention
        exposed += max(0.0, traffic - attention)
        overlapped += max(traffic, attention)
    return {"ring_calls": len(calls), "traffic_bound_calls": int(bound),
            "exposed_share": exposed / overlapped if overlapped else 0.0}


def run_context(spec: ClusterSpec, *, context: int, distribution: str, steps: int, seed: int) -> dict:
    """One context length: static and balance with each ring kind forced, both floors."""
    started = time.perf_counter()
    by_kind = {}
    for kind in ("kv", "latent"):
        result = compare_policies(replace(spec, ring_kind=kind), context=context, distribution=distribution,
                                  policies=("static", "balance"), steps=steps, seed=seed, progress=False)
        by_kind[kind] = result
    kv, latent = by_kind["kv"], by_kind["latent"]
    tps = {f"{policy}-{kind}": by_kind[kind].stats[policy].tokens_per_second
           for kind in by_kind for policy in ("static", "balance")}
    cell = {
        "context": context,
        "distribution": distribution,
        "tokens_per_second": tps,
        "latent_over_kv_balance": tps["balance-latent"] / tps["balance-kv"],
        "work_floor": kv.floor_tokens_per_second,
        "critical_path_floor": {kind: r.critical_path_floor_tokens_per_second for kind, r in by_kind.items()},
        "kv_traffic": kv_traffic(kv.plans["balance"], spec.cost_model()),
        "kv_traffic_static": kv_traffic(kv.plans["static"], spec.cost_model()),
        # the rings balance chooses with latent rings, timed as K/V rings: traffic-bound there, which is
        # why balance with K/V rings takes fewer ranks per document (and offloads) instead
        "kv_traffic_of_latent_rings": kv_traffic(latent.plans["balance"], spec.cost_model()),
        "runs": {kind: r.to_dict() for kind, r in by_kind.items()},
        "wall_seconds": time.perf_counter() - started,
    }
    return cell


def table(cells: list[dict]) -> str:
    header = ("| mix | context | static K/V | balance K/V | balance latent | latent / K/V | static latent | work floor "
              "| crit. floor K/V | crit. floor latent | K/V plan: calls traffic-bound | exposed "
              "| latent plan's rings as K/V: traffic-bound | exposed |")
    lines = [header, "|---" * (header.count("|") - 1) + "|"]
    for c in cells:
        t, traffic, other = c["tokens_per_second"], c["kv_traffic"], c["kv_traffic_of_latent_rings"]
        lines.append(
            f"| {c['distribution']} | {format_tokens(c['context'])} | {t['static-kv']:,.0f} | {t['balance-kv']:,.0f} | "
            f"{t['balance-latent']:,.0f} | {c['latent_over_kv_balance']:.2f}x | {t['static-latent']:,.0f} | "
            f"{c['work_floor']:,.0f} | {c['critical_path_floor']['kv']:,.0f} | "
            f"{c['critical_path_floor']['latent']:,.0f} | "
            f"{traffic['traffic_bound_calls']}/{traffic['ring_calls']} | {traffic['exposed_share']:.0%} | "
            f"{other['traffic_bound_calls']}/{other['ring_calls']} | {other['exposed_share']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--gpus", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=32)
    parser.add_argument("--hardware", default="h100")
    parser.add_argument("--contexts", default="128K,256K,512K,1M", help="comma-separated context lengths")
    parser.add_argument("--dists", default="byted,github", help="comma-separated length mixes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    spec = ClusterSpec(args.model, num_gpus=args.gpus, tp_size=args.tp, ep_size=args.ep, hardware=args.hardware)
    grid = [(dist, parse_count(c)) for dist in args.dists.split(",") for c in args.contexts.split(",")]
    cells = []
    for dist, context in tqdm(grid, desc="cells", unit="cell"):
        cells.append(run_context(spec, context=context, distribution=dist, steps=args.steps, seed=args.seed))
    result = {
        "command": "python benchmarks/mla_simulate.py " + " ".join(argv),
        "date": datetime.date.today().isoformat(),
        "setup": {"model": args.model, "gpus": args.gpus, "tp": args.tp, "ep": args.ep, "hardware": args.hardware,
                  "num_ranks": spec.num_ranks, "capacity": spec.rank_capacity, "distributions": args.dists.split(","),
                  "steps": args.steps, "seed": args.seed},
        "target_latent_over_kv_balance": TARGET,
        "cells": cells,
    }
    finish(table(cells), result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
