"""The flex backend with HDP's changing packed lengths, on CPU: one compiled graph for many lengths, and
a block mask built at tile level that equals torch's `create_block_mask` without its dense [T, T] mask.
(flex's compiled kernels and backward need a GPU: tests/attention/test_attention_gpu.py.)"""

import random

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hdp.attention.backends import CpuFlashBackend, Segments, flex

CPU = torch.device("cpu")


def _reference_block_mask(segments: Segments, causal: bool):
    """torch's own create_block_mask (dense evaluation) of the same document mask."""
    def row_ids(lengths):  # segment id and position of every packed row, from the Python lengths
        return (torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
                torch.cat([torch.arange(n) for n in lengths]))

    seg_q, pos_q = row_ids(segments.seqlens_q)
    seg_k, pos_k = row_ids(segments.seqlens_k)

    def mask_mod(b, h, q_idx, kv_idx):
        same = seg_q[q_idx] == seg_k[kv_idx]
        return same & (pos_q[q_idx] >= pos_k[kv_idx]) if causal else same

    return create_block_mask(mask_mod, None, None, segments.cu_q[-1], segments.cu_k[-1], device=CPU)


def test_tile_level_block_mask_equals_create_block_mask():
    rng = random.Random(0)
    lengths = [1, 5, 64, 127, 128, 129, 200, 256, 300]
    for _ in range(16):
        n = rng.randint(1, 5)
        causal = rng.random() < 0.5
        lengths_q = tuple(rng.choice(lengths) for _ in range(n))
        lengths_k = lengths_q if causal else tuple(rng.choice(lengths) for _ in range(n))
        segments = Segments(lengths_q, lengths_k, CPU)
        got, want = flex._block_mask(segments, causal), _reference_block_mask(segments, causal)
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (name, lengths_q, lengths_k, causal)
        assert torch.equal(got.to_dense(), want.to_dense()), (lengths_q, lengths_k, causal)
        assert got.seq_lengths == want.seq_lengths


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements any op produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [True, False])
def test_block_mask_never_materialises_t_by_t(causal):
    segments = Segments((3000, 2500, 2692), (3000, 2500, 2692), CPU)  # T = 8192: [T, T] is 67M elements
    flex._block_mask.cache_clear()
    with _LargestTensor() as mode:
        flex._block_mask(segments, causal)
    assert mode.largest <= 8192, mode.largest  # rows, or (T / 128)^2 = 4096 tiles


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flex_compiles_once_for_many_packed_lengths(monkeypatch):
    """The compile flex is wrapped in, with our arguments, over 10 packed lengths: one graph, not one per
    length (a static compile hits Dynamo's recompile limit of 8 and then runs flex eagerly on [T, T])."""
    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: real_compile(fn, **{**kwargs, "backend": counter}))
    flex._compiled_flex.cache_clear()
    torch._dynamo.reset()
    try:
        for total in (130, 300, 257, 511, 200, 640, 333, 1000, 129, 450):
            lengths = (total // 3, total - total // 3)
            segments = Segments(lengths, lengths, CPU)
            q, k = torch.randn(total, 2, 8), torch.randn(total, 1, 8)
            out, lse = flex.FlexBackend().forward(q, k, k, segments=segments, causal=True, scale=0.5)
            want = CpuFlashBackend().forward(q, k, k, segments=segments, causal=True, scale=0.5)
            torch.testing.assert_close((out, lse), want, rtol=1e-4, atol=1e-4)
    finally:
        flex._compiled_flex.cache_clear()
        torch._dynamo.reset()
    assert counter.frame_count <= 2, f"{counter.frame_count} compilations for 10 lengths"


def test_flex_always_asks_for_the_main_kernel(monkeypatch):
    """Short query blocks must not reach inductor's split-KV decoding kernel (it failed to lower under the
    dynamic-shape compile on an H100, torch 2.11): every call passes FORCE_USE_FLEX_ATTENTION."""
    from torch.nn.attention.flex_attention import flex_attention

    seen = []

    def recording_flex(*args, **kwargs):
        seen.append(kwargs.get("kernel_options") or {})
        return flex_attention(*args, **kwargs)

    monkeypatch.setattr(flex, "_compiled_flex", lambda: recording_flex)
    segments = Segments((5, 3), (5, 3), CPU)
    q, k = torch.randn(8, 2, 8), torch.randn(8, 1, 8)
    out, lse = flex.FlexBackend().forward(q, k, k, segments=segments, causal=True, scale=0.5)
    torch.testing.assert_close((out, lse), CpuFlashBackend().forward(q, k, k, segments=segments, causal=True, scale=0.5),
                               rtol=1e-4, atol=1e-4)
    assert seen and all(options.get("FORCE_USE_FLEX_ATTENTION") is True for options in seen)
