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
1 in fp32 (`layer_ring_bytes`; tests/comm/test_ring_traffic.py holds it against the gloo traffic counters).
That traffic is overlapped with the member's attention compute, so only the excess is exposed.

Multi-latent attention has a second ring (`attention.latent_ring`): the latent and the shared RoPE key
circulate instead of K and V, `latent_bytes_per_token` in place of `kv_bytes_per_token` in the same
formula, and every member up-projects what it receives: per layer (4 (k-1) + 1) * t * up_projection_time
(forward, the backward's recompute, the latent's and the weight's gradients for each received token; the
recompute for its own, whose forward and backward b1 holds), work of the member added to its attention
before the overlap (`layer_up_projection_time`). The kind of each ring is `ring_kind`'s: forced, or per
ring group the faster (`ring_kind_for`); the planner records it in the plan (`SequencePlacement.ring_kind`)
and the timing and the simulator price each ring by its kind. With a
topology (`ranks_per_node`, `intra_node_bandwidth`) a ring runs at its slowest link: NVLink inside one
node, the inter-node link (`ring_bandwidth`) as soon as it crosses one. Documents that share a
ring in one micro-batch share its exchange (one message per ring step carries all of them): their tokens
and their attention are summed before the overlap (`microbatch_time`).

Coefficients come from a model shape and a hardware profile (analytic FLOPs; see `presets.py`) or from
a JSON written by `megatron-hdp calibrate`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from megatron_hdp.plan.cost.experts import spread_expert_work, spread_grid
from megatron_hdp.plan.step_plan import RING_KINDS


RECOMPUTE_GRANULARITIES = ("none", "full", "selective")
"""Megatron's --recompute-granularity values, "none" for the flag left out."""

