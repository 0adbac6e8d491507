"""The host's pace, timed beside the planner: a fixed workload that shares no code with megatron_hdp.

This 2-core host runs the same plan 1.0-1.5x slower from one hour to the next (benchmarks/README.md,
issue 41's section), so a CPU time read against a fixed budget says as much about the hour as about the
planner. `reference_ms` times a workload of the planner's kind (Python loops over lists and dicts,
sorting, small numpy array steps) that no change to the repository alters; a benchmark records it beside
each measurement, and `pace` = reference ms / `REFERENCE_MS` says how fast the host ran then (1.0: the
pace at which `REFERENCE_MS` was measured; 1.3: the same work took 30% longer). Budgets are still read on
the raw CPU time; the pace only says which hour a reading came from.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

REFERENCE_MS = 60.0
"""`reference_ms` on this host on 2026-11-29 at load < 1 (the median of 15 readings), the pace of 1.0."""


def _workload() -> float:
    """~60 ms of CPU work in the shape of a planner's: a greedy assignment over Python lists, dict
    counting, sorting, and per-row numpy steps on small arrays. Returns a checksum (so nothing is skipped)."""
    rng = np.random.default_rng(0)
    weights = rng.random(4096).tolist()
    loads = [0.0] * 128
    for item in sorted(range(len(weights)), key=weights.__getitem__, reverse=True):
        rank = min(range(len(loads)), key=loads.__getitem__)
        loads[rank] += weights[item]
    counts: dict[tuple[int, int], int] = {}
    for i in range(80000):
        key = (i % 97, i % 89)
        counts[key] = counts.get(key, 0) + 1
    rows = rng.random((512, 64))
    total = 0.0
    for row in rows:
        total += float(np.sort(row).cumsum().max())
    return max(loads) + len(counts) + total


def reference_ms(repeats: int = 5) -> float:
    """The workload's CPU time in ms, median of `repeats`."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        _workload()
        times.append(1e3 * (time.process_time() - start))
    return statistics.median(times)


def pace(repeats: int = 5) -> dict:
    """{"reference_ms", "pace"}: the workload's time now and its ratio to `REFERENCE_MS`."""
    ms = reference_ms(repeats)
    return {"reference_ms": ms, "pace": ms / REFERENCE_MS}
