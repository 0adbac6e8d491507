"""The Transformer Engine backend without TE or a GPU: registry, version gate, statistics layouts, and its
calls into a stand-in `transformer_engine` whose fused_attn_fwd/bwd have the exact parameter lists of
TE 2.14 and TE 2.18 and compute attention in plain torch, with the statistics in either cuDNN layout.

The stand-in checks what this file can check without TE: keyword names per API generation, mask types,
the THD arguments, and the conversion of the softmax statistics both ways (forward and backward, alone
and inside the ring, against the float64 reference). What only a GPU can check (that real cuDNN agrees
with the stand-in) is `tests/test_attention_gpu.py`.
"""

import inspect
import logging
import sys
import types

import pytest
import torch
from attention_reference import reference_with_grads

from megatron_hdp.attention import available_backends, get_backend, simulated_ring_attention
from megatron_hdp.attention.backends import BACKENDS, PREFERENCE, Segments, _resolve, te_fused

CPU = torch.device("cpu")
TOL = dict(rtol=1e-4, atol=1e-4)

# Parameter lists of transformer_engine.pytorch.cpp_extensions.fused_attn (required, optional), from the
# v2.14 and v2.18 tags of NVIDIA/TransformerEngine.
_FWD_COMMON = (
    ["is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v"]
    + ["fake_dtype", "fused_attention_backend"]
)
_FWD_OPTIONAL_214 = (
    ["attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v"]
    + ["s_quantizer", "o_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type"]
    + ["attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal", "rng_gen", "softmax_offset"]
    + ["return_max_logit", "cuda_graph"]
)
_BWD_OPTIONAL_214 = (
    ["cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer", "dqkv_quantizer"]
    + ["attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type"]
    + ["softmax_type", "window_size", "bottom_right_diagonal", "deterministic", "cuda_graph"]
)
_BWD_REQUIRED = ["max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o"]
API = {
    "2.14": dict(
        fwd=(_FWD_COMMON, _FWD_OPTIONAL_214),
        bwd=(_BWD_REQUIRED + ["fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend"],
             _BWD_OPTIONAL_214),
    ),
    "2.18": dict(
        fwd=(_FWD_COMMON, _FWD_OPTIONAL_214 + ["o_format", "qkv_scale_inv_format"]),
        bwd=(_BWD_REQUIRED + ["fake_dtype", "aux_ctx_tensors", "fused_attention_backend"],
             _BWD_OPTIONAL_214 + ["o_format", "do_format", "dqkv_layout", "qkv_scale_inv_format",
                                  "do_scale_inv_format"]),
    ),
}


def _with_signature(impl, required, optional):
    """`impl(**kwargs)` behind TE's parameter list: unknown or missing keywords fail like TE's would."""

    def call(**kwargs):
        unknown, missing = set(kwargs) - set(required) - set(optional), set(required) - set(kwargs)
        assert not unknown and not missing, f"unknown {sorted(unknown)}, missing {sorted(missing)}"
        return impl(**kwargs)

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    call.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kind) for n in required] + [inspect.Parameter(n, kind, default=None) for n in optional]
    )
    return call


def _check_common(kw, new_api):
    assert kw["qkv_layout"] == "thd_thd_thd" and kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
    assert kw["attn_mask_type"] in ("padding", "padding_causal")  # ragged input needs a padding mask
    assert kw["fused_attention_backend"] == "F16_arbitrary_seqlen"
    assert torch.equal(kw["cu_seqlens_q_padded"], kw["cu_seqlens_q"])
    assert torch.equal(kw["cu_seqlens_kv_padded"], kw["cu_seqlens_kv"])
    assert kw.get("o_format", "sbhd" if new_api else None) == ("thd" if new_api else None)  # TE's default: sbhd


def _segments_of(kw):
    cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_kv"].tolist()
    return list(zip(cu_q, cu_q[1:], cu_k, cu_k[1:]))


def _scores(q, k, kw, q0, q1, k0, k1):
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q[q0:q1], k[k0:k1].repeat_interleave(group, 1)) * kw["attn_scale"]
    if kw["attn_mask_type"] == "padding_causal":
        assert q1 - q0 == k1 - k0
        s = s.masked_fill(torch.ones_like(s[0], dtype=torch.bool).triu(1), float("-inf"))
    return s


