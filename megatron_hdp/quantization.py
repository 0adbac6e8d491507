"""FP8/FP4 training under HDP: the token padding each recipe needs, and the recipe HDP refuses.

Both read the same settings from Megatron's argument namespace or from a `TransformerConfig` (the fields
have the same names: fp8, fp8_recipe, fp4, fp4_recipe, tp_only_amax_red, sequence_parallel,
tensor_model_parallel_size), so `pretrain_gpt.py --hdp` and the Core-API `HDPTrainer` pad and refuse alike.

Padding. Every micro-batch (a padding micro-batch of an idle rank included) is padded with masked tokens
to `token_multiple`: the TP size when sequence parallelism splits the tokens, times the per-GEMM-input
multiple of the recipe. The multiples come from Transformer Engine's shape checks, the strictest over the TE 2.x
releases (2.1 to 2.18; where a later release dropped a check, noted below, the padding is still valid):

* delayed, tensorwise (per-tensor FP8): 16. `module/linear.py` asserts `assert_dim_for_fp8_exec`
  (utils.py: leading dims % 8, last dim % 16) on every FP8 GEMM input; the weight-gradient GEMM takes the
  transposed activation, whose last dim is the token count, hence 16. Megatron pads MoE tokens to the
  same 16 (`fp8_utils.get_fp8_align_size`).
* mxfp8: 32. `MXFP8Quantizer.make_empty` asserts `prod(shape[:-1]) % MXFP8_BLOCK_SCALING_SIZE == 0`
  (tensor/mxfp8_tensor.py, TE 2.1 to 2.14; `is_quantizable` keeps the rule in 2.18), block size 32
  (constants.py); Megatron's `get_fp8_align_size` gives 32 as well.
* blockwise: 128 per TP rank with sequence parallelism, else 16. `Float8BlockQuantizer.is_quantizable`
  needs the rows divisible by `block_len` = 128 (tensor/float8_blockwise_tensor.py), and TE 2.8 to 2.12
  assert it on the rank's shard before the sequence-parallel all-gather (`assert_dim_for_all_gather`,
  module/linear.py); later releases gather in BF16 instead, which the padding keeps off. Without the
  all-gather the quantizer pads its scales itself (`get_scale_shape` rounds up) and the FP8 GEMM's 16
  applies.
* NVFP4 (--fp4-format, recipe nvfp4): 32. `NVFP4Quantizer.make_empty` asserts the rows divisible by
  `NVFP4_BLOCK_SCALING_SIZE` = 16 (tensor/nvfp4_tensor.py, TE 2.8 to 2.14), and the column-wise copy the
  weight gradient uses packs two tokens per byte, with rows the FP4 GEMM reads through TMA in 16-byte
  units: 32 tokens (Megatron's `fp4_utils.get_fp4_align_size` docstring).
* custom (--fp8-recipe custom / --fp4-recipe custom): the quantizers are user code whose shape rules HDP
  cannot know: refused.

Delayed scaling. Megatron wraps a block's forward in one `fp8_autocast` whose amax reduction group is
`get_amax_reduction_group(with_context_parallel=True, tp_only_amax_red=...)` (fp8_utils.get_fp8_context):
TP x DP x CP unless --tp-only-amax-red. TE all-reduces the amaxes over that group when the outermost
autocast exits (`FP8GlobalStateManager.fp8_autocast_exit` -> `reduce_and_update_fp8_tensors(forward=True)`,
fp8.py) and again at the end of the first FP8 module's backward (linear.py, layernorm_linear.py,
layernorm_mlp.py: `reduce_and_update_fp8_tensors(forward=False)`), i.e. twice per micro-batch. HDP ranks
run different numbers of micro-batches, so over TP x DP they post different numbers of all-reduces on one
communicator: a hang, or amaxes of different micro-batches max-reduced together. With
--tp-only-amax-red the group is the TP group, whose ranks run the same micro-batches, so every rank of it
posts the same reductions in the same order; that is Megatron's own setting with its own meaning (each
data-parallel replica keeps its own scaling factors), so HDP accepts delayed scaling with it and refuses
it without. Megatron-LM keeps `tp_only_amax_red` off the command line (arguments.py excludes it from the
flags it generates from TransformerConfig), so `pretrain_gpt.py --hdp` refuses delayed scaling and a
Core-API user may set the field. The other recipes reduce nothing at autocast exit (TE's amax buffers hold delayed-scaling
tensors only) and reduce per-tensor amaxes within the TP group only (`amax_reduction_group = tp_group`).
"""

