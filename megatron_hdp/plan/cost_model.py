"""The one cost model the planner, the simulator and the runtime statistics share.

Notation of ByteScale (arXiv 2502.21231) Eq. 3, per transformer layer on one rank, forward + backward:

    T(s)   = a1 * s^2 + b1 * s + g      compute seconds for a whole causal document of s tokens
    Act(s) = a2 * s + b2                activation bytes kept for backward

A rank holding t tokens of a document of s tokens split over a ring of k ranks (zigzag, so every member
does the same causal work) computes a1 * s * t + b1 * t: its t queries see on average s/2 keys, and
a1 * s^2 is the cost of the whole document's s^2/2 causal pairs. Ring attention sends, per layer and per
member, exactly what `attention.zigzag_ring` sends: k-1 K/V buffers in the forward, k-1 K/V buffers and
k dK/dV buffers in the backward (the partials ride the ring back to their owner), K/V in the activation
dtype and dK/dV in the accumulation dtype (fp32 for bf16/fp16 activations): per member
(2 (k-1) + k * grad_factor) * t * kv_bytes_per_token bytes in 3k-2 messages, grad_factor = 2 in bf16 and
1 in fp32 (`layer_ring_bytes`; tests/test_ring_traffic.py holds it against the gloo traffic counters).
That traffic is overlapped with the member's attention compute, so only the excess is exposed. With a
topology (`ranks_per_node`, `intra_node_bandwidth`) a ring runs at its slowest link: NVLink inside one
node, the inter-node link (`ring_bandwidth`) as soon as it crosses one. Documents that share a
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

import numpy as np

from megatron_hdp.plan.pipeline import FORWARD_SHARE


RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
"""Megatron's --recompute-granularity values, "none" for the flag left out."""



