"""Multi-latent attention's ring: the latent and the shared RoPE key circulate, every member up-projects them.

Megatron's `MLASelfAttention` makes each token's K and V from a small latent: the normalised
`kv_lora_rank` part of `linear_kv_down_proj`'s output (512 wide in DeepSeek-V3) goes through
`linear_kv_up_proj` (weight [H * (qk_head_dim + v_head_dim), kv_lora_rank], TP-local rows; its output
viewed [T, H, qk_head_dim + v_head_dim] splits into k_no_pe and value), and the rotated RoPE key
k_pos_emb [T, 1, qk_pos_emb_head_dim] is shared by all heads: K = cat(k_no_pe, k_pos_emb broadcast over
heads), V = value. The K/V ring (`zigzag_ring`) moves H x (qk_head_dim + qk_pos_emb_head_dim +
v_head_dim) values per token; this ring moves the latent and the RoPE key instead, kv_lora_rank +
qk_pos_emb_head_dim values (576 against 16 x 320 = 5,120 for DeepSeek-V3 at TP 8), and each member
up-projects every block it attends to with the layer's weights (`LatentKV.block_kv`). Same block loop
as the K/V ring (`ring_loop`: relayed or direct plans, the fp32 merge, the deadlock rules of
`comm.ring_program`), the same result: full (causal) attention over each document.

Backward: the latent and RoPE key circulate again, each member recomputes the up-projection of the
blocks it receives, and the block's dK, dV give (`LatentKV.add_block_grads`)
* the partials of the held latent, dK/dV(no-pe part) @ W, and of the held RoPE key, dK(rope part)
  summed over heads: they ride the ring back to the latent's owner in fp32 like the K/V ring's dK/dV;
* this member's share of the up-projection weight's gradient, dW += dKV^T latent over the blocks it
  received (fp32): summed over the pool by Megatron's DDP like every other weight gradient.

Traffic per call and rank (`comm.traffic`): (k-1) latent buffers forward in the input dtype, (k-1)
latent buffers and k partial buffers backward in the accumulation dtype (fp32 for half precision); a
latent buffer holds kv_lora_rank + qk_pos_emb_head_dim values per token: the K/V ring's formula with
that width (`plan.cost.model.CostModel`, `latent_bytes_per_token`). Compute per received token: the
up-projection, 2 R H (Dn + Dv) FLOPs forward, twice that in the backward plus its recompute.

Tensor parallelism. The latent and the RoPE key are the same on every TP rank, each TP rank holding its
heads' rows of the weight; the latent and RoPE-key gradients this function returns are partials over
this TP rank's heads. For the latent, Megatron's `linear_kv_up_proj` (a ColumnParallelLinear) would have
summed them over TP in its backward; bypassing its forward, the integration must keep that sum: give
this function the latent through `copy_to_tensor_model_parallel_region` (all-reduce in the backward), or
with sequence parallelism through `gather_from_sequence_parallel_region` (the [s/TP] latent gathered to
[s]; reduce-scatter in the backward), exactly what `linear_kv_up_proj` does to its input. The RoPE key's
partial is what autograd gives Megatron's own `expand` + `cat` of it on this TP rank, reduced wherever
Megatron reduces it today. The weight gradient needs no TP reduction (each TP rank owns its rows).

Sliding windows run (the plan is direct, as in the K/V ring). Sinks (Megatron's off-by-one and learnable
softmax) are the K/V ring's: applied to this rank's rows after the merge, whatever circulated, by the
autograd function both rings share (`ring_function`, over the source `LatentKV`).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.distributed as dist

from megatron_hdp.attention.backends import get_backend
from megatron_hdp.attention.layout import check_seqlens
from megatron_hdp.attention.local import check_window, default_scale
from megatron_hdp.attention.ring_function import ring_function, simulated_ring_function
from megatron_hdp.attention.ring_loop import KVSource, accumulation_dtype
from megatron_hdp.attention.ring_plan import Rows, ring_plan
from megatron_hdp.attention.sink import check_sink
from megatron_hdp.attention.virtual_ring import VirtualRing
from megatron_hdp.comm.p2p import current_ring


class LatentKV(KVSource):
    """A member's latent [T, R] and rotated RoPE key [T, 1, Dr] travel; a block's K/V are up-projected."""

    def __init__(
        self, latent: torch.Tensor, k_rope: torch.Tensor, weight: torch.Tensor, *, qk_head_dim: int, v_head_dim: int
    ) -> None:
        self.parts = (latent, k_rope)
        self.weight = weight
        self.value_dim = v_head_dim
        self.qk_head_dim = qk_head_dim
        self.num_heads = weight.shape[0] // (qk_head_dim + v_head_dim)
        self.weight_grad: torch.Tensor | None = None
        """This member's share of the weight's gradient (accumulation dtype), once a block went backward."""

    def block_kv(self, rows: Rows, held: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        latent, k_rope = rows.take(held[0]), rows.take(held[1])
        kv = (latent @ self.weight.t()).view(latent.shape[0], self.num_heads, -1)  # [n, H, Dn + Dv]
        k = torch.cat([kv[..., : self.qk_head_dim], k_rope.expand(-1, self.num_heads, -1)], dim=-1)
        return k, kv[..., self.qk_head_dim :]

    def add_block_grads(self, rows, held, dk, dv, held_grads):
        latent = rows.take(held[0])
        dkv = torch.cat([dk[..., : self.qk_head_dim], dv], dim=-1).reshape(latent.shape[0], -1)  # W's row order
        rows.add(held_grads[0], dkv @ self.weight)
        rows.add(held_grads[1], dk[..., self.qk_head_dim :].to(held_grads[1].dtype).sum(1, keepdim=True))
        acc = held_grads[0].dtype  # each block's product in fp32, not rounded to a half dtype first
        if self.weight_grad is None:
            self.weight_grad = torch.zeros_like(self.weight, dtype=acc)
        self.weight_grad.addmm_(dkv.t().to(acc), latent.to(acc))

    def weight_gradient(self) -> torch.Tensor:
        """This member's share of the weight's gradient in the accumulation dtype (zeros: it attended nothing)."""
        if self.weight_grad is None:
            return torch.zeros_like(self.weight, dtype=accumulation_dtype(self.weight.dtype))
        return self.weight_grad

    def input_grads(self, part_grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(latent's, RoPE key's, this member's share of the weight's): the inputs `latent_ring_attention` passes."""
        return (*part_grads, self.weight_gradient().to(self.weight.dtype))