from __future__ import annotations

from typing import Any

GEMM_TOKEN_MULTIPLE = 16
"""Tokens of an FP8 GEMM input (per TP rank): see the module docstring."""

RECIPE_TOKEN_MULTIPLE = {"delayed": 16, "tensorwise": 16, "mxfp8": 32, "blockwise": 16, "nvfp4": 32}
"""Per-GEMM-input token multiple of each built-in recipe (FP8 recipes, and NVFP4 under --fp4-format)."""

SEQUENCE_PARALLEL_TOKEN_MULTIPLE = {"blockwise": 128}
"""Recipes whose quantized sequence-parallel all-gather needs more of each TP rank's shard."""

WORKING_FP8_RECIPES = ("tensorwise", "mxfp8", "blockwise")


def _name(value: Any) -> str:
    """A recipe as its flag value ('delayed'), from a string or Megatron's str-valued enums."""
    return str(getattr(value, "value", value))


def active_recipe(settings: Any) -> str | None:
    """The recipe the run quantizes with: fp8_recipe under --fp8-format, fp4_recipe under --fp4-format."""
    if getattr(settings, "fp8", None):
        return _name(settings.fp8_recipe)
    if getattr(settings, "fp4", None):
        return _name(settings.fp4_recipe)
    return None


def token_multiple(settings: Any) -> int:
    """The multiple every HDP micro-batch's token count is padded to (with masked tokens) on this run.

    `settings` is Megatron's argument namespace or a `TransformerConfig`. Sequence parallelism splits a
    micro-batch over the TP ranks; FP8/FP4 needs each TP rank's GEMM input to be a multiple of the
    recipe's number (module docstring). ValueError for a recipe without a known rule (see `problems`).
    """
    tp = settings.tensor_model_parallel_size if getattr(settings, "sequence_parallel", False) else 1
    recipe = active_recipe(settings)
    if recipe is None:
        return tp
    if recipe not in RECIPE_TOKEN_MULTIPLE:
        raise ValueError(_custom_message(settings))
    if tp > 1 and recipe in SEQUENCE_PARALLEL_TOKEN_MULTIPLE:
        return tp * SEQUENCE_PARALLEL_TOKEN_MULTIPLE[recipe]
    return tp * RECIPE_TOKEN_MULTIPLE[recipe]


def _custom_message(settings: Any) -> str:
    fp8 = bool(getattr(settings, "fp8", None))
    flag = "--fp8-recipe" if fp8 else "--fp4-recipe"
    fix = f"--fp8-recipe {', '.join(WORKING_FP8_RECIPES)}" if fp8 else "--fp4-recipe nvfp4"
    return (
        f"{flag} {active_recipe(settings)}: HDP pads every micro-batch to the token multiple its recipe's "
        f"quantizers need, and a custom quantizer's is unknown; use {fix}"
    )


def problems(settings: Any) -> list[str]:
    """One message per FP8/FP4 setting HDP cannot train with, each naming the flag and the fix."""
    recipe = active_recipe(settings)
    if recipe is None:
        return []
    if recipe not in RECIPE_TOKEN_MULTIPLE:
        return [_custom_message(settings)]
    if recipe == "delayed" and not getattr(settings, "tp_only_amax_red", False):
        return [
            "--fp8-recipe delayed (the default of --fp8-format): Transformer Engine all-reduces the FP8 amaxes "
            "over tensor x data parallel ranks twice per micro-batch, and HDP ranks run different numbers of "
            f"micro-batches (a hang); use --fp8-recipe {', '.join(WORKING_FP8_RECIPES)} (Core API: or "
            "TransformerConfig(tp_only_amax_red=True), amaxes reduced within the tensor-parallel group only)"
        ]
    return []
