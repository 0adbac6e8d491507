"""Local kernels, the LSE merge and the ring algorithm in one process, against a float64 reference."""

import logging

import pytest
import torch
from attention_reference import reference_attention, reference_with_grads
from hypothesis import HealthCheck, given, settings
from kernel_stand_ins import segment_attention
from hypothesis import strategies as st

from megatron_hdp.attention import (
    available_backends,
    get_backend,
    local_varlen_attention,
    ring_attention,
    simulated_ring_attention,
)
from megatron_hdp.attention.backends import Segments, grads_by_recompute
from megatron_hdp.attention.merge import merge_attention

CPU = torch.device("cpu")
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(seqlens, hq, hkv, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    return [torch.randn(total, h, dim, generator=gen, dtype=dtype) for h in (hq, hkv, hkv, hq)]  # q k v dout


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
def test_cpu_flash_backend_matches_math(causal, hq, hkv):
    lengths_q = (3, 1, 7)
    lengths_k = lengths_q if causal else (5, 2, 4)
    segments = Segments(lengths_q, lengths_k, CPU)
    q = torch.randn(sum(lengths_q), hq, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), hkv, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    ref_out, ref_lse = segment_attention(q, k, v, segments, causal, 0.3)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    backend = get_backend("cpu_flash", device=CPU, dtype=torch.float64)
    out, lse = backend.forward(q, k, v, segments=segments, causal=causal, scale=0.3)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse.detach())
    grads = backend.backward(dout, q, k, v, out, lse, segments=segments, causal=causal, scale=0.3)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_cpu_flash_backend_keeps_low_precision_dtypes():
    segments = Segments((6,), (6,), CPU)
    q, k, v = (torch.randn(6, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    backend = get_backend("auto", device=CPU, dtype=torch.bfloat16)
    out, lse = backend.forward(q, k, v, segments=segments, causal=True, scale=0.3)
    assert (out.dtype, lse.dtype) == (torch.bfloat16, torch.float32)
    grads = backend.backward(torch.ones_like(out), q, k, v, out, lse, segments=segments, causal=True, scale=0.3)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3


def test_merge_of_two_key_blocks_is_attention_over_both():
    segments_a, segments_b = Segments((5,), (3,), CPU), Segments((5,), (4,), CPU)
    q = torch.randn(5, 2, 8, dtype=torch.float64)
    k, v = torch.randn(7, 2, 8, dtype=torch.float64), torch.randn(7, 2, 8, dtype=torch.float64)
    out_a, lse_a = segment_attention(q, k[:3], v[:3], segments_a, False, 0.5)
    out_b, lse_b = segment_attention(q, k[3:], v[3:], segments_b, False, 0.5)
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = segment_attention(q, k, v, Segments((5,), (7,), CPU), False, 0.5)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)


def test_grads_by_recompute_sum_to_full_gradients():
    """The flex backend's backward formula: block gradients from the merged out/lse add up exactly."""
    q = torch.randn(6, 4, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    dout = torch.randn(6, 4, 8, dtype=torch.float64)
    full, half_a, half_b = Segments((6,), (9,), CPU), Segments((6,), (4,), CPU), Segments((6,), (5,), CPU)
    want_out, _ = segment_attention(q, k, v, full, False, 0.4)
    want = torch.autograd.grad(want_out, (q, k, v), dout)
    with torch.no_grad():
        out_a, lse_a = segment_attention(q, k[:4], v[:4], half_a, False, 0.4)
        out_b, lse_b = segment_attention(q, k[4:], v[4:], half_b, False, 0.4)
        out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, segments in ((slice(0, 4), half_a), (slice(4, 9), half_b)):
        bq, bk, bv = grads_by_recompute(
            lambda q_, k_, v_: segment_attention(q_, k_, v_, segments, False, 0.4), dout, q, k[rows], v[rows], out, lse
        )
        dq += bq
        dk[rows] += bk
        dv[rows] += bv
    for got, expected in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, expected)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_backend_forward_conventions_on_cpu(monkeypatch):
    """flex runs compiled on CUDA only; its mask, layout and lse conventions are checked here eagerly."""
    from torch.nn.attention.flex_attention import flex_attention

    from megatron_hdp.attention.backends import flex

    monkeypatch.setattr(flex, "_compiled_flex", lambda: flex_attention)
    for causal, lengths_k in ((True, (3, 5, 2)), (False, (4, 1, 6))):
        segments = Segments((3, 5, 2), lengths_k, CPU)
        q, k, v = torch.randn(10, 4, 8), torch.randn(sum(lengths_k), 2, 8), torch.randn(sum(lengths_k), 2, 8)
        out, lse = flex.FlexBackend().forward(q, k, v, segments=segments, causal=causal, scale=0.4)
        want_out, want_lse = segment_attention(q, k, v, segments, causal, 0.4)
        torch.testing.assert_close(out, want_out, **TOL)
        torch.testing.assert_close(lse, want_lse, **TOL)


def test_backend_choice():
    assert available_backends("cpu", torch.float32) == ["cpu_flash"]
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope", device=CPU, dtype=torch.float32)
    with pytest.raises(ValueError, match="'torch_varlen' does not run on device cpu"):
        get_backend("torch_varlen", device=CPU, dtype=torch.float16)
    with pytest.raises(ValueError, match="no attention backend supports"):
        get_backend("auto", device=CPU, dtype=torch.int32)
    auto = get_backend("auto", device=CPU, dtype=torch.float32)
    q = torch.randn(5, 2, 8)
    assert type(auto.kernel_for(q, q, Segments((5,), (5,), CPU))).__name__ == "CpuFlashBackend"


@pytest.mark.parametrize("causal", [True, False])
def test_local_varlen_attention_and_ring_of_one(causal):
    seqlens = [1, 6, 13]
    q, k, v, dout = _qkv(seqlens, 4, 2)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=causal, scale=0.25)
    for attend in (
        lambda *x: local_varlen_attention(*x, seqlens=seqlens, causal=causal, softmax_scale=0.25),
        lambda *x: ring_attention(*x, seqlens=seqlens, ring=[0], causal=causal, softmax_scale=0.25),
    ):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = attend(*leaves)
        got = [out, *torch.autograd.grad(out, leaves, dout)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g.double(), w, **TOL)


