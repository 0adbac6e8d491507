"""Read what an HDP training run left behind: TensorBoard scalars and the plans saved with --hdp-save-plans.

Used by `megatron-hdp report` and `megatron-hdp calibrate --from-run`. No torch: TensorBoard's own event
reader (the `tensorboard` package) parses the event files.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

PLAN_FILE = re.compile(r"iter_(\d+)\.json$")
"""Name of a saved plan: iter_<iteration, 7 digits>.json (the StepPlan JSON of that training step)."""


def read_scalars(directory: str | Path) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files under `directory`: tag -> {step: value}.

    Raises ValueError when there is no event file (a wrong directory, or a run without
    --tensorboard-dir).
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ValueError("reading TensorBoard event files needs the tensorboard package: pip install tensorboard") from None
    files = sorted(Path(directory).rglob("events.out.tfevents.*"))
    if not files:
        raise ValueError(f"no TensorBoard event files under {directory} (was the run started with --tensorboard-dir?)")
    scalars: dict[str, dict[int, float]] = {}
    for events in files:
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: float(e.value) for e in accumulator.Scalars(tag)})
    return scalars


def read_plans(directory: str | Path) -> dict[int, dict]:
    """The saved StepPlan dicts under `directory` (searched recursively), by training iteration."""
    plans = {}
    for path in sorted(Path(directory).rglob("iter_*.json")):
        match = PLAN_FILE.search(path.name)
        if match:
            plans[int(match.group(1))] = json.loads(path.read_text())
    return plans


def per_rank_series(scalars: dict[str, dict[int, float]], prefix: str) -> dict[int, dict[int, float]]:
    """{rank: {step: value}} of the per-rank tags `<prefix>/<rank>` (e.g. hdp/rank/compute-s)."""
    series = {}
    for tag, values in scalars.items():
        head, _, rank = tag.rpartition("/")
        if head == prefix and rank.isdigit():
            series[int(rank)] = values
    return series
