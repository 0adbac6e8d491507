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
from megatron_hdp.attention.backends import BlockWindow, Segments, grads_by_recompute
from megatron_hdp.attention.merge import merge_attention

CPU = torch.device("cpu")
TOL = dict(rtol=1e-5, atol=1e-5)


def _qkv(seqlens, hq, hkv, dim=8, dtype=torch.float32, seed=0, value_dim=None):
    """q, k, v, dout; v and dout `value_dim` wide (default: `dim`), as multi-latent attention's are."""
    gen = torch.Generator().manual_seed(seed)
    total, dv = sum(seqlens), value_dim or dim
    return [torch.randn(total, h, d, generator=gen, dtype=dtype) for h, d in ((hq, dim), (hkv, dim), (hkv, dv), (hq, dv))]


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


@pytest.mark.parametrize("window", [None, BlockWindow(2, (0, 3, 1))])
def test_cpu_flash_backend_takes_a_narrower_value_head_dim(window):
    """Multi-latent attention's head dims (q and k wider than v, here 12 / 8): the op refuses them, the
    backend pads V with zeros and cuts the output and dV back; out, lse and every gradient equal the math,
    dV keeps V's width. With a window at offsets too (the ring's pieces: the op's mask per segment)."""
    causal = True
    lengths_q, lengths_k = (3, 1, 7), (3, 4, 7) if window is not None else (3, 1, 7)
    segments = Segments(lengths_q, lengths_k, CPU)
    q = torch.randn(sum(lengths_q), 4, 12, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lengths_k), 2, 12, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lengths_k), 2, 8, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(sum(lengths_q), 4, 8, dtype=torch.float64)
    if window is None:
        ref_out, ref_lse = segment_attention(q, k, v, segments, causal, 0.3)
    else:
        ref_out, ref_lse = _windowed_segment_attention(q, k, v, segments, window, 0.3)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    backend = get_backend("cpu_flash", device=CPU, dtype=torch.float64)
    out, lse = backend.forward(q, k, v, segments=segments, causal=causal, scale=0.3, window=window)
    assert out.shape == (q.shape[0], 4, 8) and out.is_contiguous()
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse.detach())
    grads = backend.backward(dout, q, k, v, out, lse, segments=segments, causal=causal, scale=0.3, window=window)
    assert grads[2].shape == v.shape
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def _windowed_segment_attention(q, k, v, segments, window, scale):
    """(out, lse) of packed segments under `window`'s rule at its offsets, in plain torch."""
    group = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for s, (q0, q1, k0, k1) in enumerate(zip(segments.cu_q, segments.cu_q[1:], segments.cu_k, segments.cu_k[1:])):
        kk, vv = (x[k0:k1].repeat_interleave(group, 1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[q0:q1], kk) * scale
        diff = torch.arange(q1 - q0)[:, None] + window.shifts[s] - torch.arange(k1 - k0)[None, :]
        scores = scores.masked_fill((diff < 0) | (diff > window.left), float("-inf"))
        lses.append(scores.logsumexp(-1))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs), torch.cat(lses, 1)


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
    with pytest.raises(ValueError, match=r"k and v must have the same tokens and heads, got shapes \(8, 2, 8\) and \(8, 1, 4\)"):
        local_varlen_attention(q, k, torch.randn(8, 1, 4), seqlens=[4, 4])
    with pytest.raises(ValueError, match="q and k must have the same head_dim, got 8 and 6"):
        local_varlen_attention(q, torch.randn(8, 2, 6), v, seqlens=[4, 4])
    with pytest.raises(ValueError, match="q has 8 tokens but seqlens give this rank 9"):
        local_varlen_attention(q, k, v, seqlens=[4, 5])
    with pytest.raises(ValueError, match=r"kv heads \(3\) must divide query heads \(4\)"):
        local_varlen_attention(q, torch.randn(8, 3, 8), torch.randn(8, 3, 8), seqlens=[4, 4])


def _check_simulated_ring(seqlens, ring_size, hq, hkv, causal, seed, value_dim=None, window=None):
    q, k, v, dout = _qkv(seqlens, hq, hkv, seed=seed, value_dim=value_dim)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=causal, scale=0.3, window=window)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = simulated_ring_attention(
        *leaves, seqlens=seqlens, ring_size=ring_size, causal=causal, softmax_scale=0.3, window=window
    )
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("ring_size", [2, 3, 4, 8])
def test_simulated_ring_edge_lengths(ring_size):
    k = ring_size
    _check_simulated_ring([1, 2 * k - 1, 2 * k, 2 * k + 1, 3], ring_size, 4, 2, True, seed=k)


@pytest.mark.parametrize("ring_size", [1, 2, 3, 5])
def test_simulated_ring_with_a_narrower_value_head_dim(ring_size):
    """Multi-latent attention's head dims (q and k 8 wide, v 4) on every position of rings of 1-5, causal,
    non-causal and windowed (the direct plan), GQA: out [T, Hq, 4] and every gradient equal the float64
    reference (the ring moves K and V unpadded in one message: `comm.payload`)."""
    k = ring_size
    seqlens = [1, 2 * k - 1, 2 * k + 1, 19]
    for causal, window, seed in ((True, None, 1), (False, None, 2), (True, 3, 3)):
        _check_simulated_ring(seqlens, ring_size, 4, 2, causal, seed=seed + 10 * k, value_dim=4, window=window)


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
