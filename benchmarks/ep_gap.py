"""Where balance's EP-unit plan loses against the work floor: its step split into what the floor leaves out.

    python benchmarks/ep_gap.py                                   # DeepSeek-V3, 2,048 GPUs, TP 8, EP 32
    python benchmarks/ep_gap.py --dists github --seeds 0 1 2 3

Under expert parallelism (`search/expert_units.py`) every EP group of e ranks runs its micro-batch indices
as rows: a row lasts its slowest lane apart from the routed expert work, plus that work's mean over the
lanes, plus the all-to-all of its fullest lane (`experts.spread_grid`), and a unit's step is the sum of its
rows. The work floor (`sim.compare.compute_floor`) holds each document's whole time and each token's own
all-to-all, spread evenly. So, per rank, step - floor is exactly the sum of

- ring inflation: what a document's ring members do beyond its whole time (ring traffic their attention
  does not hide, ring latency), each member timed on its own zigzag share, summed over split documents;
- overheads: every lane's micro-batch overhead at every index (empty ones included);
- compute row loss: per row, the lanes' time below the row's slowest lane (apart from the expert work),
  for rows holding lane rings and for rows of whole sequences;
- all-to-all row loss: per row, the transfers every lane waits for beyond its own (the fullest lane's);
- unit imbalance: the slowest unit's rows against the mean unit's;
- the rest (rings of several units coupling units at one index), which should be ~0.

Also printed: the ring traffic's exposure threshold, i.e. the fewest tokens a ring member must hold for
its attention to hide the ring's transfers (`sharding.member_time` against the whole time, per document
length), against the capacity C. Where it is above C, every ring within capacity pays ring traffic and
every ring member above C makes its row's all-to-all wait (benchmarks/README.md, issue 41, round 3).
Writes benchmarks/results/ep_gap.json with the command and the date.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_cell import cell_batches, parse_cell_arguments  # noqa: E402
from output import finish  # noqa: E402

from megatron_hdp.config import HDPConfig  # noqa: E402
from megatron_hdp.plan.cost.model import CostModel  # noqa: E402
from megatron_hdp.plan.cost.sharding import member_time, shard_time, whole_times  # noqa: E402
from megatron_hdp.plan.planner import make_plan  # noqa: E402
from megatron_hdp.plan.step_plan import StepPlan  # noqa: E402
from megatron_hdp.plan.zigzag import zigzag_token_counts  # noqa: E402
from megatron_hdp.sim.compare import step_floors  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "ep_gap.json"
PARTS = ("inflation", "overheads", "ring_rows", "whole_rows", "alltoall", "units", "rest")
THRESHOLD_LENGTHS = (24_000, 40_000, 60_000, 80_000, 100_000, 131_072)


def decompose(plan: StepPlan, lengths: np.ndarray, cost: CostModel, floor: float) -> dict:
    """step - floor of an EP plan without PP, per rank, split into `PARTS` (module docstring)."""
    ranks, e = plan.num_ranks, cost.expert_parallel_size
    expert, alltoall = cost.expert_seconds_per_token(pp_size=1), cost.expert_alltoall_seconds_per_token()
    overhead = cost.microbatch_time([], pp_size=1)
    split = [seq for seq in plan.sequences if len(seq.ring) > 1]
    parts = dict.fromkeys(PARTS, 0.0)
    parts["inflation"] = sum(shard_time(cost, seq_len=s.length, num_tokens=int(t), ring_size=len(s.ring))
                             for s in split for t in zigzag_token_counts(s.length, len(s.ring)))
    parts["inflation"] -= float(whole_times([s.length for s in split], cost_model=cost).sum())
    units = []
    for unit in range(ranks // e):
        lanes = [plan.ranks[r].microbatches for r in range(unit * e, (unit + 1) * e)]
        total = 0.0
        for index in range(max(map(len, lanes))):
            mbs = [mb[index] if index < len(mb) else None for mb in lanes]
            tokens = np.array([mb.num_tokens if mb else 0 for mb in mbs], dtype=np.float64)
            own = np.array([mb.est_time if mb else overhead for mb in mbs]) - expert * tokens
            rings = any(len(plan.sequences[sh.seq].ring) > 1 for mb in mbs if mb for sh in mb.shards)
            parts["ring_rows" if rings else "whole_rows"] += e * own.max() - own.sum()
            parts["alltoall"] += alltoall * (e * tokens.max() - tokens.sum())
            parts["overheads"] += e * overhead
            total += own.max() + expert * tokens.mean() + alltoall * tokens.max()
        units.append(total)
    parts = {name: value / ranks for name, value in parts.items()}
    parts["units"] = max(units) - float(np.mean(units))
    parts["rest"] = plan.est_step_time - floor - sum(parts.values())
    return parts


def exposure_threshold(cost: CostModel, length: int) -> int:
    """The fewest tokens a member of a ring of this document can hold with its ring traffic hidden: the
    member tokens at the largest ring size below the first whose members' summed time exceeds the whole
    time by more than 0.1%."""
    whole = float(whole_times([length], cost_model=cost)[0])
    for size in range(2, length // 2 + 1):
        if size * member_time(length, size, cost_model=cost) > 1.001 * whole:
            return -(-length // (size - 1))
    return 1


def main() -> None:
    args = parse_cell_arguments(__doc__.splitlines()[0], RESULTS)
    records = []
    for dist, seed, lengths, cost, capacity, ranks in cell_batches(args):
        floor = step_floors(lengths, cost, num_ranks=ranks, pp_size=1)["work_s"]
        plan = make_plan(lengths, num_ranks=ranks, config=HDPConfig(hdp_capacity=capacity), cost_model=cost,
                         policy="balance")
        records.append({"dist": dist, "seed": seed, "floor_s": floor, "step_s": plan.est_step_time,
                        "of_work_floor": floor / plan.est_step_time,
                        **decompose(plan, lengths, cost, floor)})
        print(f"{dist} seed {seed}: {floor / plan.est_step_time:.2%} of the work floor", flush=True)
    thresholds = {length: exposure_threshold(cost, length) for length in THRESHOLD_LENGTHS}
    lines = ["| mix | seed | floor s | step s | of floor | " + " | ".join(PARTS) + " |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(PARTS)]
    for r in records:
        lines.append(f"| {r['dist']} | {r['seed']} | {r['floor_s']:.3f} | {r['step_s']:.3f} | "
                     f"{r['of_work_floor']:.2%} | " + " | ".join(f"{r[p]:.3f}" for p in PARTS) + " |")
    lines.append(f"\nC = {capacity} tokens; ring traffic hidden from member tokens of: "
                 + ", ".join(f"{length}: {t}" for length, t in thresholds.items()))
    result = {"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(), "model": args.model,
              "gpus": args.gpus, "tp": args.tp, "ep": args.ep, "capacity": capacity, "records": records,
              "exposure_threshold_tokens": {str(k): v for k, v in thresholds.items()}}
    finish("\n".join(lines), result, args.out)


if __name__ == "__main__":
    main()
