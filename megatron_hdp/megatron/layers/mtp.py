"""Multi-token prediction under HDP: Megatron's own MTP block, its rolls answered from the loader.

Megatron's MTP block (megatron-core 0.19 and 0.20) rolls input ids and position ids
(`MultiTokenPredictionLayer._get_embeddings`), labels and loss mask (`process_mtp_loss`) with
`roll_tensor`, which on zigzag shards would wrap inside each shard. `hdp_roll_tensor`, installed as
`multi_token_prediction.roll_tensor` (`install_mtp`, version-checked), answers each roll from the
micro-batch's `MTPRolls` (`data/mtp_shift.py`: each input's chain over depths 0..D, read by the loader),
so no message is sent. A tensor is recognised by identity; the one exception is the copy of the labels
`process_mtp_loss` makes before its first roll, recognised only inside that call (`hdp_process_mtp_loss`
opens the scope: `MTPRolls.copying`). Anything else raises, so a Megatron that rolls something new stops
instead of training on wrong tokens. Without HDP parameters the roll is Megatron's.

The log (`mtp_k loss`) is the token-level mean over the global batch: the sum of the depth-k token losses
over the number of depth-k loss tokens, whatever the placement. Megatron logs the mean over micro-batches of
each one's depth-k loss per token (weighted, under HDP, by the per-document weights of `data/mtp_shift.py`),
which depends on how documents are packed and split. `hdp_process_mtp_loss` records each micro-batch's
unweighted depth-k loss sum and loss-token count (`MTPLossLoggingHelper.tracker`, key `TOKEN_LOSS`), and
`log_token_level_mtp_loss` sums them over the data-parallel group and puts the quotient where Megatron's
log reads it. The gradient: depth k's loss enters the backward weighted per document (M / M_k, in the
rolled loss masks), as plain Megatron weighs a one-document micro-batch, which no placement changes;
Megatron's own per-micro-batch ratio is made 1 (`MTPRolls.normaliser`).

`mtp_block_spec_of` is Megatron's MTP block spec built from a given layer spec (HDP's, for both drivers):
Megatron-LM's model builders build the MTP block from the stock layer specs whatever `--spec` says
(`megatron.training.models.gpt.mtp_block_spec`, which install() wraps: `with_mtp_layer_spec`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch

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


PROCESS_MTP_LOSS_PARAMETERS = (
    "hidden_states", "labels", "loss_mask", "output_layer", "output_weight", "runtime_gather_output", "is_training",
    "compute_language_model_loss", "config", "cp_group", "tp_group", "packed_seq_params")
"""The leading parameters of Megatron's `process_mtp_loss` the wrapper was written against (0.19 and 0.20)."""
TOKEN_LOSS = "hdp_token_loss"
"""Key of `MTPLossLoggingHelper.tracker` holding this rank's [2, depths] float64 (unweighted loss sum, loss
tokens) of each depth since the last log."""


def hdp_process_mtp_loss(original: Callable) -> Callable:
    """Megatron's `process_mtp_loss`; on an HDP micro-batch (`packed_seq_params.mtp_rolls`) with the loss
    mask `MTPRolls.normaliser` (the weights are in the rolled masks), inside the scope where its labels'
    copy is recognised, and, in training, recording each depth's unweighted token-loss sum and count for
    the token-level log (module docstring)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def process_mtp_loss(*args: Any, **kwargs: Any):
        bound = signature.bind(*args, **kwargs)
        call = bound.arguments
        rolls: Optional[MTPRolls] = getattr(call.get("packed_seq_params"), "mtp_rolls", None)
        if rolls is None or call["labels"] is None:
            return original(*bound.args, **bound.kwargs)
        call["loss_mask"] = rolls.normaliser  # Megatron's per-micro-batch ratio 1 (data/mtp_shift.py)
        if call["is_training"]:
            call["compute_language_model_loss"] = _recording(call["compute_language_model_loss"], rolls,
                                                             call["config"].mtp_num_layers)
        with rolls.copying(call["labels"]):
            return original(*bound.args, **bound.kwargs)

    process_mtp_loss._hdp_original = original  # type: ignore[attr-defined]
    return process_mtp_loss


def _recording(compute_loss: Callable, rolls: MTPRolls, num_layers: int) -> Callable:
    """`compute_loss(labels, logits)` adding, when `labels` are a depth-d MTP target, the unweighted sum of
    the depth-d token losses and their count to the tracker's `TOKEN_LOSS` row d - 1."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    def compute_language_model_loss(labels, logits):
        loss = compute_loss(labels, logits)
        depth, tokens = rolls.loss_tokens(labels)
        if tokens is not None:
            sums = MTPLossLoggingHelper.tracker.get(TOKEN_LOSS)
            if sums is None or sums.shape[1] != num_layers:
                sums = MTPLossLoggingHelper.tracker[TOKEN_LOSS] = torch.zeros(2, num_layers, dtype=torch.float64,
                                                                              device=loss.device)
            tokens = tokens.reshape(loss.shape)
            sums[0, depth - 1] += torch.where(tokens, loss.detach(), 0).sum(dtype=torch.float64)
            sums[1, depth - 1] += tokens.sum()
        return loss

    return compute_language_model_loss


def install_mtp() -> None:
    """Make Megatron's MTP roll with `hdp_roll_tensor` (the module global both of its callers read) and
    GPTModel compute its MTP loss through `hdp_process_mtp_loss` (idempotent). ValueError when this
    Megatron's `roll_tensor` or `process_mtp_loss` has another signature."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    current = mtp.roll_tensor
    if not hasattr(current, "_hdp_original"):
        _require_parameters(current, ROLL_PARAMETERS, "megatron.core's roll_tensor", leading=True)
        mtp.roll_tensor = hdp_roll_tensor(current)
    current = gpt_model.process_mtp_loss
    if not hasattr(current, "_hdp_original"):
        _require_parameters(current, PROCESS_MTP_LOSS_PARAMETERS, "megatron.core's process_mtp_loss", leading=True)
        gpt_model.process_mtp_loss = hdp_process_mtp_loss(current)


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


def log_token_level_mtp_loss() -> None:
    """Make Megatron's `mtp_k loss` log (call on every rank before `training_log`) the token-level mean of
    depth k over the global batch: the recorded sums and counts (`TOKEN_LOSS`) summed over the group
    Megatron averages the log over, their quotient (0 without loss tokens) put where Megatron's log reads
    it (it averages the equal values over that group and divides by its number of micro-batches). A
    collective over that group on the ranks that hold the MTP block; nothing elsewhere."""
    import torch.distributed as dist
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    values = tracker.get("loss_values")
    if values is None:
        return
    sums = tracker.get(TOKEN_LOSS)
    if sums is None or sums.shape[1] != len(values):
        sums = torch.zeros(2, len(values), dtype=torch.float64, device=values.device)
    if tracker.get("avg_group") is not None:
        dist.all_reduce(sums, group=tracker["avg_group"])
    mean = sums[0] / sums[1].clamp(min=1)
    values.copy_(mean * get_num_microbatches())
    tracker[TOKEN_LOSS] = sums.zero_()
