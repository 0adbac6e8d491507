"""Exactness harness: HDP on several ranks against ordinary training of the same batch in one process.

The reference is independent of HDP's own code: Megatron's stock local layer spec (its own attention
and its own RoPE), each document as its own batch [1, L], the loss = sum of token losses / total tokens
of the global batch, Megatron's schedule and optimizer on one rank (reached through `megatron/`, the
only layer that imports Megatron: `step.forward_backward` passes its arguments to Megatron's
`get_forward_backward_func()` unchanged, with no HDP code on the way). The HDP run loads the reference's
initial weights — each parameter sliced the way its TP rank / PP stage / EP rank holds it — trains the
same global batches, and reports its loss and gradients with the metadata to compare them shard by
shard (`expected_shard`). Used by tests/megatron/test_megatron_exactness.py and the demo's self-check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

VOCAB_SIZE = 128


def document_tokens(seed: int, seq: int, length: int) -> np.ndarray:
    """The L + 1 raw tokens of synthetic document `seq` of a batch drawn with `seed`."""
    return np.random.default_rng([seed, seq]).integers(0, VOCAB_SIZE, size=length + 1, dtype=np.int64)


def token_reader(seed: int, lengths: Sequence[int]):
    """`read_tokens(seq, start, end)` over the synthetic documents of one batch."""
    docs = [document_tokens(seed, i, n) for i, n in enumerate(lengths)]
    return lambda seq, start, end: docs[seq][start:end]


HEAD_SHARDED = ("core_attention.softmax_offset",)
"""Per-head parameters Megatron splits over TP without marking them `tensor_model_parallel`: the attention
sink (`softmax_type="learnable"`), of which each TP rank holds its heads' slice (dim 0), as the
`{'softmax_offset': 0}` of Megatron's `sharded_state_dict` says."""


@dataclass(frozen=True)
class ShardInfo:
    """How a local parameter sits in the full (reference) parameter of the same global name."""

    name: str
    tp_rank: int
    tp_size: int
    partition_dim: int
    """-1: replicated across TP."""
    gated: bool
    """A SwiGLU fc1 weight: each TP rank holds [gate_r; up_r], not a contiguous slice."""


def global_name(name: str, *, layer_offset: int, expert_offset: int) -> str:
    """The reference (PP=1, EP=1) name of a local parameter: global layer and expert indices."""
    name = name.removeprefix("module.")
    name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + layer_offset}.", name)
    return re.sub(
        r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + expert_offset}.", name
    )


