"""Run a benchmark's measurement N times (`--repeat N`) and report each figure as median and range.

One run of a shared, loaded host is one draw: the next person who runs the command gets another. So a
benchmark whose figures the READMEs quote measures N times, one whole run after the other (within a
run its cases still take turns, so ratios between them are measured side by side), and keeps:

- every run in `runs`, each with its `conditions` (date, load average before and after);
- the median of each figure over the runs, in the shape of one run's result (what a reader of a single
  run, e.g. `megatron-hdp selftest`, finds where it always was);
- `spread`: the same shape again, each figure that varied as {median, min, max, runs}; a figure equal in
  every run (a parameter, a byte count) stays a plain value.

A ratio is computed inside each run (side by side) and then summarised over the runs, never as a ratio
of medians.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from typing import Any, Callable

CONDITIONS = "conditions"


def add_repeat_argument(parser: argparse.ArgumentParser) -> None:
    """`--repeat N`: independent runs of the whole measurement (>= 1), as step_bench's."""
    parser.add_argument("--repeat", type=_positive, default=1,
                        help="independent runs of the whole measurement; figures as median and range over them")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--repeat must be >= 1, got {value}")
    return value


def spread(values: list[float]) -> dict:
    """Median and range of one figure over the runs."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": len(values)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _combine(values: list[Any], leaf: Callable[[list[float]], Any]) -> Any:
    """`values` (one per run, same shape) folded into one: dicts key by key (keys every run has, in the
    first run's order), lists of one length item by item, numbers by `leaf` where they differ; anything
    else equal in every run is kept, and otherwise listed run by run."""
    first = values[0]
    if all(isinstance(v, dict) for v in values):
        return {k: _combine([v[k] for v in values], leaf) for k in first if all(k in v for v in values)}
    if all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
        return [_combine(list(items), leaf) for items in zip(*values)]
    if all(v == first for v in values):
        return first
    if all(_is_number(v) for v in values):
        return leaf(values)
    return values


def over_runs(runs: list[dict]) -> dict:
    """The medians (shape of one run), `spread` (median and range of every figure that varied), `repeat`,
    the range of the load average around the runs, and every run, for a benchmark's result JSON. `runs`
    come from `repeat_measurement`."""
    figures = [{k: v for k, v in run.items() if k != CONDITIONS} for run in runs]
    return {**_combine(figures, statistics.median), "repeat": len(runs), "load_average_range": load_range(runs),
            "spread": _combine(figures, spread), "runs": runs}


def repeat_measurement(measure: Callable[[], dict], times: int, *,
                       report: Callable[[int, dict], None] | None = None) -> list[dict]:
    """`measure()` `times` times, one run after the other; each run's result gets its `conditions` (date,
    load average before and after), and `report(index, result)` is called after each (e.g. to print it)."""
    runs = []
    for index in range(times):
        load_before = os.getloadavg()
        result = measure()
        runs.append({**result, CONDITIONS: {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                            "load_average_before": list(load_before),
                                            "load_average_after": list(os.getloadavg())}})
        if report:
            if times > 1:
                print(f"run {index + 1} of {times} (load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f})")
            report(index, result)
    return runs


def format_spread(figure: Any, fmt: Callable[[float], str] | str = "{:.3g}", *, scale: float = 1.0) -> str:
    """A figure of one run, or of `spread`: `median [min, max]` where it varied, the value alone where not
    (times `scale`, e.g. 1e3 for seconds shown in ms)."""
    render = fmt.format if isinstance(fmt, str) else fmt
    if isinstance(figure, dict) and "median" in figure:
        return f"{render(figure['median'] * scale)} [{render(figure['min'] * scale)}, {render(figure['max'] * scale)}]"
    return render(figure * scale) if _is_number(figure) else str(figure)


def load_range(runs: list[dict]) -> list[float]:
    """Lowest and highest 1-minute load average seen before or after any run (the conditions to quote)."""
    loads = [c[key][0] for c in (run[CONDITIONS] for run in runs) for key in ("load_average_before", "load_average_after")]
    return [min(loads), max(loads)]
