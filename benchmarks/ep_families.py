"""Which of balance's plan families wins an EP batch, and by how much the others trail: every family timed.

    python benchmarks/ep_families.py                                       # EP 8 models, 256-16,384 ranks
    python benchmarks/ep_families.py --models deepseek-v3 --ranks 256,512  # DeepSeek-V3, TP 8, EP 32
    python benchmarks/ep_families.py --models qwen3-30b-a3b --ranks 2048 --seeds 4

With expert parallelism `balance` plans a batch in families (`policies/balance.py`): EP groups as units
with the first widening option's rings (`U0`), those rings within capacity (`Ucap`), the alternatives'
(`Ualt`), rank by rank (`R0`, its alternatives `Ralt`), and the plan made as if EP 1 timed with the
coupling (`EP1`). Which families run depends on the plans before them (`improvable`), and a family whose
floor cannot beat the best plan so far is not timed (`beat`). Here `beat` is withheld, so every family
that runs is timed (the plan kept is the same: a pruned family could not have won), and so is the shape
rule that plans deep batches by units alone (`balance.UNITS_ONLY_DEPTH`, which these sweeps decided: the
table at the end counts where the rank-by-rank families won, by micro-batches a rank), and each family's
best step is recorded beside the batch's shape: the work floor (`sim.compare.step_floors`, every rank
1/n of the compute) against the lower bound (`timeline.bounds.step_time_lower_bound`, the longest
documents' fastest rings included). A rule that skips a family by the shape is worth it only where that
family never wins, or wins by a negligible margin (benchmarks/README.md, issue 41, round 4).

EP 8 models (Mixtral-8x7B and qwen3-30B-A3B on nodes of 8, llama-7b with the topology unknown) plan 32M
tokens at C = 16K as plan_bench's feature cells; DeepSeek-V3 (TP 8, EP 32) plans 4 micro-batches of its
rank capacity a rank (131K context), as benchmarks/ep_gap.py. Writes benchmarks/results/ep_families.json
(or --out) with the command and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
from pathlib import Path

from megatron_hdp.config import HDPConfig
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.plan.policies import balance
from megatron_hdp.plan.timeline.bounds import step_time_lower_bound
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import MICROBATCHES_PER_RANK, step_floors

RESULTS = Path(__file__).resolve().parent / "results" / "ep_families.json"

UNITS = ("U0", "Ucap", "Ualt")
RANKS = ("R0", "Ralt", "EP1")


class Recorder:
    """balance's builders wrapped: each family's timed step, in the order they ran, with `beat` withheld."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, float]] = []
        self.tags: dict[int, str] = {}
        self._unit_options, self._build_units = balance.unit_options, balance.build_units
        self._build_ranks, self._with_coupling = balance.build_ranks, balance.with_coupling
        balance.unit_options, balance.build_units = self.unit_options, self.build_units
        balance.UNITS_ONLY_DEPTH = float("inf")  # every family runs where `improvable` lets it, at any depth
        balance.build_ranks, balance.with_coupling = self.build_ranks, self.with_coupling

    def unit_options(self, *args, **kwargs):
        first, rest = self._unit_options(*args, **kwargs)
        for i, (sizes, _) in enumerate(first):
            self.tags[id(sizes)] = "U0" if i == 0 else "Ucap"
        return first, self._alternatives(rest)

    def _alternatives(self, rest):
        for sizes, ratios in rest:  # (made as balance asks for them)
            self.tags[id(sizes)] = "Ualt"
            yield sizes, ratios

    def build_units(self, lengths, sizes, ratios, **kwargs):
        kwargs.pop("beat", None)
        plan = self._build_units(lengths, sizes, ratios, **kwargs)
        self.steps.append((self.tags.get(id(sizes), "U?"), plan.est_step_time))
        return plan

    def build_ranks(self, lengths, sizes, ratios, **kwargs):
        kwargs.pop("beat", None)
        plan = self._build_ranks(lengths, sizes, ratios, **kwargs)
        if kwargs["cost_model"].expert_parallel_size > 1:  # the EP-1 pass counts as one family, `EP1`
            self.steps.append(("Ralt" if any(f == "R0" for f, _ in self.steps) else "R0", plan.est_step_time))
        return plan

    def with_coupling(self, plan, cost_model, shared):
        timed = self._with_coupling(plan, cost_model, shared)
        self.steps.append(("EP1", timed.est_step_time))
        return timed


def batch(model: str, mix: str, num_ranks: int, seed: int, depth: float | None = None):
    """(lengths, cost model, capacity) of one cell: `depth` C-token micro-batches a rank, or by default
    32M tokens (EP 8 models) and `MICROBATCHES_PER_RANK` (DeepSeek-V3)."""
    if model == "deepseek-v3":
        spec = ClusterSpec(model=model, num_gpus=num_ranks * 8, tp_size=8, ep_size=32)
        capacity = spec.rank_capacity
        lengths = sample_global_batch(mix, num_tokens=int((depth or MICROBATCHES_PER_RANK) * capacity * num_ranks),
                                      seed=seed, max_length=131072)
        return lengths, spec.cost_model(), capacity
    spec = ClusterSpec(model, num_gpus=num_ranks, tp_size=1)
    cost_model = dataclasses.replace(spec.cost_model(), expert_parallel_size=8,
                                     ranks_per_node=None if model == "llama-7b" else 8)
    tokens = 32 * 2**20 if depth is None else int(depth * 16384 * num_ranks)
    return sample_global_batch(mix, num_tokens=tokens, seed=seed), cost_model, 16384


