"""The one fit of the cost model to measurements: compute T(s) and activation Act(s), and the CostModel.

Per layer, a document of s tokens costs

    T(s)   = a1 * s^2 + b1 * s + g      seconds (attention, linear layers, per-micro-batch overhead)
    Act(s) = a2 * s + b2                bytes kept for the backward

Every caller fits the same way: `megatron-hdp calibrate` on one layer timed per length
(`harness/calibrate.py`), the CPU training harness on the runtime's own micro-batches
(`harness/cpu_training.py`), and the online refit and `calibrate --from-run` on whole steps, where a
rank's compute is a sum over its shards (`plan/cost/online_refit.py` makes those feature rows). Compute is
non-negative least squares on *relative* error (each row divided by its measured time, so short
sequences count as much as long ones, and the cost model rejects negative coefficients), columns scaled
to similar size for NNLS's conditioning; optionally rows whose relative residual is an outlier are
dropped and the fit repeated. Activation bytes are fitted on absolute error (bytes grow linearly, no
row dominates). `fitted_cost_model` is the one place a CostModel is made from fitted coefficients.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
from scipy.optimize import nnls

from megatron_hdp.plan.cost.model import CostModel

COMPUTE_COEFFICIENTS = ("a1", "b1", "g")
"""T(s)'s coefficients, in the order of the fits' columns: s^2, s, 1 (per micro-batch)."""
ACTIVATION_COEFFICIENTS = ("a2", "b2")
"""Act(s)'s coefficients: per token, per micro-batch."""


def fit_relative(features: np.ndarray, measured: np.ndarray, *, outlier_mads: Optional[float] = None) -> np.ndarray:
    """coef >= 0 minimising sum(((features @ coef) - measured) / measured)^2; rows with measured <= 0 are
    ignored. With `outlier_mads`, rows whose relative residual lies more than that many median absolute
    deviations from the median (a preempted rank, a GC pause) are dropped and the fit repeated, provided
    at least as many rows as coefficients are left."""
    features, measured = np.asarray(features, dtype=float), np.asarray(measured, dtype=float)
    keep = measured > 0
    a = features[keep] / measured[keep, None]
    scale = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)  # columns of similar size keep NNLS well conditioned
    a = a / scale
    b = np.ones(int(keep.sum()))
    coef, _ = nnls(a, b)
    if outlier_mads is not None:
        residual = a @ coef - b
        deviation = np.abs(residual - np.median(residual))
        mad = max(float(np.median(deviation)), 1e-3)
        inliers = deviation <= outlier_mads * mad
        if inliers.sum() >= features.shape[1] and not inliers.all():
            coef, _ = nnls(a[inliers], b[inliers])
    return coef / scale


def fit_compute(seq_lens: Sequence[int], seconds: Sequence[float]) -> tuple[float, float, float]:
    """(a1, b1, g) >= 0 of T(s) from the measured seconds of one layer on one document of each length."""
    if len(seq_lens) != len(seconds):
        raise ValueError(f"{len(seq_lens)} sequence lengths but {len(seconds)} measured times")
    if len(seq_lens) < 3:
        raise ValueError(f"fitting T(s) needs at least 3 sequence lengths, got {len(seq_lens)}")
    s = np.asarray(seq_lens, dtype=float)
    a1, b1, g = fit_relative(np.stack([s**2, s, np.ones_like(s)], axis=1), np.asarray(seconds, dtype=float))
    return float(a1), float(b1), float(g)


def fit_activation(seq_lens: Sequence[int], nbytes: Sequence[float]) -> tuple[float, float]:
    """(a2, b2) >= 0 of Act(s): least squares of a2 s + b2 against the measured activation bytes."""
    if len(seq_lens) != len(nbytes):
        raise ValueError(f"{len(seq_lens)} sequence lengths but {len(nbytes)} measured byte counts")
    if len(seq_lens) < 2:
        raise ValueError(f"fitting Act(s) needs at least 2 sequence lengths, got {len(seq_lens)}")
    s = np.asarray(seq_lens, dtype=float)
    basis = np.stack([s, np.ones_like(s)], axis=1)
    scale = basis.max(axis=0)
    coef, _ = nnls(basis / scale, np.asarray(nbytes, dtype=float))
    a2, b2 = coef / scale
    return float(a2), float(b2)


def fit_jitter(coupled_phases: Sequence[Sequence[float]]) -> float:
    """`CostModel.jitter` from measured coupled phases, each the times of one phase (a forward or a
    backward) of the members of one group that run it together: the least-squares fit of the slowest
    member's lead over the members' mean, max / mean - 1, to jitter x E[max of k normals] over every
    phase (`timing.jitter_lead`, what the simulator charges each coupled phase). Fitted on the lead it
    predicts, not on the spread: where a phase's times have heavier tails than a normal's, the standard
    deviation under-predicts the lead."""
    from megatron_hdp.plan.cost.model import expected_max_of_normals

    groups = [np.asarray(times, dtype=float) for times in coupled_phases if len(times) > 1]
    if not groups:
        raise ValueError("fitting the jitter needs at least one coupled phase of 2 or more members")
    if min(times.min() for times in groups) <= 0:
        raise ValueError("coupled phase times must be > 0")
    leads = np.array([times.max() / times.mean() - 1.0 for times in groups])
    expected = np.array([expected_max_of_normals(len(times)) for times in groups])
    return float(leads @ expected / (expected @ expected))


def fit_alltoall_rate(crossing_bytes: Sequence[float], seconds: Sequence[float]) -> tuple[Optional[float], float]:
    """(bytes/s, seconds per call) of an all-to-all from calls timed at several sizes: seconds = latency +
    crossing bytes / rate, `fit_relative`'s least squares (each call counts by its relative error).
    `crossing_bytes`: what one member sends to the others in the call (its (e - 1) / e share), the bytes
    `CostModel.expert_alltoall_seconds_per_token` divides by the rate. Rate None where the times do not
    grow with the bytes (nothing to charge per byte)."""
    if len(crossing_bytes) != len(seconds):
        raise ValueError(f"{len(crossing_bytes)} all-to-all sizes but {len(seconds)} measured times")
    if len(set(crossing_bytes)) < 2:
        raise ValueError(f"fitting an all-to-all rate needs at least 2 distinct sizes, got {list(crossing_bytes)}")
    size = np.asarray(crossing_bytes, dtype=float)
    per_byte, latency = fit_relative(np.stack([size, np.ones_like(size)], axis=1), np.asarray(seconds, dtype=float))
    return (1.0 / float(per_byte) if per_byte > 0 else None), float(latency)


def fitted_cost_model(
    compute: Sequence[float],
    activation: Optional[Sequence[float]] = None,
    *,
    base: Optional[CostModel] = None,
    **fields: Any,
) -> CostModel:
    """The cost model with fitted `compute` (a1, b1, g) and, when given, `activation` (a2, b2):
    `base` with those coefficients (and `fields`) replaced, or, without `base`, a new CostModel of them
    and `fields` (the rest of its fields: memory, bandwidths, layers)."""
    values = dict(zip(COMPUTE_COEFFICIENTS, map(float, compute)), **fields)
    if activation is not None:
        values.update(zip(ACTIVATION_COEFFICIENTS, map(float, activation)))
    return dataclasses.replace(base, **values) if base is not None else CostModel(**values)
