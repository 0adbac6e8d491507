"""Attention over whole documents held by one rank: one local kernel call, no communication.

This is the path of every document a rank holds entirely (ring of one), and what the Megatron core
attention module calls for them. It costs exactly one backend forward and one backward.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from megatron_hdp.attention.backends import AttentionBackend, BlockWindow, Segments, get_backend
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.layout import check_seqlens
from megatron_hdp.attention.sink import add_sink, check_sink, sink_grad


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_tokens: int) -> None:
    """ValueError unless q [T, Hq, D], k [T, Hkv, D] and v [T, Hkv, Dv] with T = `num_tokens` and Hkv
    dividing Hq. Dv may differ from D (multi-latent attention: q and k 192 wide, v 128)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
        if x.shape[0] != num_tokens:
            raise ValueError(
                f"{name} has {x.shape[0]} tokens but seqlens give this rank {num_tokens} tokens"
            )
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same tokens and heads, got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"kv heads ({k.shape[1]}) must divide query heads ({q.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
            f"{q.device}/{k.device}/{v.device}"
        )


def default_scale(softmax_scale: float | None, head_dim: int) -> float:
    """`softmax_scale`, or 1/sqrt(head_dim) when None."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)


def check_window(window: int | None, *, causal: bool) -> int | None:
    """The sliding window's `left` (None: no window), ValueError for a negative one or one without the
    causal mask. Megatron's `window_size = (left, 0)`: query i sees keys i - left .. i of its document."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be None or an int >= 0 (keys i - window .. i are visible), got {window!r}")
    if not causal:
        raise ValueError("a sliding window needs causal=True (Megatron applies window_size under the causal mask)")
    return window


def document_window(window: int | None, segments: Segments) -> BlockWindow | None:
    """The `BlockWindow` of whole documents (every segment a causal square at shift 0)."""
    return None if window is None else BlockWindow(window, (0,) * segments.num_segments)


def local_segments(seqlens: Sequence[int], device: torch.device, tables: HostTables | None = None) -> Segments:
    """The kernel segments of whole documents `seqlens`, their cu_seqlens tensors on `device`: delivered by
    `tables` (the micro-batch's one asynchronous copy) when given, else made now (outside any layer)."""
    lengths = tuple(int(n) for n in seqlens)
    segments = Segments(lengths, lengths, torch.device(device))
    if tables is not None:
        segments.schedule_tables(tables)
    else:
        segments.cu_seqlens_q, segments.cu_seqlens_k  # noqa: B018
    return segments


class _LocalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sink, backend: AttentionBackend, segments: Segments, causal: bool, scale: float, window=None):
        out, lse = backend.forward(q, k, v, segments=segments, causal=causal, scale=scale, window=window)
        if sink is not None:
            out, lse = add_sink(out, lse, sink)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.backend, ctx.segments, ctx.causal, ctx.scale, ctx.window = backend, segments, causal, scale, window
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ctx.backend.backward(
            dout, q, k, v, out, lse, segments=ctx.segments, causal=ctx.causal, scale=ctx.scale, window=ctx.window
        )
        dsink = sink_grad(dout, out, lse, sink) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dsink, None, None, None, None, None


def local_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    seqlens: Sequence[int],
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    segments: Segments | None = None,
    deterministic: bool = False,
    window: int | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention within each packed document of `seqlens` (THD: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]).

    Differentiable in q, k, v; returns [T, Hq, Dv]. `backend` names a kernel of
    `megatron_hdp.attention.backends` ("auto": the fastest available for the device and dtype).
    `segments`, when given, are `local_segments(seqlens, device)` made once per micro-batch, so that
    the layers of a model share its cu_seqlens tensors (no host-to-device copy per layer).
    `deterministic` asks the kernel for a deterministic backward (Megatron's `deterministic_mode`).
    `window` (sliding-window attention, Megatron's `window_size = (window, 0)`): query i sees the keys
    i - window .. i of its document; None: all earlier keys. `sink` [Hq]: each query head's sink logit s_h,
    exp(s_h) added to every row's normaliser (Megatron's off-by-one softmax: zeros; learnable: its
    `softmax_offset`), differentiable; None: the plain softmax (`megatron_hdp.attention.sink`).
    """
    lengths = check_seqlens(seqlens)
    left = check_window(window, causal=causal)
    check_qkv(q, k, v, num_tokens=sum(lengths))
    check_sink(sink, q)
    kernel = get_backend(backend, device=q.device, dtype=q.dtype, deterministic=deterministic)
    if segments is None:
        segments = local_segments(lengths, q.device)
    assert segments.seqlens_q == lengths and segments.device.type == q.device.type, (segments, lengths, q.device)
    scale = default_scale(softmax_scale, q.shape[2])
    return _LocalAttention.apply(q, k, v, sink, kernel, segments, causal, scale, document_window(left, segments))
