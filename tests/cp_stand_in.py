"""Plain Megatron with `--context-parallel-size` > 1 on a CPU without Transformer Engine: the checkpoint users
bring to a long-context HDP run (the dense chain of tests/megatron/test_checkpoints.py saves one this way).

Megatron's context parallelism needs TE's attention (the local `DotProductAttention` refuses CP > 1). What a
checkpoint holds does not depend on the attention kernel: CP shards neither parameters nor optimizer state
(the CP ranks of a data-parallel rank are replicas for the weights, and the distributed optimizer shards
over DP x CP), so the checkpoint is fixed by the process groups Megatron builds for CP, which this run
has. The stand-in trains with Megatron's own CP layout on those groups: each CP rank's forward step takes
its zigzag half of every sample (chunks r and 2cp-1-r of 2cp, as Megatron's `get_batch_on_this_cp_rank`;
the rotary embedding slices itself the same way), and its core attention all-gathers K and V over the CP
group and attends every local query to the keys at or before its global position: full causal attention,
what TE's ring computes, written here independently of both.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention


def cp_positions(seq_length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of CP rank `cp_rank`'s tokens in a sample of `seq_length`: chunks cp_rank and
    2 cp_size - 1 - cp_rank of 2 cp_size equal chunks."""
    chunk = seq_length // (2 * cp_size)
    assert chunk * 2 * cp_size == seq_length, (seq_length, cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class _GatherSequence(torch.autograd.Function):
    """[s_local, ...] of every CP rank -> [cp x s_local, ...] in rank order; the backward sums the full
    gradient over the group (all-reduce: gloo has no reduce-scatter) and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.rows = group, torch.distributed.get_rank(group), local.shape[0]
        pieces = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(pieces, local.contiguous(), group=group)
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


class ContextParallelAttention(DotProductAttention):
    """Megatron's local attention over the whole sequence's keys, gathered from the CP group."""

    def __init__(self, config, *args, **kwargs):
        cp_size, config.context_parallel_size = config.context_parallel_size, 1  # past the local class's refusal
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp_size

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        group = parallel_state.get_context_parallel_group()
        cp_size, cp_rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
        seq_length = query.shape[0] * cp_size
        gathered = torch.cat([cp_positions(seq_length, cp_size, rank) for rank in range(cp_size)])
        order = torch.argsort(gathered).to(key.device)  # rank order -> sequence order
        key, value = _GatherSequence.apply(key, group)[order], _GatherSequence.apply(value, group)[order]
        queries = cp_positions(seq_length, cp_size, cp_rank).to(query.device)
        future = torch.arange(seq_length, device=query.device)[None, :] > queries[:, None]  # True: masked
        return super().forward(query, key, value, future[None, None], attn_mask_type, attention_bias,
                               packed_seq_params)


class _ThisCPRank:
    """Batches of [b, s] samples -> this CP rank's half of each (Megatron's RerunDataIterator has only
    __next__); the attention builds its own causal mask, so the batch's is dropped."""

    def __init__(self, batches):
        self.batches = batches

    def __next__(self) -> dict:
        batch = next(self.batches)
        group = parallel_state.get_context_parallel_group()
        rows = cp_positions(batch["tokens"].shape[1], torch.distributed.get_world_size(group),
                            torch.distributed.get_rank(group))
        return {name: None if name == "attention_mask" or value is None else value[:, rows]
                for name, value in batch.items()}


def _rotary_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    """Megatron's `get_pos_emb_on_this_cp_rank` (the rotary table's rows of this CP rank's tokens) without
    its pinned-memory copy to CUDA, which a CPU cannot make."""
    rows = cp_positions(pos_emb.shape[seq_dim], cp_group.size(), cp_group.rank()).to(pos_emb.device)
    return pos_emb.index_select(seq_dim, rows)


def install(example) -> None:
    """Train `example` (examples/pretrain_gpt_hdp imported) with this CP stand-in: the local spec's core
    attention, the rotary table's CP slice and the plain forward step's batches."""
    from megatron.core.models import backends
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    backends.DotProductAttention = ContextParallelAttention
    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _rotary_on_this_cp_rank
    forward_step = example.forward_step

    def cp_forward_step(data_iterator, model):
        return forward_step(_ThisCPRank(data_iterator), model)

    example.forward_step = cp_forward_step
