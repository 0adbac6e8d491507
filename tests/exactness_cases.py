"""Test-only model pieces for the exactness tests: an SP-capable RMSNorm and the HDP GPT built with it, and the
reference core attention of multi-latent attention.

Megatron's torch norms (`WrappedTorchNorm`) refuse sequence parallelism without TE or Apex, yet the norm
itself is token-wise: with SP each TP rank normalizes its slice of the sequence, and only the norm
weights' gradients need a sum over the TP group — which `finalize_model_grads` does for every parameter
marked `sequence_parallel`. This norm is torch's RMSNorm with that mark, used in every norm slot of the
layer spec and as the final norm, so that sequence parallelism runs on CPU.
"""

from __future__ import annotations

import copy
import dataclasses

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm whose weight is marked `sequence_parallel` when the config uses SP."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def with_sp_norms(spec, config):
    """A copy of GPT layer spec `spec` with every norm a `SequenceParallelRMSNorm`: the layer's two, and
    multi-latent attention's latent norms (they see this TP rank's slice of the rows too)."""
    spec = copy.deepcopy(spec)
    spec.submodules = dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm
    )
    attention = spec.submodules.self_attention
    if config.multi_latent_attention and config.qk_layernorm:
        norms = dict(kv_layernorm=SequenceParallelRMSNorm)
        if config.q_lora_rank is not None:
            norms["q_layernorm"] = SequenceParallelRMSNorm
        attention.submodules = dataclasses.replace(attention.submodules, **norms)
    return spec


def build_sp_gpt(config, *, vocab_size: int, max_sequence_length: int):
    """The HDP GPTModel of `build_gpt`, every norm a `SequenceParallelRMSNorm`."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_hdp.megatron.layers.spec import get_gpt_layer_with_hdp_spec
    from megatron_hdp.megatron.core_api.model import build_gpt

    spec = with_sp_norms(get_gpt_layer_with_hdp_spec(
        num_experts=config.num_moe_experts, normalization=config.normalization, qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
    ), config)
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=SequenceParallelRMSNorm
    )
    return build_gpt(config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                     transformer_layer_spec=block)


class ReferenceCoreAttention(torch.nn.Module):
    """The reference's core attention for Megatron's multi-latent attention: causal softmax attention of
    one unpacked batch in float64 (with `softmax_type="learnable"` a sink: one more softmax column per head
    holding its `softmax_offset`), written here from the formula (Megatron's local `DotProductAttention`
    cannot take MLA's different q/k and v head dims in megatron-core 0.19, and TE's is GPU-only). Built
    by Megatron's MLA with the `core_attention` keywords; query [s, b, n, dk], key [s, b, n, dk], value
    [s, b, n, dv] -> [s, b, n * dv] in the query's dtype."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type="self", softmax_scale=None, **unused):
        super().__init__()
        from megatron.core import parallel_state

        self.softmax_scale = softmax_scale
        assert config.softmax_type in ("vanilla", "learnable"), config.softmax_type
        if config.softmax_type == "learnable":  # a sink logit per head of this TP rank, Megatron's parameter name
            heads = config.num_attention_heads // parallel_state.get_tensor_model_parallel_world_size()
            self.softmax_offset = torch.nn.Parameter(config.init_method(torch.empty(heads)))

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, packed_seq_params=None, **unused):
        assert packed_seq_params is None and attention_mask is None, "the reference runs one document per batch"
        q, k, v = (x.double() for x in (query, key, value))
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.softmax_scale
        future = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
        sink = getattr(self, "softmax_offset", None)
        if sink is None:
            probs = scores.softmax(-1)
        else:  # the sink's column in every row's softmax, then dropped (it has no value)
            column = sink.double()[None, :, None, None].expand(*scores.shape[:-1], 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        out = torch.einsum("bnst,tbnd->sbnd", probs, v)
        return out.reshape(*out.shape[:2], -1).to(query.dtype)


def reference_mla_block(config):
    """Megatron's own GPT decoder block spec for `config` (its MLASelfAttention, dense and MoE layers by
    `moe_layer_freq`, this pipeline stage's layers) with `ReferenceCoreAttention` as the core attention;
    with sequence parallelism every norm a `SequenceParallelRMSNorm`."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    layers = []
    for spec in block.layer_specs:
        spec = with_sp_norms(spec, config) if config.sequence_parallel else copy.deepcopy(spec)
        attention = spec.submodules.self_attention
        attention.submodules = dataclasses.replace(attention.submodules, core_attention=ReferenceCoreAttention)
        layers.append(spec)
    final_norm = SequenceParallelRMSNorm if config.sequence_parallel else block.layer_norm
    return dataclasses.replace(block, layer_specs=layers, layer_norm=final_norm)
