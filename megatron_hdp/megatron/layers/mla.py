"""Multi-latent attention under HDP: Megatron's `MLASelfAttention` with RoPE at each token's document position.

Megatron's `MLASelfAttention.get_query_key_value_tensors` rotates the RoPE part of the query and the
shared RoPE key itself, with positions restarting at every `cu_seqlens` boundary of the packed batch:
wrong for a zigzag ring shard, whose tokens sit at positions [a, b) and [c, d) of their document.
`HDPMLASelfAttention` is that module with this one method rewritten: the same submodules and
parameters (its state dict and sharded state dict have Megatron's keys), RoPE or YaRN (`rope_type`,
`rotary_scaling_factor`, `mscale`, `mscale_all_dim`, the YaRN betas) evaluated at the positions the
collation computed (`position_angles`), and V handed to the core attention unpadded (Megatron pads V to
the query's head dim for TE's THD kernels; HDP's kernels take it, and the K/V ring moves K and V of
their own widths). The layer spec (`megatron/layers/spec.py`) swaps this class in for `MLASelfAttention`
and `HDPCoreAttention` in for the `core_attention` leaf, which attends whole documents locally and
split ones on their ring.

The seam a latent ring builds on. The computation is split in two, so that a ring that circulates the
latent instead of K and V can take the first part's results and apply the second on each member:

1. `latent_inputs(hidden_states, meta)` -> `LatentInputs(query, latent, k_pos_emb)`: the down
   projections, their norms and the RoPE, everything that is per token of this rank: query
   [T, Hq/TP, qk_head_dim + qk_pos_emb_head_dim] with RoPE, latent [T, kv_lora_rank] (the output of
   `kv_layernorm`: normalised under the local spec; under the TE spec `kv_layernorm` is an IdentityOp
   and the norm is fused into `linear_kv_up_proj`, a layer-norm linear, so the latent is the
   un-normalised one and the norm happens in step 2, per token, on whichever rank applies it), and
   k_pos_emb [T, 1, qk_pos_emb_head_dim], the shared RoPE key already rotated at the token's position;
2. `up_project(latent, k_pos_emb)` -> (key, value): `linear_kv_up_proj` (this TP rank's heads) into
   k_no_pe and value, and the key k_no_pe ++ k_pos_emb. Linear in the latent per token, so up-projecting
   a received block of latents equals receiving that block's K and V; its weight gradient on a member is
   that member's share of `linear_kv_up_proj`'s gradient (Megatron's DDP sums the shares).
The K/V ring runs 2 then the ring over K and V. When the plan gives a ring call of the micro-batch the
latent ring (`AttentionGroup.ring_kind`), the layer also hands the core attention `LatentInputs`
(`core_attention.LatentRingInputs`): the normalised latent through `linear_kv_up_proj`'s own TP input
mapping, the rotated RoPE key and `linear_kv_up_proj.weight`; those groups' rows of K and V are not read,
each ring member up-projects the latent blocks it receives (`attention.latent_ring`). The latent and the
RoPE key travel as the 4th value of `get_query_key_value_tensors`, which Megatron passes to the core
attention as the keyword `qr` (`HDPCoreAttention.requires_dsa_inputs`) and threads through
`--recompute-modules core_attn`'s checkpoint as an argument of the checkpointed call (its
`core_attention_extra_kwargs`), so the recompute attends with the same, detached, latent: core-attention
recompute and attention sinks run on latent rings as on K/V rings. Under the TE spec
the norm is the fused one of `linear_kv_up_proj` (a layer-norm linear): the ring applies it with that
module's own `layer_norm_weight` (and bias), so no parameter is added or renamed (`normalised_latent`).
With gradient-accumulation fusion, Megatron's linears add their weight gradient into `main_grad`
themselves and DDP then ignores `.grad`; the ring's share of the up-projection's gradient goes there too
(`fused_weight_grad`).

`--recompute-modules mla_up_proj` keeps its meaning: the q and kv up projections with the RoPE run
under Megatron's `CheckpointWithoutOutput`, as in Megatron's own method. Training only (no inference
context, no cached latents: refused in `megatron/layers/options.py`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import YarnRotaryEmbedding
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import get_pg_size

from megatron_hdp.attention.core_attention import HDPBatchMeta, LatentRingInputs
from megatron_hdp.attention.rope import rope_angles
from megatron_hdp.megatron.layers.packed_seq import batch_meta


class LatentInputs(NamedTuple):
    """What attention needs of this rank's tokens before the K/V up-projection (module doc, step 1)."""

    query: torch.Tensor
    """[T, Hq/TP, qk_head_dim + qk_pos_emb_head_dim], RoPE applied at each token's document position."""
    latent: torch.Tensor
    """[T, kv_lora_rank]: `kv_layernorm`'s output (normalised unless the norm is fused into the up-projection)."""
    k_pos_emb: torch.Tensor
    """[T, 1, qk_pos_emb_head_dim]: the RoPE key shared by all heads, rotated at each token's position."""