def check_latent_inputs(
    q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor, up_weight: torch.Tensor, *, num_tokens: int,
    qk_head_dim: int, v_head_dim: int,
) -> None:
    """ValueError unless q [T, H, Dn + Dr], latent [T, R], k_rope [T, 1, Dr] and up_weight [H (Dn + Dv), R]
    with T = `num_tokens`, Dn = `qk_head_dim`, Dv = `v_head_dim`, all of one dtype and device."""
    for name, x, dims in (("q", q, 3), ("latent", latent, 2), ("k_rope", k_rope, 3), ("up_weight", up_weight, 2)):
        if x.dim() != dims:
            raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    for name, x in (("q", q), ("latent", latent), ("k_rope", k_rope)):
        if x.shape[0] != num_tokens:
            raise ValueError(f"{name} has {x.shape[0]} tokens but seqlens give this rank {num_tokens} tokens")
    if min(qk_head_dim, v_head_dim) < 1:
        raise ValueError(f"qk_head_dim and v_head_dim must be >= 1, got {qk_head_dim} and {v_head_dim}")
    if k_rope.shape[1] != 1:
        raise ValueError(f"k_rope must be one RoPE key shared by all heads, [T, 1, Dr], got {tuple(k_rope.shape)}")
    if q.shape[2] != qk_head_dim + k_rope.shape[2]:
        raise ValueError(
            f"q's head dim {q.shape[2]} must be qk_head_dim + the RoPE key's {qk_head_dim} + {k_rope.shape[2]}"
        )
    rows = q.shape[1] * (qk_head_dim + v_head_dim)
    if tuple(up_weight.shape) != (rows, latent.shape[1]):
        raise ValueError(
            f"up_weight must be [heads x (qk_head_dim + v_head_dim), kv_lora_rank] = [{rows}, {latent.shape[1]}], "
            f"got {list(up_weight.shape)}"
        )
    tensors = (q, latent, k_rope, up_weight)
    if len({x.dtype for x in tensors}) > 1 or len({x.device for x in tensors}) > 1:
        raise ValueError(
            "q, latent, k_rope, up_weight must share dtype and device, got "
            + ", ".join(f"{x.dtype} on {x.device}" for x in tensors)
        )