def shard_infos(model: torch.nn.Module) -> dict[str, ShardInfo]:
    """ShardInfo of every parameter of this rank's model chunk (a GPTModel, maybe inside DDP), by local name."""
    from megatron_hdp.megatron.core_api.initialize import expert_parallel_coordinate, tensor_parallel_coordinate

    inner = getattr(model, "module", model)
    layers = inner.decoder.layers
    layer_offset = layers[0].layer_number - 1 if len(layers) else 0
    num_experts = inner.config.num_moe_experts or 0
    ep_rank, ep_size = expert_parallel_coordinate()
    expert_offset = ep_rank * (num_experts // ep_size) if num_experts else 0
    infos = {}
    for name, param in inner.named_parameters():
        tp = bool(getattr(param, "tensor_model_parallel", False))
        tp_rank, tp_size = tensor_parallel_coordinate(expert=not getattr(param, "allreduce", True))
        partition_dim = param.partition_dim if tp else 0 if name.endswith(HEAD_SHARDED) else -1
        infos[name] = ShardInfo(
            name=global_name(name, layer_offset=layer_offset, expert_offset=expert_offset),
            tp_rank=tp_rank,
            tp_size=tp_size,
            partition_dim=partition_dim if tp_size > 1 else -1,
            gated=name.endswith("linear_fc1.weight") and inner.config.gated_linear_unit,
        )
    return infos


def expected_shard(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """The slice of reference tensor `full` (a weight or its gradient) that `info`'s rank holds."""
    if info.partition_dim < 0:
        return full
    if info.gated:
        gate, up = torch.chunk(full, 2, dim=info.partition_dim)
        return torch.cat(
            [torch.chunk(x, info.tp_size, dim=info.partition_dim)[info.tp_rank] for x in (gate, up)],
            dim=info.partition_dim,
        )
    return torch.chunk(full, info.tp_size, dim=info.partition_dim)[info.tp_rank]


def load_full_weights(model: torch.nn.Module, full: dict[str, np.ndarray]) -> None:
    """Copy each local parameter's shard of the reference weights `full` into this rank's model."""
    inner = getattr(model, "module", model)
    params = dict(inner.named_parameters())
    with torch.no_grad():
        for name, info in shard_infos(model).items():
            params[name].copy_(expected_shard(torch.as_tensor(full[info.name]), info))


def owned_grad_ranges(optimizer) -> dict[torch.nn.Parameter, tuple[int, int]]:
    """With Megatron's distributed optimizer: the [start, end) of each parameter (flattened) whose reduced
    gradient this rank holds after the reduce-scatter (the rest of its main_grad is not reduced). Empty
    for the ordinary optimizer, whose every main_grad is all-reduced whole."""
    ranges = {}
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for gbuf_range_map in getattr(opt, "gbuf_ranges", []):
            for bucket_maps in gbuf_range_map.values():
                for bucket_map in bucket_maps:
                    for param, param_ranges in bucket_map["param_map"].items():
                        ranges[param] = (param_ranges["param"].start, param_ranges["param"].end)
    return ranges


def local_grads(model: torch.nn.Module, optimizer=None) -> dict[str, tuple[ShardInfo, np.ndarray]]:
    """This rank's reduced gradients (Megatron DDP's main_grad), keyed by global name, with their ShardInfo.

    With the distributed optimizer (`optimizer` given), each gradient is the flattened slice
    `owned_grad_ranges` names, NaN elsewhere (those elements were never reduced on this rank); a parameter
    it holds no slice of is left out. numpy, so that results cross process boundaries by plain pickling
    (torch tensors would travel through shared memory that dies with the child)."""
    inner = getattr(model, "module", model)
    params = dict(inner.named_parameters())
    owned = owned_grad_ranges(optimizer) if optimizer is not None else {}
    grads = {}
    for name, info in shard_infos(model).items():
        grad = params[name].main_grad.detach().numpy().copy()
        if owned:
            if params[name] not in owned:
                continue
            start, end = owned[params[name]]
            flat = np.full(grad.size, np.nan, dtype=grad.dtype)
            flat[start:end] = grad.reshape(-1)[start:end]
            grad = flat.reshape(grad.shape)
        grads[info.name] = (info, grad)
    return grads


def full_weights(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """The reference model's parameters by name (numpy): what `load_full_weights` slices from."""
    inner = getattr(model, "module", model)
    return {name: p.detach().numpy().copy() for name, p in inner.named_parameters()}


def reference_forward_step(data_iterator, model, *, multiple: int = 1):
    """Megatron forward_step of the reference: one whole document [1, L] with Megatron's own attention,
    padded at its end to a multiple of `multiple` tokens (sequence parallelism splits the sequence over
    the TP ranks) with loss mask 0: under the causal mask the padding changes no real token's result."""
    from functools import partial

    from megatron_hdp.megatron.core_api.forward_step import token_loss

    raw = torch.from_numpy(next(data_iterator))
    length, pad = raw.shape[0] - 1, -(raw.shape[0] - 1) % multiple
    raw = torch.nn.functional.pad(raw, (0, pad))
    tokens, labels = raw[:-1][None], raw[1:][None]
    positions = torch.arange(tokens.shape[1])[None]
    output = model(input_ids=tokens, position_ids=positions, attention_mask=None, labels=labels)
    return output, partial(token_loss, (torch.arange(length + pad) < length).float())


def reference_steps(
    model: torch.nn.Module, optimizer, batches: Sequence[tuple[int, Sequence[int]]], *, token_multiple: int = 1
) -> list[dict]:
    """Train `model` (one pipeline, Megatron DDP) on each (seed, lengths) batch, each document padded to a
    multiple of `token_multiple` tokens (`reference_forward_step`); per step its loss and grads."""
    from functools import partial

    from megatron_hdp.megatron.core_api.step import forward_backward, sync_grads_at_schedule_end

    sync_grads_at_schedule_end([model])
    results = []
    for seed, lengths in batches:
        docs = [document_tokens(seed, i, n) for i, n in enumerate(lengths)]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        step = partial(reference_forward_step, multiple=token_multiple)
        longest = max(lengths) + -max(lengths) % token_multiple
        losses = forward_backward([model], step, iter(docs), num_microbatches=len(docs), seq_length=longest)
        total = torch.stack([x["lm loss"].double() for x in losses]).sum(0)
        grads = {name: g for name, (_, g) in local_grads(model).items()}
        optimizer.step()
        results.append({"loss": float(total[0] / total[1]), "grads": grads})
    return results
