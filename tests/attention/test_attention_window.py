"""Sliding-window attention (Megatron's `window_size = (w, 0)`): the local kernel, the ring's windowed plan
and `simulated_ring_attention` against the dense float64 reference with the window
(`attention_reference`), forward and backward; pieces outside every window are never computed; kernels
that take one bottom-right window per call stand aside for the ring's pieces at offsets.
(The gloo ring with windows: `tests/attention/test_ring_attention.py`, the cases with `window=`.)"""

import itertools

import pytest
import torch
from attention_reference import reference_with_grads

from megatron_hdp.attention import local_varlen_attention, simulated_ring_attention, zigzag_token_indices
from megatron_hdp.attention.backends import KernelShape, Segments
from megatron_hdp.attention.backends.base import BlockWindow
from megatron_hdp.attention.backends.flash_attn_varlen import FlashAttnVarlenBackend
from megatron_hdp.attention.backends.flex import FlexBackend, window_mask_mod
from megatron_hdp.attention.backends.torch_varlen import TorchVarlenBackend
from megatron_hdp.attention.ring_plan import ring_plan

CPU = torch.device("cpu")
TOL = dict(rtol=1e-5, atol=1e-5)


def _tensors(seqlens, heads=(4, 2), dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    return [torch.randn(total, h, dim, generator=gen) for h in (heads[0], heads[1], heads[1], heads[0])]


def _check(attend, seqlens, window, heads=(4, 2), seed=0):
    q, k, v, dout = _tensors(seqlens, heads, seed=seed)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout)
    want = reference_with_grads(q, k, v, dout, seqlens, causal=True, scale=0.3, window=window)
    for name, got, w in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in leaves)), want):
        torch.testing.assert_close(got.double(), w, **TOL, msg=lambda m: f"{name}, window {window}: {m}")


@pytest.mark.parametrize("window", [0, 1, 3, 7, 100])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_local_kernel_window_matches_reference(window, heads):
    seqlens = [1, 5, 12, 2]
    _check(
        lambda q, k, v: local_varlen_attention(q, k, v, seqlens=seqlens, softmax_scale=0.3, window=window),
        seqlens, window, heads,
    )


def test_window_changes_the_result():
    """The window is not silently ignored: with w smaller than a document the output differs."""
    q, k, v, _ = _tensors([12])
    full = local_varlen_attention(q, k, v, seqlens=[12], softmax_scale=0.3)
    windowed = local_varlen_attention(q, k, v, seqlens=[12], softmax_scale=0.3, window=3)
    assert not torch.allclose(full, windowed)
    assert torch.equal(full[:4], windowed[:4])  # rows 0..3 see every earlier key anyway


def _edge(k):
    return [1, 2 * k - 1, 2 * k, 2 * k + 1]


@pytest.mark.parametrize("ring_size", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 1, 2, 5, 9, 30])
def test_simulated_ring_window_matches_reference(ring_size, window):
    """Windows smaller than a chunk, about one, spanning several; documents shorter than 2k included."""
    seqlens = _edge(ring_size) + [7 * ring_size + 3, 41]
    _check(
        lambda q, k, v: simulated_ring_attention(
            q, k, v, seqlens=seqlens, ring_size=ring_size, softmax_scale=0.3, window=window, backend="cpu_flash"
        ),
        seqlens, window, heads=(4, 1), seed=ring_size * 100 + window,
    )


def _pairs(seqlens, ring_size, position, window):
    """(q token, kv token) global pairs the windowed plan of `position` computes, with multiplicity, and
    the number of kernel calls per step."""
    plan = ring_plan(tuple(seqlens), ring_size, position, True, CPU, window)
    rows = [zigzag_token_indices(seqlens, ring_size, p) for p in range(ring_size)]
    pairs, calls = [], []
    for step, blocks in enumerate(plan.blocks):
        calls.append(len(blocks))
        for block in blocks:
            q_tokens = block.q_rows.take(rows[position])
            kv_tokens = block.kv_rows.take(rows[plan.source(step)])
            seg = block.segments
            local_rows = block.q_rows.take(torch.arange(plan.num_tokens[position])).tolist()
            assert len(set(local_rows)) == len(local_rows), "a local row appears twice in one call"
            for s, (q0, q1, k0, k1) in enumerate(zip(seg.cu_q, seg.cu_q[1:], seg.cu_k, seg.cu_k[1:])):
                mask = block.window.mask(s, q1 - q0, k1 - k0, CPU)
                assert mask.any(1).all(), "a query row of a piece sees no key of it"
                assert mask.any(0).all(), "a key of a piece is seen by no query of it"
                qs, ks = q_tokens[q0:q1].tolist(), kv_tokens[k0:k1].tolist()
                pairs += [(qs[i], ks[j]) for i, j in mask.nonzero().tolist()]
    return pairs, calls


