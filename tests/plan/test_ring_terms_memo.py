"""The cost model's ring terms, remembered per (ring size, kind), give the floats of the written-out formulas.

`CostModel._ring_terms` keeps each ring's per-token bytes, message latency and up-projection count once per
model (the ring sizing times thousands of shards a plan); plans must stay the same to the bit, so every
public ring term is held here to the formula of `CostModel`'s docstrings written out in plain arithmetic
(sharing no code with the model), with ==, for both ring kinds, scalars and arrays, before and after the
memo is filled, and across models that differ in one coefficient (a memo shared between them would be wrong).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megatron_hdp.plan.cost.presets import analytic_cost_model


def _by_hand(m, t, s, k, bw, kind):
    """(bytes, comm, up, overlap, shard) of one layer, by the formulas, in the model's order of operations."""
    circ = m.latent_bytes_per_token if kind == "latent" else m.kv_bytes_per_token
    grad = circ * max(4, m.activation_dtype_bytes) / m.activation_dtype_bytes
    sent = (2 * (k - 1) * circ + k * grad) * t if k > 1 else 0.0
    comm = sent / bw + (3 * k - 2 if k > 1 else 0) * m.ring_latency
    up = (4 * (k - 1) + 1) * t * m.up_projection_time if kind == "latent" and k > 1 else 0.0 * t
    attention = m.a1 * s * t
    work = attention + up
    overlap = np.maximum(work, comm) if isinstance(work, np.ndarray) else max(work, comm)
    return sent, comm, up, overlap, attention


def test_ring_terms_equal_the_formulas_bit_for_bit():
    base = analytic_cost_model("deepseek-v3", tp_size=8)
    models = [base, dataclasses.replace(base, ring_latency=3e-5), dataclasses.replace(base, ring_kind="kv"),
              dataclasses.replace(base, ring_kind="latent"), analytic_cost_model("llama-7b")]
    for m in models:
        for _ in range(2):  # the memo empty, then filled
            for k in (1, 2, 3, 7, 8, 9, 64, 365):
                bw = m.size_bandwidth(k)
                for t in (1, 4096, 16384, 131071, np.array([5.0, 16384.0, 70001.0])):
                    s = 2 * k * 70001
                    for kind in ("kv", "latent") if m.latent_bytes_per_token else ("kv",):
                        sent, comm, up, overlap, attention = _by_hand(m, t, s, k, bw, kind)
                        assert np.array_equal(m.layer_ring_bytes(num_tokens=t, ring_size=k, kind=kind), sent)
                        assert np.array_equal(m.layer_ring_comm_time(num_tokens=t, ring_size=k, kind=kind), comm)
                        assert np.array_equal(m.layer_up_projection_time(num_tokens=t, ring_size=k, kind=kind), up)
                        assert np.array_equal(m.layer_ring_overlap_time(num_tokens=t, attention=attention,
                                                                        ring_size=k, kind=kind), overlap)
                    if isinstance(t, np.ndarray):
                        continue
                    kinds = ("kv", "latent") if m.ring_kind == "auto" and m.latent_bytes_per_token and k > 1 else (
                        "kv" if m.ring_kind == "auto" else m.ring_kind,)
                    shard = m.b1 * t + min(_by_hand(m, t, s, k, bw, kind)[3] for kind in kinds)
                    assert m.layer_shard_time(seq_len=s, num_tokens=t, ring_size=k) == shard
