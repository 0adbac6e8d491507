"""The one cost model the planner, the simulator and the runtime statistics share.

Notation of ByteScale (arXiv 2502.21231) Eq. 3, per transformer layer on one rank, forward + backward:

    T(s)   = a1 * s^2 + b1 * s + g      compute seconds for a whole causal document of s tokens
    Act(s) = a2 * s + b2                activation bytes kept for backward

A rank holding t tokens of a document of s tokens split over a ring of k ranks (zigzag, so every member
does the same causal work) computes a1 * s * t + b1 * t: its t queries see on average s/2 keys, and
a1 * s^2 is the cost of the whole document's s^2/2 causal pairs. Ring attention sends, per layer and per
member, k-1 K/V blocks in the forward and k-1 K/V + dK/dV blocks in the backward (3 (k-1) t kv-bytes),
overlapped with that member's attention compute, so only the excess is exposed. Documents that share a
ring in one micro-batch share its exchange (one message per ring step carries all of them): their tokens
and their attention are summed before the overlap (`microbatch_time`).

Coefficients come from a model shape and a hardware profile (analytic FLOPs; see `presets.py`) or from
a JSON written by `megatron-hdp calibrate`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
"""Megatron's --recompute-granularity values, "none" for the flag left out."""


@dataclass(frozen=True)
class CostModel:
    """Per-layer coefficients for one rank (TP already applied) and the links it uses."""

    a1: float
    """Seconds per token^2 of causal attention (fwd + bwd) for a whole document: T's s^2 term."""
    b1: float
    """Seconds per token of the linear layers (QKV, projection, MLP; fwd + bwd)."""
    g: float
    """Seconds of fixed overhead per micro-batch per layer (kernel launches)."""
    a2: float
    """Activation bytes per token per layer kept for backward."""
    b2: float
    """Fixed activation bytes per micro-batch per layer."""
    kv_bytes_per_token: float
    """Bytes of K and V of one token in one layer (what a ring step sends per token)."""
    num_layers: int
    """Transformer layers of the whole model (a pipeline stage holds num_layers / pp_size)."""
    ring_bandwidth: float
    """Bytes/s of one point-to-point ring link."""
    ring_latency: float = 10e-6
    """Seconds of fixed cost per ring message."""
    d2h_bandwidth: float = 25e9
    """Bytes/s from device to pinned host memory (activation offload)."""
    h2d_bandwidth: float = 25e9
    """Bytes/s from pinned host memory back to the device."""
    host_memory_bytes: Optional[float] = None
    """Pinned host bytes one rank may fill with offloaded activations (None: unlimited). Bounds the
    planner's offload decision: r * Act(t) * layers per stage <= host_memory_bytes."""
    ring_block_overhead: float = 0.0
    """Seconds per document, per extra ring step, per layer that no transfer hides: a split document costs
    2 (k-1) more attention-kernel calls (one block per ring step, forward and backward) than a whole one.
    About 0 where one varlen kernel call takes every document of a step; ~40 us on the CPU backend, which
    calls the kernel per document (fitted by `benchmarks/step_bench.py`)."""
    recompute_granularity: str = "none"
    """Megatron's --recompute-granularity these coefficients hold for: none, full or selective.
    Recomputation trades Act(s) for T(s) (full keeps a layer's input only and runs its forward twice), so
    a cost model measured under another setting mis-sizes D(s) and the step times; `validate_hdp_args`
    warns when the run's setting differs."""

    def __post_init__(self) -> None:
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"cost model recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got "
                f"{self.recompute_granularity!r}"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (value is None and f.name == "host_memory_bytes") or f.name == "recompute_granularity":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"cost model {f.name} must be a finite number, got {value!r}")
        for name in ("a1", "b1", "g", "a2", "b2", "kv_bytes_per_token", "ring_latency", "ring_block_overhead"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model coefficient {name} must be >= 0, got {getattr(self, name)}")
        for name in ("ring_bandwidth", "d2h_bandwidth", "h2d_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost model {name} must be > 0, got {getattr(self, name)}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(f"cost model host_memory_bytes must be >= 0, got {self.host_memory_bytes}")
        if not isinstance(self.num_layers, numbers.Integral) or self.num_layers <= 0:
            raise ValueError(f"cost model num_layers must be a positive integer, got {self.num_layers!r}")

    # --- per layer -----------------------------------------------------------------------------
    def layer_compute_time(self, *, seq_len: int, num_tokens: int) -> float:
        """Compute seconds of one layer for `num_tokens` of a document of `seq_len` tokens."""
        return self.a1 * seq_len * num_tokens + self.b1 * num_tokens

    def layer_ring_comm_time(self, *, num_tokens: int, ring_size: int) -> float:
        """Seconds one ring member spends sending its K/V (and dK/dV) around a ring, one layer."""
        if ring_size <= 1:
            return 0.0
        steps = 3 * (ring_size - 1)
        return steps * (self.kv_bytes_per_token * num_tokens / self.ring_bandwidth + self.ring_latency)

    def layer_ring_block_time(self, *, num_documents: int, ring_size: int) -> float:
        """Seconds of per-block kernel overhead of `num_documents` split over one ring of `ring_size`, one
        layer (not hidden by the ring's transfers: it is work of the same rank)."""
        if ring_size <= 1:
            return 0.0
        return 2 * (ring_size - 1) * num_documents * self.ring_block_overhead

    def layer_shard_time(self, *, seq_len: int, num_tokens: int, ring_size: int) -> float:
        """One layer's time for one shard: linear work plus attention, ring traffic hidden under it."""
        attention = self.a1 * seq_len * num_tokens
        comm = self.layer_ring_comm_time(num_tokens=num_tokens, ring_size=ring_size)
        return self.b1 * num_tokens + max(attention, comm)

    def activation_bytes(self, num_tokens: int) -> float:
        """Act(t): activation bytes of one layer for `num_tokens` tokens in one micro-batch."""
        return self.a2 * num_tokens + self.b2

    # --- whole micro-batches -------------------------------------------------------------------
    def microbatch_time(self, shards: Sequence[tuple[int, int, tuple[int, ...]]], *, pp_size: int = 1) -> float:
        """Seconds of one micro-batch on one pipeline stage.

        `shards` holds (seq_len, num_tokens, ring) for each document piece in the micro-batch, `ring` the
        ranks holding that document (one rank: it is whole). Pieces on the same ring of k > 1 ranks share
        one ring exchange, as the runtime's ring-attention call runs all of them together: per layer that
        ring costs b1 * sum(t) + max(sum(a1 * s * t), 3 (k-1) (kv_bytes * sum(t) / bw + latency)), plus
        2 (k-1) * ring_block_overhead per document on it.
        """
        per_layer = self.g
        rings: dict[tuple[int, ...], list[float]] = {}
        for seq_len, num_tokens, ring in shards:
            if len(ring) <= 1:
                per_layer += self.layer_compute_time(seq_len=seq_len, num_tokens=num_tokens)
                continue
            summed = rings.setdefault(tuple(ring), [0.0, 0.0, 0])
            summed[0] += num_tokens
            summed[1] += self.a1 * seq_len * num_tokens
            summed[2] += 1
        for ring, (num_tokens, attention, num_documents) in rings.items():
            comm = self.layer_ring_comm_time(num_tokens=num_tokens, ring_size=len(ring))
            blocks = self.layer_ring_block_time(num_documents=num_documents, ring_size=len(ring))
            per_layer += self.b1 * num_tokens + max(attention, comm) + blocks
        return per_layer * self.num_layers / pp_size

    def sequence_time(self, seq_len: int, *, ring_size: int = 1, pp_size: int = 1) -> float:
        """Seconds one ring member spends on a document split evenly over `ring_size` ranks."""
        tokens = -(-seq_len // ring_size)
        return self.microbatch_time([(seq_len, tokens, tuple(range(ring_size)))], pp_size=pp_size)

    def ring_bytes(self, *, num_tokens: int, ring_size: int, pp_size: int = 1) -> float:
        """Attention bytes one ring member sends in one step (all layers of a stage, fwd + bwd)."""
        if ring_size <= 1:
            return 0.0
        return 3 * (ring_size - 1) * self.kv_bytes_per_token * num_tokens * self.num_layers / pp_size

    def hidden_offload_ratio(self, *, seq_len: int, num_tokens: int, ring_size: int) -> float:
        """Largest fraction of a layer's activations whose D2H copy hides under that layer's compute.

        ByteScale Eq. 3's overlap constraint: r * Act(t) / B_d2h <= T_shard(t). Capped at 1.
        """
        act = self.activation_bytes(num_tokens)
        if act <= 0:
            return 1.0
        compute = self.layer_shard_time(seq_len=seq_len, num_tokens=num_tokens, ring_size=ring_size)
        return min(1.0, compute * self.d2h_bandwidth / act)

    # --- persistence ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The coefficients as a JSON-ready dict (the format `calibrate` writes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """Build from a dict; unknown keys are an error so that a typo never goes unnoticed."""
        if not isinstance(data, dict):
            raise ValueError(f"a cost model is a JSON object of coefficients, got {type(data).__name__}")
        fields = dataclasses.fields(cls)
        names = {f.name for f in fields}
        unknown = sorted(map(str, set(data) - names))
        if unknown:
            raise ValueError(f"unknown cost model keys {unknown}; expected a subset of {sorted(names)}")
        required = [f.name for f in fields if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ValueError(f"cost model keys {missing} are missing; required: {required}")
        return cls(**data)

    def to_json(self, path: str | Path) -> None:
        """Write the coefficients to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "CostModel":
        """Read coefficients written by `to_json` (e.g. by `megatron-hdp calibrate`)."""
        return cls.from_dict(json.loads(Path(path).read_text()))
