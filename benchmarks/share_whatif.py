"""What ring members with unequal token shares would gain on balance's EP-unit plans: a what-if, measured
before anyone changes the runtime (benchmarks/README.md, issue 41, "unequal shares, measured").

    python benchmarks/share_whatif.py                         # DeepSeek-V3, 2,048 GPUs, TP 8, EP 32, seeds 0-7
    python benchmarks/share_whatif.py --cells ep --seeds 0 1  # the 12 Mixtral / qwen3 EP cells

The runtime holds every member of a ring to the zigzag's equal split (`plan.zigzag.zigzag_chunks`), so none
of this is plannable today. The what-if keeps balance's plan (its rows, its lanes, its whole documents)
and only re-chooses, row by row, how many tokens each lane holds of each ring, under the cost model's terms
for a member holding t_p tokens of a document of s tokens on a ring of k members whose largest share is tau:

    per layer: b1' t_p + max(a1 s t_p + up (t_p + 4 (k-1) tau),  bytes(k) tau / bw + (3k-2) latency) + blocks

- causal work a1 s t_p: a member's chunks mirrored (front chunk [x, x+u), back chunk [s-x-u, s-x)) keep
  the mean query position at s/2 for any u, so the cost model's attention per token holds for any share;
- traffic: every ring step moves every member's block one hop and ends with the largest, and a member
  forwards blocks it does not own, so a member holding less still waits for k-1 blocks of tau tokens
  (`CostModel._ring_terms`' bytes per token, times tau instead of its own t); a latent ring member also
  up-projects k-1 received blocks of up to tau tokens. A lane holding pieces of two rings pays both rings'
  traffic. Hence no share can lower a ring's inflation: sum_p max(a1 s t_p, c tau) >= max(a1 s^2, c s);
- b1' is b1 without the routed expert share (the all-to-all spreads that work over the row's lanes),
  blocks the cost model's per-block kernel overhead.

A row (one index of one EP unit) lasts its slowest lane's own time + the routed expert work's mean + the
all-to-all of its fullest lane (`experts.spread_grid`); a unit's step is the sum of its rows, the plan's step
the slowest unit's (no PP, no jitter; rebuilt from the rows and checked against `StepPlan.est_step_time`).
Rows without a ring keep their time. Three estimates per row holding a ring:

- ideal: the row's lanes levelled exactly, own time and tokens both at their means (at today's ring sizes
  the lanes' summed own time cannot fall, see above, so this is an upper estimate); it removes what
  `ep_gap.py` counts as the ring rows' compute loss and their all-to-all waits;
- members: each ring's shares re-chosen among its own members only (same ring sizes);
- lanes: also shares on any other lane of the row (a whole-document lane or another ring's member, which
  then pays both rings' traffic): rings placed on the lanes with the most room, or laid end to end along
  the lanes (McNaughton's wrap-around), over ring sizes k-1 .. k+3, a grid of largest shares and both ring
  kinds.

For the last two a bisection on the row's slowest own time finds the least time at which the rings fit,
with a lane's tokens at most the row's fullest lane today times `CAP_FACTORS` (the all-to-all traded for
time; the best of them is kept) and the memory rule: C tokens a lane, more only for a lane holding one
ring's share alone where the offload hides (`sharding.fits`; `--no-memory` drops the rule). Each estimate
is printed twice: the slowest unit as planned, and in brackets the mean unit (what a planner that also
re-levels the units could reach at best). `--offload-family` plans without the rings-within-capacity family
(rings offload, members above C: where attention, not traffic, sets the member time). Writes
benchmarks/results/share_whatif.json (or `--out`) with the command and the date.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output import finish  # noqa: E402

from megatron_hdp.config import HDPConfig  # noqa: E402
from megatron_hdp.plan.cost.model import CostModel  # noqa: E402
from megatron_hdp.plan.cost.sharding import fits  # noqa: E402
from megatron_hdp.plan.lengths import sample_global_batch  # noqa: E402
from megatron_hdp.plan.planner import make_plan  # noqa: E402
from megatron_hdp.plan.search import expert_units  # noqa: E402
from megatron_hdp.plan.step_plan import RING_KINDS, StepPlan  # noqa: E402
from megatron_hdp.sim.cluster import ClusterSpec  # noqa: E402
from megatron_hdp.sim.compare import MICROBATCHES_PER_RANK, step_floors  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "share_whatif.json"
DEEPSEEK = [("deepseek-v3", 2048, 8, 32, "github", 131072), ("deepseek-v3", 2048, 8, 32, "byted", 131072)]
EP_CELLS = [("mixtral-8x7b", 512, 8, 8, "github", 131072), ("mixtral-8x7b", 512, 8, 8, "byted", 131072),
            ("mixtral-8x7b", 1024, 4, 32, "github", 131072),
            ("qwen3-30b-a3b", 64, 1, 8, "rl-rollouts", 131072), ("qwen3-30b-a3b", 256, 1, 8, "rl-rollouts", 32768),
            ("qwen3-30b-a3b", 256, 1, 8, "github", 131072)]
"""epeval's 12 cells (with seeds 0-1): model, GPUs, TP, EP, mix, context."""
ESTIMATES = ("today", "ideal", "members", "lanes")
TAU_POINTS = 16
BISECTIONS = 14
CAP_FACTORS = (1.0, 1.02, 1.05, 1.1)
"""A lane's tokens at most the row's fullest lane's today times these (the all-to-all traded for time)."""


