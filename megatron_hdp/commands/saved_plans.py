"""`megatron-hdp plan --from FILE.json|DIR`: summarise and draw the plans training saved (`--hdp-save-plans`).

Training writes one StepPlan JSON per step, `DIR/iter_0000001.json`, ..., each `sequences` entry with the
document it came from (`"source": {"dataset", "document", "offset"}`). Every file is read and validated
(a file that is not a valid plan is refused, naming it); the table has one row per step, and `--plot`
draws a strip of a few steps, evenly spaced over the run, side by side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from megatron_hdp.plan.step_plan import StepPlan


@dataclass(frozen=True)
class SavedPlan:
    """One saved step: its name (the file's stem), the validated plan, and each sequence's source (or None)."""

    name: str
    plan: StepPlan
    sources: tuple[dict | None, ...]


def saved_plan_files(path: str | Path) -> list[Path]:
    """`path` itself when it is a file; else the directory's *.json files in name (= step) order."""
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob("*.json"))
    if not files:
        raise ValueError(f"--from {path}: the directory holds no *.json plans")
    return files


def load_saved_plan(path: Path) -> SavedPlan:
    """Read and validate one saved plan; ValueError naming the file when it is not one."""
    try:
        data = json.loads(path.read_text())
        plan = StepPlan.from_dict(data).validate()
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        detail = f"missing key {error}" if isinstance(error, KeyError) else str(error)
        raise ValueError(f"--from {path}: not a valid StepPlan JSON ({detail})") from None
    return SavedPlan(path.stem, plan, tuple(entry.get("source") for entry in data["sequences"]))


def saved_row(saved: SavedPlan) -> str:
    """One step of the table: the plan's shape and where its documents came from."""
    plan, summary = saved.plan, saved.plan.summary()
    sources = [s for s in saved.sources if s]
    datasets = len({s.get("dataset") for s in sources})
    documents = len({(s.get("dataset"), s.get("document")) for s in sources})
    origin = f"{datasets} dataset{'s' * (datasets != 1)}, {documents} documents" if sources else "-"
    return (f"{saved.name:<16}{plan.policy:<20}{plan.num_ranks:>6}{plan.capacity:>9}{summary.num_sequences:>7}"
            f"{summary.num_tokens:>12,}{summary.num_rings:>7}{max(summary.ring_sizes, default=1):>9}"
            f"{f'{summary.min_microbatches}-{summary.max_microbatches}':>9}{summary.balance:>9.3f}"
            f"{plan.est_step_time:>10.3f}  {origin}")


def spaced(items: list, count: int) -> list:
    """`count` items evenly spaced from the first to the last (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    if count == 1:
        return [items[0]]
    return [items[round(i * (len(items) - 1) / (count - 1))] for i in range(count)]


def show_saved_plans(path: str, *, plot: str | None, plot_steps: int) -> int:
    """Print one row per saved step; draw `plot_steps` of them, evenly spaced, when `plot` is given."""
    from tqdm import tqdm

    files = saved_plan_files(path)
    header = (f"{'step':<16}{'policy':<20}{'ranks':>6}{'C':>9}{'seqs':>7}{'tokens':>12}{'rings':>7}{'max ring':>9}"
              f"{'mb/rank':>9}{'balance':>9}{'est s':>10}  sources")
    print(header)
    print("-" * len(header))
    drawn = set(spaced(files, plot_steps)) if plot else set()
    to_draw = []
    for file in tqdm(files, desc="reading plans", unit="plan", delay=2.0, disable=None, leave=False):
        saved = load_saved_plan(file)
        print(saved_row(saved))
        if file in drawn:
            to_draw.append(saved)
    if plot:
        from megatron_hdp.sim.plots import plot_plans  # matplotlib only when asked for

        plot_plans({s.name: s.plan for s in to_draw}, plot)
        steps = "" if len(files) == 1 else f" ({len(to_draw)} of {len(files)} steps)"
        print(f"wrote {plot}{steps}")
    return 0
