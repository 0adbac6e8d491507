"""The Transformer Engine backend without TE or a GPU: registry, version gate, statistics layouts, and its
calls into a stand-in `transformer_engine` whose fused_attn_fwd/bwd have the exact parameter lists of
TE 2.14 and TE 2.18 and compute attention in plain torch, with the statistics in either cuDNN layout.

The stand-in checks what this file can check without TE: keyword names per API generation, mask types,
the THD arguments, and the conversion of the softmax statistics both ways (forward and backward, alone
and inside the ring, against the float64 reference). What only a GPU can check (that real cuDNN agrees
with the stand-in) is `tests/attention/test_attention_gpu.py`.
"""

import logging

import pytest
import torch
from attention_reference import reference_with_grads
from kernel_stand_ins import check_backend_in_ring, cleared_caches
from te_stand_in import install_fake_te, selector_parameters

from megatron_hdp.attention import available_backends, get_backend, local_varlen_attention
from megatron_hdp.attention.backends import BACKENDS, PREFERENCE, KernelShape, Segments, te_fused

CPU = torch.device("cpu")
TOL = dict(rtol=1e-4, atol=1e-4)

# Parameter lists of transformer_engine.pytorch.cpp_extensions.fused_attn (required, optional), read from
# the v2.0, v2.10, v2.14 and v2.18 tags of NVIDIA/TransformerEngine.
@pytest.fixture
def fresh_caches(monkeypatch):
    """Clear the backend choice, the TE API and version caches before and after a test."""
    monkeypatch.setattr(te_fused, "_STATS_LAYOUT", {})
    with cleared_caches(te_fused._te_api, te_fused.te_version_problem):
        yield


def test_registry_lists_te_first_and_only_where_it_runs():
    assert BACKENDS["te_fused"] is PREFERENCE[0] is te_fused.TeFusedBackend
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert "te_fused" not in available_backends("cpu", dtype)
    with pytest.raises(ValueError, match=r"'te_fused' does not run on device cpu with dtype torch.bfloat16: .*CUDA"):
        get_backend("te_fused", device=CPU, dtype=torch.bfloat16)


def test_te_version_gate(monkeypatch, fresh_caches, caplog):
    cuda = torch.device("cuda")  # the version is checked before the device is touched
    monkeypatch.setattr(te_fused, "installed_te_version", lambda: None)
    assert "not installed" in te_fused.TeFusedBackend.unsupported_reason(cuda, torch.bfloat16)
    assert "float16 or bfloat16" in te_fused.TeFusedBackend.unsupported_reason(cuda, torch.float32)
    te_fused.te_version_problem.cache_clear()
    monkeypatch.setattr(te_fused, "installed_te_version", lambda: "1.13.0")
    with caplog.at_level(logging.WARNING, logger=te_fused.__name__):
        with pytest.raises(ValueError, match=r"'te_fused' does not run .*transformer_engine 1\.13\.0 is installed"):
            get_backend("te_fused", device=cuda, dtype=torch.bfloat16)
        assert not te_fused.TeFusedBackend.supports(cuda, torch.float16)
    assert sum("1.13.0" in r.getMessage() for r in caplog.records) == 1  # warned once
    for version in ("2.0.0", "2.14.1", "2.18.0+cu12", "2.20.0.dev0"):
        te_fused.te_version_problem.cache_clear()
        monkeypatch.setattr(te_fused, "installed_te_version", lambda: version)
        assert te_fused.te_version_problem() is None, version
    te_fused.te_version_problem.cache_clear()
    monkeypatch.setattr(te_fused, "installed_te_version", lambda: "3.0.0")
    assert "3.0.0" in te_fused.te_version_problem()


def test_get_max_tokens_matches_te():
    """TE's get_max_tokens (common/fused_attn/utils.cu), by its comment's table."""
    for tokens, rows in ((1, 1024), (1024, 1024), (1025, 2048), (5000, 8192), (32768, 32768), (32769, 65536)):
        assert te_fused.get_max_tokens(tokens) == rows, tokens
    assert te_fused.get_max_tokens(100_000) == 4 * 32768


def test_statistics_layouts_round_trip():
    segments = Segments((3, 1, 5), (2, 4, 5), CPU)
    lse = torch.randn(4, 9)
    tokens = torch.stack([lse[:, t] for t in range(9)]).unsqueeze(-1)  # [T, H, 1] by hand
    max_tokens = torch.cat([tokens, torch.zeros(1024 - 9, 4, 1)])
    padded = torch.zeros(3, 4, 5, 1)
    for b, (start, stop) in enumerate(zip(segments.cu_q, segments.cu_q[1:])):
        for i in range(stop - start):
            padded[b, :, i, 0] = lse[:, start + i]
    for layout, stats in (("tokens", tokens), ("max_tokens", max_tokens), ("segments", padded)):
        torch.testing.assert_close(te_fused.lse_to_stats(lse, segments, layout=layout), stats, rtol=0, atol=0)
        garbage = stats.clone()  # rows past T (packed) or past a segment's end (per segment) are never read
        if layout == "max_tokens":
            garbage[9:] = torch.nan
        if layout == "segments":
            garbage[1, :, 1:] = torch.nan
        assert te_fused.stats_layout(garbage, segments) == layout
        torch.testing.assert_close(te_fused.stats_to_lse(garbage, segments), lse, rtol=0, atol=0)