@pytest.mark.parametrize("ring_size", [2, 3, 4])
@pytest.mark.parametrize("window", [0, 2, 6])
def test_windowed_plan_computes_each_visible_pair_once_and_nothing_else(ring_size, window):
    seqlens = _edge(ring_size) + [40]
    starts = list(itertools.accumulate([0] + seqlens))
    for position in range(ring_size):
        pairs, _ = _pairs(seqlens, ring_size, position, window)
        assert len(pairs) == len(set(pairs)), "a pair is computed twice"
        expected = set()
        for t in zigzag_token_indices(seqlens, ring_size, position).tolist():
            doc = max(d for d in range(len(seqlens)) if starts[d] <= t)
            expected |= {(t, j) for j in range(max(starts[doc], t - window), t + 1)}
        assert set(pairs) == expected


def test_steps_outside_every_window_make_no_call():
    """One document of 64 tokens on 4 ranks (chunks of 8), window 3: position 0 holds chunks 0 and 7 and
    sees only chunk 6 (held by position 1, step 3) beyond its own; steps 1 and 2 compute nothing."""
    _, calls = _pairs([64], 4, 0, 3)
    assert calls == [2, 0, 0, 1]  # step 0: chunk 0 and chunk 7 diagonals (7 over 0 is outside)
    plan = ring_plan((64,), 4, 0, True, CPU, 63)
    # a window over the whole document is no window: the plain plan, one call per step
    assert [len(b) for b in plan.blocks] == [1, 1, 1, 1] and all(b[0].window is None for b in plan.blocks)


def test_flex_mask_mod_is_the_window_rule():
    """flex's windowed mask_mod (run densely on CPU) equals `BlockWindow.mask` per segment."""
    from megatron_hdp.attention.backends.base import segment_rows

    segments = Segments((3, 5), (4, 2), CPU)
    window = BlockWindow(2, (1, 4))
    seg_q, pos_q = segment_rows(segments.cu_seqlens_q, 8)
    seg_k, pos_k = segment_rows(segments.cu_seqlens_k, 6)
    mod = window_mask_mod(seg_q, pos_q, seg_k, pos_k, window)
    dense = mod(0, 0, torch.arange(8)[:, None], torch.arange(6)[None, :])
    want = torch.zeros(8, 6, dtype=torch.bool)
    want[0:3, 0:4] = window.mask(0, 3, 4, CPU)
    want[3:8, 4:6] = window.mask(1, 5, 2, CPU)
    assert torch.equal(dense, want)


def test_kernels_with_one_window_per_call_stand_aside_for_pieces_at_offsets():
    q, k = torch.zeros(4, 2, 8), torch.zeros(4, 2, 8)
    segments = Segments((2, 2), (2, 2), CPU)
    aligned = KernelShape.of(q, k, segments, window=BlockWindow(3, (0, 0)))
    offset = KernelShape.of(q, k, segments, window=BlockWindow(3, (0, 2)))
    assert (aligned.window, offset.window, aligned.window_left) == ("aligned", "offset", 3)
    for cls in (FlashAttnVarlenBackend, TorchVarlenBackend):
        assert cls.shape_problem(aligned) is None
        assert "offsets" in cls.shape_problem(offset)
    assert FlexBackend.shape_problem(offset) is None


@pytest.mark.parametrize("window", [-1, 2.5, True])
def test_bad_window_raises(window):
    q, k, v, _ = _tensors([4])
    with pytest.raises(ValueError, match="window"):
        local_varlen_attention(q, k, v, seqlens=[4], window=window)
    with pytest.raises(ValueError, match="causal"):
        simulated_ring_attention(q, k, v, seqlens=[4], ring_size=2, causal=False, window=2)
