"""The tiny Llama-style model shape the CPU demo, the benchmarks, the exactness tests and the GPU smoke
run build (RoPE, GQA, SwiGLU, RMSNorm, no biases, untied embeddings; fp32 for exactness on CPU).

Only the shape lives here: the TransformerConfig sized by parallel_state, the GPTModel, its DDP and
optimizer are the integration layer's (`megatron_hdp.megatron.core_api.model`), which a real run uses the same
way with its own shape.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from megatron_hdp.megatron.core_api.model import TransformerConfig, transformer_config


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
    **fields: Any,
) -> TransformerConfig:
    """A tiny fp32 Llama-style TransformerConfig, sized by parallel_state (TP, PP, virtual stages, EP as
    initialized: `megatron.core_api.model.transformer_config`). With `moe_aux_loss_coeff` > 0 the router adds
    Megatron's load-balancing loss ("aux_loss"; under HDP per document: megatron_hdp.megatron.layers.moe_aux_loss).
    `fields`: further config fields, e.g. `tiny_mla_fields()` for multi-latent attention."""
    moe: dict[str, Any] = {}
    if num_moe_experts:
        moe = dict(
            num_moe_experts=num_moe_experts,
            moe_router_topk=moe_router_topk,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff > 0 else "none",
            moe_z_loss_coeff=moe_z_loss_coeff,
        )
    return transformer_config(
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
        sequence_parallel=sequence_parallel,
        **moe,
        **fields,
    )


def tiny_mla_fields(*, q_lora_rank: Optional[int] = 24, rope_type: str = "yarn") -> dict[str, Any]:
    """DeepSeek-style multi-latent attention for `tiny_llama_config` (4 heads, no GQA): query through a
    `q_lora_rank` latent (None: one projection), K and V from a 16-wide latent, q/k head dim 12 + 8 RoPE, v
    head dim 8, latent norms (qk_layernorm: Megatron's local spec has a standalone query norm only with a
    query latent, so none without); with `rope_type="yarn"` YaRN at 4x an original context of 16
    positions, with an mscale that differs from mscale_all_dim (the RoPE and the softmax scale both move)."""
    yarn = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.5)
    return dict(
        multi_latent_attention=True, num_query_groups=None, q_lora_rank=q_lora_rank, kv_lora_rank=16,
        qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=8, qk_layernorm=q_lora_rank is not None,
        rope_type=rope_type,
        **(yarn if rope_type == "yarn" else {}),
    )
