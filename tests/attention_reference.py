"""Single-process reference for the attention tests: full per-document attention in float64.

With a sink (Megatron's off-by-one / learnable softmax) the softmax is materialised over the scores plus
one extra column holding the head's sink logit, whose probability is then dropped (it has no value):
the definition, written without the package's log-sum-exp algebra."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seqlens: Sequence[int],
    *,
    causal: bool,
    scale: float,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each packed document, computed densely in float64 (differentiable).

    q [T, Hq, D], k and v [T, Hkv, D]; query head h uses kv head h // (Hq / Hkv). `window`: sliding
    window, key j visible to query i only when i - j <= window (Megatron's window_size (window, 0)).
    `sink` [Hq]: each head's sink logit, an extra softmax column of every row (differentiable).
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    outs, start = [], 0
    for length in seqlens:
        rows = slice(start, start + length)
        scores = torch.einsum("qhd,khd->hqk", q[rows], k[rows]) * scale
        if causal:
            future = torch.ones(length, length, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(future, -math.inf)
        if window is not None:
            distance = torch.arange(length)[:, None] - torch.arange(length)[None, :]
            scores = scores.masked_fill((distance > window).to(q.device), -math.inf)
        if sink is not None:
            column = sink.double()[:, None, None].expand(-1, length, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v[rows]))
        start += length
    return torch.cat(outs)


def reference_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    seqlens: Sequence[int],
    *,
    causal: bool,
    scale: float,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of `reference_attention` for the output gradient `dout`, all float64; with a
    `sink`, (out, dq, dk, dv, dsink)."""
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    if sink is not None:
        leaves.append(sink.detach().double().requires_grad_())
    out = reference_attention(*leaves[:3], seqlens, causal=causal, scale=scale, window=window,
                              sink=leaves[3] if sink is not None else None)
    grads = torch.autograd.grad(out, leaves, dout.double())
    return (out.detach(), *grads)


def reference_latent_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    up_weight: torch.Tensor,
    seqlens: Sequence[int],
    *,
    qk_head_dim: int,
    v_head_dim: int,
    causal: bool,
    scale: float,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-latent attention as Megatron's MLASelfAttention computes it, in float64 (differentiable):
    kv = latent W^T viewed [T, H, qk_head_dim + v_head_dim], split into k_no_pe and value; K = cat(k_no_pe,
    k_rope [T, 1, Dr] repeated over heads); then `reference_attention` over each document (with `sink`)."""
    heads = q.shape[1]
    kv = torch.einsum("tr,or->to", latent.double(), up_weight.double()).reshape(-1, heads, qk_head_dim + v_head_dim)
    k_no_pe, value = kv[..., :qk_head_dim], kv[..., qk_head_dim:]
    key = torch.cat([k_no_pe, k_rope.double().repeat(1, heads, 1)], dim=-1)
    return reference_attention(q, key, value, seqlens, causal=causal, scale=scale, window=window, sink=sink)


def reference_latent_with_grads(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    up_weight: torch.Tensor,
    dout: torch.Tensor,
    seqlens: Sequence[int],
    **kwargs,
) -> tuple[torch.Tensor, ...]:
    """(out, dq, dlatent, dk_rope, dup_weight) of `reference_latent_attention` for `dout`, all float64; with a
    `sink` keyword, (out, dq, dlatent, dk_rope, dup_weight, dsink)."""
    sink = kwargs.pop("sink", None)
    leaves = [x.detach().double().requires_grad_() for x in (q, latent, k_rope, up_weight)]
    if sink is not None:
        leaves.append(sink.detach().double().requires_grad_())
    out = reference_latent_attention(*leaves[:4], seqlens, sink=leaves[4] if sink is not None else None, **kwargs)
    return (out.detach(), *torch.autograd.grad(out, leaves, dout.double()))
