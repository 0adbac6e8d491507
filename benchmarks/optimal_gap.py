"""How far `balance` is from the optimum, and the lower bound below it, on small seeded random batches.

    python benchmarks/optimal_gap.py [--cases 200] [--time-limit 30] [--max-ranks 8] [--max-docs 12]
                                     [--optimum-from JSON [--solve-unproven [SEED ...]]]
                                     [--out benchmarks/results/optimal_gap.json]

Each case draws 5-12 documents, 2-8 ranks, a capacity C of 512, 1,024 or 2,048 tokens and offloading on
or off (seeded by its index), lengths from 50 tokens to C with a third of the documents longer (up to
3 C, never more than the pool holds), with the analytic llama-7b / H100 cost model. Per case: balance's
predicted step time over the optimum of `plan.optimal` (the exact planner, a MILP that shares no
planning logic with balance) and the optimum over `bounds.step_time_lower_bound`, side by side: the
first says how good balance is, the second how far the bound (the only measuring stick at scale) sits
below the best plan; beside it the optimum over the exact planner's rigid-ring bound
(`policies.optimal_rigid`, an exact search only small pools afford), which says how much of that distance
is rings that must hold their ranks at once. A case the solver does not prove within --time-limit seconds is counted, not
used for the distribution; the solver's dual bound on it, or the rigid-ring bound where higher (a step
no plan beats), still caps balance's gap there. Prints each case as it is solved, then the distribution (median, p90, worst) and the worst cases.
`--optimum-from` takes the optima of an earlier run of the same cases and measures balance and the bound
anew, in seconds instead of the solver's minutes; with `--solve-unproven` the cases that run left
unproven (or only the seeds it names) are solved again with --time-limit (a longer limit for the few hard
ones).
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
from megatron_hdp.plan.policies.optimal import UnprovenOptimum, plan_optimal, ring_options  # noqa: E402
from megatron_hdp.plan.policies.milp import native_stdout_silenced  # noqa: E402
from megatron_hdp.plan.policies.optimal_rigid import rigid_ring_bound  # noqa: E402
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
    bounds = {"bound_s": step_time_lower_bound(spec["lengths"], num_ranks=spec["num_ranks"], capacity=spec["capacity"],
                                               cost_model=cost_model, max_offload_ratio=config.max_offload_ratio),
              "rigid_s": rigid_bound(spec, cost_model=cost_model, config=config, upper=balance)}
    if known is not None:
        bracket = {k: known[k] for k in ("dual_s", "incumbent_s") if k in known}
        return {**spec, "balance_s": balance, "optimum_s": known["optimum_s"], **bounds, **bracket,
                "balance_plan_ms": 1e3 * balance_s, "solve_s": known["solve_s"]}
    start = time.perf_counter()
    try:
        with native_stdout_silenced():  # HiGHS's stray debug line would land in the table
            optimum = plan_optimal(spec["lengths"], time_limit=time_limit, upper_bound=balance, **common).est_step_time
        bracket = {}
    except UnprovenOptimum as unproven:
        optimum = None
        bracket = {"dual_s": unproven.dual, "incumbent_s": unproven.best}
    return {**spec, "balance_s": balance, "optimum_s": optimum, **bounds, **bracket,
            "balance_plan_ms": 1e3 * balance_s, "solve_s": time.perf_counter() - start}


def rigid_bound(spec: dict, *, cost_model, config: HDPConfig, upper: float) -> float | None:
    """The exact planner's rigid-ring bound on case `spec` (`optimal_rigid`: rings that hold their ranks at
    once, an exact search of small pools), below `upper` (balance's step: a plan of the space), or None
    past its node budget: how much of the step-time lower bound's distance to the optimum is rings that
    must run side by side, which the bound at scale cannot search."""
    times = [{o.size: o.time for o in ring_options(s, num_ranks=spec["num_ranks"], capacity=spec["capacity"],
                                                   cost_model=cost_model, max_offload_ratio=config.max_offload_ratio)}
             for s in spec["lengths"]]
    found = rigid_ring_bound(spec["lengths"], times, capacity=spec["capacity"], overhead=cost_model.microbatch_time([]),
                             num_ranks=spec["num_ranks"], upper=upper * (1 + 1e-9))
    return None if found is None else found.bound


def tighter(solved: dict, earlier: dict) -> dict:
    """A case solved again (`solved`), still unproven, keeps the closer bracket of both solves: the higher
    dual bound, the better plan found."""
    if solved["optimum_s"] or "dual_s" not in earlier:
        return solved
    plans = [p for p in (solved["incumbent_s"], earlier["incumbent_s"]) if p is not None]
    return {**solved, "dual_s": max(solved["dual_s"], earlier["dual_s"]), "incumbent_s": min(plans, default=None)}


def dual(row: dict) -> float:
    """The highest bound proven on an unproven case's optimum: the solver's dual or the rigid-ring bound."""
    return max(row["dual_s"], row.get("rigid_s") or 0.0)


def table(rows: list[dict]) -> str:
    """One line per case: pool, batch, balance / optimum (of an unproven case, `<=` balance / the highest
    bound proven on it, `dual`), optimum / the step-time lower bound and / the rigid-ring bound, solver
    seconds."""
    lines = ["seed ranks     C offload docs  balance/opt  opt/bound  opt/rigid  solve s", "-" * 73]
    for r in rows:
        ratio = (f"{r['balance_s'] / r['optimum_s']:11.4f}" if r["optimum_s"]
                 else f"  <={r['balance_s'] / dual(r):7.4f}" if r.get("dual_s") else "   unproven")
        bound = f"{r['optimum_s'] / r['bound_s']:9.4f}" if r["optimum_s"] else "        -"
        rigid = f"{r['optimum_s'] / r['rigid_s']:9.4f}" if r["optimum_s"] and r["rigid_s"] else "        -"
        lines.append(f"{r['seed']:4d} {r['num_ranks']:5d} {r['capacity']:5d} {str(r['offload']):>7s} "
                     f"{len(r['lengths']):4d}  {ratio}  {bound}  {rigid}  {r['solve_s']:7.1f}")
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
    parser.add_argument("--solve-unproven", nargs="*", type=int, metavar="SEED",
                        help="with --optimum-from: solve again, with --time-limit, the cases it left unproven "
                             "(only these seeds when given)")
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
        if (args.solve_unproven is not None and known is not None and known["optimum_s"] is None
                and (not args.solve_unproven or seed in args.solve_unproven)):
            rows.append(tighter(measure(spec, time_limit=args.time_limit), known))  # a longer limit may prove it
        else:
            rows.append(measure(spec, time_limit=args.time_limit, known=known))
        print_new_rows(table, rows[-1:])
    solved = [r for r in rows if r["optimum_s"]]
    if not solved:
        raise SystemExit(f"no case proven within {args.time_limit:g} s: raise --time-limit or lower --max-ranks")
    gaps = np.array([r["balance_s"] / r["optimum_s"] for r in solved])
    bounds = np.array([r["optimum_s"] / r["bound_s"] for r in solved])
    rigid = np.array([r["optimum_s"] / r["rigid_s"] for r in solved if r["rigid_s"]])
    summary = {"cases": len(rows), "proven": len(solved), "balance_over_optimum": distribution(gaps),
               "optimum_over_bound": distribution(bounds), "optimum_over_rigid": distribution(rigid),
               "balance_within_1pct": float(np.mean(gaps <= 1.01)), "balance_within_5pct": float(np.mean(gaps <= 1.05))}
    bracketed = [r for r in rows if not r["optimum_s"] and r.get("dual_s")]
    if bracketed:  # balance / dual bound >= balance / optimum: a proven ceiling on the unproven cases' gaps
        ceilings = np.array([r["balance_s"] / dual(r) for r in bracketed])
        summary["unproven_balance_over_dual"] = {"cases": len(bracketed), "worst": float(ceilings.max()),
                                                 "within_5pct": float(np.mean(ceilings <= 1.05))}
    worst = sorted(solved, key=lambda r: -r["balance_s"] / r["optimum_s"])[:5]
    text = table(worst) + "\n\n" + "\n".join(
        f"{name}: median {d['median']:.4f}, p90 {d['p90']:.4f}, worst {d['worst']:.4f}"
        for name, d in (("balance / optimum", summary["balance_over_optimum"]),
                        ("optimum / lower bound", summary["optimum_over_bound"]),
                        ("optimum / rigid-ring bound", summary["optimum_over_rigid"])))
    if bracketed:
        text += (f"\nunproven, balance / the highest bound proven (at least balance / optimum): worst "
                 f"{ceilings.max():.4f}, {int(np.sum(ceilings <= 1.05))} of {len(bracketed)} within 5%")
    text += (f"\n{len(solved)} of {len(rows)} cases proven optimal "
             + (f"(optima from {args.optimum_from})" if args.optimum_from else f"within {args.time_limit:g} s"))
    finish("worst cases:\n" + text, {"command": " ".join(["python", "benchmarks/optimal_gap.py", *(argv or sys.argv[1:])]),
                                     "date": date.today().isoformat(), "summary": summary, "cases": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
