"""Start HDP inside Megatron-Core: parallel_state with the data-parallel group as the HDP domain.

Megatron is initialized with `context_parallel_size=1`, so its data-parallel group at each (PP stage,
TP rank) coordinate *is* the HDP domain: the D ranks a step plan distributes sequences over. Megatron's
DDP then reduces gradients over exactly that domain, and a ring for a sequence at stage s / TP rank t
connects the HDP ranks at that same (s, t) — by point-to-point messages in the default communicator,
addressed by the global ranks in `HDPState.hdp_global_ranks` (`comm.domain`: plain data, built here).

Order of the steps (each depends on the one before): CPU shims (no CUDA) -> a barrier on the default
group -> parallel_state -> seeds. The barrier is the default group's first operation, with every rank
taking part: NCCL creates a group's communicator lazily, at its first call, and a ring's
`batch_isend_irecv` among a few ranks must not be that call (undefined; it can hang).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import random as mp_random

from megatron_hdp.comm.domain import HDPState
from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.experts import expert_unit_size

logger = logging.getLogger(__name__)


def hdp_state() -> HDPState:
    """The HDP view of the parallel_state Megatron was initialized with (context parallelism must be 1)."""
    if not ps.model_parallel_is_initialized():
        raise ValueError("Megatron's parallel_state is not initialized: call initialize_hdp() first")
    if ps.get_context_parallel_world_size() != 1:
        raise ValueError(
            f"context_parallel_size={ps.get_context_parallel_world_size()}: HDP replaces context "
            "parallelism (the data-parallel group is the HDP domain); initialize with context_parallel_size=1"
        )
    dp_ranks = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group()))
    hdp_rank = ps.get_data_parallel_rank()
    unit = expert_unit(len(dp_ranks))
    first = hdp_rank - hdp_rank % unit
    return HDPState(
        hdp_rank=hdp_rank,
        hdp_global_ranks=dp_ranks,
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep_size=unit,
        ep_hdp_ranks=tuple(range(first, first + unit)),
    )


def expert_unit(hdp_size: int) -> int:
    """HDP ranks this rank's MoE all-to-all couples, read off Megatron's groups: the HDP (data-parallel)
    ranks of its expert tensor-and-model-parallel group, closed under TP (`plan.cost.experts.expert_unit_size`
    of the run's TP, EP and expert TP). ValueError unless they are the consecutive block of that many HDP
    ranks holding this one, the layout the planner plans around (`plan.cost.experts.expert_groups`)."""
    tp = ps.get_tensor_model_parallel_world_size()
    unit = expert_unit_size(tp_size=tp, ep_size=ps.get_expert_model_parallel_world_size(),
                            etp_size=ps.get_expert_tensor_parallel_world_size())
    # Megatron's tensor-and-data-parallel group lists its ranks TP-fastest: position // TP is the HDP rank
    tp_dp = dist.get_process_group_ranks(ps.get_tensor_and_data_parallel_group())
    hdp_of = {rank: position // tp for position, rank in enumerate(tp_dp)}
    dp_ranks = dist.get_process_group_ranks(ps.get_data_parallel_group())
    coupled = {hdp_of.get(rank) for rank in dist.get_process_group_ranks(ps.get_expert_tensor_and_model_parallel_group())}
    hdp_rank = ps.get_data_parallel_rank()
    block = set(range(hdp_rank - hdp_rank % unit, hdp_rank - hdp_rank % unit + unit))
    if [hdp_of.get(rank) for rank in dp_ranks] != list(range(len(dp_ranks))) or not coupled <= block or hdp_size % unit:
        raise ValueError(
            f"the expert-parallel group of HDP rank {hdp_rank} couples HDP ranks {sorted(coupled, key=str)}, not the "
            f"block of {unit} consecutive ones of a domain of {hdp_size} that the planner plans together (TP "
            f"{tp}, EP {ps.get_expert_model_parallel_world_size()}, expert TP "
            f"{ps.get_expert_tensor_parallel_world_size()}): initialize Megatron with its default rank order"
        )
    return unit


def planner_cost_model(cost_model: CostModel, state: HDPState) -> CostModel:
    """`cost_model` (the caller's, taken as measured) on this mesh through the one builder
    (`plan.cost.mesh.mesh_cost_model`): with the HDP ranks an MoE all-to-all couples (Megatron's TP, EP
    and expert TP, as `state.ep_size` holds them), so that the planner plans EP groups together and times
    them as they run; its ranks per node (else this device's NVLink domain / TP), ring kind and the rest
    as the caller set them."""
    from megatron_hdp.plan.cost.mesh import hardware_for_device, mesh_cost_model

    device = hardware_for_device(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    model = mesh_cost_model(model=None, hardware=device, measured=cost_model, tp_size=state.tp_size,
                            ep_size=ps.get_expert_model_parallel_world_size(),
                            etp_size=ps.get_expert_tensor_parallel_world_size(),
                            ranks_per_node=cost_model.ranks_per_node, ring_kind=cost_model.ring_kind)
    assert model.expert_parallel_size == state.ep_size, (model.expert_parallel_size, state.ep_size)
    return model


def initialize_hdp(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    seed: int = 1234,
) -> HDPState:
    """Initialize Megatron's parallel_state for HDP on the already-initialized default process group.

    TP, PP, EP, expert TP (None: TP) and the virtual pipeline stages per PP rank (None: no interleaving)
    are as asked; context parallelism is 1 and the data-parallel size D = world / (TP x PP) is the HDP
    domain. ValueError (before any collective) when the sizes do not divide.
    """
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: init_process_group() before initialize_hdp()")
    world = dist.get_world_size()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    expert_tp = expert_tensor_parallel_size or tensor_model_parallel_size
    if min(tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, expert_tp) < 1:
        raise ValueError(
            f"parallel sizes must be >= 1, got TP={tensor_model_parallel_size}, "
            f"PP={pipeline_model_parallel_size}, EP={expert_model_parallel_size}, expert TP={expert_tp}"
        )
    if world % model_parallel:
        raise ValueError(
            f"world size {world} is not divisible by TP x PP = {tensor_model_parallel_size} x "
            f"{pipeline_model_parallel_size}"
        )
    hdp_size = world // model_parallel
    unit = expert_unit_size(tp_size=tensor_model_parallel_size, ep_size=expert_model_parallel_size, etp_size=expert_tp)
    if hdp_size % unit:
        raise ValueError(
            f"the HDP domain of {hdp_size} ranks (world {world} / TP x PP {model_parallel}) is not divisible by the "
            f"{unit} HDP ranks an expert-parallel group spans (EP={expert_model_parallel_size}, expert "
            f"TP={expert_tp}): choose EP and expert TP so that expert TP x EP divides world / PP"
        )
    cpu = apply_cpu_shims()
    if torch.cuda.is_available():  # NCCL: on this rank's device (the one torch.cuda.set_device chose)
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=1,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    mp_random.model_parallel_cuda_manual_seed(seed)  # looked up now: the CPU shim may have replaced it
    torch.manual_seed(seed)
    state = hdp_state()
    logger.info(
        "HDP domain of %d ranks (TP=%d, PP=%d, VPP=%d, EP=%d%s); this rank is HDP rank %d",
        state.hdp_size, state.tp_size, state.pp_size, state.vpp_size, state.ep_size, ", CPU" if cpu else "", state.hdp_rank,
    )
    return state


def tensor_parallel_coordinate(*, expert: bool = False) -> tuple[int, int]:
    """This rank's (rank, size) in the group a tensor-parallel weight is split over: Megatron's expert-TP
    group for an expert's weights (`expert`), its TP group for the others."""
    if expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def expert_parallel_coordinate() -> tuple[int, int]:
    """This rank's (rank, size) in its expert-parallel group (which experts of a MoE layer it holds)."""
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def destroy_hdp() -> None:
    """Tear down Megatron's parallel_state and its process-wide loss trackers, which are sized by the first
    model that fills them (tests and demos that initialize more than once, with other models)."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    ps.destroy_model_parallel()
    MTPLossLoggingHelper.tracker.clear()
    destroy_moe_metrics_tracker()
