"""The simulated cluster: model, GPU count, TP x PP, the HDP pool it leaves, and what a rank can hold.

One validated object owns the layout (torchtitan's `ParallelDims` habit): GPUs = HDP ranks x TP x PP,
and every error names the factor that is wrong. The cost model comes from `presets` (analytic FLOPs) or
from a `megatron-hdp calibrate` JSON, so measured kernel timings feed the simulation when available.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_hdp.plan.cost.model import RING_KIND_SETTINGS, CostModel
from megatron_hdp.plan.timeline.interleaved import uncapped_warmup
from megatron_hdp.plan.cost.mesh import mesh_cost_model
from megatron_hdp.plan.cost.presets import HardwareProfile, ModelShape, hardware_profile, model_shape
from megatron_hdp.plan.cost.experts import expert_unit_size

_SUFFIX = {"K": 1024, "M": 1024**2, "G": 1024**3}
MEMORY_RESERVE = 0.10
"""Fraction of GPU memory kept free for the allocator, communication buffers and the LM head's logits."""


def format_tokens(tokens: int) -> str:
    """262144 -> '256K', 2097152 -> '2M' (binary suffixes, as `megatron-hdp plan`'s parse_count reads)."""
    for suffix in ("G", "M", "K"):
        if tokens % _SUFFIX[suffix] == 0:
            return f"{tokens // _SUFFIX[suffix]}{suffix}"
    return str(tokens)


