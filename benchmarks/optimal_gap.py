"""How far `balance` is from the optimum, and the lower bound below it, on small seeded random batches.

    python benchmarks/optimal_gap.py [--cases 200] [--time-limit 30] [--max-ranks 8] [--max-docs 12] [--optimum-from JSON [--solve-unproven]]
                                     [--out benchmarks/results/optimal_gap.json]

Each case draws 5-12 documents, 2-8 ranks, a capacity C of 512, 1,024 or 2,048 tokens and offloading on
or off (seeded by its index), lengths from 50 tokens to C with a third of the documents longer (up to
3 C, never more than the pool holds), with the analytic llama-7b / H100 cost model. Per case: balance's
predicted step time over the optimum of `plan.optimal` (the exact planner, a MILP that shares no
planning logic with balance) and the optimum over `bounds.step_time_lower_bound`, side by side: the
first says how good balance is, the second how far the bound (the only measuring stick at scale) sits
below the best plan. A case the solver does not prove within --time-limit seconds is counted, not
used. Prints each case as it is solved, then the distribution (median, p90, worst) and the worst cases.
`--optimum-from` takes the optima of an earlier run of the same cases and measures balance and the bound
anew, in seconds instead of the solver's minutes; with `--solve-unproven` the cases that run left
unproven are solved again with --time-limit (a longer limit for the few hard ones).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import finish, print_new_rows  # noqa: E402

from megatron_hdp.config import HDPConfig  # noqa: E402
from megatron_hdp.plan.timeline.bounds import step_time_lower_bound  # noqa: E402
from megatron_hdp.plan.policies.optimal import plan_optimal  # noqa: E402
from megatron_hdp.plan.planner import make_plan  # noqa: E402
from megatron_hdp.plan.cost.presets import analytic_cost_model  # noqa: E402

CAPACITIES = (512, 1024, 2048)
SPEC_KEYS = ("seed", "num_ranks", "capacity", "offload", "lengths")
"""What identifies a case in a result file (`case`'s keys)."""


def case(seed: int, *, max_ranks: int = 8, max_docs: int = 12) -> dict:
    """The batch and pool of case `seed` (module doc; at most `max_ranks` ranks and `max_docs` documents)."""
    rng = np.random.default_rng(seed)
    num_ranks = int(rng.integers(2, max_ranks + 1))
    capacity = int(rng.choice(CAPACITIES))
    offload = bool(rng.integers(0, 2))
    num_docs = int(rng.integers(5, max_docs + 1))
    longest = min(3 * capacity, num_ranks * capacity)
    lengths = [int(rng.integers(capacity + 1, longest + 1)) if rng.random() < 1 / 3 else int(rng.integers(50, capacity + 1))
               for _ in range(num_docs)]
    return {"seed": seed, "num_ranks": num_ranks, "capacity": capacity, "offload": offload, "lengths": lengths}


def measure(spec: dict, *, time_limit: float, known: dict | None = None) -> dict:
    """balance, optimum and lower bound of one case (optimum None when not proven in time); `known`, an
    earlier result of the same case, supplies the optimum (and its solve time) instead of the solver."""
    cost_model = analytic_cost_model("llama-7b")
    config = HDPConfig(hdp_capacity=spec["capacity"], hdp_offload=spec["offload"])
    common = dict(num_ranks=spec["num_ranks"], config=config, cost_model=cost_model)
    start = time.perf_counter()
    balance = make_plan(spec["lengths"], policy="balance", **common).est_step_time
    balance_s = time.perf_counter() - start
    bound = step_time_lower_bound(spec["lengths"], num_ranks=spec["num_ranks"], capacity=spec["capacity"],
                                  cost_model=cost_model, max_offload_ratio=config.max_offload_ratio)
    if known is not None:
        return {**spec, "balance_s": balance, "optimum_s": known["optimum_s"], "bound_s": bound,
                "balance_plan_ms": 1e3 * balance_s, "solve_s": known["solve_s"]}
    start = time.perf_counter()
    try:
        optimum = plan_optimal(spec["lengths"], time_limit=time_limit, upper_bound=balance, **common).est_step_time
    except ValueError:
        optimum = None
    return {**spec, "balance_s": balance, "optimum_s": optimum, "bound_s": bound,
            "balance_plan_ms": 1e3 * balance_s, "solve_s": time.perf_counter() - start}


def table(rows: list[dict]) -> str:
    """One line per case: pool, batch, balance / optimum, optimum / bound, solver seconds."""
    lines = ["seed ranks     C offload docs  balance/opt  opt/bound  solve s", "-" * 62]
    for r in rows:
        ratio = f"{r['balance_s'] / r['optimum_s']:11.4f}" if r["optimum_s"] else "   unproven"
        bound = f"{r['optimum_s'] / r['bound_s']:9.4f}" if r["optimum_s"] else "        -"
        lines.append(f"{r['seed']:4d} {r['num_ranks']:5d} {r['capacity']:5d} {str(r['offload']):>7s} "
                     f"{len(r['lengths']):4d}  {ratio}  {bound}  {r['solve_s']:7.1f}")
    return "\n".join(lines)


def distribution(values: np.ndarray) -> dict:
    """Median, p90 and worst of ratios."""
    return {"median": float(np.median(values)), "p90": float(np.quantile(values, 0.9)), "worst": float(values.max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--time-limit", type=float, default=30.0, help="solver seconds per case")
    parser.add_argument("--max-ranks", type=int, default=8, help="largest pool drawn (2 to this)")
    parser.add_argument("--max-docs", type=int, default=12, help="most documents drawn (5 to this)")
    parser.add_argument("--optimum-from", metavar="JSON",
                        help="an earlier result: its optima (proven or not) for the same cases, balance and the "
                             "bound measured anew (after a change to balance or the bound; the optimum is fixed)")
    parser.add_argument("--solve-unproven", action="store_true",
                        help="with --optimum-from: solve again, with --time-limit, the cases it left unproven")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "optimal_gap.json"))
    args = parser.parse_args(argv)
    earlier = {}
    if args.optimum_from:
        earlier = {tuple(sorted((k, str(v)) for k, v in c.items() if k in SPEC_KEYS)): c
                   for c in json.loads(Path(args.optimum_from).read_text())["cases"]}
    rows = []
    for seed in range(args.cases):
        spec = case(seed, max_ranks=args.max_ranks, max_docs=args.max_docs)
        known = earlier.get(tuple(sorted((k, str(v)) for k, v in spec.items())))
        if args.optimum_from and known is None:
            raise SystemExit(f"case {seed} is not in {args.optimum_from}: run it with the same --max-ranks/--max-docs")
        if args.solve_unproven and known is not None and known["optimum_s"] is None:
            known = None  # a longer --time-limit than the earlier run's may prove it
        rows.append(measure(spec, time_limit=args.time_limit, known=known))
        print_new_rows(table, rows[-1:])
    solved = [r for r in rows if r["optimum_s"]]
    if not solved:
        raise SystemExit(f"no case proven within {args.time_limit:g} s: raise --time-limit or lower --max-ranks")
    gaps = np.array([r["balance_s"] / r["optimum_s"] for r in solved])
    bounds = np.array([r["optimum_s"] / r["bound_s"] for r in solved])
    summary = {"cases": len(rows), "proven": len(solved), "balance_over_optimum": distribution(gaps),
               "optimum_over_bound": distribution(bounds),
               "balance_within_1pct": float(np.mean(gaps <= 1.01)), "balance_within_5pct": float(np.mean(gaps <= 1.05))}
    worst = sorted(solved, key=lambda r: -r["balance_s"] / r["optimum_s"])[:5]
    text = table(worst) + "\n\n" + "\n".join(
        f"{name}: median {d['median']:.4f}, p90 {d['p90']:.4f}, worst {d['worst']:.4f}"
        for name, d in (("balance / optimum", summary["balance_over_optimum"]),
                        ("optimum / lower bound", summary["optimum_over_bound"])))
    text += (f"\n{len(solved)} of {len(rows)} cases proven optimal "
             + (f"(optima from {args.optimum_from})" if args.optimum_from else f"within {args.time_limit:g} s"))
    finish("worst cases:\n" + text, {"command": " ".join(["python", "benchmarks/optimal_gap.py", *(argv or sys.argv[1:])]),
                                     "date": date.today().isoformat(), "summary": summary, "cases": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