def won_rank_by_rank(families: dict[str, float]) -> bool | None:
    """Whether a family planned rank by rank (`R0`, `Ralt`, `EP1`) beat every EP-unit family; None where
    none ran."""
    ranks = [step for family, step in families.items() if family in RANKS]
    if not ranks:
        return None
    return min(ranks) < min(step for family, step in families.items() if family in UNITS) * (1 - 1e-9)


def depth_table(records: list[dict]) -> str:
    """By C-token micro-batches a rank (`depth`): batches, those where a rank-by-rank family ran, those it
    won, and its largest win (1 - its step over the best unit family's), the evidence of
    `balance.UNITS_ONLY_DEPTH`."""
    rows: dict[float, list] = {}
    for r in records:
        row = rows.setdefault(round(r["depth"], 1), [0, 0, 0, 0.0])
        won = won_rank_by_rank(r["families"])
        row[0] += 1
        row[1] += won is not None
        if won:
            units = min(step for family, step in r["families"].items() if family in UNITS)
            ranks = min(step for family, step in r["families"].items() if family in RANKS)
            row[2] += 1
            row[3] = max(row[3], 1 - ranks / units)
    lines = [f"{'depth':>6}{'batches':>9}{'ran':>5}{'won':>5}{'largest win':>13}"]
    lines += [f"{d:>6.1f}{n:>9}{ran:>5}{won:>5}{100 * most:>12.1f}%" for d, (n, ran, won, most) in sorted(rows.items())]
    return "\n".join(lines)


def coupling_table(records: list[dict]) -> str:
    """By model: batches where the plan made as if EP 1 ran (`EP1`), those where it planned a faster step
    than every other family, and its largest such margin: what a rule skipping that pass would lose."""
    rows: dict[str, list] = {}
    for r in records:
        families = r["families"]
        if "EP1" not in families:
            continue
        others = min((step for family, step in families.items() if family != "EP1"), default=float("inf"))
        row = rows.setdefault(r["model"], [0, 0, 0.0])
        row[0] += 1
        if families["EP1"] < others * (1 - 1e-9):
            row[1] += 1
            row[2] = max(row[2], 1 - families["EP1"] / others)
    lines = [f"{'model':>16}{'EP1 ran':>9}{'won':>5}{'largest win':>13}"]
    lines += [f"{model:>16}{ran:>9}{won:>5}{100 * most:>12.1f}%" for model, (ran, won, most) in sorted(rows.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b,llama-7b")
    parser.add_argument("--mixes", default="github,byted")
    parser.add_argument("--ranks", default="256,1024,4096,16384")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 .. N-1 per cell")
    parser.add_argument("--depths", default=None, help="comma list of C-token micro-batches a rank, each a "
                        "batch size (default: 32M tokens, DeepSeek-V3 4 a rank)")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the depth and EP-1 tables of these result files (batches deduplicated) and exit")
    args = parser.parse_args(argv)
    if args.table:
        records = [r for path in args.table for r in json.loads(Path(path).read_text())["records"]]
        default_depths = {}  # (results written before depth was recorded: the default batch, made once)
        for r in records:
            if "depth" not in r:
                key = (r["model"], r["mix"], r["ranks"], r["seed"])
                if key not in default_depths:
                    lengths, _, capacity = batch(*key)
                    default_depths[key] = sum(lengths) / (capacity * r["ranks"])
                r["depth"] = default_depths[key]
        unique = {(r["model"], r["mix"], r["ranks"], r["seed"], round(r["depth"], 6)): r for r in records}
        print(depth_table(list(unique.values())))
        print(coupling_table(list(unique.values())))
        return 0
    recorder = Recorder()
    records = []
    for model in args.models.split(","):
        for mix in args.mixes.split(","):
            for num_ranks, depth, seed in itertools.product(
                    map(int, args.ranks.split(",")),
                    [None] if args.depths is None else map(float, args.depths.split(",")), range(args.seeds)):
                lengths, cost_model, capacity = batch(model, mix, num_ranks, seed, depth)
                recorder.steps.clear()
                recorder.tags.clear()
                plan = balance.plan_balance(lengths, num_ranks=num_ranks, cost_model=cost_model,
                                            config=HDPConfig(hdp=True, hdp_capacity=capacity))
                bound = step_time_lower_bound(lengths, num_ranks=num_ranks, capacity=capacity,
                                              cost_model=cost_model)
                work = step_floors(lengths, cost_model, num_ranks=num_ranks, pp_size=1)["work_s"]
                best: dict[str, float] = {}
                for family, step in recorder.steps:
                    best[family] = min(best.get(family, float("inf")), step)
                records.append(dict(model=model, mix=mix, ranks=num_ranks, seed=seed, step=plan.est_step_time,
                                    bound=bound, work=work, families=best,
                                    depth=sum(lengths) / (capacity * num_ranks)))
                print(f"{model} {mix} {num_ranks} seed {seed} depth {records[-1]['depth']:.2f}: "
                      f"step {plan.est_step_time:.4f} bound {bound:.4f} work {work:.4f} "
                      + " ".join(f"{f}={s:.4f}" for f, s in best.items()), flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
                                          "records": records}, indent=1) + "\n")
    print(depth_table(records))
    print(coupling_table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
