"""Per-token log-probability of the label and entropy from vocabulary-parallel logits, differentiable.

Megatron's output layer leaves each tensor-parallel rank 1/TP of the vocabulary's logits; its
`vocab_parallel_cross_entropy` turns them into the label's loss without gathering the vocabulary. The
post-training door needs the entropy too, so this is the same computation written with Megatron's
differentiable TP reduction (`reduce_from_tensor_model_parallel_region`: all-reduce forward, identity
backward, the result replicated on every TP rank), and its mirror `copy_to_tensor_model_parallel_region`
(identity forward, all-reduce backward) where the replicated log Z enters each rank's own share of the
vocabulary (the probabilities of the entropy), so that its gradient collects every rank's share: with z the logits, m their (detached) maximum over the
whole vocabulary, Z = sum exp(z - m),

    log p(label) = z_label - m - log Z,      entropy = log Z - sum_v p_v (z_v - m).

Run per micro-batch in fp32, so only one micro-batch's [T, V / TP] logits exist at a time.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of `labels`, entropy), each [T] fp32, of this TP rank's logits [T, V / TP] (already
    divided by any temperature); `labels` [T] are global vocabulary ids."""
    logits = logits.float()
    vocab_local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * vocab_local
    with torch.no_grad():
        top = logits.max(dim=-1).values
        if ps.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    shifted = logits - top[:, None]
    log_z = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1)).log()
    here = (labels >= start) & (labels < start + vocab_local)
    local = (labels - start).clamp(0, vocab_local - 1)
    picked = shifted.gather(-1, local[:, None]).squeeze(-1) * here
    logprobs = reduce_from_tensor_model_parallel_region(picked) - log_z
    probs = (shifted - copy_to_tensor_model_parallel_region(log_z)[:, None]).exp()
    entropy = log_z - reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))
    return logprobs, entropy


def is_tensor_parallel_first() -> bool:
    """Whether this rank is TP rank 0 (the one that reports replicated per-token results)."""
    return ps.get_tensor_model_parallel_rank() == 0
