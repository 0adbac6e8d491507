"""The flash-attn backend without flash-attn or a GPU: the version/module gate, and its calls into
stand-in `flash_attn` modules whose `_flash_attn_varlen_forward` / `_flash_attn_varlen_backward` have the
exact parameter lists and return values of flash-attn v2.6.3, v2.7.4 and v2.8.3 (read from
Dao-AILab/flash-attention's flash_attn/flash_attn_interface.py at those tags), computing attention in
plain torch, and refuse a V head dim other than q's as FlashAttention-2 does. Checked: keyword names
per release, the forward's result layout, and the block gradients inside the ring against the float64
reference (multi-latent attention's narrower V through the backend's zero padding too). What only a GPU can check is tests/attention/test_attention_gpu.py.
"""

import importlib.machinery
import logging
import types

import pytest
import torch
from attention_reference import reference_with_grads
from flash_attn_stand_in import SIGNATURES, fake_flash_attn, install
from kernel_stand_ins import check_backend_in_ring, cleared_caches, segment_attention

from megatron_hdp.attention import get_backend, local_varlen_attention, simulated_ring_attention
from megatron_hdp.attention.backends import Segments, flash_attn_varlen

CUDA = torch.device("cuda")


CPU = torch.device("cpu")


@pytest.fixture
def fresh_caches():
    with cleared_caches(flash_attn_varlen._flash_api, flash_attn_varlen.flash_attn_problem):
        yield


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4"])  # 2.8.3 has 2.7.4's parameter lists
def test_flash_attn_calls_against_reference(monkeypatch, fresh_caches, version):
    install(monkeypatch, fake_flash_attn(version), version)
    monkeypatch.setattr(
        flash_attn_varlen.FlashAttnVarlenBackend, "supports", classmethod(lambda cls, device, dtype: True)
    )
    check_backend_in_ring("flash_attn", version)


@pytest.mark.parametrize("version", ["2.6.3", "2.7.4"])
def test_flash_attn_sliding_window_of_whole_documents(monkeypatch, fresh_caches, version):
    """Whole documents: flash-attn gets the window as (left, 0) in each release's keywords, and the result
    equals the float64 reference with the window; a ring's pieces at offsets are no call for flash-attn
    (one bottom-right window per call): a named flash_attn backend says so, "auto" takes another kernel."""
    install(monkeypatch, fake_flash_attn(version), version)
    monkeypatch.setattr(
        flash_attn_varlen.FlashAttnVarlenBackend, "supports", classmethod(lambda cls, device, dtype: True)
    )
    seqlens = [1, 5, 12, 23]
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(sum(seqlens), h, 8, generator=gen) for h in (4, 2, 2, 4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_varlen_attention(*leaves, seqlens=seqlens, softmax_scale=0.3, backend="flash_attn", window=3)
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    want = reference_with_grads(q, k, v, dout, seqlens, causal=True, scale=0.3, window=3)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{version} {name}: {m}")
    with pytest.raises(ValueError, match="offsets"):
        simulated_ring_attention(q, k, v, seqlens=seqlens, ring_size=3, softmax_scale=0.3, backend="flash_attn", window=3)


def _namespace_flash_attn() -> dict:
    """What flash-attn-4 leaves: `flash_attn` as a namespace package holding only `cute`."""
    package = types.ModuleType("flash_attn")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    return {"flash_attn": package}


WARNED = ("supports 2.6 - 2.x only", "flash-attn-4 provides only flash_attn.cute")


@pytest.mark.parametrize(
    "modules,version,capability,problem",
    [
        pytest.param(lambda: fake_flash_attn("2.8.3"), "2.8.3", (9, 0), None, id="2.8.3-hopper"),
        pytest.param(lambda: fake_flash_attn("2.6.3"), "2.6.3", (8, 0), None, id="2.6.3-ampere"),
        pytest.param(lambda: fake_flash_attn("2.8.3"), "2.8.3", (7, 5), "compute capability 8.0", id="turing"),
        pytest.param(lambda: fake_flash_attn("2.6.3"), "2.5.9", (9, 0), "supports 2.6 - 2.x only", id="2.5"),
        pytest.param(_namespace_flash_attn, None, (9, 0), "flash-attn-4 provides only flash_attn.cute", id="fa4"),
        pytest.param(dict, None, (9, 0), "flash-attn is not installed", id="absent"),
    ],
)
def test_flash_attn_gate(monkeypatch, fresh_caches, caplog, modules, version, capability, problem):
    install(monkeypatch, modules(), version, capability)
    with caplog.at_level(logging.WARNING, logger=flash_attn_varlen.__name__):
        reason = flash_attn_varlen.FlashAttnVarlenBackend.unsupported_reason(CUDA, torch.bfloat16)
        assert flash_attn_varlen.FlashAttnVarlenBackend.supports(CUDA, torch.float16) == (problem is None)
    if problem is None:
        assert reason is None
        return
    assert problem in reason
    with pytest.raises(ValueError, match="'flash_attn' does not run on device cuda"):
        get_backend("flash_attn", device=CUDA, dtype=torch.bfloat16)
    warned = [r for r in caplog.records if "other attention backends" in r.getMessage()]
    assert len(warned) == (problem in WARNED)  # once, where a flash_attn is there but unusable


def test_flash_attn_local_call_unpacks_each_release(monkeypatch, fresh_caches):
    """The forward's (out, lse) for both result layouts, compared directly with the math."""
    segments = Segments((3, 6), (3, 6), CPU)
    q, k, v = (torch.randn(9, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    want_out, want_lse = segment_attention(q, k, v, segments, True, 0.5)
    for version in SIGNATURES:
        flash_attn_varlen._flash_api.cache_clear()
        install(monkeypatch, fake_flash_attn(version), version)
        backend = flash_attn_varlen.FlashAttnVarlenBackend()
        out, lse = backend.forward(q, k, v, segments=segments, causal=True, scale=0.5)
        torch.testing.assert_close(out, want_out)
        torch.testing.assert_close(lse, want_lse)