def position_angles(rotary: torch.nn.Module, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """([T, 1, 1, dim] RoPE angles at `position_ids`, mscale) of MLA's rotary module: Megatron's
    `RotaryEmbedding` (mscale 1) or `YarnRotaryEmbedding`, whose table is linear in the position: its row
    1 is the blended inverse frequencies (twice), so row p of Megatron's table is p times it, bit for bit."""
    if not isinstance(rotary, YarnRotaryEmbedding):
        return rope_angles(rotary, position_ids), 1.0
    table, mscale = rotary.get_emb(2)
    return position_ids.to(table.dtype)[:, None, None, None] * table[1], mscale


class HDPMLASelfAttention(MLASelfAttention):
    """Megatron's MLA self-attention with per-token RoPE and V unpadded (module doc); same parameters."""

    def _run_core_attention(
        self, *args: Any, x: Any = None, qr: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """The plain core-attention call (`MultiLatentAttention`'s pads V to the query's head dim for THD),
        with the latent ring's inputs when the micro-batch has latent ring groups: `qr` is the 4th value of
        `get_query_key_value_tensors`, the ring's latent and RoPE key (`ring_tensors`), which Megatron hands
        here as a keyword argument (`HDPCoreAttention.requires_dsa_inputs`), through the core-attention
        checkpoint as one of the checkpointed call's arguments; `x` (the hidden states) is not needed."""
        if qr is not None:
            kwargs["latent"] = self.ring_latent(qr)
        return Attention._run_core_attention(self, *args, **kwargs)

    def get_query_key_value_tensors(
        self,
        hidden_states: torch.Tensor,
        key_value_states: Any = None,
        position_ids: Any = None,
        packed_seq_params: Any = None,
        inference_context: Any = None,
        *,
        inference_params: Any = None,
    ):
        """(query, key, value, q_compressed, latent) of Megatron's method, for an HDP micro-batch."""
        if inference_context is not None or inference_params is not None:
            raise ValueError("HDP's multi-latent attention runs training micro-batches only (no inference context)")
        meta = batch_meta(packed_seq_params, "HDPMLASelfAttention")
        latent_rings = any(g.is_ring and g.ring_kind == "latent" for g in meta.groups)
        if self.recompute_up_proj:  # --recompute-modules mla_up_proj: the up projections and RoPE, as Megatron's

            def up_projections(q_compressed, latent, k_pos_emb):
                query, k_pos_emb = self._rotated(q_compressed, k_pos_emb, meta)
                return (query, *self.up_project(latent, k_pos_emb))

            q_compressed, latent, k_pos_emb = self._compressed(hidden_states)
            self.qkv_up_checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8 or self.config.fp4)
            query, key, value = self.qkv_up_checkpoint.checkpoint(up_projections, q_compressed, latent, k_pos_emb)
            if latent_rings:
                k_pos_emb = self._rope(k_pos_emb.unsqueeze(-2), meta)
        else:
            query, latent, k_pos_emb = self.latent_inputs(hidden_states, meta)
            key, value = self.up_project(latent, k_pos_emb)
        # the 4th value (Megatron's q_compressed) reaches the core attention as `qr` (`_run_core_attention`)
        return query, key, value, self.ring_tensors(latent, k_pos_emb) if latent_rings else None, latent

    def latent_inputs(self, hidden_states: torch.Tensor, meta: HDPBatchMeta) -> LatentInputs:
        """Step 1 of the module doc: (query with RoPE, latent, rotated shared RoPE key) of this rank's tokens."""
        q_compressed, latent, k_pos_emb = self._compressed(hidden_states)
        query, k_pos_emb = self._rotated(q_compressed, k_pos_emb, meta)
        return LatentInputs(query, latent, k_pos_emb)

    def up_project(self, latent: torch.Tensor, k_pos_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 2 of the module doc: (key [T, H/TP, qk_head_dim + qk_pos_emb_head_dim], value
        [T, H/TP, v_head_dim]), both contiguous, of `latent` [T, kv_lora_rank] and the rotated `k_pos_emb`
        [T, 1, pe]."""
        config, heads = self.config, self.num_attention_heads_per_partition
        kv, _ = self.linear_kv_up_proj(latent)
        k_no_pe, value = torch.split(
            kv.view(*kv.shape[:-1], heads, config.qk_head_dim + config.v_head_dim),
            [config.qk_head_dim, config.v_head_dim], dim=-1,
        )
        return torch.cat([k_no_pe, k_pos_emb.expand(-1, heads, -1)], dim=-1), value.contiguous()

    def ring_tensors(self, latent: torch.Tensor, k_pos_emb: torch.Tensor) -> torch.Tensor:
        """[T, kv_lora_rank + qk_pos_emb_head_dim]: what circulates on the latent ring for this rank's tokens,
        one tensor so that Megatron's core-attention checkpoint takes it as an argument: the normalised
        latent as `linear_kv_up_proj` sees its input (`copy_to_tensor_model_parallel_region`, with sequence
        parallelism the gather: their backward sums the TP ranks' latent gradients, as the linear's own
        would), then the rotated RoPE key."""
        latent = normalised_latent(self.linear_kv_up_proj, latent, self.config)
        if self.config.sequence_parallel and get_pg_size(self.tp_group) > 1:
            latent = gather_from_sequence_parallel_region(latent, group=self.tp_group)
        else:
            latent = copy_to_tensor_model_parallel_region(latent, group=self.tp_group)
        return torch.cat([latent, k_pos_emb.squeeze(1)], dim=-1)

    def ring_latent(self, ring_tensors: torch.Tensor) -> LatentRingInputs:
        """The latent ring's inputs from `ring_tensors`' latent and rotated RoPE key, with the up-projection's
        weight (this TP rank's heads)."""
        config = self.config
        latent, k_pos_emb = torch.split(ring_tensors, [config.kv_lora_rank, config.qk_pos_emb_head_dim], dim=-1)
        weight = self.linear_kv_up_proj.weight
        if config.gradient_accumulation_fusion:
            weight = fused_weight_grad(weight)
        return LatentRingInputs(latent, k_pos_emb.unsqueeze(1), weight, config.qk_head_dim, config.v_head_dim)

    def _compressed(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_compressed, latent, raw k_pos_emb [T, pe]): Megatron's down projections with its TP / SP
        gathers (as in `MLASelfAttention.get_query_key_value_tensors`), THD-squeezed, then the norms."""
        config = self.config
        q_compressed, kv_combined = self._qkv_down_projection(hidden_states)
        widths = [config.kv_lora_rank, config.qk_pos_emb_head_dim]
        if kv_combined.size(-1) != sum(widths):  # a column-parallel down projection: its output is TP-sharded
            latent, k_pos_emb = torch.split(gather_from_tensor_model_parallel_region(kv_combined), widths, dim=-1)
            if config.sequence_parallel:
                latent = scatter_to_sequence_parallel_region(latent)
        else:
            latent, k_pos_emb = torch.split(kv_combined, widths, dim=-1)
            if get_pg_size(self.tp_group) > 1 and config.sequence_parallel:
                k_pos_emb = gather_from_sequence_parallel_region(k_pos_emb, group=self.tp_group)
        q_compressed, latent, k_pos_emb = (x.squeeze(1) for x in (q_compressed, latent, k_pos_emb))
        if config.q_lora_rank is not None:
            q_compressed = self.q_layernorm(q_compressed)
        return q_compressed, self.kv_layernorm(latent), k_pos_emb

    def _rotated(
        self, q_compressed: torch.Tensor, k_pos_emb: torch.Tensor, meta: HDPBatchMeta
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query with RoPE, k_pos_emb [T, 1, pe] rotated): the q up projection, then RoPE at each token's
        document position on the query's RoPE part and on the shared key (Megatron's MLA interleave)."""
        config = self.config
        up = self.linear_q_up_proj if config.q_lora_rank is not None else self.linear_q_proj
        q, _ = up(q_compressed)
        q = q.view(*q.shape[:-1], self.num_attention_heads_per_partition, self.q_head_dim)
        q_no_pe, q_pos_emb = torch.split(q, [config.qk_head_dim, config.qk_pos_emb_head_dim], dim=-1)
        return torch.cat([q_no_pe, self._rope(q_pos_emb, meta)], dim=-1), self._rope(k_pos_emb.unsqueeze(-2), meta)

    def _rope(self, x: torch.Tensor, meta: HDPBatchMeta) -> torch.Tensor:
        """[T, heads, pe] rotated at each token's document position (Megatron's MLA interleave)."""
        angles, mscale = meta.memo(
            ("mla-rope", id(self.rotary_pos_emb)), lambda: position_angles(self.rotary_pos_emb, meta.position_ids)
        )
        return apply_rotary_pos_emb(
            x.unsqueeze(1), angles, config=self.config, mscale=mscale, cp_group=self.pg_collection.cp,
            mla_rotary_interleaved=True,
        ).squeeze(1)


def normalised_latent(up_proj: torch.nn.Module, latent: torch.Tensor, config: Any) -> torch.Tensor:
    """`latent` as `up_proj` (`linear_kv_up_proj`) multiplies it: as given under the local spec (the
    standalone `kv_layernorm` normalised it), through `up_proj`'s fused norm under the TE spec (a
    layer-norm linear: its `layer_norm_weight` / `layer_norm_bias`, `config.normalization`, epsilon and
    zero-centred gamma), so that the ring's norm is the module's own parameters."""
    weight = getattr(up_proj, "layer_norm_weight", None)
    if weight is None:
        return latent
    if config.layernorm_zero_centered_gamma:
        weight = weight + 1
    shape, eps = (latent.shape[-1],), config.layernorm_epsilon
    if config.normalization == "RMSNorm":
        return torch.nn.functional.rms_norm(latent, shape, weight, eps)
    return torch.nn.functional.layer_norm(latent, shape, weight, getattr(up_proj, "layer_norm_bias", None), eps)


class _MainGradWeight(torch.autograd.Function):
    """The weight itself forward; backward adds the gradient into `main_grad` (fp32) and returns none."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor) -> torch.Tensor:
        ctx.weight = weight
        return weight.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> None:
        ctx.weight.main_grad.add_(grad.to(ctx.weight.main_grad.dtype))
        return None


def fused_weight_grad(weight: torch.Tensor) -> torch.Tensor:
    """`weight` whose gradient through this use goes straight into `weight.main_grad`, as Megatron's
    gradient-accumulation fusion does for its linears (DDP then reads `main_grad`, not `.grad`); `weight`
    unchanged while it has no `main_grad` (not wrapped by DDP yet)."""
    return _MainGradWeight.apply(weight) if hasattr(weight, "main_grad") else weight
