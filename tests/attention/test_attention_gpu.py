"""CUDA kernels behind the backend interface, against the float64 reference (skipped without a GPU).

Each available CUDA backend runs the local varlen path and the in-process ring (whose block backward
takes the merged out/lse, the part a kernel's own autograd never exercises), causal and not, and its
forward's lse is checked directly (for te_fused that is the conversion of cuDNN's softmax statistics), and
multi-latent attention's head dims (192 / 128) run through each.
Where Transformer Engine 2.x is installed, te_fused must be among the available backends, so a wrong
version or capability check cannot quietly leave it untested. Attention sinks (Megatron's off-by-one and
learnable softmax) on every CUDA kernel: neither `varlen_attn` (torch 2.10-2.13) nor flex attention takes a
sink, so the sink is applied to the rows' (out, lse) the kernel returns (`megatron_hdp.attention.sink`) and
the kernel's backward is fed (out', lse'): checked here on whole documents and simulated rings.
"""

import pytest
import torch
from attention_reference import reference_with_grads

from megatron_hdp.attention import available_backends, get_backend, local_varlen_attention, simulated_ring_attention
from megatron_hdp.attention.backends import Segments, te_fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEQLENS = [1, 7, 64, 129, 300]


def _cases():
    """(dtype, backend) for every CUDA backend available here (none without a GPU)."""
    if not torch.cuda.is_available():
        return []
    dtypes = (torch.bfloat16, torch.float16, torch.float32)
    return [(dtype, name) for dtype in dtypes for name in available_backends("cuda", dtype)]


def _inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(SEQLENS)
    return [torch.randn(total, h, 64, generator=gen, device="cuda", dtype=dtype) for h in (8, 2, 2, 8)]


def _skip_without_kernel(backend, q, k, v=None):
    """Skip where the named backend has no kernel for this shape (TE's selector: e.g. THD below sm90)."""
    segments = Segments(tuple(SEQLENS), tuple(SEQLENS), q.device)
    try:
        get_backend(backend, device=q.device, dtype=q.dtype).kernel_for(q, k, segments, v=v)
    except ValueError as problem:
        pytest.skip(str(problem))


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype,backend", _cases())
@pytest.mark.parametrize("ring_size,causal", [(1, True), (3, True), (4, True), (1, False), (3, False)])
def test_cuda_backend_local_and_ring(dtype, backend, ring_size, causal):
    q, k, v, dout = _inputs(dtype)
    _skip_without_kernel(backend, q, k)
    want = reference_with_grads(q, k, v, dout, SEQLENS, causal=causal, scale=0.125)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if ring_size == 1:
        out = local_varlen_attention(*leaves, seqlens=SEQLENS, causal=causal, softmax_scale=0.125, backend=backend)
    else:
        out = simulated_ring_attention(
            *leaves, seqlens=SEQLENS, ring_size=ring_size, causal=causal, softmax_scale=0.125, backend=backend
        )
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **_tol(dtype), msg=lambda m: f"{backend} {name}: {m}")


@pytest.mark.parametrize("dtype,backend", _cases())
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_backend_lse(dtype, backend, causal):
    """The forward's lse [Hq, T] against the float64 log-sum-exp, q and kv segments of different lengths."""
    q, k, v, _ = _inputs(dtype)
    _skip_without_kernel(backend, q, k)
    lengths_k = SEQLENS if causal else SEQLENS[::-1]
    segments = Segments(tuple(SEQLENS), tuple(lengths_k), q.device)
    kernel = get_backend(backend, device="cuda", dtype=dtype)
    out, lse = kernel.forward(q, k, v, segments=segments, causal=causal, scale=0.125)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    group = q.shape[1] // k.shape[1]
    want = []
    for q0, q1, k0, k1 in zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:]):
        kk = k[k0:k1].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * 0.125
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
        want.append(scores.logsumexp(-1))
    torch.testing.assert_close(lse.double(), torch.cat(want, 1), **_tol(dtype), msg=lambda m: f"{backend}: {m}")


def test_te_fused_is_available_where_te_2x_is_installed():
    if te_fused.installed_te_version() is None:
        pytest.skip("Transformer Engine is not installed")
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("cuDNN fused attention needs compute capability 8.0 or newer")
    assert te_fused.te_version_problem() is None, te_fused.te_version_problem()
    for dtype in (torch.bfloat16, torch.float16):
        assert available_backends("cuda", dtype)[0] == "te_fused"