HOST_BUFFER_OVERHEAD = 9 / 8
"""Pinned host bytes per offloaded byte, at most: the offload pool pins each span in power-of-two pieces
that add up to the span rounded up to 1/8 of its power of two (`offload/pool.py`; exact for spans of at
least 32 KiB, and the offloader moves none under 1 MiB by default)."""

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
    activation_dtype_bytes: int = 2
    """Bytes per element of the activations (bf16: 2, fp32: 4): K/V travel in it, dK/dV in the ring's
    accumulation dtype, at least fp32 (see `kv_grad_bytes_per_token`). Old JSON without it: bf16."""
    host_memory_bytes: Optional[float] = None
    """Pinned host bytes one rank may fill with offloaded activations (None: unlimited). Bounds the
    planner's offload decision: r * Act(t) * layers per stage * HOST_BUFFER_OVERHEAD <= host_memory_bytes."""
    ranks_per_node: Optional[int] = None
    """HDP ranks per node (rank r on node r // ranks_per_node); None: topology unknown, every ring link runs
    at `ring_bandwidth`."""
    intra_node_bandwidth: Optional[float] = None
    """Bytes/s of a ring link inside a node (NVLink); `ring_bandwidth` is then the link between nodes
    (InfiniBand per GPU). None: `ring_bandwidth` everywhere. A ring runs at its slowest link."""
    expert_parallel_size: int = 1
    """HDP ranks per expert-parallel group (consecutive ranks, `plan.timing.expert_groups`): their MoE
    all-to-all couples micro-batch i of every member, and each member runs its group's largest count. EP
    when expert TP is TP; with another expert TP, `plan.timing.expert_unit_size`."""
    ring_block_overhead: float = 0.0
    """Seconds per document, per extra ring step, per layer that no transfer hides: a split document costs
    2 (k-1) more attention-kernel calls (one block per ring step, forward and backward) than a whole one.
    About 0 where one varlen kernel call takes every document of a step; tens of microseconds on the CPU
    backend, which calls the kernel per document (fitted by `benchmarks/step_bench.py`: the dated value
    is in benchmarks/results/step_bench.json)."""
    jitter: float = 0.0
    """Relative standard deviation of a micro-batch's time from one rank to another running the same work
    (0: every rank runs at the model's time). Members of a ring finish with the slowest, so rings pay the
    expected lead of the slowest of k over their mean (`plan.timing.jitter_lead`). About 0 on
    dedicated GPUs; several percent for CPU processes sharing cores (fitted by `benchmarks/step_bench.py`
    to the lead of the slowest member of identical ring micro-batches, `plan.fit.fit_jitter`)."""
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
            optional = f.name in ("host_memory_bytes", "ranks_per_node", "intra_node_bandwidth")
            if (value is None and optional) or f.name == "recompute_granularity":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"cost model {f.name} must be a finite number, got {value!r}")
        for name in ("a1", "b1", "g", "a2", "b2", "kv_bytes_per_token", "ring_latency", "ring_block_overhead",
                     "jitter"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model coefficient {name} must be >= 0, got {getattr(self, name)}")
        for name in ("ring_bandwidth", "d2h_bandwidth", "h2d_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost model {name} must be > 0, got {getattr(self, name)}")
        if self.intra_node_bandwidth is not None and self.intra_node_bandwidth <= 0:
            raise ValueError(f"cost model intra_node_bandwidth must be > 0, got {self.intra_node_bandwidth}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(f"cost model host_memory_bytes must be >= 0, got {self.host_memory_bytes}")
        if self.activation_dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"cost model activation_dtype_bytes must be 1, 2, 4 or 8, got {self.activation_dtype_bytes}")
        for name in ("num_layers", "expert_parallel_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or value <= 0):
                raise ValueError(f"cost model {name} must be a positive integer, got {value!r}")

    # --- per layer -----------------------------------------------------------------------------
    def layer_compute_time(self, *, seq_len: int, num_tokens: int) -> float:
        """Compute seconds of one layer for `num_tokens` of a document of `seq_len` tokens."""
        return self.a1 * seq_len * num_tokens + self.b1 * num_tokens

    @property
    def kv_grad_bytes_per_token(self) -> float:
        """Bytes of dK and dV of one token in one layer as the ring backward sends them: the accumulation
        dtype, max(fp32, activation dtype) (`zigzag_ring._accumulation_dtype`)."""
        element = self.activation_dtype_bytes
        return self.kv_bytes_per_token * max(4, element) / element

    @staticmethod
    def ring_messages(ring_size: int) -> int:
        """Messages one member sends per layer: k-1 forward, k-1 K/V + k dK/dV backward."""
        return 3 * ring_size - 2 if ring_size > 1 else 0

    def layer_ring_bytes(self, *, num_tokens, ring_size: int):
        """Bytes one member holding `num_tokens` sends around a ring of `ring_size`, one layer, fwd + bwd."""
        if ring_size <= 1:
            return 0.0
        per_token = 2 * (ring_size - 1) * self.kv_bytes_per_token + ring_size * self.kv_grad_bytes_per_token
        return per_token * num_tokens

    def layer_ring_comm_time(self, *, num_tokens, ring_size: int, bandwidth=None):
        """Seconds one ring member spends sending its K/V (and dK/dV) around a ring, one layer, over links
        of `bandwidth` (default: what a ring of this size gets when placed inside a node if it fits,
        `size_bandwidth`)."""
        if bandwidth is None:
            bandwidth = self.size_bandwidth(ring_size)
        return (self.layer_ring_bytes(num_tokens=num_tokens, ring_size=ring_size) / bandwidth
                + self.ring_messages(ring_size) * self.ring_latency)

    # --- topology ------------------------------------------------------------------------------
    def crosses_nodes(self, ring: Sequence[int]) -> bool:
        """Whether the ranks of `ring` sit on more than one node (always False without a topology)."""
        if self.ranks_per_node is None or len(ring) <= 1:
            return False
        first = ring[0] // self.ranks_per_node
        return any(rank // self.ranks_per_node != first for rank in ring)

    def ring_link_bandwidth(self, ring: Sequence[int]) -> float:
        """Bytes/s of the slowest link of `ring`: between nodes when it crosses one, else inside one."""
        if self.intra_node_bandwidth is None or self.crosses_nodes(ring) or self.ranks_per_node is None:
            return self.ring_bandwidth
        return self.intra_node_bandwidth

    def size_bandwidth(self, ring_size: int) -> float:
        """Link bytes/s the planner assumes for a ring of `ring_size` before it is placed: inside a node
        when it fits one (the placement keeps such rings inside a node when it can), else between nodes."""
        if self.intra_node_bandwidth is None or self.ranks_per_node is None or ring_size > self.ranks_per_node:
            return self.ring_bandwidth
        return self.intra_node_bandwidth

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
        ring costs b1 * sum(t) + max(sum(a1 * s * t), layer_ring_comm_time(sum(t), k)), plus
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
            comm = self.layer_ring_comm_time(num_tokens=num_tokens, ring_size=len(ring),
                                             bandwidth=self.ring_link_bandwidth(ring))
            blocks = self.layer_ring_block_time(num_documents=num_documents, ring_size=len(ring))
            per_layer += self.b1 * num_tokens + max(attention, comm) + blocks
        return per_layer * self.num_layers / pp_size

    def sequence_time(self, seq_len: int, *, ring_size: int = 1, pp_size: int = 1) -> float:
        """Seconds one ring member spends on a document split evenly over `ring_size` ranks."""
        tokens = -(-seq_len // ring_size)
        return self.microbatch_time([(seq_len, tokens, tuple(range(ring_size)))], pp_size=pp_size)

    def ring_bytes(self, *, num_tokens: int, ring_size: int, pp_size: int = 1) -> float:
        """Attention bytes one ring member sends in one step (all layers of a stage, fwd + bwd)."""
        return self.layer_ring_bytes(num_tokens=num_tokens, ring_size=ring_size) * self.num_layers / pp_size

    def offload_windows(self, layer_time):
        """(forward, backward) seconds of one layer that offload copies can hide under: a layer's D2H copy
        overlaps the forward of the layers after it, its H2D prefetch the backward of the layers after it
        (in backward order), so each direction has one layer's share of its own pass per layer."""
        forward = layer_time * FORWARD_SHARE
        return forward, layer_time - forward

    def exposed_offload_time(self, copy_bytes, layer_time):
        """Seconds per layer that copying `copy_bytes` out in the forward and back in the backward adds
        beyond the windows of `offload_windows` (0 when both copies hide)."""
        forward, backward = self.offload_windows(layer_time)
        return (np.maximum(0.0, copy_bytes / self.d2h_bandwidth - forward)
                + np.maximum(0.0, copy_bytes / self.h2d_bandwidth - backward))

    def hidden_offload_ratio(self, *, seq_len: int, num_tokens: int, ring_size: int) -> float:
        """Largest fraction of a layer's activations whose copies both hide (ByteScale Eq. 3, with the
        windows it leaves implicit): r * Act(t) / B_d2h <= forward and r * Act(t) / B_h2d <= backward of
        one layer of the shard (`offload_windows`). Capped at 1.
        """
        act = self.activation_bytes(num_tokens)
        if act <= 0:
            return 1.0
        forward, backward = self.offload_windows(
            self.layer_shard_time(seq_len=seq_len, num_tokens=num_tokens, ring_size=ring_size))
        return min(1.0, forward * self.d2h_bandwidth / act, backward * self.h2d_bandwidth / act)

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
