"""Build a Megatron-Core GPTModel for HDP (or the plain reference), wrap it in DDP, make its optimizer.

The tiny Llama-style shape (RoPE, GQA, SwiGLU, RMSNorm, no biases, untied embeddings) serves the CPU
demo, the benchmark and the exactness tests; a real run builds its model the same way with its own
TransformerConfig. fp32 throughout (exactness on CPU).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hdp.megatron.layer_spec import get_gpt_layer_with_hdp_spec, prepare_model_for_hdp


def tiny_llama_config(
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_query_groups: int = 2,
    ffn_hidden_size: int = 128,
    num_moe_experts: Optional[int] = None,
    moe_router_topk: int = 2,
    moe_aux_loss_coeff: float = 0.0,
    moe_z_loss_coeff: Optional[float] = None,
    sequence_parallel: bool = False,
) -> TransformerConfig:
    """A tiny fp32 Llama-style TransformerConfig sized by parallel_state (TP, PP, virtual stages, EP as
    initialized). With `moe_aux_loss_coeff` > 0 the router adds Megatron's load-balancing loss
    ("aux_loss"; under HDP per document: megatron_hdp.megatron.moe_aux_loss). With virtual pipeline
    stages the interleaved schedule overlaps its stage-to-stage P2P (`overlap_p2p_comm`), as Megatron-LM
    requires at PP = 2 (its batched P2P would post two sends between the same pair of ranks at once)."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    interleaved = dict(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    moe: dict[str, Any] = {}
    if num_moe_experts:
        moe = dict(
            num_moe_experts=num_moe_experts,
            moe_router_topk=moe_router_topk,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_z_loss_coeff=moe_z_loss_coeff,
            expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        )
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        ffn_hidden_size=ffn_hidden_size,
        gated_linear_unit=True,
        activation_func=F.silu,
        normalization="RMSNorm",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        calculate_per_token_loss=True,
        variable_seq_lengths=True,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        sequence_parallel=sequence_parallel,
        moe_token_dispatcher_type="alltoall",  # Megatron's allgather dispatcher rejects variable_seq_lengths
        **(interleaved if vpp else {}),
        **moe,
    )


def build_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int,
    hdp: bool = True,
    transformer_layer_spec: Any = None,
    vp_stage: Optional[int] = None,
) -> GPTModel:
    """GPTModel for this rank's pipeline stage (model chunk `vp_stage` of it with virtual pipeline
    stages): with the HDP core attention (`hdp=True`) or Megatron's stock local spec (the reference).
    RoPE either way; untied embedding and output weights. `transformer_layer_spec` replaces the spec (a
    layer or block spec, e.g. with other norms)."""
    spec_kwargs = dict(num_experts=config.num_moe_experts, normalization=config.normalization)
    spec = get_gpt_layer_with_hdp_spec(**spec_kwargs) if hdp else get_gpt_layer_local_spec(**spec_kwargs)
    spec = transformer_layer_spec or spec
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        vp_stage=vp_stage,
    )
    return prepare_model_for_hdp(model) if hdp else model


def build_gpt_chunks(config: TransformerConfig, **kwargs: Any) -> list[GPTModel]:
    """This rank's model chunks: one `build_gpt` per virtual pipeline stage (Megatron's interleaved
    schedule runs chunk c's layers for every micro-batch), or the one stage model without them.
    `kwargs` as `build_gpt`'s."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is None:
        return [build_gpt(config, **kwargs)]
    return [build_gpt(config, vp_stage=stage, **kwargs) for stage in range(vpp)]


def wrap_for_training(model: GPTModel, **kwargs: Any) -> tuple[DistributedDataParallel, Any]:
    """`wrap_chunks_for_training` of the one model chunk: its DDP wrapper and the optimizer."""
    (ddp,), optimizer = wrap_chunks_for_training([model], **kwargs)
    return ddp, optimizer


def wrap_chunks_for_training(
    chunks: Sequence[GPTModel],
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = False,
    bucket_size: Optional[int] = None,
    distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    bf16: bool = False,
) -> tuple[list[DistributedDataParallel], Any]:
    """Megatron DDP (gradients reduced once per step over the data-parallel group = HDP domain, summed:
    the per-token loss scales them) around each model chunk, and Megatron's Adam optimizer over all of
    them. `overlap_grad_reduce` starts each bucket's reduction (`bucket_size` parameters, None: one
    bucket) as soon as its gradients are ready in the last micro-batch, as Megatron's --overlap-grad-reduce
    does; chunks after the first get one bucket each, as Megatron-LM's get_model gives them
    (`disable_bucketing`). `distributed_optimizer` shards the optimizer state and the reduced gradients
    over the HDP domain (reduce-scatter, then an all-gather of the updated parameters:
    --use-distributed-optimizer); `overlap_param_gather` defers that all-gather to forward pre-hooks of
    the next step (--overlap-param-gather). `bf16`: the chunks hold bf16 parameters, the optimizer fp32
    main copies of them (--bf16)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        bucket_size=bucket_size,
        use_distributed_optimizer=distributed_optimizer,
        overlap_param_gather=overlap_param_gather,
    )
    ddps = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam", lr=lr, weight_decay=weight_decay, clip_grad=clip_grad, bf16=bf16,
            use_distributed_optimizer=distributed_optimizer,
        ),
        ddps,
    )
    return ddps, optimizer
