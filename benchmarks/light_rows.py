"""What planning slow ring rows light gives balance's EP plans: every batch planned with and without it.

    python benchmarks/light_rows.py                       # Mixtral-8x7B, qwen3-30B-A3B (EP 8), DeepSeek-V3 (EP 32)
    python benchmarks/light_rows.py --ranks 1024 --seeds 2

`expert_units.place_units` (module doc, step 2) also plans the rows of rings of several units that outlast
a lane's mean work with their free lanes kept light, where the pool could spare them
(`expert_units.critical_rows`), and keeps the arrangement whose slowest unit is faster. Here each batch
is planned twice by `balance`, as it is and with `critical_rows` finding no row (every free lane filled,
as before the change), and the two timed steps are compared. Batches: 32M tokens at C = 16K (plan_bench's
feature cells), github and byted; Mixtral-8x7B and qwen3-30B-A3B at EP 8 on nodes of 8, DeepSeek-V3 at
TP 8 and EP 32. Writes benchmarks/results/light_rows.json (or --out) and prints a table per model and pool.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import finish  # noqa: E402

from megatron_hdp.config import HDPConfig  # noqa: E402
from megatron_hdp.plan.lengths import sample_global_batch  # noqa: E402
from megatron_hdp.plan.policies.balance import plan_balance  # noqa: E402
from megatron_hdp.plan.search import expert_units  # noqa: E402
from megatron_hdp.sim.cluster import ClusterSpec  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "light_rows.json"
MODELS = {"mixtral-8x7b": (1, 8), "qwen3-30b-a3b": (1, 8), "deepseek-v3": (8, 32)}  # model: (TP, EP)
CAPACITY = 16384


def step(lengths: list[int], cost_model, num_ranks: int, *, light: bool) -> float:
    """balance's timed step, with rows planned light where `critical_rows` finds them, or never."""
    found = expert_units.critical_rows
    if not light:
        expert_units.critical_rows = lambda *args, **kwargs: []
    try:
        return plan_balance(lengths, num_ranks=num_ranks, cost_model=cost_model,
                            config=HDPConfig(hdp=True, hdp_capacity=CAPACITY)).est_step_time
    finally:
        expert_units.critical_rows = found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ranks", default="512,896,1024,1376,2048,4096,8192,16384")
    parser.add_argument("--mixes", default="github,byted")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0 .. N-1 per cell")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    records = []
    for model in args.models.split(","):
        tp, ep = MODELS[model]
        for num_ranks in map(int, args.ranks.split(",")):
            if num_ranks % ep:
                continue
            spec = ClusterSpec(model, num_gpus=num_ranks * tp, tp_size=tp)
            cost = dataclasses.replace(spec.cost_model(), expert_parallel_size=ep,
                                       **({"ranks_per_node": 8} if tp == 1 else {}))
            for mix in args.mixes.split(","):
                for seed in range(args.seeds):
                    lengths = sample_global_batch(mix, num_tokens=32 * 2**20, seed=seed)
                    before, after = (step(lengths, cost, num_ranks, light=light) for light in (False, True))
                    records.append(dict(model=model, ranks=num_ranks, mix=mix, seed=seed, filled_s=before,
                                        light_s=after, change=after / before - 1))
                    print(f"{model} {num_ranks} {mix} seed {seed}: {before:.4f} -> {after:.4f} s "
                          f"({100 * (after / before - 1):+.2f}%)", flush=True)
    cells = collections.defaultdict(list)
    for r in records:
        cells[r["model"], r["ranks"]].append(r["change"])
    lines = ["| model | HDP ranks | batches | faster | slower | change: best / worst |",
             "|---|---:|---:|---:|---:|---|"]
    for (model, num_ranks), changes in cells.items():
        lines.append(f"| {model} | {num_ranks:,} | {len(changes)} | {sum(c < -1e-12 for c in changes)} | "
                     f"{sum(c > 1e-12 for c in changes)} | {100 * min(changes):+.2f}% / {100 * max(changes):+.2f}% |")
    finish("\n".join(lines), {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
                              "records": records}, args.out)


if __name__ == "__main__":
    main()
