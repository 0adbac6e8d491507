"""Test-only model pieces for the exactness tests: an SP-capable RMSNorm and the HDP GPT built with it.

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


def build_sp_gpt(config, *, vocab_size: int, max_sequence_length: int):
    """The HDP GPTModel of `build_gpt`, every norm a `SequenceParallelRMSNorm`."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from megatron_hdp.megatron.layer_spec import get_gpt_layer_with_hdp_spec
    from megatron_hdp.megatron.model import build_gpt

    spec = copy.deepcopy(get_gpt_layer_with_hdp_spec(num_experts=config.num_moe_experts, normalization=config.normalization))
    spec.submodules = dataclasses.replace(
        spec.submodules, input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm
    )
    block = TransformerBlockSubmodules(
        layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=SequenceParallelRMSNorm
    )
    return build_gpt(config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                     transformer_layer_spec=block)