def fake_te(new_api: bool, ragged: bool) -> dict[str, types.ModuleType]:
    """sys.modules entries of a stand-in TE: attention in plain torch, statistics in one cuDNN layout."""

    def fwd(**kw):
        _check_common(kw, new_api)
        assert kw["is_training"]
        q, k, v = kw["q"], kw["k"], kw["v"]
        out, heads, spans = torch.empty_like(q), q.shape[1], _segments_of(kw)
        stats = torch.full((q.shape[0], heads, 1) if ragged else (len(spans), heads, kw["max_seqlen_q"], 1), torch.nan)
        for b, (q0, q1, k0, k1) in enumerate(spans):
            s = _scores(q, k, kw, q0, q1, k0, k1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[k0:k1].repeat_interleave(heads // k.shape[1], 1))
            lse = s.logsumexp(-1)  # [H, n]
            if ragged:
                stats[q0:q1, :, 0] = lse.t()
            else:
                stats[b, :, : q1 - q0, 0] = lse
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def bwd(**kw):
        _check_common(kw, new_api)
        if new_api:
            assert (kw["do_format"], kw["dqkv_layout"]) == ("thd", "thd_thd_thd")
        else:
            assert kw["dqkv_dtype"] == ("te", kw["q"].dtype)
        q, k, v, o, do = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
        stats, rng_state = kw["aux_ctx_tensors"]
        assert rng_state.shape == (2,)
        spans, heads, group = _segments_of(kw), q.shape[1], q.shape[1] // k.shape[1]
        assert stats.shape == ((q.shape[0], heads, 1) if ragged else (len(spans), heads, kw["max_seqlen_q"], 1))
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b, (q0, q1, k0, k1) in enumerate(spans):  # the flash backward from the given statistics
            lse = stats[q0:q1, :, 0].t() if ragged else stats[b, :, : q1 - q0, 0]
            p = torch.exp(_scores(q, k, kw, q0, q1, k0, k1) - lse.unsqueeze(-1))
            kk, vv = (x[k0:k1].repeat_interleave(group, 1) for x in (k, v))
            dp = torch.einsum("qhd,khd->hqk", do[q0:q1], vv)
            ds = p * (dp - (do[q0:q1] * o[q0:q1]).sum(-1).t().unsqueeze(-1)) * kw["attn_scale"]
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kk)
            dk[k0:k1] = torch.einsum("hqk,qhd->khd", ds, q[q0:q1]).unflatten(1, (-1, group)).sum(2)
            dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do[q0:q1]).unflatten(1, (-1, group)).sum(2)
        return [dq, dk, dv, None]

    api = API["2.18" if new_api else "2.14"]
    fused_attn = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    fused_attn.fused_attn_fwd = _with_signature(fwd, *api["fwd"])
    fused_attn.fused_attn_bwd = _with_signature(bwd, *api["bwd"])
    fused_attn.FusedAttnBackend = {"F16_arbitrary_seqlen": "F16_arbitrary_seqlen", "No_Backend": "none"}
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = {dtype: ("te", dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions"]
    modules = {name: types.ModuleType(name) for name in names}
    modules[fused_attn.__name__], modules[constants.__name__] = fused_attn, constants
    return modules


@pytest.fixture
def fresh_caches(monkeypatch):
    """Clear the backend choice, the TE API and version caches before and after a test."""
    monkeypatch.setattr(te_fused, "_RAGGED_STATS", {})
    caches = (_resolve, te_fused._te_api, te_fused.te_version_problem)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


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


def test_statistics_layouts_round_trip():
    segments = Segments((3, 1, 5), (2, 4, 5), CPU)
    lse = torch.randn(4, 9)
    ragged = torch.stack([lse[:, t] for t in range(9)]).unsqueeze(-1)  # [T, H, 1] by hand
    padded = torch.zeros(3, 4, 5, 1)
    for b, (start, stop) in enumerate(zip(segments.cu_q, segments.cu_q[1:])):
        for i in range(stop - start):
            padded[b, :, i, 0] = lse[:, start + i]
    torch.testing.assert_close(te_fused.lse_to_stats(lse, segments, ragged=True), ragged, rtol=0, atol=0)
    torch.testing.assert_close(te_fused.lse_to_stats(lse, segments, ragged=False), padded, rtol=0, atol=0)
    torch.testing.assert_close(te_fused.stats_to_lse(ragged, segments), lse, rtol=0, atol=0)
    padded_garbage = padded.clone()
    padded_garbage[1, :, 1:] = torch.nan  # rows past a segment's end are never read
    torch.testing.assert_close(te_fused.stats_to_lse(padded_garbage, segments), lse, rtol=0, atol=0)


@pytest.mark.parametrize("new_api", [False, True], ids=["te2.14", "te2.18"])
@pytest.mark.parametrize("ragged", [True, False], ids=["packed_stats", "padded_stats"])
def test_te_backend_calls_against_reference(monkeypatch, fresh_caches, new_api, ragged):
    for name, module in fake_te(new_api, ragged).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(te_fused.TeFusedBackend, "supports", classmethod(lambda cls, device, dtype: True))
    seqlens = [1, 5, 12, 23]
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(sum(seqlens), h, 8, generator=gen) for h in (4, 2, 2, 4))
    for causal in (True, False):
        want = reference_with_grads(q, k, v, dout, seqlens, causal=causal, scale=0.3)
        for ring_size in (1, 3):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = simulated_ring_attention(
                *leaves, seqlens=seqlens, ring_size=ring_size, causal=causal, softmax_scale=0.3, backend="te_fused"
            )
            got = [out, *torch.autograd.grad(out, leaves, dout)]
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                torch.testing.assert_close(
                    g.double(), w, **TOL, msg=lambda m: f"causal={causal} ring={ring_size} {name}: {m}"
                )
    assert te_fused._RAGGED_STATS == {"cpu": ragged}