@dataclass
class Ring:
    """One ring of a row: its document, its member lanes, and today's largest share."""

    length: int
    members: list[int]
    bandwidth: float
    tau: int


class ShareCost:
    """A ring member's seconds holding t tokens with the ring's largest share tau (the module docstring's
    terms), the tokens a lane may hold (the memory rule), and the all-to-all's seconds a token."""

    def __init__(self, cost: CostModel, capacity: int, max_offload_ratio: float, memory: bool = True) -> None:
        self.cost, self.layers, self.capacity, self.memory = cost, cost.num_layers, capacity, memory
        self.max_offload_ratio = max_offload_ratio
        self._fit: dict[tuple[int, int], int] = {}
        self.alltoall = cost.expert_alltoall_seconds_per_token()
        self.linear = cost.b1 * (1.0 - cost.expert_share)
        self.kinds = [kind for kind in RING_KINDS if kind == "kv" or cost.latent_bytes_per_token]
        if cost.ring_kind != "auto":
            self.kinds = [cost.ring_kind]

    def piece(self, length: int, t, tau, k: int, bandwidth: float, kind: str):
        """Seconds (all layers) a lane spends on t tokens of a ring of k members, largest share tau."""
        c = self.cost
        per_token, latency, _ = c._ring_terms(k, kind)
        up = c.up_projection_time if kind == "latent" else 0.0
        work = c.a1 * length * t + up * (t + 4 * (k - 1) * tau)
        comm = per_token * tau / bandwidth + latency
        return (self.linear * t + np.maximum(work, comm) + c.layer_ring_block_time(num_documents=1, ring_size=k)) \
            * self.layers

    def most_tokens(self, length: int, k: int) -> int:
        """Most tokens a member of a ring of k holding nothing else may keep: C, or more where the offload that
        needs hides and fits host memory (`sharding.fits`, the planner's rule)."""
        if not self.memory:
            return length
        if (length, k) not in self._fit:
            lo, hi = self.capacity, length
            while hi - lo > 64:
                mid = (lo + hi) // 2
                ok = fits(self.cost, seq_len=length, ring_size=k, num_tokens=mid, capacity=self.capacity,
                          max_offload_ratio=self.max_offload_ratio)
                lo, hi = (mid, hi) if ok else (lo, mid)
            self._fit[length, k] = lo
        return self._fit[length, k]

    def lane_tokens(self, cap: float) -> float:
        """Most tokens a lane holding more than one ring's share may keep: C (the contract), or `cap` alone
        without the memory rule."""
        return min(cap, self.capacity) if self.memory else cap

    def room(self, length: int, spare, tau, k: int, bandwidth: float, kind: str):
        """Most tokens t <= tau a lane with `spare` seconds left can take of such a ring (<= 0: none)."""
        c = self.cost
        per_token, latency, _ = c._ring_terms(k, kind)
        up = c.up_projection_time if kind == "latent" else 0.0
        budget = spare / self.layers - c.layer_ring_block_time(num_documents=1, ring_size=k)
        comm = per_token * tau / bandwidth + latency
        by_comm = (budget - comm) / self.linear
        by_work = (budget - up * 4 * (k - 1) * tau) / (self.linear + c.a1 * length + up)
        return np.minimum(np.minimum(by_comm, by_work), tau)


