"""HDP as one leaf of Megatron's layer spec: the `core_attention` that routes documents to local or ring.

`get_gpt_layer_with_hdp_spec()` is Megatron's own local (or Transformer Engine) GPT layer spec with the
`core_attention` leaf swapped for `HDPCoreAttention`; everything else in the layer (QKV, projection,
norms, MLP or MoE) is Megatron's. The micro-batch metadata reaches the leaf inside `HDPPackedSeqParams`
(Megatron passes `packed_seq_params` unchanged to every layer of every pipeline stage).

RoPE. Megatron applies RoPE before `core_attention`, with positions restarting at each `cu_seqlens`
boundary — wrong for a zigzag shard, whose tokens sit at positions [a, b) and [c, d) of their document.
So `HDPCoreAttention` applies RoPE itself, per token, from the positions the collation computed, with
the frequencies of the model's own `RotaryEmbedding` (evaluated at those positions, once per
micro-batch: `attention/rope.py`) and Megatron's own `apply_rotary_pos_emb`; `prepare_model_for_hdp`
hands each leaf that rotary module and switches the GPTModel's own RoPE off (one attribute). The
exactness tests compare against a stock GPTModel with Megatron's standard RoPE.

Multi-latent attention rotates the RoPE part of its query and shared key inside Megatron's
`MLASelfAttention`, at positions restarting per segment too: `HDPMLASelfAttention` (`megatron/layers/mla.py`)
takes its place in the spec and rotates at the collated positions, and `HDPCoreAttention` applies no RoPE.

Transformer Engine: with `backend="transformer_engine"` the layer is Megatron's TE spec (fused
QKV+norm linears) and the local kernel is the one `megatron_hdp.attention` picks at run time ("auto";
TE's fused attention when installed). That path cannot run on this CPU-only machine.

Sinks (`softmax_type`): the leaf holds Megatron's `softmax_offset` as the core attention it replaces does
(`HDPCoreAttention._make_softmax_offset`) and hands it to the kernels and rings (`attention/sink.py`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any, ClassVar, Optional

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hdp.attention.core_attention import HDPBatchMeta, LatentRingInputs, hdp_core_attention
from megatron_hdp.attention.rope import rope_angles
from megatron_hdp.megatron.layers.mla import HDPMLASelfAttention
from megatron_hdp.megatron.layers.moe_aux_loss import install_document_hook, with_document_aux_loss_router
from megatron_hdp.megatron.layers.mtp import install_mtp
from megatron_hdp.megatron.layers.options import check_config
from megatron_hdp.megatron.layers.packed_seq import batch_meta

logger = logging.getLogger(__name__)

BACKENDS = ("local", "transformer_engine")


def layer_window(config: TransformerConfig, layer_number: int) -> Optional[int]:
    """The sliding window's `left` of layer `layer_number` (1-based), None for full causal attention: Megatron's
    `window_size = (left, 0)` on the layers its `is_layer_window_attention` picks (`window_attn_skip_freq`),
    as `DotProductAttention` and `TEDotProductAttention` decide it. (-1, 0) and (-1, -1) are no window;
    other right bounds are refused (`megatron/layers/options.py`)."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = config.window_size
    if not is_layer_window_attention(window, config.window_attn_skip_freq, layer_number) or window[0] < 0:
        return None
    return int(window[0])


