"""A Megatron-Core GPTModel for HDP (or the plain reference), wrapped in Megatron DDP, with its optimizer.

What a Core-API user of `HDPTrainer` builds before the first step: a TransformerConfig sized by the
initialized parallel_state with the settings HDP needs, this rank's model chunks with the HDP layer spec,
and Megatron's DDP and optimizer around them. The shape of the model (layers, widths, norms, dtype) is the
caller's: the harnesses' tiny Llama is `megatron_hdp.harness.model.tiny_llama_config`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_hdp.megatron.layers.spec import get_gpt_layer_with_hdp_spec, prepare_model_for_hdp
from megatron_hdp.megatron.layers.mtp import mtp_block_spec_of


def transformer_config(**fields: Any) -> TransformerConfig:
    """TransformerConfig of `fields` (the model's shape and precision) on the initialized parallel_state:
    TP, PP, virtual pipeline stages and, for a MoE model, EP as initialized; the per-token loss and
    variable sequence lengths HDP needs (`step.check_model_config`); Megatron's alltoall token dispatcher
    (its allgather dispatcher rejects variable_seq_lengths). With virtual pipeline stages the interleaved
    schedule overlaps its stage-to-stage P2P (`overlap_p2p_comm`), as Megatron-LM requires at PP = 2 (its
    batched P2P would post two sends between the same pair of ranks at once). With
    `multi_latent_attention=True` among `fields` the config is Megatron's `MLATransformerConfig`."""
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    sizes: dict[str, Any] = dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
    )
    if vpp:
        sizes.update(virtual_pipeline_model_parallel_size=vpp, overlap_p2p_comm=True, batch_p2p_comm=False)
    if fields.get("num_moe_experts"):
        sizes["expert_model_parallel_size"] = ps.get_expert_model_parallel_world_size()
    config_class = MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig
    return config_class(calculate_per_token_loss=True, variable_seq_lengths=True,
                        moe_token_dispatcher_type="alltoall", **sizes, **fields)


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
    layer or block spec, e.g. with other norms). With `config.mtp_num_layers` the model has Megatron's
    multi-token prediction block, its layers built like the decoder's (`mtp.mtp_block_spec_of`: with HDP
    core attention under `hdp=True`)."""
    spec_kwargs = dict(num_experts=config.num_moe_experts, normalization=config.normalization,
                       qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention)
    spec = get_gpt_layer_with_hdp_spec(**spec_kwargs) if hdp else get_gpt_layer_local_spec(**spec_kwargs)
    spec = transformer_layer_spec or spec
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp_block_spec_of(config, spec, vp_stage=vp_stage),
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
    adam_eps: float = 1e-8,
    weight_decay: float = 0.0,
    clip_grad: float = 1.0,
    overlap_grad_reduce: bool = False,
    bucket_size: Optional[int] = None,
    distributed_optimizer: bool = False,
    overlap_param_gather: bool = False,
    bf16: bool = False,
    optimizer: str = "adam",
) -> tuple[list[DistributedDataParallel], Any]:
    """Megatron DDP (gradients reduced once per step over the data-parallel group = HDP domain, summed:
    the per-token loss scales them) around each model chunk, and Megatron's Adam optimizer over all of
    them. `overlap_grad_reduce` starts each bucket's reduction (`bucket_size` parameters, None: one
    bucket) as soon as its gradients are ready in the last micro-batch, as Megatron's --overlap-grad-reduce
    does; chunks after the first get one bucket each, as Megatron-LM's get_model gives them
    (`disable_bucketing`). `distributed_optimizer` shards the optimizer state and the reduced gradients
    over the HDP domain (reduce-scatter, then an all-gather of the updated parameters:
    --use-distributed-optimizer); `overlap_param_gather` defers that all-gather to forward pre-hooks of
    the next step (--overlap-param-gather). `adam_eps`: Adam's epsilon (--adam-eps). `bf16`: the chunks
    hold bf16 parameters, the optimizer fp32 main copies of them (--bf16). `optimizer`: Megatron's "adam" or
    "sgd" (--optimizer)."""
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
            optimizer=optimizer, lr=lr, adam_eps=adam_eps, weight_decay=weight_decay, clip_grad=clip_grad,
            bf16=bf16,
            use_distributed_optimizer=distributed_optimizer,
        ),
        ddps,
    )
    return ddps, optimizer
