"""Per-document zigzag ring attention over an arbitrary list of global ranks (HDP dynamic communication).

A long document is held by the k ranks of its ring, each holding chunk p and 2k-1-p of it (docs/architecture.md,
"Ring attention"); several documents sharing one ring are packed (THD). The forward passes the packed
K and V once around the ring (k-1 hops), attending local q rows to whatever part of the received KV is
visible (`ring_plan`) and merging the partial results by their log-sum-exp (`merge`). The backward
passes K and V around again together with the dK/dV partials, which ride the ring back to their owner
(k hops); the block gradients come from the kernel's backward fed the final out and lse. Each step
posts the next exchange before computing, so communication overlaps the block computation.

The algorithm is written once as ring programs (`megatron_hdp.comm.ring_program`, the block loop of
`ring_loop` over the source `HeldKV`; the autograd functions are `ring_function`'s, shared with the latent
ring): `ring_attention` runs this rank's program over point-to-point messages in the HDP communicator
(never a process group per ring); `simulated_ring_attention` runs all k positions in one process (tests,
single-device benchmark). A ring of one is the local kernel, with no communication at all.

Several rings (ordering rule): a rank in several rings calls `ring_attention` for them in one global
order, ascending smallest sequence id of the ring, as every other rank does; the backwards then run in
the reverse order by themselves. Why this cannot deadlock, also when rings of different ranks overlap,
is in `megatron_hdp.comm.ring_program`. Every argument is checked before the first message, on every
rank of the call, so a bad call raises everywhere instead of hanging a peer — as long as all ranks make
the same call, which the identical step plan guarantees.

Traffic per call and rank (counted in `megatron_hdp.comm.traffic`): a K+V buffer is K and V of the
rows held, one flat message (`comm.payload`), Hkv x (D + Dv) values per token (multi-latent attention's
V is narrower than K and travels unpadded); forward (k-1) K+V buffers in the input dtype; backward
(k-1) K+V buffers plus k dK+dV buffers in the accumulation dtype (fp32 for half-precision inputs).
Accumulation of out, dq, dk, dv is in fp32 (fp64 for fp64 inputs); results come back in the input
dtype. The dK/dV partials travel in fp32 on purpose: sent in bf16 they are rounded at every one of the
k hops, so their error against float64 grows with k while fp32 transport stays at one rank's
(`benchmarks/ring_grad_precision.py`; its dated numbers are in
benchmarks/results/ring_grad_precision.json); bf16 would save about a quarter of the bytes (3k-2 K/V
units per member instead of 4k-2).

Sliding windows (`window`): the plan is direct (`RingPlan.direct`, see `ring_plan`): at step s the K/V of
position p-s comes straight from it and its dK/dV partials go straight back, only for the steps some
token of p can see; traffic per rank is then (2 K/V + 1 partial) buffers per needed step.

Sinks (`sink`: Megatron's off-by-one and learnable softmax) are applied to this rank's rows after the
merge (`megatron_hdp.attention.sink`, the same helper as whole documents): the ring programs do not
change, the backward program is fed the rows' (out', lse'), and the sink's gradient is one reduction
over the rank's rows. No extra message.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megatron_hdp.attention.backends import Segments, get_backend
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import check_seqlens
from megatron_hdp.attention.local import _LocalAttention, check_qkv, check_window, default_scale, document_window
from megatron_hdp.attention.ring_function import ring_function, simulated_ring_function
from megatron_hdp.attention.ring_loop import HeldKV
from megatron_hdp.attention.ring_plan import ring_plan
from megatron_hdp.attention.sink import check_sink
from megatron_hdp.attention.virtual_ring import VirtualRing
from megatron_hdp.comm.p2p import current_ring


def prepare_ring_plan(
    seqlens: Sequence[int],
    ring: Sequence[int],
    *,
    tables: HostTables,
    device: torch.device,
    causal: bool = True,
    group: dist.ProcessGroup | None = None,
    window: int | None = None,
) -> None:
    """Build (and cache) this rank's plan of `ring_attention` over `ring`, its kernel tables (cu_seqlens,
    row indices) scheduled on `tables`, the micro-batch's one asynchronous copy to `device`. Call it once
    per micro-batch, outside the layers: a plan first built inside a layer would copy them from the host
    there, synchronously, and document lengths, hence plans, change from one micro-batch to the next."""
    members = current_ring(ring, group=group)
    if members.size > 1:
        left = check_window(window, causal=causal)
        lengths, device = check_seqlens(seqlens), torch.device(device)
        plan = ring_plan(lengths, members.size, members.position, bool(causal), device, left)
        plan.schedule_tables(tables)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seqlens: Sequence[int],
    ring: Sequence[int],
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    group: dist.ProcessGroup | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each document of `seqlens`, the documents split over the ranks of `ring`.

    Called by every rank of `ring` (global ranks of `group`, default the world, in ring order) with its
    zigzag shards: q [T_local, Hq, D], k [T_local, Hkv, D] and v [T_local, Hkv, Dv] (Dv may differ from
    D: multi-latent attention), the rows `zigzag_token_indices(seqlens, len(ring), position)` of the
    packed documents. Returns out [T_local, Hq, Dv], differentiable in q, k, v, equal to full (causal)
    attention over each document. Any document length >= 1 works. ValueError before any message for a
    rank outside the ring, token counts that do not match `seqlens`, or kv heads not dividing query heads.
    `deterministic` asks every block's kernel for a deterministic backward (the ring adds the block
    gradients in a fixed order, so the whole backward is deterministic then). `window`: sliding-window
    attention (query i sees keys i - window .. i of its document; `ring_plan` skips pieces outside it).
    `sink` [Hq]: the query heads' sink logits (`megatron_hdp.attention.sink`), applied to this rank's rows
    after the ring's LSE merge; each rank returns the gradient of its own rows' share.
    """
    lengths = check_seqlens(seqlens)
    left = check_window(window, causal=causal)
    members = current_ring(ring, group=group)
    plan_needed = members.size > 1
    num_tokens = sum(lengths)
    if plan_needed:
        plan = ring_plan(lengths, members.size, members.position, bool(causal), q.device, left)
        num_tokens = plan.num_tokens[members.position]
    check_qkv(q, k, v, num_tokens=num_tokens)
    check_sink(sink, q)
    kernel = get_backend(backend, device=q.device, dtype=q.dtype, deterministic=deterministic)
    scale = default_scale(softmax_scale, q.shape[2])
    if not plan_needed:
        segments = Segments(lengths, lengths, q.device)
        window = document_window(left, segments)
        return _LocalAttention.apply(q, k, v, sink, kernel, segments, bool(causal), scale, window)
    return ring_function(q, (k, v), make_source=HeldKV, sink=sink, plan=plan, ring=members, backend=kernel,
                         scale=scale)