class HDPCoreAttention(MegatronModule):
    """Drop-in `core_attention`: per-token RoPE, then `hdp_core_attention` (local kernel or ring).

    Constructed by Megatron's `SelfAttention` with the `CoreAttentionBuilder` keywords; called with THD
    query [T, Hq, D] and key/value [T, Hkv, D] (TP-local heads) and an `HDPPackedSeqParams`.
    """

    sink_like: ClassVar[str] = "local"
    """Whose `softmax_offset` this leaf makes: Megatron's local `DotProductAttention`'s or TE's."""

    requires_dsa_inputs: ClassVar[bool] = True
    """Asks Megatron's MLA (the only reader) to pass `x` and `qr` (its 4th QKV value) to the core attention as
    `core_attention_extra_kwargs`: the checkpointed call's arguments under core-attention recompute.
    `HDPMLASelfAttention` sends the latent ring's latent and RoPE key that way and takes both out again
    before this leaf is called (`mla.HDPMLASelfAttention._run_core_attention`)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        cp_comm_type: Optional[str] = None,
        softmax_scale: Optional[float] = None,
        pg_collection: Any = None,
        **unused: Any,
    ) -> None:
        super().__init__(config=config)
        check_config(config)  # the Core API's path to the refusals --hdp's flags get (megatron/layers/options.py)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"HDP core attention is causal only, got attn_mask_type={attn_mask_type}")
        if attention_type != "self":
            raise ValueError(f"HDP core attention supports self attention only, got {attention_type!r}")
        self.layer_number = layer_number
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.softmax_scale
        self.window = layer_window(config, layer_number)
        if self.window is not None and config.deterministic_mode and torch.cuda.is_available():
            raise ValueError(
                f"window_size={config.window_size} with deterministic_mode: on a GPU the ring pieces of a sliding "
                "window run on flex attention (flash-attn, TE and varlen_attn take one window per call), whose "
                "backward is not deterministic; drop --deterministic-mode or --window-size"
            )
        self._rotary: tuple = ()  # the model's RotaryEmbedding, set by prepare_model_for_hdp (not a submodule)
        self._make_softmax_offset(pg_collection)

    def _make_softmax_offset(self, pg_collection: Any) -> None:
        """`softmax_offset` [heads per TP rank] as the replaced core attention makes it, at the same point of
        the model's construction (so the RNG draws of the parameters after it stay Megatron's): off-by-one
        a zero tensor that is no parameter (no checkpoint key), learnable a parameter."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        self.softmax_offset, kind = None, self.config.softmax_type
        if kind in (None, "vanilla"):
            return
        self.tp_group = (pg_collection or ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])).tp
        heads, device = self.config.num_attention_heads // self.tp_group.size(), torch.cuda.current_device()
        dtype = torch.float32 if self.sink_like == "transformer_engine" else self.config.params_dtype
        if kind == "off-by-one":
            self.softmax_offset = torch.zeros(heads, device=device, dtype=dtype)
        elif self.sink_like == "transformer_engine":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(heads, device=device, dtype=dtype))
        else:
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=dtype))
            if self.config.perform_initialization:
                self.softmax_offset = self.config.init_method(self.softmax_offset)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's own (`DotProductAttention.sharded_state_dict`): the learnable sink split over TP by heads."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

        if self.softmax_offset is None:
            return {}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return DotProductAttention.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def set_rotary(self, rotary: Optional[torch.nn.Module]) -> None:
        """Use `rotary` (a Megatron RotaryEmbedding) for per-token RoPE; None: no RoPE."""
        self._rotary = (rotary,) if rotary is not None else ()

    def _rope(self, x: torch.Tensor, meta: HDPBatchMeta) -> torch.Tensor:
        (rotary,) = self._rotary
        freqs = meta.memo(("rope", id(rotary)), lambda: rope_angles(rotary, meta.position_ids))
        return apply_rotary_pos_emb(x.unsqueeze(1), freqs, config=self.config).squeeze(1)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        latent: Optional[LatentRingInputs] = None,
        **unused: Any,
    ) -> torch.Tensor:
        """`latent`: the latent ring's inputs (`HDPMLASelfAttention` gives them when the micro-batch has
        latent ring groups)."""
        meta = batch_meta(packed_seq_params, "HDPCoreAttention")
        if attention_bias is not None:
            raise ValueError("HDP core attention does not support an attention bias")
        if self._rotary:
            query = self._rope(query, meta)
            key = self._rope(key, meta)
        return hdp_core_attention(
            query, key, value, meta=meta, softmax_scale=self.softmax_scale,
            deterministic=self.config.deterministic_mode, window=self.window, sink=self.softmax_offset,
            latent=latent,
        )