RING_KIND_SETTINGS = ("auto", *RING_KINDS)
"""`CostModel.ring_kind`: one kind for every ring, or "auto" (per ring group, the faster one)."""



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
    """HDP ranks per expert-parallel group (consecutive ranks, `plan.cost.experts.expert_groups`): their MoE
    all-to-all couples micro-batch i of every member, and each member runs its group's largest count. EP
    when expert TP is TP; with another expert TP, `plan.cost.experts.expert_unit_size`."""
    expert_share: float = 0.0
    """Of b1, the share that is routed-expert work (0 for a dense model): with `expert_parallel_size` > 1
    the MoE all-to-all runs it on the members holding the token's experts, so each member of an EP group
    does its group's mean of it at every micro-batch index (`plan.cost.experts.spread_expert_work`). Analytic:
    the routed experts' share of the linear FLOPs (`presets.analytic_cost_model`); fitted on the CPU by
    `benchmarks/step_bench.py` from an EP group where one member holds all the tokens."""
    expert_alltoall_bytes_per_token: float = 0.0
    """Bytes one MoE all-to-all moves per token a rank holds, per layer averaged over the model's layers,
    were every routed copy to leave the rank: the hidden state (activation dtype) times top-k, over TP
    (sequence parallel), times the MoE layers' share of the layers (0 for a dense model). With
    `expert_parallel_size` e > 1 the share (e - 1) / e of it crosses the EP group's links, four times per
    layer (dispatch and combine, forward and backward), not overlapped with compute (Megatron's alltoall
    dispatcher runs them on the compute stream): `expert_alltoall_seconds_per_token`."""
    expert_alltoall_bandwidth: Optional[float] = None
    """Bytes/s at which those transfers run, where it is not the EP group's link (`size_bandwidth`): the
    CPU harness measures gloo's all-to-all in CPU seconds per byte, which no ring link gives
    (`harness.cpu_fit.measure_alltoall`). None: the link."""
    ring_block_overhead: float = 0.0
    """Seconds per document, per extra ring step, per layer that no transfer hides: a split document costs
    2 (k-1) more attention-kernel calls (one block per ring step, forward and backward) than a whole one.
    About 0 where one varlen kernel call takes every document of a step; tens of microseconds on the CPU
    backend, which calls the kernel per document (fitted by `benchmarks/step_bench.py`: the dated value
    is in benchmarks/results/step_bench.json)."""
    jitter: float = 0.0
    """Relative standard deviation of a micro-batch's time from one rank to another running the same work
    (0: every rank runs at the model's time). Members of a ring finish with the slowest, so rings pay the
    expected lead of the slowest of k over their mean (`plan.timeline.timing.jitter_lead`). About 0 on
    dedicated GPUs; several percent for CPU processes sharing cores (fitted by `benchmarks/step_bench.py`
    to the lead of the slowest member of identical ring micro-batches, `plan.cost.fit.fit_jitter`)."""
    recompute_granularity: str = "none"
    """Megatron's --recompute-granularity these coefficients hold for: none, full or selective.
    Recomputation trades Act(s) for T(s) (full keeps a layer's input only and runs its forward twice), so
    a cost model measured under another setting mis-sizes D(s) and the step times; `validate_hdp_args`
    warns when the run's setting differs."""

    latent_bytes_per_token: float = 0.0
    """Bytes of multi-latent attention's latent and shared RoPE key of one token in one layer (what a latent
    ring step sends per token: kv_lora_rank + qk_pos_emb_head_dim values, not divided by TP); 0: no latent
    ring (the model's attention is not multi-latent)."""
    up_projection_time: float = 0.0
    """Seconds of one forward up-projection (latent -> this TP rank's K and V, `linear_kv_up_proj`) of one
    token in one layer. A latent ring member runs it 4x per token it receives and once more per own token
    (`layer_up_projection_time`)."""
    ring_kind: str = "auto"
    """Which ring split documents run: "kv", "latent" (needs `latent_bytes_per_token`), or "auto": per ring
    group the one `ring_kind_for` times faster (always "kv" without a latent)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ring_factors", {})  # `_ring_terms`' memo (not a field: eq, hash, asdict skip it)
        if self.ring_kind not in RING_KIND_SETTINGS:
            raise ValueError(f"cost model ring_kind must be one of {RING_KIND_SETTINGS}, got {self.ring_kind!r}")
        if self.ring_kind == "latent" and not self.latent_bytes_per_token:
            raise ValueError("cost model ring_kind 'latent' needs latent_bytes_per_token > 0 (a multi-latent "
                             "attention model); use 'kv' or 'auto'")
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"cost model recompute_granularity must be one of {RECOMPUTE_GRANULARITIES}, got "
                f"{self.recompute_granularity!r}"
            )
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            optional = f.name in ("host_memory_bytes", "ranks_per_node", "intra_node_bandwidth",
                                  "expert_alltoall_bandwidth")
            if (value is None and optional) or f.name in ("recompute_granularity", "ring_kind"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"cost model {f.name} must be a finite number, got {value!r}")
        for name in ("a1", "b1", "g", "a2", "b2", "kv_bytes_per_token", "ring_latency", "ring_block_overhead",
                     "jitter", "latent_bytes_per_token", "up_projection_time", "expert_alltoall_bytes_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"cost model coefficient {name} must be >= 0, got {getattr(self, name)}")
        for name in ("ring_bandwidth", "d2h_bandwidth", "h2d_bandwidth"):
            if getattr(self, name) <= 0:
                raise ValueError(f"cost model {name} must be > 0, got {getattr(self, name)}")
        for name in ("intra_node_bandwidth", "expert_alltoall_bandwidth"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"cost model {name} must be > 0 (or left out), got {getattr(self, name)}")
        if self.host_memory_bytes is not None and self.host_memory_bytes < 0:
            raise ValueError(f"cost model host_memory_bytes must be >= 0, got {self.host_memory_bytes}")
        if not 0.0 <= self.expert_share <= 1.0:
            raise ValueError(f"cost model expert_share must be in [0, 1], got {self.expert_share}")
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

    def expert_seconds_per_token(self, *, pp_size: int = 1) -> float:
        """Routed-expert seconds of one token on one pipeline stage (its layers, forward + backward): what the
        EP all-to-all spreads over the group (`plan.cost.experts.spread_expert_work`)."""
        return self.expert_share * self.b1 * self.num_layers / pp_size

    def expert_alltoall_seconds_per_token(self, *, pp_size: int = 1) -> float:
        """Seconds the MoE all-to-alls of one pipeline stage (its layers, forward + backward) take per token
        of the EP group's most loaded member: each member sends (e - 1) / e of its tokens' routed copies
        over its link (inside a node when the group fits one: `size_bandwidth`; `expert_alltoall_bandwidth`
        where given), and the collective ends with its largest sender (`plan.cost.experts.spread_expert_work`).
        0 without expert parallelism."""
        e = self.expert_parallel_size
        if e <= 1 or not self.expert_alltoall_bytes_per_token:
            return 0.0
        bandwidth = self.expert_alltoall_bandwidth or self.size_bandwidth(e)
        per_layer = 4 * self.expert_alltoall_bytes_per_token * (e - 1) / e / bandwidth
        return per_layer * self.num_layers / pp_size

    def expert_coupled_times(self, times: Sequence[Sequence[float]], tokens: Sequence[Sequence[float]], *,
                             pp_size: int = 1) -> list[list[float]]:
        """`times[r][i]` (micro-batch times, padded as the runtime runs them) under this model's EP coupling:
        each group's routed expert work shared out and the all-to-all's transfers added at every index
        (`plan.cost.experts.spread_expert_work` at `expert_seconds_per_token` and
        `expert_alltoall_seconds_per_token`). What the planner, the simulator and the Hybrid-CP estimate time."""
        return spread_expert_work(times, tokens, ep_size=self.expert_parallel_size,
                                  seconds_per_token=self.expert_seconds_per_token(pp_size=pp_size),
                                  alltoall_seconds_per_token=self.expert_alltoall_seconds_per_token(pp_size=pp_size))

    def expert_coupled_grid(self, times: np.ndarray, tokens: np.ndarray, *, pp_size: int = 1) -> np.ndarray:
        """`expert_coupled_times` on [rank, index] arrays (zeros past a rank's padded count), the same floats:
        the array form `assemble.time_plan` keeps without PP."""
        spt = self.expert_seconds_per_token(pp_size=pp_size)
        a2a = self.expert_alltoall_seconds_per_token(pp_size=pp_size)
        e = self.expert_parallel_size
        if e <= 1 or not (spt or a2a):
            return times
        shape = (-1, e, times.shape[1])
        return spread_grid(times.reshape(shape), tokens.reshape(shape), seconds_per_token=spt,
                           alltoall_seconds_per_token=a2a).reshape(times.shape)

    def ring_bytes_per_token(self, kind: str = "kv") -> float:
        """Bytes of one token of what a ring of `kind` circulates, in one layer: K and V, or the latent."""
        return self.latent_bytes_per_token if kind == "latent" else self.kv_bytes_per_token

    def grad_bytes_per_token(self, kind: str = "kv") -> float:
        """Bytes of the gradient partials of one token in one layer as a ring of `kind` sends them back: the
        accumulation dtype, max(fp32, activation dtype) (`attention.ring_loop.accumulation_dtype`)."""
        element = self.activation_dtype_bytes
        return self.ring_bytes_per_token(kind) * max(4, element) / element

    @property
    def kv_grad_bytes_per_token(self) -> float:
        """Bytes of dK and dV of one token in one layer as the K/V ring's backward sends them."""
        return self.grad_bytes_per_token("kv")

    @staticmethod
    def ring_messages(ring_size: int) -> int:
        """Messages one member sends per layer: k-1 forward, k-1 K/V + k dK/dV backward."""
        return 3 * ring_size - 2 if ring_size > 1 else 0

    def _ring_terms(self, ring_size: int, kind: str) -> tuple[float, float, int]:
        """The per-layer factors of one member of a ring of `ring_size` (> 1) and `kind`: bytes sent per token
        held (forward: k-1 blocks of what circulates; backward: k-1 again and k of its gradient partials),
        seconds of its messages' latency, and up-projections per token held (a latent ring: 4 per received
        token, 1 per own one; 0 for K/V). Computed once per model and (size, kind): the ring sizing times
        thousands of shards a plan, each through `layer_ring_overlap_time`."""
        terms = self._ring_factors.get((ring_size, kind))
        if terms is None:
            per_token = 2 * (ring_size - 1) * self.ring_bytes_per_token(kind) + ring_size * self.grad_bytes_per_token(kind)
            ups = 4 * (ring_size - 1) + 1 if kind == "latent" else 0
            terms = self._ring_factors[ring_size, kind] = (per_token, self.ring_messages(ring_size) * self.ring_latency, ups)
        return terms

    def layer_ring_bytes(self, *, num_tokens, ring_size: int, kind: str = "kv"):
        """Bytes one member holding `num_tokens` sends around a ring of `ring_size` and `kind`, one layer,
        fwd + bwd."""
        if ring_size <= 1:
            return 0.0
        return self._ring_terms(ring_size, kind)[0] * num_tokens

    def layer_ring_comm_time(self, *, num_tokens, ring_size: int, bandwidth=None, kind: str = "kv"):
        """Seconds one ring member spends sending its share (K/V or latent, and their gradients) around a
        ring of `kind`, one layer, over links of `bandwidth` (default: what a ring of this size gets when
        placed inside a node if it fits, `size_bandwidth`)."""
        if bandwidth is None:
            bandwidth = self.size_bandwidth(ring_size)
        return self._comm(num_tokens, ring_size, bandwidth, kind)

    def _comm(self, num_tokens, ring_size: int, bandwidth: float, kind: str):
        """`layer_ring_comm_time` with every argument given (positional: the ring sizing's hot path)."""
        if ring_size <= 1:
            return 0.0 / bandwidth + self.ring_messages(ring_size) * self.ring_latency
        per_token, messages, _ = self._ring_terms(ring_size, kind)
        return per_token * num_tokens / bandwidth + messages

    def layer_up_projection_time(self, *, num_tokens, ring_size: int, kind: str = "kv"):
        """Seconds of up-projection one member of a latent ring adds in one layer, holding `num_tokens`:
        4 up-projections per received token ((k-1) t: the position-0 member attends every row it receives,
        and ring steps wait for the slowest member) and 1 per own token (the backward's recompute)."""
        return self._up(num_tokens, ring_size, kind)

    def _up(self, num_tokens, ring_size: int, kind: str):
        """`layer_up_projection_time`, positional."""
        if kind != "latent" or ring_size <= 1:
            return 0.0 * num_tokens
        return self._ring_terms(ring_size, kind)[2] * num_tokens * self.up_projection_time

    def layer_ring_overlap_time(self, *, num_tokens, attention, ring_size: int, bandwidth=None, kind: str = "kv"):
        """Seconds of one layer of a ring group beyond its linear work: its attention (and up-projection)
        with the ring's traffic hidden under them, only the excess exposed."""
        if bandwidth is None:
            bandwidth = self.size_bandwidth(ring_size)
        return self._overlap(num_tokens, attention, ring_size, bandwidth, kind)

    def _overlap(self, num_tokens, attention, ring_size: int, bandwidth: float, kind: str):
        """`layer_ring_overlap_time` with every argument given, positional."""
        work = attention + self._up(num_tokens, ring_size, kind)
        comm = self._comm(num_tokens, ring_size, bandwidth, kind)
        return np.maximum(work, comm) if isinstance(work, np.ndarray) else max(work, comm)

    def ring_kind_for(self, *, num_tokens: float, attention: float, ring_size: int, bandwidth=None) -> str:
        """The ring a group of `num_tokens` per member with `attention` seconds per layer runs: `ring_kind`
        when forced, else the kind of least `layer_ring_overlap_time` (the K/V ring on a tie, and always
        without a latent)."""
        if self.ring_kind != "auto":
            return self.ring_kind
        if not self.latent_bytes_per_token or ring_size <= 1:
            return "kv"
        times = [self.layer_ring_overlap_time(num_tokens=num_tokens, attention=attention, ring_size=ring_size,
                                              bandwidth=bandwidth, kind=kind) for kind in RING_KINDS]
        return RING_KINDS[int(times[1] < times[0])]

    def layer_ring_buffer_bytes(self, *, num_tokens: int, ring_size: int, kind: str = "kv") -> float:
        """Transient device bytes a member holding `num_tokens` uses for a ring of `kind` in one layer's
        backward (the larger pass), beyond the activations (`a2`): two buffers of what circulates (held,
        arriving), three of its gradient partials (accumulating, leaving, arriving), and for a latent ring
        the up-projected block, its K and V and their gradients (at least 2 kv_bytes_per_token per token).
        Not planned with (the capacity C leaves room for it); `megatron-hdp plan` reports the largest over a
        plan's ring calls (its `ring MB` column, `commands.plan.peak_ring_buffer_bytes`)."""
        if ring_size <= 1:
            return 0.0
        per_token = 2 * self.ring_bytes_per_token(kind) + 3 * self.grad_bytes_per_token(kind)
        if kind == "latent":
            per_token += 2 * self.kv_bytes_per_token
        return per_token * num_tokens

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
        """One layer's time for one shard: linear work plus attention, ring traffic hidden under it (the
        ring kind `ring_kind_for` picks, at `size_bandwidth`)."""
        attention = self.a1 * seq_len * num_tokens
        bandwidth = self.size_bandwidth(ring_size)
        if self.ring_kind == "auto" and self.latent_bytes_per_token and ring_size > 1:
            # the kind ring_kind_for picks is the one of least overlap time (K/V on a tie: the same value),
            # so each kind is timed once here instead of again for the kind picked (the ring sizing's hot path)
            return self.b1 * num_tokens + min(self._overlap(num_tokens, attention, ring_size, bandwidth, "kv"),
                                              self._overlap(num_tokens, attention, ring_size, bandwidth, "latent"))
        kind = self.ring_kind_for(num_tokens=num_tokens, attention=attention, ring_size=ring_size, bandwidth=bandwidth)
        return self.b1 * num_tokens + self._overlap(num_tokens, attention, ring_size, bandwidth, kind)

    def activation_bytes(self, num_tokens: int) -> float:
        """Act(t): activation bytes of one layer for `num_tokens` tokens in one micro-batch."""
        return self.a2 * num_tokens + self.b2

    # --- whole micro-batches -------------------------------------------------------------------
    def microbatch_time(self, shards: Sequence[tuple], *, pp_size: int = 1) -> float:
        """Seconds of one micro-batch on one pipeline stage.

        `shards` holds (seq_len, num_tokens, ring) or (seq_len, num_tokens, ring, ring_kind) for each
        document piece in the micro-batch, `ring` the ranks holding that document (one rank: it is whole),
        `ring_kind` the plan's ("kv" or "latent"; left out: `ring_kind_for` picks). Pieces on the same ring
        of k > 1 ranks share one ring exchange, as the runtime's ring-attention call runs all of them
        together (so they share a kind): per layer that ring costs b1 * sum(t) + layer_ring_overlap_time
        (max(sum(a1 * s * t) + up-projection, traffic of sum(t))), plus 2 (k-1) * ring_block_overhead
        per document on it.
        """
        per_layer = self.g
        rings: dict[tuple[int, ...], list] = {}
        for seq_len, num_tokens, ring, *kind in shards:
            if len(ring) <= 1:
                per_layer += self.layer_compute_time(seq_len=seq_len, num_tokens=num_tokens)
                continue
            summed = rings.setdefault(tuple(ring), [0.0, 0.0, 0, *kind])
            assert summed[3:] == kind, f"pieces on ring {ring} of one micro-batch with kinds {summed[3:]} and {kind}"
            summed[0] += num_tokens
            summed[1] += self.a1 * seq_len * num_tokens
            summed[2] += 1
        for ring, (num_tokens, attention, num_documents, *kind) in rings.items():
            bandwidth, k = self.ring_link_bandwidth(ring), len(ring)
            kind = kind[0] if kind else self.ring_kind_for(num_tokens=num_tokens, attention=attention, ring_size=k,
                                                           bandwidth=bandwidth)
            overlap = self.layer_ring_overlap_time(num_tokens=num_tokens, attention=attention, ring_size=k,
                                                   bandwidth=bandwidth, kind=kind)
            blocks = self.layer_ring_block_time(num_documents=num_documents, ring_size=k)
            per_layer += self.b1 * num_tokens + overlap + blocks
        return per_layer * self.num_layers / pp_size

    def sequence_time(self, seq_len: int, *, ring_size: int = 1, pp_size: int = 1) -> float:
        """Seconds one ring member spends on a document split evenly over `ring_size` ranks."""
        tokens = -(-seq_len // ring_size)
        return self.microbatch_time([(seq_len, tokens, tuple(range(ring_size)))], pp_size=pp_size)

    def ring_bytes(self, *, num_tokens: int, ring_size: int, pp_size: int = 1, kind: str = "kv") -> float:
        """Attention bytes one member of a ring of `kind` sends in one step (all layers of a stage, fwd + bwd)."""
        return self.layer_ring_bytes(num_tokens=num_tokens, ring_size=ring_size, kind=kind) * self.num_layers / pp_size

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


FORWARD_SHARE = 1.0 / 3.0
"""Fraction of a micro-batch's time spent in the forward pass (backward = 2x forward)."""


@functools.lru_cache(maxsize=None)
def expected_max_of_normals(k: int) -> float:
    """E[max of k independent standard normal variables]: 0 for k = 1, 0.56 for 2, 1.03 for 4, 1.42 for 8."""
    if k <= 1:
        return 0.0
    x = np.linspace(-10.0, 10.0, 20001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    density = k * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (k - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))
