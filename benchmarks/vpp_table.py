"""Issue 23's table re-run with virtual pipeline stages: llama-70b on 16,384 GPUs (TP 8, PP 4), 2M context.

    python benchmarks/vpp_table.py                       # VPP 1, 2, 4, 5, 10; github and byted; 2 steps (~20 min)
    python benchmarks/vpp_table.py --vpp 1,5 --steps 1 --no-readme
    python benchmarks/vpp_table.py --render              # rewrite the README table from the saved JSON
    python benchmarks/vpp_table.py --model mixtral-8x22b --ep 8 --vpp 1,2,7 --no-readme --out moe.json

Each VPP runs `compare_policies` (the `megatron-hdp simulate` path: sampled batches, `make_plan`, the
step simulator) with every pipeline stage split into that many model chunks (Megatron's interleaved
schedule, `plan/timeline/interleaved.py`). The global batch is fixed at 4 x 16K x 512 tokens, the VPP 1 default,
so every row plans the same batches; C follows each VPP's activation memory
(`ClusterSpec.memory_capacity`). Each row also gives both floors of `compare_policies`: the work floor
(the batch's compute over every GPU) and the critical-path floor (that, or the longest document's fastest
crossing of the 4 stages when longer, `plan.timeline.bounds.fastest_crossing`), the second being the one a
schedule could reach. Writes benchmarks/results/vpp_table.json (with the command and the date) and the
table between the vpp_table markers of benchmarks/README.md. `--model` and `--ep` run another model (a
MoE one with its experts over EP ranks, whose HDP ranks the MoE all-to-all couples in every micro-batch:
`ClusterSpec.ep_size`) on the same cluster.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

from tqdm import tqdm

from megatron_hdp.plan.cost.presets import model_shape
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import compare_policies

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "vpp_table.json"
README = HERE / "README.md"
BEGIN, END = "<!-- vpp_table:begin -->", "<!-- vpp_table:end -->"

MODEL, GPUS, TP, PP, CONTEXT = "llama-70b", 16384, 8, 4, 2 * 1024 * 1024
GLOBAL_BATCH = 4 * 16384 * (GPUS // (TP * PP))
DISTRIBUTIONS = ("github", "byted")
POLICIES = ("static", "balance")
TARGETS = {"github": 3.6, "byted": 3.4}
"""Issue 23's done-when: balance with the best VPP over static, or within 15% of the (work) floor."""
FLOOR_MARGIN = 0.15


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vpp", default="1,2,4,5,10", help="comma-separated virtual stages per pipeline stage")
    parser.add_argument("--model", default=MODEL, help="model preset (plan/cost/presets.py MODELS)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (a MoE --model)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated policies")
    parser.add_argument("--steps", type=int, default=2, help="sampled global batches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-readme", action="store_true", help="do not rewrite benchmarks/README.md")
    parser.add_argument("--out", default=str(RESULTS), help="result JSON")
    parser.add_argument("--render", action="store_true", help=f"simulate nothing: rebuild the README from {RESULTS.name}")
    return parser.parse_args(argv)


def run_cells(vpps: list[int], policies: list[str], *, steps: int, seed: int, model: str = MODEL,
              ep_size: int = 1) -> list[dict]:
    """Every (mix, VPP) cell: the compare_policies result as a dict."""
    cells = []
    for dist, vpp in tqdm([(d, v) for d in DISTRIBUTIONS for v in vpps], desc="vpp table", unit="cell"):
        spec = ClusterSpec(model, num_gpus=GPUS, tp_size=TP, pp_size=PP, vpp_size=vpp, ep_size=ep_size)
        started = time.perf_counter()
        result = compare_policies(spec, context=CONTEXT, distribution=dist, global_batch_tokens=GLOBAL_BATCH,
                                  policies=policies, steps=steps, seed=seed, progress=False)
        cell = result.to_dict()
        cell["wall_seconds"] = time.perf_counter() - started
        cells.append(cell)
    return cells