@dataclass(frozen=True)
class ClusterSpec:
    """A cluster running one model: GPUs split into TP x PP x an HDP pool of `num_ranks` ranks."""

    model: str
    """Preset model name (`presets.MODELS`), e.g. 'llama-7b'."""
    num_gpus: int
    tp_size: int = 1
    pp_size: int = 1
    vpp_size: int = 1
    """Model chunks (virtual pipeline stages) per pipeline stage: Megatron's interleaved schedule when > 1."""
    hardware: str = "h100"
    """Preset hardware profile (`presets.HARDWARE`)."""
    allreduce_bandwidth: Optional[float] = None
    """Bytes/s of the gradient all-reduce ring per GPU; the hardware's inter-node link when unset."""
    ring_bandwidth: Optional[float] = None
    """Bytes/s of one ring-attention link, overriding the cost model's (hardware preset or calibrated)."""
    capacity: Optional[int] = None
    """Tokens per rank per micro-batch (C); derived from GPU memory when unset (`memory_capacity`)."""
    cost_model_path: Optional[str] = None
    """A `megatron-hdp calibrate` JSON to use instead of the analytic cost model."""
    gpus_per_node: Optional[int] = None
    """GPUs per node: a node holds gpus_per_node / tp_size consecutive HDP ranks of each pipeline stage
    (Megatron orders TP fastest, then DP), which talk over `intra_node_bandwidth`. None: the hardware's
    NVLink domain (8; 72 on gb200: the ring topology takes the NVLink domain as the node)."""
    intra_node_bandwidth: Optional[float] = None
    """Bytes/s of a ring link inside a node; the hardware's NVLink when unset."""
    ep_size: int = 1
    """Expert-parallel size (Megatron's --expert-model-parallel-size): each rank holds num_experts / EP of
    every MoE layer's experts, and the MoE all-to-all couples the HDP ranks of an EP group
    (`plan.cost.experts.expert_unit_size`)."""
    etp_size: Optional[int] = None
    """Expert tensor-parallel size (--expert-tensor-parallel-size); None: TP, Megatron's default."""
    ring_kind: Optional[str] = None
    """Which ring split documents run (`CostModel.ring_kind`: auto, kv, latent); None: the cost model's."""

    def __post_init__(self) -> None:
        self.shape  # unknown model -> ValueError naming the known ones
        self.hardware_profile
        for name in ("num_gpus", "tp_size", "pp_size", "vpp_size", "ep_size", "expert_tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_gpus % (self.tp_size * self.pp_size):
            raise ValueError(
                f"num_gpus {self.num_gpus} is not a multiple of tp_size x pp_size = {self.tp_size} x {self.pp_size}"
            )
        if self.shape.num_layers % self.pp_size:
            raise ValueError(f"pp_size {self.pp_size} does not divide {self.model}'s {self.shape.num_layers} layers")
        if self.vpp_size > 1 and self.pp_size == 1:
            raise ValueError(f"vpp_size {self.vpp_size} needs pipeline parallelism; pp_size is 1")
        if self.shape.num_layers % (self.pp_size * self.vpp_size):
            raise ValueError(f"pp_size {self.pp_size} x vpp_size {self.vpp_size} does not divide {self.model}'s "
                             f"{self.shape.num_layers} layers")
        expert_grid = self.expert_tp_size * self.ep_size * self.pp_size
        if self.num_gpus % expert_grid:
            raise ValueError(f"num_gpus {self.num_gpus} is not a multiple of expert TP x EP x PP = {self.expert_tp_size} x "
                             f"{self.ep_size} x {self.pp_size} (Megatron's expert grid; with it, the HDP pool holds "
                             "whole expert-parallel groups)")
        if self.ring_kind is not None and self.ring_kind not in RING_KIND_SETTINGS:
            raise ValueError(f"ring_kind must be one of {RING_KIND_SETTINGS}, got {self.ring_kind!r}")
        if self.gpus_per_node is not None and self.gpus_per_node <= 0:
            raise ValueError(f"gpus_per_node must be positive, got {self.gpus_per_node}")
        for name in ("allreduce_bandwidth", "ring_bandwidth", "intra_node_bandwidth"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"capacity must be a positive token count, got {self.capacity}")
        if self.cost_model_path is not None and not Path(self.cost_model_path).is_file():
            raise ValueError(f"cost model file {self.cost_model_path!r} does not exist")

    @property
    def shape(self) -> ModelShape:
        return model_shape(self.model)

    @property
    def hardware_profile(self) -> HardwareProfile:
        return hardware_profile(self.hardware)

    @property
    def num_ranks(self) -> int:
        """Size of the HDP pool (Megatron's DP group with context_parallel_size=1)."""
        return self.num_gpus // (self.tp_size * self.pp_size)

    @property
    def expert_tp_size(self) -> int:
        """Expert tensor-parallel size: `etp_size`, else TP."""
        return self.etp_size or self.tp_size

    @property
    def expert_unit(self) -> int:
        """HDP ranks one MoE all-to-all couples (`plan.cost.experts.expert_unit_size`): EP when expert TP is TP."""
        return expert_unit_size(tp_size=self.tp_size, ep_size=self.ep_size, etp_size=self.expert_tp_size)

    def parameters_per_gpu(self) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds: the dense ones over TP x PP, the experts over expert TP
        x EP x PP (num_experts / EP experts a rank, each split over expert TP)."""
        experts = self.shape.expert_parameters()
        dense = self.shape.num_parameters() - experts
        return dense / (self.tp_size * self.pp_size), experts / (self.expert_tp_size * self.ep_size * self.pp_size)

    @property
    def grad_bytes(self) -> float:
        """bf16 gradient bytes one GPU reduces after a step: the dense ones over the HDP pool, the experts'
        over their expert-data-parallel group (taken as one all-reduce of both, over the pool)."""
        return 2.0 * sum(self.parameters_per_gpu())

    @property
    def grad_allreduce_bandwidth(self) -> float:
        return self.allreduce_bandwidth or self.hardware_profile.ring_bandwidth

    def cost_model(self) -> CostModel:
        """This cluster's mesh through the one builder (`plan.cost.mesh.mesh_cost_model`): the calibrated
        cost model when a JSON was given, else the analytic one for this model/TP, on the hardware with
        `ring_bandwidth` / `intra_node_bandwidth` in place of its links when set, this cluster's ranks per
        node (gpus_per_node / TP, else the builder's rule: the NVLink domain / TP), ring kind and the HDP
        ranks its MoE all-to-all couples."""
        hardware = self.hardware_profile
        links = {name: getattr(self, name) for name in ("ring_bandwidth", "intra_node_bandwidth") if getattr(self, name)}
        cost = mesh_cost_model(model=self.shape, hardware=dataclasses.replace(hardware, **links), tp_size=self.tp_size,
                               ep_size=self.ep_size, etp_size=self.etp_size, ring_kind=self.ring_kind,
                               ranks_per_node=max(1, self.gpus_per_node // self.tp_size) if self.gpus_per_node else None,
                               measured=self.cost_model_path)
        return dataclasses.replace(cost, **links)

    def memory_capacity(self) -> int:
        """Largest power-of-two C whose activations fit beside the model states (`memory_budget`)."""
        return self.memory_budget()["capacity"]

    def memory_budget(self) -> dict:
        """How C follows from GPU memory: "states_gb" (model states per GPU), "free_gb" (what is left for
        activations), "token_mb" (activation bytes of one token over the layers a stage holds at its peak),
        "fits" (tokens that fit) and "capacity" (C: "fits" rounded down to a power of two, which a static CP
        = context / C also needs).

        Model states per GPU: bf16 weights and grads (4 bytes/param) plus fp32 Adam states and master
        weights (12 bytes/param) sharded over the data-parallel ranks (distributed optimizer): the dense
        parameters over TP x PP, their states over the HDP pool; the experts over expert TP x EP x PP,
        their states over the expert-data-parallel ranks, GPUs / (expert TP x EP x PP) (`parameters_per_gpu`).
        Activations: a micro-batch of C tokens keeps Act(C) per layer; in 1F1B the first stage holds pp
        micro-batches of num_layers/pp layers, i.e. num_layers layers' worth, so PP does not change C. The
        interleaved schedule (vpp_size v > 1) holds its warm-up's forwards plus one, 2 (pp - 1) + (v - 1) G
        + 1 chunks of num_layers / (pp v) layers (G = pp): num_layers x (1 + (pp - 1) / (pp v)) layers'
        worth, as Korthikanti et al. 2022 (Sec. 4.2.3) count it, so C may halve (`activation_layers_factor`).
        """
        dense, experts = self.parameters_per_gpu()
        expert_dp = self.num_gpus // (self.expert_tp_size * self.ep_size * self.pp_size)
        states = dense * (4.0 + 12.0 / self.num_ranks) + experts * (4.0 + 12.0 / expert_dp)
        free = self.hardware_profile.memory_bytes * (1 - MEMORY_RESERVE) - states
        cost = self.cost_model()
        layers = cost.num_layers * self.activation_layers_factor
        per_token = cost.a2 * layers
        where = f"{self.model} with TP={self.tp_size}, PP={self.pp_size}, EP={self.ep_size}"
        if free <= cost.b2 * layers or per_token <= 0:
            raise ValueError(f"{where} leaves no memory for activations")
        tokens = (free - cost.b2 * layers) / per_token
        if tokens < 1:
            raise ValueError(f"{where} cannot hold one token per rank")
        return {"states_gb": states / 1e9, "free_gb": free / 1e9, "token_mb": per_token / 1e6, "fits": int(tokens),
                "capacity": 2 ** int(math.floor(math.log2(tokens)))}

    @property
    def activation_layers_factor(self) -> float:
        """Layers' worth of activations the first stage holds at its peak, over num_layers (`memory_capacity`):
        the first stage's warm-up forwards plus one (`interleaved.uncapped_warmup`), each of one chunk."""
        chunks = uncapped_warmup(pp_size=self.pp_size, stage=0, vpp_size=self.vpp_size, group_size=self.pp_size) + 1
        return chunks / (self.pp_size * self.vpp_size)

    @property
    def rank_capacity(self) -> int:
        """C: the given capacity, else `memory_capacity()`."""
        return self.capacity or self.memory_capacity()

    def check_context(self, context: int) -> None:
        """ValueError when one sequence of `context` tokens cannot fit the whole pool."""
        if context <= 0:
            raise ValueError(f"context must be positive, got {context}")
        pool = self.rank_capacity * self.num_ranks
        if context > pool:
            raise ValueError(
                f"context {format_tokens(context)} exceeds the HDP pool: {self.num_ranks} ranks x C={self.rank_capacity} "
                f"= {pool} tokens; use more GPUs, a smaller TP x PP, or a shorter context"
            )