def test_bad_local_calls_raise():
    q, k, v, _ = _qkv([4, 4], 4, 2)
    with pytest.raises(ValueError, match="q has 8 tokens but seqlens give this rank 9"):
        local_varlen_attention(q, k, v, seqlens=[4, 5])
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide query heads \(4\)"):
        local_varlen_attention(q, torch.randn(8, 3, 8), torch.randn(8, 3, 8), seqlens=[4, 4])


def _check_simulated_ring(seqlens, ring_size, hq, hkv, causal, seed):
    q, k, v, dout = _qkv(seqlens, hq, hkv, seed=seed)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=causal, scale=0.3)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = simulated_ring_attention(*leaves, seqlens=seqlens, ring_size=ring_size, causal=causal, softmax_scale=0.3)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("ring_size", [2, 3, 4, 8])
def test_simulated_ring_edge_lengths(ring_size):
    k = ring_size
    _check_simulated_ring([1, 2 * k - 1, 2 * k, 2 * k + 1, 3], ring_size, 4, 2, True, seed=k)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seqlens=st.lists(st.integers(1, 24), min_size=1, max_size=4),
    ring_size=st.integers(1, 6),
    heads=st.sampled_from([(2, 2), (4, 2), (4, 1)]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_simulated_ring_matches_reference(seqlens, ring_size, heads, causal, seed):
    _check_simulated_ring(seqlens, ring_size, *heads, causal, seed)


def test_auto_choice_is_logged_once_per_shape(caplog):
    from megatron_hdp.attention.backends import _kernel_for

    _kernel_for.cache_clear()
    with caplog.at_level(logging.INFO, logger="megatron_hdp.attention.backends"):
        for seqlens in ([5, 6], [7], [8, 1]):  # one length bucket: (4, 8]
            q = torch.randn(sum(seqlens), 2, 8, dtype=torch.float64)
            local_varlen_attention(q, q, q, seqlens=seqlens, backend="auto")
    assert sum("cpu_flash" in r.getMessage() for r in caplog.records) == 1


def test_reference_is_causal():
    q, k, v, _ = _qkv([5], 2, 2)
    out = reference_attention(q, k, v, [5], causal=True, scale=1.0)
    torch.testing.assert_close(out[0].float(), v[0], **TOL)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.bfloat16, 3e-2)])
def test_simulated_ring_keeps_input_dtype(dtype, tol):
    """Accumulation is fp32 (fp64 for fp64); outputs and gradients come back in the input dtype."""
    seqlens = [1, 9, 40, 7]
    q, k, v, dout = _qkv(seqlens, 4, 2, dim=16, seed=3)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=True, scale=0.25)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = simulated_ring_attention(*leaves, seqlens=seqlens, ring_size=3, softmax_scale=0.25)
    got = [out, *torch.autograd.grad(out, leaves, dout.to(dtype))]
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol)