class HDPCoreAttentionForTE(HDPCoreAttention):
    """`HDPCoreAttention` in the place of Megatron's `TEDotProductAttention`, with its checkpoint keys: an
    empty `_extra_state` in the state dict (TE 2.x module/base.py `get_extra_state`, without FP8) and, in
    the sharded one, only the learnable sink (`softmax_offset`, as `HDPCoreAttention` shards it), so TE
    checkpoints move both ways in either format. Its learnable sink is made as TE's `DotProductAttention`
    makes its own (float32 zeros, not Megatron's `init_method`). A non-empty attention extra state (an FP8
    run's, `torch` format) is refused rather than dropped from the next checkpoint without a word.
    """

    sink_like = "transformer_engine"

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        if state is None or (isinstance(state, torch.Tensor) and state.numel() == 0):
            return
        raise ValueError(
            f"layer {self.layer_number}'s core_attention._extra_state in the checkpoint holds Transformer Engine's "
            "FP8 state (an FP8 run saved with --ckpt-format torch), which HDP's attention would drop: convert the "
            "checkpoint with plain Megatron (--ckpt-convert-format torch_dist, which leaves it out), or load it "
            "without --hdp"
        )


def get_gpt_layer_with_hdp_spec(*, backend: str = "local", **spec_kwargs: Any) -> ModuleSpec:
    """Megatron's GPT layer spec (`local` or `transformer_engine`) with HDP's attention (`with_hdp_attention`).
    `spec_kwargs` go to Megatron's spec function (num_experts, moe_grouped_gemm, qk_layernorm,
    multi_latent_attention, normalization, ...)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {BACKENDS}")
    if backend == "local":
        spec = gpt_layer_specs.get_gpt_layer_local_spec(**spec_kwargs)
    else:
        if not getattr(gpt_layer_specs, "HAVE_TE", False):
            raise ValueError("backend='transformer_engine' needs Transformer Engine installed; use backend='local'")
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**spec_kwargs)
    return with_hdp_attention(spec, transformer_engine=backend == "transformer_engine")


def get_gpt_decoder_block_with_hdp_spec(
    config: TransformerConfig, *, use_transformer_engine: bool = False, vp_stage: Optional[int] = None
) -> Any:
    """Megatron's GPT decoder block spec for `config` (what Megatron-LM builds for `--num-experts`: dense
    and MoE layers by `moe_layer_freq`, this pipeline stage's layers) with HDP's attention in every layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    block = get_gpt_decoder_block_spec(
        config, use_transformer_engine, normalization=config.normalization, qk_l2_norm=config.qk_l2_norm,
        vp_stage=vp_stage,
    )
    swapped: dict[int, ModuleSpec] = {}  # Megatron repeats one spec object per kind of layer
    for spec in block.layer_specs:
        if id(spec) not in swapped:
            swapped[id(spec)] = with_hdp_attention(spec, transformer_engine=use_transformer_engine)
    return dataclasses.replace(block, layer_specs=[swapped[id(spec)] for spec in block.layer_specs])


def with_hdp_attention(spec: ModuleSpec, *, transformer_engine: bool) -> ModuleSpec:
    """A copy of Megatron's GPT layer spec `spec` with `HDPCoreAttention` as its `core_attention`
    (`HDPCoreAttentionForTE` in a `transformer_engine` spec: TEDotProductAttention's checkpoint keys), with
    `HDPMLASelfAttention` (`megatron/layers/mla.py`) for a multi-latent `MLASelfAttention` (the same submodules
    and parameter names: only the class of the module changes), and the per-document MoE router."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if attention.module is MLASelfAttention:
        attention.module = HDPMLASelfAttention
    elif isinstance(attention.module, type) and issubclass(attention.module, MLASelfAttention):
        if attention.module is not HDPMLASelfAttention:  # FusedMLASelfAttention: --mla-down-proj-fusion
            raise ValueError(
                f"HDP runs Megatron's MLASelfAttention, not {attention.module.__name__}; drop --mla-down-proj-fusion"
            )
    leaf = HDPCoreAttentionForTE if transformer_engine else HDPCoreAttention  # the checkpoint keys it replaces
    attention.submodules = dataclasses.replace(attention.submodules, core_attention=leaf)
    return with_document_aux_loss_router(spec)


def hdp_core_attention_modules(model: torch.nn.Module) -> list[HDPCoreAttention]:
    """Every `HDPCoreAttention` in `model`."""
    return [m for m in model.modules() if isinstance(m, HDPCoreAttention)]


def model_windows(model: torch.nn.Module) -> tuple[Optional[int], ...]:
    """The distinct sliding windows of `model`'s HDP core attentions (None: full causal), None first."""
    windows = {core.window for core in hdp_core_attention_modules(model)}
    return tuple(sorted(windows, key=lambda w: -1 if w is None else w)) or (None,)