def markdown(cells: list[dict]) -> str:
    """One row per (mix, VPP); speedups over static at the same VPP and over static at VPP 1."""
    policies = [p for p in cells[0]["policies"] if p != "static"]
    head = ("| mix | VPP | C | static tokens/s | " + " | ".join(f"{p} (x static, x static VPP 1)" for p in policies)
            + " | work floor (x static VPP 1) | critical-path floor (x static VPP 1) | balance / work floor "
              "| balance / critical-path floor | balance idle | of which bubble |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for cell in cells:
        setup, stats = cell["setup"], cell["policies"]
        base = _static_vpp1(cells, setup["distribution"])
        entries = []
        for p in policies:
            s = stats[p]
            entries.append("n/a" if s["error"] else
                           f"{s['speedup']:.2f}x, **{s['tokens_per_second'] / base:.2f}x**")
        balance = stats["balance"]
        rows.append(f"| {setup['distribution']} | {setup['vpp_size']} | {setup['capacity'] // 1024}K | "
                    f"{stats['static']['tokens_per_second']:,.0f} | " + " | ".join(entries) + " | "
                    f"{cell['floor_tokens_per_second'] / base:.2f}x | "
                    f"{cell['critical_path_floor_tokens_per_second'] / base:.2f}x | "
                    f"{balance['tokens_per_second'] / cell['floor_tokens_per_second']:.0%} | "
                    f"{balance['tokens_per_second'] / cell['critical_path_floor_tokens_per_second']:.0%} | "
                    f"{balance['idle_fraction']:.0%} | {balance['bubble_fraction']:.0%} |")
    return "\n".join(rows)


def _static_vpp1(cells: list[dict], dist: str) -> float:
    """Static's tokens/s at VPP 1 for `dist`: the baseline of issue 23's target."""
    return next(c for c in cells if c["setup"]["distribution"] == dist
                and c["setup"]["vpp_size"] == 1)["policies"]["static"]["tokens_per_second"]


def verdict(cells: list[dict]) -> str:
    """Issue 23's done-when per mix, with the best VPP, against both floors; and what bounds each step."""
    lines = []
    for dist in DISTRIBUTIONS:
        mine = [c for c in cells if c["setup"]["distribution"] == dist]
        base = _static_vpp1(cells, dist)
        best = max(mine, key=lambda c: c["policies"]["balance"]["tokens_per_second"])
        tps = best["policies"]["balance"]["tokens_per_second"]
        work, critical = best["floor_tokens_per_second"], best["critical_path_floor_tokens_per_second"]
        met = tps / base >= TARGETS[dist] or tps / work >= 1 - FLOOR_MARGIN
        steps = "; ".join(f"step {i + 1}: {f['crossing_s']:.2f} s on a ring of {f['crossing_ring_size']} against "
                          f"{f['work_s']:.2f} s of work" for i, f in enumerate(best["floor_steps"]))
        lines.append(f"- {dist}: best VPP {best['setup']['vpp_size']}, balance {tps / base:.2f}x static VPP 1 "
                     f"({best['policies']['balance']['speedup']:.2f}x static at that VPP): {tps / work:.0%} of the "
                     f"work floor ({work / base:.2f}x), {tps / critical:.0%} of the critical-path floor "
                     f"({critical / base:.2f}x). Target {TARGETS[dist]}x or >= {1 - FLOOR_MARGIN:.0%} of the work "
                     f"floor: {'met' if met else 'not met'}; {TARGETS[dist]}x is "
                     f"{'within' if critical / base >= TARGETS[dist] else 'beyond'} the critical-path floor. "
                     f"The longest document's fastest crossing per step: {steps}.")
    return "\n".join(lines)


def render(data: dict) -> str:
    return (f"_Generated by `{data['command']}` on {data['date']}._\n\n{markdown(data['cells'])}\n\n"
            f"{verdict(data['cells'])}\n")


def write_readme(section: str) -> None:
    """Replace the text between the vpp_table markers of benchmarks/README.md."""
    text = README.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{README} has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    README.write_text(head + BEGIN + "\n" + section + END + tail)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.render:
        data = json.loads(RESULTS.read_text())
    else:
        vpps = [int(v) for v in args.vpp.split(",")]
        if 1 not in vpps:
            raise SystemExit("--vpp must include 1 (the speedups are also given over static at VPP 1)")
        if args.ep > 1 and not model_shape(args.model).num_experts:
            raise SystemExit(f"--ep {args.ep} needs a MoE --model; {args.model} has no experts")
        cells = run_cells(vpps, args.policies.split(","), steps=args.steps, seed=args.seed, model=args.model,
                          ep_size=args.ep)
        # the critical-path floor in tokens/s per mix (the key the earlier crossing_bound function filled)
        crossing = {dist: next(c for c in cells if c["setup"]["distribution"] == dist)[
            "critical_path_floor_tokens_per_second"] for dist in DISTRIBUTIONS}
        data = {"command": " ".join(["python benchmarks/vpp_table.py", *argv]), "date": datetime.date.today().isoformat(),
                "machine": platform.platform(), "cells": cells, "crossing_bound": crossing}
        out.write_text(json.dumps(data, indent=2) + "\n")
    section = render(data)
    print(section)
    if not args.no_readme:
        write_readme(section)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
