"""The block loop of every attention ring: what circulates is a source's payload, each block's K/V come from it.

A ring member attends its local q rows to the K/V of every position in turn (`ring_plan` says which rows
of what it holds each kernel call takes) and merges the partial results by their log-sum-exp. What
travels around the ring, and how a block's K and V are made from it, is the `KVSource`'s business:

* `HeldKV` — K and V themselves (the K/V ring, `zigzag_ring`): a block takes their rows;
* `latent_ring.LatentKV` — multi-latent attention's latent and shared RoPE key: a block up-projects its
  rows with the layer's weights.

The programs here (`ring_forward`, `ring_backward`) are the rest, written once for every source: the
order of posts and waits (next exchange posted before the current block's compute; relayed or direct
plans), the fp32 merge, and the backward's partials — the gradients of the payload, in the accumulation
dtype, riding the ring back to their owner (relayed: k hops with the buffer; direct: straight back).
The deadlock argument is `megatron_hdp.comm.ring_program`'s: every member runs the same program shape.
The autograd functions that run these programs are `ring_function`'s, one pair for every source.
"""

from __future__ import annotations

import abc

import torch

from megatron_hdp.attention.backends import AttentionBackend
from megatron_hdp.attention.merge import merge_attention
from megatron_hdp.attention.ring_plan import RingPlan, Rows
from megatron_hdp.comm.payload import Payload
from megatron_hdp.comm.ring_program import WAIT, Post, RingProgram


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype out, lse and every gradient are accumulated (and gradient partials sent) in: fp32 at least."""
    return torch.promote_types(dtype, torch.float32)


class KVSource(abc.ABC):
    """What one ring member holds of the keys and values, and how a block's K/V are made from it."""

    parts: tuple[torch.Tensor, ...]
    """This member's tensors that circulate, each [T_local, ...] (one flat message, `payload`)."""
    value_dim: int
    """V's (and the output's) head dim."""

    @property
    def payload(self) -> Payload:
        return Payload.of(*self.parts)

    @abc.abstractmethod
    def block_kv(self, rows: Rows, held: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """K [n, Hkv, D] and V [n, Hkv, Dv] of the `rows` of the parts `held` (some position's)."""

    @abc.abstractmethod
    def add_block_grads(
        self, rows: Rows, held: tuple[torch.Tensor, ...], dk: torch.Tensor, dv: torch.Tensor,
        held_grads: tuple[torch.Tensor, ...],
    ) -> None:
        """Add the gradients of the held parts' `rows` for the block's dK, dV into `held_grads` (the
        partials that go back to the owner, accumulation dtype), and keep any of the source's own."""

    def input_grads(self, part_grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The gradients of the tensors the source was made from (`ring_function`'s `inputs`), given those
        of its `parts` that came back round the ring: the parts' own (the K/V ring's inputs are its parts)."""
        return part_grads


class HeldKV(KVSource):
    """The K/V ring's source: K [T, Hkv, D] and V [T, Hkv, Dv] travel themselves."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.parts = (k, v)
        self.value_dim = v.shape[2]

    def block_kv(self, rows, held):
        return rows.take(held[0]), rows.take(held[1])

    def add_block_grads(self, rows, held, dk, dv, held_grads):
        rows.add(held_grads[0], dk)
        rows.add(held_grads[1], dv)


def _post_kv(
    plan: RingPlan, step: int, *, held: torch.Tensor, own: torch.Tensor, payload: Payload
) -> RingProgram[torch.Tensor]:
    """Post the K/V exchange of `step` (before computing step - 1); returns the buffer it arrives in.
    Relayed: pass the K/V held now to the next position. Direct: send this position's own K/V to the
    position `step` ahead if that one needs it, receive from the one `step` behind if this one does
    (an empty tensor: nothing is posted for that side)."""
    if not plan.direct:
        recv = payload.empty(held, plan.num_tokens[plan.source(step)])
        yield Post(send=held, recv=recv)
        return recv
    recv = payload.empty(own, plan.num_tokens[plan.source(step)] if plan.blocks[step] else 0)
    yield Post(send=own if plan.sends[step] else own[:0], recv=recv, hops=step)
    return recv


def ring_forward(
    q: torch.Tensor, source: KVSource, *, plan: RingPlan, backend: AttentionBackend, scale: float
) -> RingProgram[tuple[torch.Tensor, torch.Tensor]]:
    """One position's forward: returns (out [T, Hq, Dv] in q's dtype, lse [Hq, T])."""
    payload = source.payload
    kv = own = payload.pack(*source.parts)
    acc = accumulation_dtype(q.dtype)
    out = q.new_zeros((*q.shape[:2], source.value_dim), dtype=acc)  # every row sees its own diagonal in some call
    lse = q.new_full((q.shape[1], q.shape[0]), -torch.inf, dtype=acc)
    q_cache: dict[tuple, torch.Tensor] = {}
    for step, calls in enumerate(plan.blocks):
        last = step + 1 == plan.ring_size
        if not last:
            next_kv = yield from _post_kv(plan, step + 1, held=kv, own=own, payload=payload)
        held = payload.split(kv)
        for block in calls:
            if block.q_rows.key not in q_cache:  # (setdefault would gather the rows on every step)
                q_cache[block.q_rows.key] = block.q_rows.take(q)
            q_block = q_cache[block.q_rows.key]
            block_out, block_lse = backend.forward(
                q_block,
                *source.block_kv(block.kv_rows, held),
                segments=block.segments,
                causal=block.causal,
                scale=scale,
                window=block.window,
            )
            merged_out, merged_lse = merge_attention(
                block.q_rows.take(out), block.q_rows.take(lse, 1), block_out, block_lse
            )
            block.q_rows.put(out, merged_out)
            block.q_rows.put(lse, merged_lse, 1)
        if not last:
            yield WAIT
            kv = next_kv
    return out.to(q.dtype), lse


def _return_partials(
    plan: RingPlan, step: int, dkv: torch.Tensor, dkv_own: torch.Tensor | None, transport: torch.dtype, last: bool,
    payload: Payload,
) -> RingProgram[torch.Tensor]:
    """Direct plans, end of `step`: wait for the step's K/V exchange (posted first), send the partials
    of the payload held (position source(step)'s) straight back to it, receive this position's from the
    one `step` ahead (if that one had a call), and return this position's sum so far."""
    if step == 0:
        if not last:
            yield WAIT
        return dkv
    rows = plan.num_tokens[plan.position] if plan.sends[step] else 0
    dkv_in = payload.empty(dkv, rows, dtype=transport)
    send = dkv.to(transport) if plan.blocks[step] else payload.empty(dkv, 0, dtype=transport)
    yield Post(send=send, recv=dkv_in, hops=-step)
    if not last:
        yield WAIT  # the K/V of the next step
    yield WAIT  # the partials
    return dkv_own + dkv_in if rows else dkv_own


def ring_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    source: KVSource,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    plan: RingPlan,
    backend: AttentionBackend,
    scale: float,
    grad_dtype: torch.dtype | None = None,
) -> RingProgram[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
    """One position's backward: returns (dq in q's dtype, the gradients of `source.parts` in theirs).

    The partials travel in `grad_dtype` (default: the accumulation dtype, see `zigzag_ring`'s module doc)
    and are summed in the accumulation dtype on arrival."""
    payload = source.payload
    kv = own = payload.pack(*source.parts)
    acc = accumulation_dtype(q.dtype)
    transport = grad_dtype or acc
    dq = q.new_zeros(q.shape, dtype=acc)
    dkv_in = dkv_own = None
    q_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
    for step, calls in enumerate(plan.blocks):
        last = step + 1 == plan.ring_size
        if not last:
            next_kv = yield from _post_kv(plan, step + 1, held=kv, own=own, payload=payload)
        # partials of the payload held now, owned by position source(step): relayed, they travel with it
        held = payload.split(kv)
        dkv = kv.new_zeros(kv.shape, dtype=acc)
        held_grads = payload.split(dkv)
        for block in calls:
            rows = block.q_rows
            if rows.key not in q_cache:
                q_cache[rows.key] = (rows.take(dout), rows.take(q), rows.take(out), rows.take(lse, 1))
            dout_b, q_b, out_b, lse_b = q_cache[rows.key]
            k_b, v_b = source.block_kv(block.kv_rows, held)
            dq_b, dk_b, dv_b = backend.backward(
                dout_b, q_b, k_b, v_b, out_b, lse_b,
                segments=block.segments,
                causal=block.causal,
                scale=scale,
                window=block.window,
            )
            rows.add(dq, dq_b)
            source.add_block_grads(block.kv_rows, held, dk_b, dv_b, held_grads)
        if plan.direct:  # the partials go straight back to their owner, position source(step)
            dkv_own = yield from _return_partials(plan, step, dkv, dkv_own, transport, last, payload)
            if not last:
                kv = next_kv
            continue
        if step > 0:
            yield WAIT  # the partials of the same owner, from the previous position
            dkv += dkv_in
        if not last:
            yield WAIT
            kv = next_kv
        if plan.ring_size == 1:  # nothing travels: the partials are this position's own
            dkv_own = dkv
            break
        dkv_in = payload.empty(dkv, plan.num_tokens[plan.source(step + 1)], dtype=transport)
        yield Post(send=dkv.to(transport), recv=dkv_in)
    if dkv_own is None:
        yield WAIT  # relayed: after k hops the partials are back with their owner, the local gradients
        dkv_own = dkv_in
    grads = tuple(g.to(part.dtype) for g, part in zip(payload.split(dkv_own), source.parts))
    return dq.to(q.dtype), grads
