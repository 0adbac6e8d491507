"""Helpers for stand-ins of optional GPU libraries (Transformer Engine, flash-attn) in CPU tests: a callable
with a library function's exact parameter list, so a call with a keyword or an argument count that the
real function would reject fails here too; plain-torch attention over packed segments for the stand-ins
to compute with; and the check every stand-in backend runs (alone and in the ring, against float64)."""

import contextlib
import inspect

import torch
from attention_reference import reference_with_grads

from megatron_hdp.attention import simulated_ring_attention
from megatron_hdp.attention.backends import Segments, _kernel_for, _resolve


def with_signature(impl, required, optional=()):
    """`impl(**kwargs)` behind a keyword parameter list: unknown or missing keywords fail like the real call."""

    def call(**kwargs):
        unknown, missing = set(kwargs) - set(required) - set(optional), set(required) - set(kwargs)
        assert not unknown and not missing, f"unknown {sorted(unknown)}, missing {sorted(missing)}"
        return impl(**kwargs)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    call.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in required] + [inspect.Parameter(n, kind, default=None) for n in optional]
    )
    return call


def positional(impl, names):
    """`impl(**dict(zip(names, args)))` for a pybind function that takes exactly `len(names)` positional args."""

    def call(*args, **kwargs):
        assert not kwargs, f"pybind function called with keywords {sorted(kwargs)}"
        assert len(args) == len(names), f"takes {len(names)} positional arguments ({names}), got {len(args)}"
        return impl(**dict(zip(names, args)))

    return call


def segment_attention(q, k, v, segments: Segments, causal: bool, scale: float, window=(-1, -1)):
    """Differentiable (out, lse [H, T]) of packed segments in plain torch (GQA by repeating kv heads).
    `window` (left, right) as flash-attn documents it: bottom-right aligned, key j visible to query i when
    i + Lk - Lq - left <= j <= i + Lk - Lq + right, a negative bound meaning none."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for q0, q1, k0, k1 in zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:]):
        kk, vv = (x[k0:k1].repeat_interleave(group, 1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
        aligned = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0) - torch.arange(k1 - k0)[None, :]  # i' - j
        if window[0] >= 0:
            scores = scores.masked_fill(aligned > window[0], float("-inf"))
        if window[1] >= 0:
            scores = scores.masked_fill(aligned < -window[1], float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs), torch.cat(lses, 1)


def check_backend_in_ring(backend: str, label: str) -> None:
    """`backend` alone (ring of 1) and in a ring of 3, causal and not, GQA, with no sink, the off-by-one
    sink and a learnable one (Megatron's softmax_type), against the float64 reference; causal in a ring of 3
    also with V narrower than q and k (multi-latent attention's head dims, 8 / 4), with a learnable sink."""
    seqlens = [1, 5, 12, 23]
    cases = [(True, kind, 8, (1, 3)) for kind in ("vanilla", "off-by-one", "learnable")]  # sinks: causal mask
    cases += [(False, "vanilla", 8, (1, 3)), (True, "learnable", 4, (3,))]
    for causal, kind, value_dim, ring_sizes in cases:
        gen = torch.Generator().manual_seed(value_dim)
        dims = (8, 8, value_dim, value_dim)
        q, k, v, dout = (torch.randn(sum(seqlens), h, d, generator=gen) for h, d in zip((4, 2, 2, 4), dims))
        sink = {"vanilla": None, "off-by-one": torch.zeros(4), "learnable": torch.randn(4, generator=gen)}[kind]
        want = reference_with_grads(q, k, v, dout, seqlens, causal=causal, scale=0.3, sink=sink)
        for ring_size in ring_sizes:
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            leaves += [] if sink is None else [sink.clone().requires_grad_()]
            out = simulated_ring_attention(
                *leaves[:3], seqlens=seqlens, ring_size=ring_size, causal=causal, softmax_scale=0.3, backend=backend,
                sink=leaves[3] if sink is not None else None,
            )
            got = [out, *torch.autograd.grad(out, leaves, dout)]
            for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
                where = f"{label} causal={causal} {kind} ring={ring_size} dv={value_dim} {name}"
                torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{where}: {m}")


@contextlib.contextmanager
def cleared_caches(*caches):
    """The backend choice caches and `caches` (a library's API and version) cleared before and after."""
    caches = (_resolve, _kernel_for, *caches)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
