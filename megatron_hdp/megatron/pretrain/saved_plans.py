"""`--hdp-save-plans DIR`: what ran, one StepPlan JSON per training step, each sequence with its source.

Rank 0 writes `DIR/iter_{iteration:07d}.json` (Megatron's 1-based iteration, as in its log line and
checkpoint names): `StepPlan.to_dict()` with, in each `sequences` entry, `"source": {"dataset": <path
prefix or "mock">, "document": <document id in that dataset's IndexedDataset (or JSONL line for SFT)>,
"offset": <first token of this sequence inside the document>}` from the data source's `origin`. The
file is written to a temporary name and renamed, so a reader never sees half a plan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def plan_with_sources(step: Any) -> dict:
    """The step's plan as a dict, each sequence with the `source` its data source reports (if any)."""
    plan = step.plan.to_dict()
    origin = getattr(step.reader.source, "origin", None)
    if origin is not None:
        for entry in plan["sequences"]:
            entry["source"] = origin(int(step.sample_ids[entry["id"]]))
    return plan


def saved_plan_path(directory: str | Path, iteration: int) -> Path:
    return Path(directory) / f"iter_{iteration:07d}.json"


def save_step_plan(step: Any, *, directory: str | Path, iteration: int) -> Path:
    """Write `step`'s plan with sources as `directory/iter_{iteration:07d}.json`; return the path."""
    path = saved_plan_path(directory, iteration)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(plan_with_sources(step)))
    os.replace(temporary, path)
    return path


def save_training_step_plan(step: Any, directory: str | None) -> None:
    """The `megatron.training` hook: on global rank 0, save this training step's plan when asked."""
    import torch.distributed as dist
    from megatron.training import get_args

    if directory is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    save_step_plan(step, directory=directory, iteration=get_args().curr_iteration + 1)
