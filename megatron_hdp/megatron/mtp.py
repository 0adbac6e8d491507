"""Multi-token prediction under HDP: Megatron's own MTP block, its rolls answered from the loader.

Megatron's `MultiTokenPredictionBlock` (megatron-core 0.19 and 0.20) moves every input one position
left per depth with `roll_tensor(tensor, shifts=-1, dims=-1, cp_group, packed_seq_params)`: the input
ids and position ids in each MTP layer (`MultiTokenPredictionLayer._get_embeddings`), the labels and the
loss mask in `process_mtp_loss`, which scales each depth's token losses by (loss tokens) / (loss tokens
left after the roll) under `calculate_per_token_loss`. Under HDP the rows of a micro-batch are zigzag
shards of documents: the next position of a shard's last token lives in the next chunk of its document,
on another ring member (or nowhere: the document's end). Megatron's own packed roll would wrap inside each
packed shard instead.

The loader knows those next tokens (it reads the D tokens after each chunk: `data/mtp_shift.py`), so
HDP answers every roll from them and sends no message. `MTPRolls` holds, per micro-batch, the chain of
each input over depths 0..D (depth 0 is what the forward step passes to the model: input ids, position
ids, labels, loss mask) and rides in `HDPPackedSeqParams.mtp_rolls`; `hdp_roll_tensor`, installed as
`multi_token_prediction.roll_tensor` (`install_roll`, version-checked), returns the next link of the chain
a tensor belongs to. A tensor is recognised by identity, since Megatron rolls what it was given and then
what the previous roll returned; the one exception is the copy of the labels `process_mtp_loss` makes
before its first roll, recognised as the only int64 tensor of the micro-batch's shape it did not get
from us. Anything else raises, so a Megatron that rolls something new stops instead of training on
wrong tokens. The loss mask's chain carries each document's depth weight (M / M_d), and its roll reports
the micro-batch's loss-token count as the count left after the roll, so that Megatron's rescaling
(original / rolled) is 1 and the weight normalises each document as Megatron normalises a sequence
(`mtp_shift`). Without HDP parameters the roll is Megatron's.

`mtp_block_spec_of` is Megatron's MTP block spec built from a given layer spec (HDP's, for both drivers):
Megatron-LM's model builders build the MTP block from the stock layer specs whatever `--spec` says
(`megatron.training.models.gpt.mtp_block_spec`, which install() wraps; `gpt_builders.gpt_builder`, not
on pretrain_gpt.py's path), and the MTP layers' core attention must be HDP's like every other layer's.
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
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise ValueError(f"HDP's MTP rolls shift one position along the last dimension, got shifts={shifts}, "
                             f"dims={dims}")
        rolled, total = rolls.roll(tensor)
        return rolled, total if kwargs.get("return_sum", True) else None

    roll_tensor._hdp_original = original  # type: ignore[attr-defined]
    return roll_tensor


def install_roll() -> None:
    """Make Megatron's MTP roll with `hdp_roll_tensor` (idempotent; the module global both of its callers
    read). ValueError when this Megatron's `roll_tensor` has another signature."""
    from megatron.core.transformer import multi_token_prediction as mtp

    current = mtp.roll_tensor
    if hasattr(current, "_hdp_original"):
        return
    parameters = tuple(inspect.signature(current).parameters)[: len(ROLL_PARAMETERS)]
    if parameters != ROLL_PARAMETERS:
        raise ValueError(f"megatron.core's roll_tensor takes {parameters}, HDP's MTP was written for "
                         f"{ROLL_PARAMETERS} (megatron-core 0.19/0.20)")
    mtp.roll_tensor = hdp_roll_tensor(current)


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
    parameters = tuple(inspect.signature(original).parameters)
    if parameters != MTP_BLOCK_SPEC_PARAMETERS:
        raise ValueError(f"megatron.training.models.gpt.mtp_block_spec takes {parameters}; HDP wraps the one of "
                         f"megatron-core 0.19/0.20, {MTP_BLOCK_SPEC_PARAMETERS}")

    @functools.wraps(original)
    def mtp_block_spec(config: Any, transformer_layer_spec: Any, vp_stage: Optional[int] = None) -> Any:
        transformer = config.transformer
        return mtp_block_spec_of(transformer, layer_spec(config), vp_stage=vp_stage,
                                 use_transformer_engine=transformer.transformer_impl == "transformer_engine")

    return mtp_block_spec


def average_mtp_log_over_planned_microbatches(plan: Any) -> None:
    """Make Megatron's `mtp_k loss` log the mean over the step's planned micro-batches of its
    per-micro-batch MTP loss (call before `training_log`).

    Megatron logs (sum of this rank's per-micro-batch values, averaged over the data-parallel group) /
    `get_num_microbatches()` (training.py: `MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches)`),
    the mean when every rank runs that many micro-batches. HDP ranks run the plan's counts, so this rank's
    sums are scaled by dp x num_microbatches / (micro-batches of the plan that hold tokens): the log becomes
    the sum over those divided by their number (the padding micro-batches a step adds log 0)."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    values = MTPLossLoggingHelper.tracker.get("loss_values")
    planned = sum(bool(mb.shards) for schedule in plan.ranks for mb in schedule.microbatches)
    if values is not None and planned:
        values.mul_(get_num_microbatches() * parallel_state.get_data_parallel_world_size() / planned)