def _stats_layouts():
    """(version, layout) pairs TE produces: packed with max_tokens rows up to 2.10, T rows from 2.11."""
    for version in ("2.0", "2.10", "2.14", "2.18"):
        yield version, "max_tokens" if int(version.split(".")[1]) <= 10 else "tokens"
        yield version, "segments"


@pytest.mark.parametrize("version,layout", list(_stats_layouts()))
def test_te_backend_calls_against_reference(monkeypatch, fresh_caches, version, layout):
    calls = install_fake_te(monkeypatch, version, layout)
    check_backend_in_ring("te_fused", f"TE {version}")
    assert te_fused._STATS_LAYOUT == {"cpu": layout} and calls["fwd"] > 0


def test_selector_arguments_match_each_te_release(monkeypatch):
    """Our positional call of get_fused_attn_backend has the parameter count of every TE 2.x release."""
    install_fake_te(monkeypatch, "2.18")
    shape = KernelShape(CPU, torch.bfloat16, 8, 2, 128, 4096)
    for minor in range(19):
        names = selector_parameters(minor)
        args = te_fused._selector_args(shape, "padding_causal", minor)
        assert len(args) == len(names), minor
        named = dict(zip(names, args))
        assert (named["num_attn_heads"], named["num_gqa_groups"], named["head_dim_qk"]) == (8, 2, 128)
        assert (named["max_seqlen_q"], named["window_size_left"], named["window_size_right"]) == (4096, -1, 0)
        assert named["head_dim_v"] == 128
    mla = KernelShape(CPU, torch.bfloat16, 8, 2, 192, 4096, head_dim_v=128)  # multi-latent attention's dims
    named = dict(zip(selector_parameters(18), te_fused._selector_args(mla, "padding_causal", 18)))
    assert (named["head_dim_qk"], named["head_dim_v"]) == (192, 128)


# (sm, cuDNN, q heads, kv heads, head dim, whether TE has a kernel), by fused_attn.cpp's THD rules.
SHAPES = [
    pytest.param(80, 90800, 4, 4, 64, False, id="ampere-thd-needs-sm90"),
    pytest.param(90, 90800, 4, 4, 64, True, id="hopper"),
    pytest.param(90, 90500, 4, 2, 64, False, id="gqa-before-cudnn9.6"),
    pytest.param(90, 90600, 4, 2, 64, True, id="gqa-cudnn9.6"),
    pytest.param(90, 90400, 4, 4, 192, False, id="dim192-before-cudnn9.5"),
    pytest.param(90, 90500, 4, 4, 192, True, id="dim192-hopper-cudnn9.5"),
    pytest.param(100, 90800, 4, 4, 192, False, id="dim192-blackwell"),
]


@pytest.mark.parametrize("version", ["2.0", "2.10", "2.18"])
@pytest.mark.parametrize("sm,cudnn,hq,hkv,dim,has_kernel", SHAPES)
def test_auto_asks_te_and_falls_through(monkeypatch, fresh_caches, version, sm, cudnn, hq, hkv, dim, has_kernel):
    """"auto" uses te_fused only where TE's selector has a kernel, else the next backend (here cpu_flash);
    a named te_fused says why it cannot run instead of failing inside TE."""
    calls = install_fake_te(monkeypatch, version, sm=sm, cudnn=cudnn)
    seqlens = [3, 9]
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(sum(seqlens), h, dim, generator=gen) for h in (hq, hkv, hkv, hq))
    want = reference_with_grads(q, k, v, dout, seqlens, causal=True, scale=0.2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_varlen_attention(*leaves, seqlens=seqlens, softmax_scale=0.2, backend="auto")
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, **TOL)
    assert (calls["fwd"] > 0) == has_kernel
    if not has_kernel:
        with pytest.raises(ValueError, match=r"'te_fused' has no kernel for .*selector finds no fused kernel"):
            local_varlen_attention(q, k, v, seqlens=seqlens, backend="te_fused")


def test_choice_is_made_once_per_shape_signature(monkeypatch, fresh_caches):
    """Varying document lengths within one length bucket ask TE's selector once (both masks), not per call."""
    calls = install_fake_te(monkeypatch, "2.18")
    for seqlens in ([3, 9], [16, 1], [5, 5, 10], [2, 14], [11]):  # longest segment in (8, 16]
        q, k, v = (torch.randn(sum(seqlens), h, 8) for h in (4, 2, 2))
        local_varlen_attention(q, k, v, seqlens=seqlens, backend="auto")
    assert (calls["select"], calls["fwd"]) == (2, 5)
    q = torch.randn(40, 4, 8)
    local_varlen_attention(q, q[:, :2], q[:, :2], seqlens=[40], backend="auto")  # a new bucket: asked again
    assert calls["select"] == 4