def place_rings(rings: list[Ring], base: np.ndarray, held: np.ndarray, cap: float, limit: float,
                share: ShareCost, anywhere: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """Lanes' (own times, tokens) with every ring placed within `limit` seconds and `cap` tokens a lane (and
    the memory rule: C tokens a lane, more only for one ring's share alone, `ShareCost.most_tokens`), or None
    where the greedy finds no placement."""
    base, held = base.copy(), held.copy()
    alone = held == 0
    lanes = np.arange(len(base))
    for ring in sorted(rings, key=lambda r: -r.length):
        candidates = lanes if anywhere else np.asarray(ring.members)
        sizes = range(max(2, len(ring.members) - 1), min(len(candidates), len(ring.members) + 4) + 1) \
            if anywhere else [len(ring.members)]
        best = None
        for k in sizes:
            lo = -(-ring.length // k)
            most = min(cap, max(share.capacity, share.most_tokens(ring.length, k), ring.tau))
            taus = np.unique(np.concatenate([np.linspace(lo, max(lo, most), TAU_POINTS).round(), [ring.tau]]))
            taus = taus[(taus >= lo) & (taus <= most)][:, None]
            tokens_left = np.where(alone, most, share.lane_tokens(cap) - held)[candidates][None, :]
            for kind in share.kinds:
                room = share.room(ring.length, limit - base[candidates][None, :], taus, k, ring.bandwidth, kind)
                room = np.floor(np.minimum(room, tokens_left))
                top = -np.sort(-room, axis=1)[:, :k]
                ok = np.flatnonzero((top[:, -1] > 0) & (top.sum(axis=1) >= ring.length))
                for row in ok:
                    tau = float(taus[row, 0])
                    order = np.argsort(-room[row], kind="stable")[:k]
                    t = np.minimum(room[row, order], tau)
                    # fill the lanes with the most room to their room, in order, until the document is held
                    shares = np.zeros(k)
                    left = ring.length
                    for i in range(k):
                        shares[i] = min(t[i], left)
                        left -= shares[i]
                    shares = np.where(shares > 0, shares, 0.0)
                    used = share.piece(ring.length, shares, tau, k, ring.bandwidth, kind)
                    used = np.where(shares > 0, used, 0.0)
                    score = used.sum()
                    if best is None or score < best[0]:
                        best = (score, candidates[order], used, shares)
        if best is None:
            return None
        _, where, used, shares = best
        base[where] += used
        held[where] += shares
        alone[where] = False
    return base, held


def wrap_rings(rings: list[Ring], order: np.ndarray, base: np.ndarray, held: np.ndarray, cap: float,
               limit: float, share: ShareCost) -> tuple[np.ndarray, np.ndarray] | None:
    """`place_rings` by McNaughton's wrap-around: the rings, largest document first, laid one after the other
    along the lanes in `order`, each filling a lane's room within `limit` before the next lane, so a ring's
    last lane is the next ring's first (a lane holding pieces of two rings, each paying its own traffic).
    Per ring the ring size, largest share and kind that end it earliest along the lanes; None where the
    lanes run out."""
    base, held = base.copy(), held.copy()
    alone = held == 0
    at = 0  # the first lane in `order` with room left
    for ring in sorted(rings, key=lambda r: -r.length):
        best = None
        for k in range(max(2, len(ring.members) - 1), len(ring.members) + 3):
            lanes = order[at:at + k]
            if len(lanes) == 0:
                break
            lo = -(-ring.length // k)
            most = min(cap, max(share.capacity, share.most_tokens(ring.length, k), ring.tau))
            taus = np.unique(np.concatenate([np.linspace(lo, max(lo, most), TAU_POINTS // 2).round(), [ring.tau]]))
            taus = taus[(taus >= lo) & (taus <= most)][:, None]
            tokens_left = np.where(alone, most, share.lane_tokens(cap) - held)[lanes][None, :]
            for kind in share.kinds:
                room = share.room(ring.length, limit - base[lanes][None, :], taus, k, ring.bandwidth, kind)
                room = np.maximum(np.floor(np.minimum(room, tokens_left)), 0.0)
                reach = np.cumsum(room, axis=1)
                for row in np.flatnonzero(reach[:, -1] >= ring.length):
                    end = int(np.searchsorted(reach[row], ring.length))  # the lane where the ring ends
                    shares = room[row, :end + 1].copy()
                    shares[end] -= reach[row, end] - ring.length
                    last = shares[end] / room[row, end]
                    key = (end + last, float(taus[row, 0]))
                    if best is None or key < best[0]:
                        used = share.piece(ring.length, shares, float(taus[row, 0]), k, ring.bandwidth, kind)
                        best = (key, lanes[:end + 1], np.where(shares > 0, used, 0.0), shares, end, last)
        if best is None:
            return None
        _, where, used, shares, end, last = best
        base[where] += used
        held[where] += shares
        alone[where[shares > 0]] = False
        at += end + (last >= 1.0 - 1e-9)
    return base, held


def row_estimates(lanes: list, plan: StepPlan, cost: CostModel, share: ShareCost, spt: float, a2a: float,
                  overhead: float) -> dict:
    """Seconds of one row (its lanes' (rank, micro-batch or None)) under each of `ESTIMATES`, whether it holds
    rings (`rings`), and how far its lanes' own times rebuilt in this module's terms at today's shares stand
    from the plan's, relative (`error`). A row without rings, or with a ring reaching beyond it, keeps today's
    time."""
    ranks = [rank for rank, _ in lanes]
    tokens = np.array([mb.num_tokens if mb else 0 for _, mb in lanes], dtype=np.float64)
    own = np.array([mb.est_time if mb else overhead for _, mb in lanes]) - spt * tokens
    today = own.max() + spt * tokens.mean() + a2a * tokens.max()
    rings: dict[int, Ring] = {}
    base, held = np.full(len(lanes), overhead), np.zeros(len(lanes))
    pieces: list[tuple[int, int, int, str]] = []  # (lane, seq, tokens, kind) of every ring piece
    for lane, (rank, mb) in enumerate(lanes):
        whole = []
        for shard in (mb.shards if mb else ()):
            seq = plan.sequences[shard.seq]
            if len(seq.ring) <= 1:
                whole.append((seq.length, shard.num_tokens, seq.ring))
                continue
            if any(r not in ranks for r in seq.ring):
                return {name: today for name in ESTIMATES} | {"rings": False, "error": 0.0}
            ring = rings.setdefault(shard.seq, Ring(seq.length, [], cost.ring_link_bandwidth(seq.ring), 0))
            ring.members.append(lane)
            ring.tau = max(ring.tau, shard.num_tokens)
            pieces.append((lane, shard.seq, shard.num_tokens, seq.ring_kind))
        held[lane] = sum(t for _, t, _ in whole)
        if whole:
            base[lane] = cost.microbatch_time(whole, pp_size=1) - spt * held[lane]
    if not rings:
        return {name: today for name in ESTIMATES} | {"rings": False, "error": 0.0}
    rebuilt = base.copy()
    for lane, seq, t, kind in pieces:  # today's shares in this module's terms: the check against the plan
        ring = rings[seq]
        rebuilt[lane] += share.piece(ring.length, t, ring.tau, len(ring.members), ring.bandwidth, kind)
    cap = float(tokens.max())
    # the lanes in wrap order: today's members ring by ring (largest document first), then the rest, least
    # loaded first
    members = [lane for ring in sorted(rings.values(), key=lambda r: -r.length) for lane in ring.members]
    rest = sorted(set(range(len(lanes))) - set(members), key=lambda lane: base[lane])
    order = np.asarray(members + rest)
    out = {"today": today, "rings": True, "error": float(np.abs(rebuilt - own).max() / own.max()),
           "ideal": own.mean() + (spt + a2a) * tokens.mean()}
    for name, anywhere in (("members", False), ("lanes", True)):
        out[name] = min(today, *(best_row(list(rings.values()), order, base, held, cap * factor, own, share, anywhere)
                                 + spt * tokens.mean() for factor in CAP_FACTORS))
    return out


def best_row(rings: list[Ring], order: np.ndarray, base: np.ndarray, held: np.ndarray, cap: float,
             own: np.ndarray, share: ShareCost, anywhere: bool) -> float:
    """The least slowest own time + all-to-all of the row's fullest lane (`a2a` of the held tokens) that a
    bisection on the slowest own time finds, rings placed on their members (`place_rings`), or where
    `anywhere` also on any lanes (`place_rings`, `wrap_rings`); inf where today's shares are not rebuilt."""
    lo, hi, best = own.mean(), own.max(), None
    if place_rings(rings, base, held, cap, hi * (1 + 1e-9), share, False) is None:
        return np.inf
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        placed = place_rings(rings, base, held, cap, mid, share, False)
        if placed is None and anywhere:
            placed = place_rings(rings, base, held, cap, mid, share, True)
        if placed is None and anywhere:
            placed = wrap_rings(rings, order, base, held, cap, mid, share)
        if placed is None:
            lo = mid
        else:
            hi, best = mid, placed
    if best is None:
        best = place_rings(rings, base, held, cap, own.max() * (1 + 1e-9), share, False)
    times, new_held = best
    return times.max() + share.alltoall * new_held.max()


def whatif(plan: StepPlan, cost: CostModel, config: HDPConfig, memory: bool = True) -> dict:
    """The plan's step under each estimate, and today's step rebuilt from its rows (a check)."""
    e = cost.expert_parallel_size
    spt, a2a = cost.expert_seconds_per_token(pp_size=1), cost.expert_alltoall_seconds_per_token()
    overhead = cost.microbatch_time([], pp_size=1)
    share = ShareCost(cost, config.hdp_capacity, config.max_offload_ratio, memory)
    units = {name: [] for name in ESTIMATES}
    ring_rows, error = 0, 0.0
    for unit in range(plan.num_ranks // e):
        totals = dict.fromkeys(ESTIMATES, 0.0)
        schedules = [(r, plan.ranks[r].microbatches) for r in range(unit * e, (unit + 1) * e)]
        for index in range(max(len(mbs) for _, mbs in schedules)):
            lanes = [(r, mbs[index] if index < len(mbs) else None) for r, mbs in schedules]
            row = row_estimates(lanes, plan, cost, share, spt, a2a, overhead)
            ring_rows += row.pop("rings")
            error = max(error, row.pop("error"))
            for name in ESTIMATES:
                totals[name] += row[name]
        for name in ESTIMATES:
            units[name].append(totals[name])
    return ({name: max(values) for name, values in units.items()}
            | {f"{name}_mean": float(np.mean(values)) for name, values in units.items()}
            | {"ring_rows": ring_rows, "error": error})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", choices=("deepseek", "ep"), default="deepseek")
    parser.add_argument("--seeds", nargs="+", type=int, default=list(range(8)))
    parser.add_argument("--offload-family", action="store_true",
                        help="plan without the rings-within-capacity family (expert_units.ALLTOALL_SHARE set out of "
                             "reach): rings offload, their members above C, where shares could level attention")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--no-memory", action="store_true",
                        help="drop the memory rule (a lane's tokens bounded by the all-to-all trade alone): unequal "
                             "shares together with lanes filled past C, which the contract does not allow")
    args = parser.parse_args()
    if args.offload_family:
        expert_units.ALLTOALL_SHARE = float("inf")
    records = []
    for model, gpus, tp, ep, dist, context in (DEEPSEEK if args.cells == "deepseek" else EP_CELLS):
        spec = ClusterSpec(model=model, num_gpus=gpus, tp_size=tp, ep_size=ep)
        cost, capacity, ranks = spec.cost_model(), spec.rank_capacity, spec.num_ranks
        for seed in args.seeds:
            lengths = np.asarray(sample_global_batch(dist, num_tokens=MICROBATCHES_PER_RANK * capacity * ranks,
                                                     seed=seed, max_length=context))
            floor = step_floors(lengths, cost, num_ranks=ranks, pp_size=1)["work_s"]
            config = HDPConfig(hdp_capacity=capacity)
            plan = make_plan(lengths, num_ranks=ranks, config=config, cost_model=cost, policy="balance")
            steps = whatif(plan, cost, config, memory=not args.no_memory)
            record = {"model": model, "gpus": gpus, "tp": tp, "ep": ep, "dist": dist, "context": context,
                      "seed": seed, "floor_s": floor, "plan_step_s": plan.est_step_time,
                      "ring_rows": steps["ring_rows"], "rebuild_error": steps["error"],
                      **{f"{name}_s": steps[name] for name in ESTIMATES},
                      **{f"{name}_of_floor": floor / steps[name] for name in ESTIMATES},
                      **{f"{name}_units_level_of_floor": floor / steps[f"{name}_mean"] for name in ESTIMATES}}
            records.append(record)
            print(f"{model} {gpus} ep{ep} {dist} {context // 1024}K seed {seed}: "
                  + " ".join(f"{name} {floor / steps[name]:.2%} ({floor / steps[name + '_mean']:.2%})"
                             for name in ESTIMATES)
                  + f" (plan {floor / plan.est_step_time:.2%}, rebuilt rows within {steps['error']:.1e})", flush=True)
    lines = ["of the work floor: the slowest unit as planned (the mean unit)", "",
             "| cell | seed | " + " | ".join(ESTIMATES) + " |", "|---|---:|" + "---:|" * len(ESTIMATES)]
    for r in records:
        lines.append(f"| {r['model']} {r['gpus']} EP {r['ep']} {r['dist']} {r['context'] // 1024}K | {r['seed']} | "
                     + " | ".join(f"{r[f'{name}_of_floor']:.2%} ({r[f'{name}_units_level_of_floor']:.2%})"
                                  for name in ESTIMATES) + " |")
    result = {"command": " ".join(sys.argv), "offload_family": args.offload_family,
              "memory_rule": not args.no_memory, "date": datetime.date.today().isoformat(), "records": records}
    finish("\n".join(lines), result, args.out)


if __name__ == "__main__":
    main()