@pytest.mark.parametrize("dtype,backend", [c for c in _cases() if c[0] != torch.float32] + [(torch.bfloat16, "auto")])
@pytest.mark.parametrize("ring_size,window", [(1, 0), (1, 5), (1, 100), (3, 5), (4, 2), (4, 40)])
def test_cuda_sliding_window_local_and_ring(dtype, backend, ring_size, window):
    """Causal sliding windows (Megatron's (window, 0)) on the GPU kernels against the float64 reference:
    whole documents through each kernel's own window argument, ring pieces at their true offsets (kernels
    that cannot express an offset stand aside, so "auto" is checked too)."""
    q, k, v, dout = _inputs(dtype)
    want = reference_with_grads(q, k, v, dout, SEQLENS, causal=True, scale=0.125, window=window)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    try:
        if ring_size == 1:
            out = local_varlen_attention(*leaves, seqlens=SEQLENS, softmax_scale=0.125, backend=backend, window=window)
        else:
            out = simulated_ring_attention(*leaves, seqlens=SEQLENS, ring_size=ring_size, softmax_scale=0.125,
                                           backend=backend, window=window)
    except ValueError as problem:  # a named kernel that cannot express this window: it says so
        pytest.skip(str(problem))
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, **_tol(dtype), msg=lambda m: f"{backend} window {window} {name}: {m}")


@pytest.mark.parametrize("dtype,backend", _cases() + [(torch.bfloat16, "auto")])
@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
@pytest.mark.parametrize("ring_size,window", [(1, None), (1, 5), (3, None), (4, 40)])
def test_cuda_sinks_local_and_ring(dtype, backend, kind, ring_size, window):
    """A sink on whole documents and on the in-process ring (after its LSE merge), with and without a sliding
    window, against the float64 reference with the sink's extra softmax column: out, dq, dk, dv and the
    sink's gradient (a sum over all 501 rows: compared relative to its largest element)."""
    q, k, v, dout = _inputs(dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    sink = torch.zeros(8, device="cuda") if kind == "off-by-one" else torch.randn(8, generator=gen, device="cuda")
    want = reference_with_grads(q, k, v, dout, SEQLENS, causal=True, scale=0.125, window=window, sink=sink)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    try:
        if ring_size == 1:
            out = local_varlen_attention(*leaves[:3], seqlens=SEQLENS, softmax_scale=0.125, backend=backend,
                                         window=window, sink=leaves[3])
        else:
            out = simulated_ring_attention(*leaves[:3], seqlens=SEQLENS, ring_size=ring_size, softmax_scale=0.125,
                                           backend=backend, window=window, sink=leaves[3])
    except ValueError as problem:  # a named kernel without a kernel for this shape or window: it says so
        pytest.skip(str(problem))
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        # half precision: atol 3e-2. On an H200 (torch 2.11) flex at bf16 once reached 0.024 on a dq/dk element
        # of 0.06 that the next run of the same inputs met within 0.02 (its compiled backward is not
        # deterministic), and the sink rounds each row's output once more (out' in the input dtype)
        tol = _tol(dtype) if dtype == torch.float32 else dict(rtol=2e-2, atol=3e-2)
        if name == "dsink":
            tol = dict(tol, atol=tol["atol"] * max(1.0, float(w.abs().max())))
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{backend} {kind} window {window} {name}: {m}")


@pytest.mark.parametrize("dtype,backend", _cases() + [(torch.bfloat16, "auto")])
@pytest.mark.parametrize("ring_size", [1, 3])
def test_cuda_multi_latent_head_dims(dtype, backend, ring_size):
    """Multi-latent attention's head dims (q and k 192 wide, v 128; as many kv heads as q heads): every
    CUDA backend, natively (te_fused, flex) or on V zero-padded (torch_varlen, flash_attn), whole documents
    and in a ring, against the float64 reference; out and dV keep V's width."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    total = sum(SEQLENS)
    q, k, v, dout = (
        torch.randn(total, 4, d, generator=gen, device="cuda", dtype=dtype) for d in (192, 192, 128, 128)
    )
    if backend != "auto":
        _skip_without_kernel(backend, q, k, v)  # TE's selector decides for 192 / 128 (sm90, cuDNN >= 9.5)
    scale = 192**-0.5
    want = reference_with_grads(q, k, v, dout, SEQLENS, causal=True, scale=scale)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if ring_size == 1:
        out = local_varlen_attention(*leaves, seqlens=SEQLENS, softmax_scale=scale, backend=backend)
    else:
        out = simulated_ring_attention(*leaves, seqlens=SEQLENS, ring_size=ring_size, softmax_scale=scale,
                                       backend=backend)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    assert out.shape == (total, 4, 128) and got[3].shape == v.shape
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **_tol(dtype), msg=lambda m: f"{backend} 192/128 {name}: {m}")
