"""balance's EP plans against the EP-unit bound (`plan/timeline/ep_unit_bound.py`) and the work floor.

    python benchmarks/ep_unit_bound.py                        # DeepSeek-V3, 2,048 GPUs, TP 8, EP 32, 128K
    python benchmarks/ep_unit_bound.py --dists github --seeds 0

The batches are `simulate`'s (`megatron-hdp simulate --model deepseek-v3 --gpus 2048 --tp 8 --ep 32
--context 128K --steps 2`: seeds 0 and 1, 4 C-token micro-batches a rank). Each is planned by balance
(`make_plan`, timed by the cost model's timeline) and bounded by `ep_unit_bound`, which holds for every
plan whose rings of at most e ranks lie inside one EP group (its module doc says which plans, and why);
balance's plans are such plans. Columns: the work floor, the bound, balance's step, balance's share of each
(floor / step, bound / step), the bound's column-generation rounds and seconds. Writes
benchmarks/results/ep_unit_bound.json with the command and the date.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_cell import cell_batches, parse_cell_arguments  # noqa: E402
from output import finish  # noqa: E402

from megatron_hdp.config import HDPConfig  # noqa: E402
from megatron_hdp.plan.planner import make_plan  # noqa: E402
from megatron_hdp.plan.timeline.ep_unit_bound import ep_unit_bound, in_bound_class  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ep_unit_bound.json"


def table(records: list[dict]) -> str:
    lines = ["| mix | seed | work floor s | EP-unit bound s | balance step s | of the floor | of the bound | rounds "
             "| s |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['dist']} | {r['seed']} | {r['floor_s']:.4f} | {r['bound_s']:.4f} | {r['step_s']:.4f} | "
                     f"{r['floor_s'] / r['step_s']:.2%} | {r['bound_s'] / r['step_s']:.2%} | {r['rounds']} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_cell_arguments(__doc__.splitlines()[0], RESULTS)
    records = []
    for dist, seed, lengths, cost, capacity, ranks in cell_batches(args):
        plan = make_plan(lengths, num_ranks=ranks, config=HDPConfig(hdp_capacity=capacity), cost_model=cost,
                         policy="balance")
        if not in_bound_class(plan, ep_size=args.ep):
            raise SystemExit(f"{dist} seed {seed}: balance's plan is outside the bound's plans")
        start = time.process_time()
        bound = ep_unit_bound(lengths, cost, num_ranks=ranks, capacity=capacity,
                              progress=lambda r, lp, least, most: print(
                                  f"  round {r}: LP {lp:.2f} lane-s (at most {most:.4f} s), r* {least:.4f}",
                                  flush=True))
        records.append({"dist": dist, "seed": seed, "floor_s": bound.work_floor, "bound_s": bound.seconds,
                        "step_s": plan.est_step_time, "lp_lane_s": bound.lp, "least_reduced": bound.least_reduced,
                        "rounds": bound.rounds, "seconds": time.process_time() - start,
                        "tokens": int(np.sum(lengths))})
        print(table(records[-1:]).splitlines()[-1], flush=True)
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "model": args.model,
              "gpus": args.gpus, "tp": args.tp, "ep": args.ep, "capacity": capacity, "records": records}
    finish(table(records), result, args.out)


if __name__ == "__main__":
    main()
