"""The autograd functions of every attention ring: one over P2P, one simulating all k members in this process.

Both rings — the K/V ring (`zigzag_ring`, source `HeldKV`) and multi-latent attention's latent ring
(`latent_ring`, source `LatentKV`) — are the same ring programs (`ring_loop.ring_forward` /
`ring_backward`) over a `KVSource`; only the source differs. So they share these functions: the caller
passes how to make its source (`make_source`) and the tensors it is made of (`inputs`: K and V; the latent,
the RoPE key and the up-projection's weight), and gets out, differentiable in q, the inputs and the sink.

The backward rebuilds the source from the saved tensors (so activation offloading's saved-tensor hooks see
every tensor the ring keeps) and asks it for the gradients of its inputs (`KVSource.input_grads`: the
partials the ring brought back, plus what the source kept of its own, e.g. the weight's share).

Sinks (Megatron's off-by-one and learnable softmax) are applied to the rows after the ring's LSE merge
(`attention.sink`): the programs do not change, the backward program is fed the rows' (out', lse'), and
the sink's gradient is one reduction over the rows. Whatever circulates, the sink is the same.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_hdp.attention.backends import AttentionBackend
from megatron_hdp.attention.ring_loop import KVSource, ring_backward, ring_forward
from megatron_hdp.attention.ring_plan import RingPlan
from megatron_hdp.attention.sink import add_sink, sink_grad
from megatron_hdp.comm.p2p import Ring
from megatron_hdp.comm.ring_program import run_in_process, run_on_ring

SourceMaker = Callable[..., KVSource]
"""Makes a ring member's `KVSource` from its input tensors (positionally, as the ring function got them)."""


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, make_source: SourceMaker, sink, plan: RingPlan, ring: Ring, backend: AttentionBackend,
                scale: float, q, *inputs):
        program = ring_forward(q, make_source(*inputs), plan=plan, backend=backend, scale=scale)
        out, lse = run_on_ring(program, ring)
        if sink is not None:  # after the merge: the block backward then runs with the rows' lse'
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, out, lse, sink, *inputs)
        ctx.make_source, ctx.plan, ctx.ring, ctx.backend, ctx.scale = make_source, plan, ring, backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, sink, *inputs = ctx.saved_tensors
        source = ctx.make_source(*inputs)
        program = ring_backward(dout, q, source, out, lse, plan=ctx.plan, backend=ctx.backend, scale=ctx.scale)
        dq, part_grads = run_on_ring(program, ctx.ring)
        dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[1] else None
        return None, dsink, None, None, None, None, dq, *source.input_grads(part_grads)


def ring_function(
    q: torch.Tensor, inputs: Sequence[torch.Tensor], *, make_source: SourceMaker, sink: torch.Tensor | None,
    plan: RingPlan, ring: Ring, backend: AttentionBackend, scale: float,
) -> torch.Tensor:
    """This member's out [T, Hq, Dv] of the ring over `make_source(*inputs)`, with `sink` [Hq] after the
    merge (None: none); differentiable in q, `inputs` and `sink` (this member's rows' share of its gradient).
    Arguments already checked by the caller."""
    return _Ring.apply(make_source, sink, plan, ring, backend, scale, q, *inputs)


class _SimulatedRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, make_source: SourceMaker, num_shared: int, sink, plans: tuple[RingPlan, ...],
                backend: AttentionBackend, scale: float, grad_dtype, *tensors):
        size = len(plans)
        shared, qs, per_input = _split(tensors, num_shared, size)
        sources = [make_source(*(x[p] for x in per_input), *shared) for p in range(size)]
        results = run_in_process(
            [ring_forward(qs[p], sources[p], plan=plans[p], backend=backend, scale=scale) for p in range(size)]
        )
        if sink is not None:  # each position's rows, after the merge, as the real ring does
            results = [add_sink(out, lse, sink) for out, lse in results]
        outs = tuple(out for out, _ in results)
        ctx.save_for_backward(sink, *tensors, *outs, *(lse for _, lse in results))
        ctx.make_source, ctx.num_shared, ctx.num_tensors = make_source, num_shared, len(tensors)
        ctx.plans, ctx.backend, ctx.scale, ctx.grad_dtype = plans, backend, scale, grad_dtype
        return outs

    @staticmethod
    def backward(ctx, *douts):
        size = len(ctx.plans)
        sink, *saved = ctx.saved_tensors
        tensors, outs, lses = saved[: ctx.num_tensors], saved[ctx.num_tensors : -size], saved[-size:]
        shared, qs, per_input = _split(tensors, ctx.num_shared, size)
        sources = [ctx.make_source(*(x[p] for x in per_input), *shared) for p in range(size)]
        grads = run_in_process([
            ring_backward(douts[p], qs[p], sources[p], outs[p], lses[p], plan=ctx.plans[p], backend=ctx.backend,
                          scale=ctx.scale, grad_dtype=ctx.grad_dtype)
            for p in range(size)
        ])
        input_grads = [source.input_grads(parts) for source, (_, parts) in zip(sources, grads)]
        num_own = len(per_input)
        # a shared input's gradient: every position's share, as the ranks' DDP would sum them
        shared_grads = [sum(g[num_own + i] for g in input_grads) for i in range(ctx.num_shared)]
        dsink = None
        if ctx.needs_input_grad[2]:
            dsink = sum(sink_grad(douts[p], outs[p], lses[p], sink) for p in range(size))
        own = [g[i] for i in range(num_own) for g in input_grads]  # input by input, position by position
        return (None, None, dsink, None, None, None, None, *shared_grads, *(dq for dq, _ in grads), *own)


def _split(tensors: Sequence[torch.Tensor], num_shared: int, size: int):
    """(shared inputs, the positions' q, the positions' shards of each other input) of `_SimulatedRing`'s
    flat tensors: the shared ones, then q's shards, then each input's shards, position by position."""
    shared, shards = tensors[:num_shared], tensors[num_shared:]
    per_input = [shards[i : i + size] for i in range(0, len(shards), size)]
    return shared, per_input[0], per_input[1:]


def simulated_ring_function(
    shards: Sequence[torch.Tensor], *, shared: Sequence[torch.Tensor] = (), make_source: SourceMaker,
    sink: torch.Tensor | None, plans: tuple[RingPlan, ...], backend: AttentionBackend, scale: float,
    grad_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, ...]:
    """Every position's out of the ring of `len(plans)` positions run in this process: `shards` holds q's
    shards, then each per-position input's (`VirtualRing.shards` order); position p's source is
    `make_source(*its shards of the inputs, *shared)`. Differentiable in all of them and `sink`; a shared
    input's gradient is the sum of the positions' shares. `grad_dtype`: the partials' transport dtype."""
    return _SimulatedRing.apply(make_source, len(shared), sink, plans, backend, scale, grad_dtype, *shared, *shards)