def prepare_model_for_hdp(model: torch.nn.Module) -> torch.nn.Module:
    """Move RoPE of a GPTModel built with the HDP spec into its HDP core attention (per-token positions),
    its MTP layers' included; with multi-token prediction, install HDP's MTP roll (`megatron/layers/mtp.py`).

    Call once after building each model chunk (before wrapping it in DDP). ValueError when the model has
    no HDP core attention or uses a position embedding HDP cannot shard (yarn, mrope, partial no-rope).
    Multi-latent attention rotates its own RoPE part (`megatron/layers/mla.py`): its GPTModel has no rotary.
    """
    if getattr(model, "_hdp_prepared", False):
        return model
    cores = hdp_core_attention_modules(model)
    if not cores:
        raise ValueError("the model has no HDPCoreAttention: build it with get_gpt_layer_with_hdp_spec()")
    kind = getattr(model, "position_embedding_type", "none")
    if kind not in ("rope", "none", "learned_absolute"):
        raise ValueError(f"HDP supports RoPE, learned or no position embedding, got {kind!r}")
    if getattr(model.config, "no_rope_freq", None):
        raise ValueError("HDP does not support no_rope_freq (RoPE skipped on some layers)")
    if getattr(model.config, "context_parallel_size", 1) != 1:
        raise ValueError(
            f"context_parallel_size={model.config.context_parallel_size}: HDP replaces context parallelism; "
            "set it to 1 (the HDP domain is Megatron's data-parallel group)"
        )
    install_document_hook(model)
    if getattr(model.config, "mtp_num_layers", None):
        mtp_layers = getattr(getattr(model, "mtp", None), "layers", ())  # the MTP block: last stage only
        if not all(hdp_core_attention_modules(layer) for layer in mtp_layers):  # Megatron-LM's model builders
            raise ValueError("an MTP layer of the model has Megatron's own core attention, which cannot run HDP's "
                             "packed documents and rings: build the MTP block with mtp.mtp_block_spec_of")
        install_mtp()  # the MTP block's rolls come from the loader, its log is token-level (megatron/layers/mtp.py)
    rotary = getattr(model, "rotary_pos_emb", None) if kind == "rope" else None
    for core in cores:
        core.set_rotary(rotary)
    if kind == "rope":
        model.position_embedding_type = "none"  # GPTModel's own THD RoPE would restart positions per segment
    model._hdp_prepared = True
    return model


def hdp_layer_spec(config: Any, vp_stage: Optional[int] = None) -> Any:
    """`--spec` target: the GPT layer spec Megatron-LM builds for `config` (a GPTModelConfig) with HDP's
    attention: for `--num-experts` its decoder block spec (dense and MoE layers by --moe-layer-freq)."""
    transformer = config.transformer
    te = transformer.transformer_impl == "transformer_engine"
    if transformer.num_moe_experts:
        return get_gpt_decoder_block_with_hdp_spec(transformer, use_transformer_engine=te, vp_stage=vp_stage)
    common = dict(qk_layernorm=transformer.qk_layernorm, multi_latent_attention=transformer.multi_latent_attention)
    if te:
        return get_gpt_layer_with_hdp_spec(backend="transformer_engine", **common)
    return get_gpt_layer_with_hdp_spec(backend="local", normalization=transformer.normalization, **common)