def latent_ring_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    *,
    up_weight: torch.Tensor,
    seqlens: Sequence[int],
    ring: Sequence[int],
    qk_head_dim: int,
    v_head_dim: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    group: dist.ProcessGroup | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Multi-latent attention within each document of `seqlens`, split over the ranks of `ring`, moving
    the latent instead of K and V.

    Called by every rank of `ring` (global ranks of `group`, default the world, in ring order) with its
    zigzag shards (rows `zigzag_token_indices(seqlens, len(ring), position)`): q [T_local, H, Dn + Dr]
    (RoPE applied to its last Dr), latent [T_local, R] (normalised), k_rope [T_local, 1, Dr] (rotated),
    and up_weight [H (Dn + Dv), R] (`linear_kv_up_proj.weight`'s TP-local rows), Dn = `qk_head_dim`,
    Dv = `v_head_dim`. Returns out [T_local, H, Dv], equal to full (causal) attention over each document
    with K = cat(k_no_pe, k_rope over heads), V = value of the up-projection; differentiable in q,
    latent, k_rope and up_weight (this rank's share of its gradient; the latent's and k_rope's are
    partials over this TP rank's heads: see the module doc for where TP sums them). `window` and `sink`
    [H] as `ring_attention`'s (the sink applied to this rank's rows after the merge). ValueError before any
    message for a bad call, as `ring_attention`. A ring of one runs the same program without a message.
    """
    lengths = check_seqlens(seqlens)
    left = check_window(window, causal=causal)
    members = current_ring(ring, group=group)
    plan = ring_plan(lengths, members.size, members.position, bool(causal), q.device, left)
    check_latent_inputs(q, latent, k_rope, up_weight, num_tokens=plan.num_tokens[members.position],
                        qk_head_dim=qk_head_dim, v_head_dim=v_head_dim)
    kernel = get_backend(backend, device=q.device, dtype=q.dtype, deterministic=deterministic)
    scale = default_scale(softmax_scale, q.shape[2])
    check_sink(sink, q)
    return ring_function(q, (latent, k_rope, up_weight), sink=sink, plan=plan, ring=members, backend=kernel,
                         scale=scale, make_source=functools.partial(LatentKV, qk_head_dim=qk_head_dim,
                                                                    v_head_dim=v_head_dim))


def simulated_latent_ring_attention(
    q: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    *,
    up_weight: torch.Tensor,
    seqlens: Sequence[int],
    ring_size: int,
    qk_head_dim: int,
    v_head_dim: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    grad_dtype: torch.dtype | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ring algorithm of `latent_ring_attention` for k = `ring_size` virtual ranks in this process.

    Takes and returns whole packed documents (q [T, H, Dn + Dr], latent [T, R], k_rope [T, 1, Dr]; out
    [T, H, Dv]), as `simulated_ring_attention`: each virtual position gets its zigzag shards, the k ring
    programs run in lockstep, and up_weight's gradient is the sum of the k members' shares (what DDP's
    reduction over the pool gives), as is the sink's. For tests and for timing the ring on one device.
    """
    lengths = check_seqlens(seqlens)
    left = check_window(window, causal=causal)
    ring = VirtualRing.of(lengths, ring_size, causal=bool(causal), device=q.device, window=left)
    check_latent_inputs(q, latent, k_rope, up_weight, num_tokens=sum(lengths), qk_head_dim=qk_head_dim,
                        v_head_dim=v_head_dim)
    kernel = get_backend(backend, device=q.device, dtype=q.dtype, deterministic=deterministic)
    scale = default_scale(softmax_scale, q.shape[2])
    check_sink(sink, q)
    outs = simulated_ring_function(
        ring.shards(q, latent, k_rope), shared=(up_weight,), sink=sink, plans=ring.plans, backend=kernel,
        scale=scale, grad_dtype=grad_dtype,
        make_source=functools.partial(LatentKV, qk_head_dim=qk_head_dim, v_head_dim=v_head_dim),
    )
    return ring.packed(outs)
