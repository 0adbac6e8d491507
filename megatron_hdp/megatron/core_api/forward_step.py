"""`forward_step` for Megatron's schedules: one packed HDP micro-batch in, a token-level loss out.

The loss follows Megatron's own per-token convention (`calculate_per_token_loss=True`): the loss
function returns (sum of token losses, number of loss tokens); the schedule adds the counts over this
rank's micro-batches, `finalize_model_grads` sums them over the data-parallel group — the HDP domain —
and scales every gradient by 1 / that total. So the gradient is (sum of all token losses of the global
batch) / (its loss-token count), whatever number of micro-batches each rank ran: exactly the gradient
of plain data parallelism over the same global batch.
"""

from __future__ import annotations

from functools import partial
from typing import Iterator, Optional, Sequence

import torch

from megatron_hdp.attention.core_attention import HDPBatchMeta
from megatron_hdp.data.collate import PackedMicroBatch
from megatron_hdp.data.mtp_shift import MTPRolls
from megatron_hdp.megatron.layers.packed_seq import HDPPackedSeqParams
from megatron_hdp.megatron.layers.spec import model_windows
from megatron_hdp.offload.offloader import ActivationOffloader


def packed_seq_params(
    batch: PackedMicroBatch,
    *,
    hdp_global_ranks: tuple[int, ...],
    backend: str = "auto",
    host: Optional[PackedMicroBatch] = None,
    windows: tuple[Optional[int], ...] = (None,),
) -> HDPPackedSeqParams:
    """Megatron THD parameters of `batch` with its HDP metadata (rings as global ranks, positions).

    `max_seqlen` is read from the host copy `host` of the micro-batch when given (no device sync).
    `windows`: the sliding windows of the model's layers, whose ring plans are prepared with the batch."""
    max_seqlen = (host if host is not None else batch).max_segment_length
    return HDPPackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch.cu_seqlens,
        cu_seqlens_kv=batch.cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
        hdp=HDPBatchMeta(
            groups=batch.groups,
            hdp_global_ranks=hdp_global_ranks,
            position_ids=batch.position_ids,
            backend=backend,
            windows=windows,
        ),
    )


def token_loss(
    loss_mask: torch.Tensor, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron loss function: (sum of masked token losses, loss-token count, {"lm loss": [sum, count]})."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.reshape(-1).to(losses.dtype)
    assert losses.shape == mask.shape, f"{losses.shape} token losses for a mask of {mask.shape}"
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.detach().float()])}


def model_chunk_index(model: torch.nn.Module) -> int:
    """Which of this rank's model chunks `model` (as the schedule passes it, maybe inside DDP) is: its
    virtual pipeline stage, 0 without virtual pipelining."""
    from megatron.core.utils import unwrap_model

    return getattr(unwrap_model(model), "vp_stage", None) or 0


def make_forward_step(*, hdp_global_ranks: tuple[int, ...], backend: str = "auto",
                      offloaders: Sequence[ActivationOffloader] = ()):
    """A Megatron `forward_step_func(data_iterator, model)` reading `PackedMicroBatch`es.

    Each micro-batch arrives on the host and is moved once to the device of the model's parameters
    (non-blocking: asynchronous when the step pinned it) before the forward. A micro-batch collated for
    multi-token prediction also gives the model its loss mask (Megatron's MTP loss reads it) and the
    rolls of its inputs (`megatron/layers/mtp.py`). With virtual pipeline stages the schedule passes each model
    chunk its own iterator over the same micro-batches (chunk c takes micro-batch m at its own place in
    the interleaved order), so every HDP datum of the micro-batch — rings, positions, documents, loss
    mask, MTP rolls, offload ratio — reaches every chunk with it.

    `offloaders`, when given, holds one offloader per model chunk: each micro-batch's forward through
    chunk c runs inside `offloaders[c].microbatch(ratio=<the micro-batch's offload_ratio>)`.
    """

    def forward_step(data_iterator: Iterator[PackedMicroBatch], model: torch.nn.Module):
        host = next(data_iterator)
        batch = host.to(next(model.parameters()).device, non_blocking=True)
        windows = model_windows(model)
        params = packed_seq_params(
            batch, hdp_global_ranks=hdp_global_ranks, backend=backend, host=host, windows=windows
        )
        inputs = dict(
            input_ids=batch.tokens[None],
            position_ids=batch.position_ids[None],
            attention_mask=None,
            labels=batch.labels[None],
            packed_seq_params=params,
        )
        if batch.mtp_depth:  # multi-token prediction: the model rolls its inputs through params.mtp_rolls
            params.mtp_rolls = MTPRolls.of_batch(batch)
            inputs.update(params.mtp_rolls.inputs)
        if not offloaders:
            output = model(**inputs)
        else:
            with offloaders[model_chunk_index(model)].microbatch(ratio=host.offload_ratio):
                output = model(**inputs)
        return output, partial(token_loss, batch.loss_mask)

    return forward_step
