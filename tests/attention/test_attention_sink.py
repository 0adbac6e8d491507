"""Attention sinks (Megatron's `softmax_type` off-by-one and learnable) on every path, against the float64
reference that materialises the softmax with the sink's extra column (`attention_reference`): whole
documents (one local call), the ring's algorithm on 2-4 virtual ranks, sliding windows, deterministic
mode, GQA; forward, dq/dk/dv and the sink's own gradient. (Gloo rings with sinks:
`tests/attention/test_ring_attention.py`; the stand-ins of flash-attn and TE: `kernel_stand_ins.check_backend_in_ring`;
CUDA kernels: `tests/attention/test_attention_gpu.py`.)"""

import pytest
import torch
from attention_reference import reference_attention, reference_with_grads

from megatron_hdp.attention import local_varlen_attention, simulated_ring_attention

TOL = dict(rtol=1e-5, atol=1e-5)
SEQLENS = [1, 2, 7, 8, 9, 33]


def _tensors(seqlens, heads=(4, 2), seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    q, k, v, dout = (torch.randn(total, h, 8, generator=gen) for h in (heads[0], heads[1], heads[1], heads[0]))
    return q, k, v, dout, gen


def _sink(kind, heads, gen):
    return torch.zeros(heads) if kind == "off-by-one" else 2 * torch.randn(heads, generator=gen)


def _attend_and_grads(attend, q, k, v, sink, dout):
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sink)]
    out = attend(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout)]


def _check(attend, seqlens, *, kind, window=None, heads=(4, 2), seed=0):
    q, k, v, dout, gen = _tensors(seqlens, heads, seed)
    sink = _sink(kind, heads[0], gen)
    got = _attend_and_grads(attend, q, k, v, sink, dout)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=True, scale=0.3, window=window, sink=sink)
    for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(g.double(), w, **TOL, msg=lambda m: f"{kind} window {window} {name}: {m}")
    return got


@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("deterministic", [False, True])
def test_whole_documents_with_a_sink_match_the_reference(kind, window, deterministic):
    attend = lambda q, k, v, s: local_varlen_attention(  # noqa: E731
        q, k, v, seqlens=SEQLENS, softmax_scale=0.3, window=window, sink=s, deterministic=deterministic)
    first = _check(attend, SEQLENS, kind=kind, window=window)
    if deterministic:  # bitwise the same gradients, the sink's included, on a second run
        again = _check(attend, SEQLENS, kind=kind, window=window)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("kind", ["off-by-one", "learnable"])
@pytest.mark.parametrize("ring_size,window", [(2, None), (3, 2), (4, 9), (4, None)])
def test_ring_with_a_sink_matches_the_reference(kind, ring_size, window):
    """The sink after the ring's LSE merge, the block backward with the rows' lse': documents shorter than
    2k, around it and longer; windows smaller than a chunk and spanning several."""
    seqlens = [1, 2 * ring_size - 1, 2 * ring_size + 1, 29]
    attend = lambda q, k, v, s: simulated_ring_attention(  # noqa: E731
        q, k, v, seqlens=seqlens, ring_size=ring_size, softmax_scale=0.3, window=window, sink=s,
        backend="cpu_flash", deterministic=True)
    _check(attend, seqlens, kind=kind, window=window, heads=(4, 1), seed=ring_size)


def test_sinks_change_the_result_and_a_very_negative_one_changes_nothing():
    """The sink is not ignored (off-by-one differs from the plain softmax; learnable from off-by-one), and
    s_h -> -inf gives back the plain softmax."""
    q, k, v, _, _ = _tensors([12])
    attend = lambda sink: local_varlen_attention(q, k, v, seqlens=[12], softmax_scale=0.3, sink=sink)  # noqa: E731
    plain, off_by_one, learnable = attend(None), attend(torch.zeros(4)), attend(torch.full((4,), 1.5))
    assert not torch.allclose(plain, off_by_one) and not torch.allclose(off_by_one, learnable)
    torch.testing.assert_close(attend(torch.full((4,), -200.0)), plain)
    # the reference agrees that the sink only shrinks each row: out = plain * sum_j p_j
    torch.testing.assert_close(
        off_by_one.double(), reference_attention(q, k, v, [12], causal=True, scale=0.3, sink=torch.zeros(4)), **TOL)


def test_low_precision_inputs_keep_their_dtype_and_the_sinks():
    q, k, v, dout, gen = _tensors([5, 11])
    sink = torch.randn(4, generator=gen)
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [sink.to(dtype).requires_grad_()]
        out = simulated_ring_attention(*leaves[:3], seqlens=[5, 11], ring_size=2, softmax_scale=0.3, sink=leaves[3])
        out.backward(dout.to(dtype))
        assert out.dtype == dtype and all(x.grad.dtype == dtype for x in leaves)
        want = reference_with_grads(q, k, v, dout, [5, 11], causal=True, scale=0.3, sink=sink)
        tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=3e-2, atol=3e-2)
        for got, w in zip([out, *(x.grad for x in leaves)], want):
            torch.testing.assert_close(got.double(), w, **tol)


@pytest.mark.parametrize("sink,match", [(torch.zeros(3), r"one logit per query head \(4,\)"),
                                        (torch.zeros(4, 1), r"\(4, 1\)"), (torch.zeros(4, dtype=torch.int64), "float"),
                                        (0.0, "float")])
def test_bad_sinks_raise(sink, match):
    q, k, v, _, _ = _tensors([6])
    for call in (
        lambda: local_varlen_attention(q, k, v, seqlens=[6], sink=sink),
        lambda: simulated_ring_attention(q, k, v, seqlens=[6], ring_size=2, sink=sink),
    ):
        with pytest.raises(ValueError, match=match):
            call()
