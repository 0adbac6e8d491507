"""Megatron-LM's flags -> the planner's cost model of this run's mesh, through the one builder
(`plan.cost.mesh.mesh_cost_model`): the model's shape, the hardware (named or detected), TP / EP / expert
TP, ranks per node, recompute, ring kind, and --hdp-online-refit's refit (resumed from a checkpoint)."""

from __future__ import annotations

from argparse import Namespace
from typing import Optional

import torch

from megatron_hdp.config import HDPConfig
from megatron_hdp.megatron.pretrain.args import ring_kind_setting
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.online_refit import OnlineRefit
from megatron_hdp.plan.cost.presets import ModelShape


def run_cost_model(args: Namespace, config: HDPConfig) -> CostModel:
    """The planner's cost model of this run's mesh (`plan.cost.mesh.mesh_cost_model`, the one builder):
    the model's shape on the named or detected hardware (`_hardware`), or --hdp-cost-model completed from
    it, with this run's TP, EP and expert TP (the HDP ranks an MoE all-to-all couples: the groups Megatron
    will build, checked against them when the data loader is built, `_build_data_loader`), ranks per node
    (--hdp-ranks-per-node, else the hardware's NVLink domain / TP), recompute and ring kind
    (`args.ring_kind_setting`)."""
    from megatron_hdp.plan.cost.mesh import mesh_cost_model

    return mesh_cost_model(
        model=_model_shape(args), hardware=_hardware(config), tp_size=args.tensor_model_parallel_size,
        ep_size=args.expert_model_parallel_size, etp_size=getattr(args, "expert_tensor_parallel_size", None),
        ranks_per_node=config.hdp_ranks_per_node, ring_kind=ring_kind_setting(args, config),
        recompute_granularity=getattr(args, "recompute_granularity", None) or "none", measured=config.hdp_cost_model,
    )


def _hardware(config: HDPConfig) -> Optional[str]:
    """--hdp-hardware, else the preset of this rank's CUDA device (`plan.cost.mesh.resolve_hardware`: a
    CPU run plans as an H100 or with --hdp-cost-model's figures alone, an unknown GPU is refused unless
    --hdp-cost-model measured it)."""
    from megatron_hdp.plan.cost.mesh import resolve_hardware

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return resolve_hardware(flag=config.hdp_hardware, device_name=device, measured=config.hdp_cost_model is not None)


def _dense_layers(args: Namespace) -> int:
    """Decoder layers whose MLP is dense under --moe-layer-freq (Megatron's rule: an int k makes layer i MoE
    when i % k == 0, a list marks MoE layers with 1); 0 without experts. The cost model needs only their
    number (it averages the MLP over the layers)."""
    if not args.num_experts:
        return 0
    freq = getattr(args, "moe_layer_freq", 1)
    if isinstance(freq, int):
        return sum(1 for layer in range(args.num_layers) if layer % freq)
    return sum(1 for moe in freq if not moe)


def _model_shape(args: Namespace) -> ModelShape:
    """The model's shape from Megatron's flags (what the analytic cost model counts)."""
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
        ffn_hidden_size=args.ffn_hidden_size,
        vocab_size=args.padded_vocab_size or args.vocab_size or 32000,
        num_experts=args.num_experts or 0,
        moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=getattr(args, "moe_ffn_hidden_size", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        num_dense_layers=_dense_layers(args),
        gated_mlp=args.swiglu or getattr(args, "quick_geglu", False),
        head_dim=args.kv_channels or 0,
        mtp_num_layers=args.mtp_num_layers or 0,
        **(_mla_shape(args) if getattr(args, "multi_latent_attention", False) else {}),
    )


def _mla_shape(args: Namespace) -> dict:
    """`ModelShape`'s multi-latent attention fields from Megatron's MLA flags (the latent ring's cost)."""
    return dict(kv_lora_rank=args.kv_lora_rank, q_lora_rank=args.q_lora_rank, qk_head_dim=args.qk_head_dim,
                qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim)


def run_online_refit(args: Namespace, config: HDPConfig, cost_model: CostModel) -> OnlineRefit:
    """--hdp-online-refit: a refit of `cost_model` (this run's), which with --load resumes what the
    checkpoint's refit learned (its a1, b1, g; `plan.cost.online_refit.load_refit`) and nothing else: ring kind,
    ranks per node, the expert unit and the rest stay this run's."""
    from megatron_hdp.plan.cost.online_refit import RefitSettings, load_refit

    settings = RefitSettings(warmup_steps=config.hdp_refit_warmup_steps)
    resumed = load_refit(args.load, model=cost_model, settings=settings) if args.load else None
    return resumed or OnlineRefit(cost_model, settings)
