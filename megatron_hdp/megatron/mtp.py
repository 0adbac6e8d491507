"""Multi-token prediction under HDP: Megatron's own MTP block, its rolls answered from the loader.

Megatron's MTP block (megatron-core 0.19 and 0.20) rolls input ids and position ids
(`MultiTokenPredictionLayer._get_embeddings`), labels and loss mask (`process_mtp_loss`) with
`roll_tensor`, which on zigzag shards would wrap inside each shard. `hdp_roll_tensor`, installed as
`multi_token_prediction.roll_tensor` (`install_roll`, version-checked), answers each roll from the
micro-batch's `MTPRolls` (`data/mtp_shift.py`: each input's chain over depths 0..D, read by the loader),
so no message is sent. A tensor is recognised by identity; the one exception is the copy of the labels
`process_mtp_loss` makes before its first roll. Anything else raises, so a Megatron that rolls something
new stops instead of training on wrong tokens. Without HDP parameters the roll is Megatron's.

`mtp_block_spec_of` is Megatron's MTP block spec built from a given layer spec (HDP's, for both drivers):
Megatron-LM's model builders build the MTP block from the stock layer specs whatever `--spec` says
(`megatron.training.models.gpt.mtp_block_spec`, which install() wraps: `with_mtp_layer_spec`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

from megatron_hdp.data.mtp_shift import MTPRolls

ROLL_PARAMETERS = ("tensor", "shifts", "dims", "cp_group", "packed_seq_params")
"""The leading parameters of Megatron's `roll_tensor` the wrapper was written against (0.19 and 0.20; 0.20
adds `return_sum`)."""


def hdp_roll_tensor(original: Callable) -> Callable:
    """Megatron's `roll_tensor`, answered from `MTPRolls` when `packed_seq_params` carries them."""

    @functools.wraps(original)
    def roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None, **kwargs: Any):
        if not hasattr(packed_seq_params, "mtp_rolls") or tensor is None:
            return original(tensor, shifts, dims, cp_group, packed_seq_params, **kwargs)
        rolls: Optional[MTPRolls] = packed_seq_params.mtp_rolls
        if rolls is None:
            raise ValueError("an HDP micro-batch without MTP rolls reached Megatron's multi-token prediction: "
                             "collate it with mtp_depth = mtp_num_layers (HDPDataLoader, prepare_step)")
        rolled, total = rolls.roll(tensor, shifts=shifts, dims=dims)
        return rolled, total if kwargs.get("return_sum", True) else None

    roll_tensor._hdp_original = original  # type: ignore[attr-defined]
    return roll_tensor


def install_roll() -> None:
    """Make Megatron's MTP roll with `hdp_roll_tensor` (idempotent; the module global both of its callers
    read). ValueError when this Megatron's `roll_tensor` has another signature."""
    from megatron.core.transformer import multi_token_prediction as mtp

    current = mtp.roll_tensor
    if not hasattr(current, "_hdp_original"):
        _require_parameters(current, ROLL_PARAMETERS, "megatron.core's roll_tensor", leading=True)
        mtp.roll_tensor = hdp_roll_tensor(current)


def _require_parameters(function: Callable, expected: tuple[str, ...], name: str, *, leading: bool = False) -> None:
    """ValueError unless `function` takes the parameters `expected` (`leading`: as its first ones) of the
    megatron-core releases HDP's MTP was written for (0.19, 0.20)."""
    parameters = tuple(inspect.signature(function).parameters)
    if (parameters[: len(expected)] if leading else parameters) != expected:
        raise ValueError(f"{name} takes {parameters}; HDP's MTP was written for {expected} (megatron-core 0.19/0.20)")


def mtp_block_spec_of(config: Any, layer_spec: Any, *, use_transformer_engine: bool = False,
                      vp_stage: Optional[int] = None) -> Any:
    """Megatron's MTP block spec (`get_gpt_mtp_block_spec`) for `config` (a TransformerConfig) with the
    transformer layer `layer_spec`: a layer spec, or a block spec whose last layer is taken (Megatron
    builds the MTP layer like the decoder's last); None without MTP on this stage."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    if not config.mtp_num_layers:
        return None
    specs = getattr(layer_spec, "layer_specs", None)
    if specs is not None:
        if not specs:
            raise ValueError("the block spec has no layer to build the MTP layers like: pass a layer spec")
        layer_spec = specs[-1]
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=use_transformer_engine,
                                  vp_stage=vp_stage)


MTP_BLOCK_SPEC_PARAMETERS = ("config", "transformer_layer_spec", "vp_stage")
"""Parameters of `megatron.training.models.gpt.mtp_block_spec` (megatron-core 0.19 and 0.20)."""


def with_mtp_layer_spec(original: Callable, layer_spec: Callable[[Any], Any]) -> Callable:
    """`megatron.training.models.gpt.mtp_block_spec` (what `GPTModelBuilder.build_model` calls) building the
    MTP layers from `layer_spec(config)` (install(): `hdp_layer_spec`) instead of Megatron's stock specs.
    ValueError when `original` has another signature than the one this was written against."""
    _require_parameters(original, MTP_BLOCK_SPEC_PARAMETERS, "megatron.training.models.gpt.mtp_block_spec")

    @functools.wraps(original)
    def mtp_block_spec(config: Any, transformer_layer_spec: Any, vp_stage: Optional[int] = None) -> Any:
        transformer = config.transformer
        return mtp_block_spec_of(transformer, layer_spec(config), vp_stage=vp_stage,
                                 use_transformer_engine=transformer.transformer_impl == "transformer_engine")

    return mtp_block_spec


def average_mtp_log_over_planned_microbatches(plan: Any) -> None:
    """Make Megatron's `mtp_k loss` log (call before `training_log`) the mean of the per-micro-batch MTP
    loss over the plan's micro-batches that hold tokens: Megatron divides the data-parallel mean of each
    rank's sum by `get_num_microbatches()`, which HDP ranks do not all run (padding micro-batches log 0)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = MTPLossLoggingHelper.tracker.get("loss_values")
    planned = sum(bool(mb.shards) for schedule in plan.ranks for mb in schedule.microbatches)
    if values is not None and planned:
        values.mul_(get_num_microbatches() * parallel_state.get_data_parallel_world_size() / planned)