def simulated_ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seqlens: Sequence[int],
    ring_size: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    grad_dtype: torch.dtype | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ring algorithm of `ring_attention` for k = `ring_size` virtual ranks in this process.

    Takes and returns whole packed documents (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]): each virtual
    position gets its zigzag shards, the k ring programs run in lockstep with the messages copied in memory, and the
    outputs are put back in packed order. Differentiable. For tests and for timing the ring's
    decomposition of the work on one device. `grad_dtype` overrides the dtype the dK/dV partials travel
    in (`benchmarks/ring_grad_precision.py` measures what sending them in the activation dtype costs).
    `sink`: as `ring_attention`'s, applied to each position's rows after its merge.
    """
    lengths = check_seqlens(seqlens)
    left = check_window(window, causal=causal)
    ring = VirtualRing.of(lengths, ring_size, causal=bool(causal), device=q.device, window=left)
    check_qkv(q, k, v, num_tokens=sum(lengths))
    check_sink(sink, q)
    kernel = get_backend(backend, device=q.device, dtype=q.dtype, deterministic=deterministic)
    scale = default_scale(softmax_scale, q.shape[2])
    outs = simulated_ring_function(ring.shards(q, k, v), make_source=HeldKV, sink=sink, plans=ring.plans,
                                   backend=kernel, scale=scale, grad_dtype=grad_dtype)
    return ring.packed(outs)
