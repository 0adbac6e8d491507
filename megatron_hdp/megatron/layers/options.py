"""Megatron model options HDP's attention does not honour, refused in one line each (flags and configs).

HDP replaces one leaf of Megatron's layer, `core_attention`; every `TransformerConfig` field that
Megatron's own core attention (`DotProductAttention`, `TEDotProductAttention`), its multi-latent
attention (`MLASelfAttention`) or the GPT model's multi-token prediction reads is either honoured by
`HDPCoreAttention` / `HDPMLASelfAttention` or listed here.
`docs/megatron_options.md` holds the decision for every such field, and
`tests/megatron/test_megatron_options.py` reads the fields from Megatron's source so that a new release cannot add
one that is silently ignored.

One table serves both entry points: `--hdp` on the Megatron-LM command line (`validate_hdp_args`, field
name = flag name) and the Core API (`HDPCoreAttention` checks the `TransformerConfig` it is built with).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Refusal:
    """A `TransformerConfig` field (= Megatron-LM flag) whose value HDP cannot give its meaning."""

    field: str
    refused: Callable[[Any], bool]
    """Whether a value is refused (the field's default passes, unless the default itself is refused)."""
    why: str
    """What HDP would get wrong."""
    fix: Any
    """The value that runs (None: drop the flag)."""


REFUSALS: tuple[Refusal, ...] = (
    Refusal(
        "attention_dropout",
        lambda p: bool(p),
        "attention dropout is Megatron's default (0.1, also when the flag is not given), but HDP's kernels and "
        "ring attention run without it: a ring splits a document's attention over ranks and steps, and the "
        "block backward cannot replay a dropout mask drawn in the forward, so the run would train a model "
        "without attention dropout while saying it has one",
        0.0,
    ),
    Refusal(
        "mtp_hsm",
        bool,
        "MTP hidden-state mixing rolls the MTP layers' hidden states one position per depth; under HDP the "
        "next position of a zigzag shard's last token is on another ring member, and HDP answers MTP's rolls "
        "of tokens, positions, labels and loss mask from its loader, not rolls of activations",
        None,
    ),
    Refusal(
        "window_size",
        lambda w: w is not None and tuple(w) != (-1, -1) and not (w[1] == 0 and w[0] >= -1),
        "HDP honours causal sliding windows (left, 0); a right bound other than 0 has no one meaning under "
        "the causal mask (TE sets it to 0, Megatron's local attention masks the diagonal out)",
        None,
    ),
    Refusal(
        "qk_clip",
        bool,
        "QK-clip needs each head's largest attention logit from the kernel; HDP's kernels do not return it",
        None,
    ),
    Refusal(
        "log_max_attention_logit",
        bool,
        "the largest attention logit per head comes from Megatron's TE attention; HDP's kernels do not return it",
        None,
    ),
    Refusal(
        "batch_invariant_mode",
        bool,
        "batch-invariant kernels make a token's result independent of the batch; under HDP a document's "
        "attention depends on the plan (ring size, block order of the log-sum-exp merge)",
        None,
    ),
    Refusal(
        "apply_query_key_layer_scaling",
        bool,
        "it rescales fp16 scores per layer inside Megatron's softmax; HDP's kernels keep scores in fp32 and "
        "take one softmax scale",
        None,
    ),
    Refusal(
        "fine_grained_activation_offloading",
        bool,
        "Megatron's fine-grained offloading and HDP's planned selective offloading would both move the "
        "same activations",
        None,
    ),
    Refusal(
        "fused_single_qkv_rope",
        bool,
        "the fused QKV+RoPE kernel rotates at packed positions inside Megatron's attention; HDP rotates every "
        "token at its document position (zigzag shards)",
        None,
    ),
    Refusal(
        "experimental_attention_variant",
        lambda v: v is not None,
        "an experimental attention variant (DeepSeek sparse attention) is built from its own layer spec and "
        "indexer, which HDP's layer spec does not build",
        None,
    ),
    Refusal(
        "mla_down_proj_fusion",
        bool,
        "the fused q/kv down projection is another MLA module (FusedMLASelfAttention), not checked under HDP",
        None,
    ),
    Refusal(
        "cache_mla_latents",
        bool,
        "caching MLA latents serves Megatron's dynamic inference backend; an HDP model trains",
        None,
    ),
    Refusal(
        "moe_n_hash_layers",
        bool,
        "hash-routed MoE layers are not checked with HDP's per-document router",
        None,
    ),
    Refusal(
        "moe_paged_stash",
        bool,
        "the paged expert-activation stash is not checked under HDP's variable micro-batch sizes",
        None,
    ),
)


def flag_name(field: str) -> str:
    """The Megatron-LM flag of a config field: `window_size` -> `--window-size`."""
    return "--" + field.replace("_", "-")


def _flag_value(value: Any) -> str:
    return "" if value is True else f" {value}"


def flag_problems(args: Any) -> list[str]:
    """One line per refused option among Megatron-LM's parsed `args` (flag name = field name)."""
    problems = []
    for refusal in REFUSALS:
        value, flag = getattr(args, refusal.field, None), flag_name(refusal.field)
        if refusal.refused(value):
            fix = f"use {flag} {refusal.fix}" if refusal.fix is not None else f"drop {flag}"
            problems.append(f"{flag}{_flag_value(value)}: {refusal.why}; {fix}")
    return problems


def config_problems(config: Any) -> list[str]:
    """One line per refused option of a `TransformerConfig` (the Core API's path)."""
    problems = []
    for refusal in REFUSALS:
        value = getattr(config, refusal.field, None)
        if refusal.refused(value):
            fix = refusal.fix if refusal.fix is not None or not isinstance(value, bool) else False
            fix = f"leave {refusal.field} unset" if fix is None else f"set {refusal.field}={fix!r}"
            problems.append(f"{refusal.field}={value!r}: {refusal.why}; {fix}")
    return problems


def check_config(config: Any) -> None:
    """ValueError naming every refused option of `config` (a TransformerConfig) and what to set instead."""
    problems = config_problems(config)
    if problems:
        raise ValueError("HDP core attention cannot run with this TransformerConfig:\n  - " + "\n  - ".join(problems))
