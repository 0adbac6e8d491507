"""The Transformer Engine backend without TE or a GPU: registry, version gate, statistics layouts, and its
calls into a stand-in `transformer_engine` whose fused_attn_fwd/bwd have the exact parameter lists of
TE 2.14 and TE 2.18 and compute attention in plain torch, with the statistics in either cuDNN layout.

The stand-in checks what this file can check without TE: keyword names per API generation, mask types,
the THD arguments, and the conversion of the softmax statistics both ways (forward and backward, alone
and inside the ring, against the float64 reference). What only a GPU can check (that real cuDNN agrees
with the stand-in) is `tests/attention/test_attention_gpu.py`.
"""

import collections
import contextlib
import logging
import sys
import types

import pytest
import torch
from attention_reference import reference_with_grads
from kernel_stand_ins import check_backend_in_ring, cleared_caches, positional, with_signature

from megatron_hdp.attention import available_backends, get_backend, local_varlen_attention
from megatron_hdp.attention.backends import BACKENDS, PREFERENCE, KernelShape, Segments, te_fused

CPU = torch.device("cpu")
TOL = dict(rtol=1e-4, atol=1e-4)

# Parameter lists of transformer_engine.pytorch.cpp_extensions.fused_attn (required, optional), read from
# the v2.0, v2.10, v2.14 and v2.18 tags of NVIDIA/TransformerEngine.
_FWD_COMMON = (
    ["is_training", "max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v"]
    + ["fake_dtype", "fused_attention_backend"]
)
_FWD_OPTIONAL_20 = (
    ["attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "o_quantizer", "attn_scale"]
    + ["dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type", "window_size", "rng_gen"]
)
_FWD_OPTIONAL_210 = (
    ["attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v"]
    + ["s_quantizer", "o_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type"]
    + ["attn_mask_type", "softmax_type", "window_size", "rng_gen", "softmax_offset", "return_max_logit"]
    + ["cuda_graph"]
)
_FWD_OPTIONAL_214 = (
    ["attn_bias", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "page_table_k", "page_table_v"]
    + ["s_quantizer", "o_quantizer", "attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type"]
    + ["attn_mask_type", "softmax_type", "window_size", "bottom_right_diagonal", "rng_gen", "softmax_offset"]
    + ["return_max_logit", "cuda_graph"]
)
_BWD_OPTIONAL_20 = (
    ["cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer", "dqkv_quantizer"]
    + ["attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type"]
    + ["window_size", "deterministic"]
)
_BWD_OPTIONAL_210 = (
    ["cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer", "dqkv_quantizer"]
    + ["attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type"]
    + ["softmax_type", "window_size", "deterministic", "cuda_graph"]
)
_BWD_OPTIONAL_214 = (
    ["cu_seqlens_q_padded", "cu_seqlens_kv_padded", "s_quantizer", "dp_quantizer", "dqkv_quantizer"]
    + ["attn_scale", "dropout", "fast_zero_fill", "qkv_layout", "attn_bias_type", "attn_mask_type"]
    + ["softmax_type", "window_size", "bottom_right_diagonal", "deterministic", "cuda_graph"]
)
_BWD_REQUIRED = ["max_seqlen_q", "max_seqlen_kv", "cu_seqlens_q", "cu_seqlens_kv", "q", "k", "v", "o", "d_o"]
_BWD_REQUIRED_OLD = _BWD_REQUIRED + ["fake_dtype", "dqkv_dtype", "aux_ctx_tensors", "fused_attention_backend"]
API = {
    "2.0": dict(fwd=(_FWD_COMMON, _FWD_OPTIONAL_20), bwd=(_BWD_REQUIRED_OLD, _BWD_OPTIONAL_20)),
    "2.10": dict(fwd=(_FWD_COMMON, _FWD_OPTIONAL_210), bwd=(_BWD_REQUIRED_OLD, _BWD_OPTIONAL_210)),
    "2.14": dict(fwd=(_FWD_COMMON, _FWD_OPTIONAL_214), bwd=(_BWD_REQUIRED_OLD, _BWD_OPTIONAL_214)),
    "2.18": dict(
        fwd=(_FWD_COMMON, _FWD_OPTIONAL_214 + ["o_format", "qkv_scale_inv_format"]),
        bwd=(_BWD_REQUIRED + ["fake_dtype", "aux_ctx_tensors", "fused_attention_backend"],
             _BWD_OPTIONAL_214 + ["o_format", "do_format", "dqkv_layout", "qkv_scale_inv_format",
                                  "do_scale_inv_format"]),
    ),
}

# Positional parameters of transformer_engine_torch.get_fused_attn_backend (pytorch/csrc/extensions.h).
_SELECTOR_20 = (
    ["q_dtype", "kv_dtype", "qkv_layout", "bias_type", "attn_mask_type", "p_dropout", "num_attn_heads"]
    + ["num_gqa_groups", "max_seqlen_q", "max_seqlen_kv", "head_dim_qk", "head_dim_v", "window_size_left"]
    + ["window_size_right"]
)


def selector_parameters(minor: int) -> list[str]:
    """The selector's parameter list in TE 2.`minor`: 2.5 adds is_training, 2.8 softmax_type, 2.9
    return_max_logit, 2.10 cuda_graph, 2.12 deterministic."""
    names = (["is_training"] if minor >= 5 else []) + _SELECTOR_20
    if minor >= 8:
        names.insert(names.index("p_dropout"), "softmax_type")
    return names + ["return_max_logit", "cuda_graph", "deterministic"][: (minor >= 9) + (minor >= 10) + (minor >= 12)]


def cudnn_has_kernel(gpu: dict, a: dict) -> bool:
    """The THD, fp16/bf16, no-bias, no-dropout part of `nvte_get_fused_attn_backend` (common/fused_attn/
    fused_attn.cpp, v2.18): the conditions a packed-document call can miss."""
    sm, cudnn, training = gpu["sm"], gpu["cudnn"], a.get("is_training", True)
    thd = sm >= 90 and ((cudnn >= 90100 and a["num_attn_heads"] == a["num_gqa_groups"]) or cudnn >= 90600)
    d = max(a["head_dim_qk"], a["head_dim_v"])
    head_dim = d % 8 == 0 and (d <= 128 or (d <= 256 and sm == 90 and cudnn >= (90500 if training else 90100)))
    offset = max(a["num_attn_heads"], a["num_gqa_groups"]) * d * max(a["max_seqlen_q"], a["max_seqlen_kv"])
    return thd and head_dim and (offset <= 2**31 - 1 or cudnn >= 90500)


def _window(mask: str) -> tuple[int, int]:
    return (-1, 0) if "causal" in mask else (-1, -1)  # what TE's DotProductAttention passes for the mask


def _check_common(kw, new_api):
    assert kw["qkv_layout"] == "thd_thd_thd" and kw["attn_bias_type"] == "no_bias" and kw["dropout"] == 0.0
    assert kw["attn_mask_type"] in ("padding", "padding_causal")  # ragged input needs a padding mask
    assert tuple(kw["window_size"]) == _window(kw["attn_mask_type"])
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


def _stats_shape(layout, kw, num_tokens, heads):
    if layout == "segments":
        return (len(_segments_of(kw)), heads, kw["max_seqlen_q"], 1)
    return (te_fused.get_max_tokens(num_tokens) if layout == "max_tokens" else num_tokens, heads, 1)


def fake_te(version: str, layout: str, gpu: dict, calls: collections.Counter) -> dict[str, types.ModuleType]:
    """sys.modules entries of a stand-in TE `version`: attention in plain torch, statistics in `layout`
    ("tokens", "max_tokens" or "segments"), and TE's backend selector for the GPU `gpu` (sm, cudnn),
    which the fused calls consult too and fail on like TE's NVTE_ERROR."""
    new_api, minor = version == "2.18", int(version.split(".")[1])

    def nvte_check(kw, training):
        shape = dict(num_attn_heads=kw["q"].shape[1], num_gqa_groups=kw["k"].shape[1], head_dim_qk=kw["q"].shape[2])
        shape.update(head_dim_v=kw["v"].shape[2], max_seqlen_q=kw["max_seqlen_q"], max_seqlen_kv=kw["max_seqlen_kv"])
        if not cudnn_has_kernel(gpu, dict(shape, is_training=training)):
            raise RuntimeError("NVTE_ERROR: Invalid combination of data type and sequence length for fused attention.")

    def select(**a):
        calls["select"] += 1
        assert (a["qkv_layout"], a["bias_type"], a["p_dropout"]) == ("thd_thd_thd", "no_bias", 0.0)
        assert (a["window_size_left"], a["window_size_right"]) == _window(a["attn_mask_type"])
        assert a.get("softmax_type", "vanilla") == "vanilla"
        calls["select deterministic"] += bool(a.get("deterministic", False))
        return "F16_arbitrary_seqlen" if cudnn_has_kernel(gpu, a) else "No_Backend"

    def fwd(**kw):
        calls["fwd"] += 1
        _check_common(kw, new_api)
        assert kw["is_training"]
        nvte_check(kw, True)
        q, k, v = kw["q"], kw["k"], kw["v"]
        out, heads, spans = q.new_empty(*q.shape[:2], v.shape[2]), q.shape[1], _segments_of(kw)
        stats = torch.full(_stats_shape(layout, kw, q.shape[0], heads), torch.nan)
        for b, (q0, q1, k0, k1) in enumerate(spans):
            s = _scores(q, k, kw, q0, q1, k0, k1)
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v[k0:k1].repeat_interleave(heads // k.shape[1], 1))
            lse = s.logsumexp(-1)  # [H, n]
            if layout == "segments":
                stats[b, :, : q1 - q0, 0] = lse
            else:
                stats[q0:q1, :, 0] = lse.t()
        return out, [stats, torch.zeros(2, dtype=torch.int64)]

    def bwd(**kw):
        _check_common(kw, new_api)
        nvte_check(kw, True)
        if new_api:
            assert (kw["do_format"], kw["dqkv_layout"]) == ("thd", "thd_thd_thd")
        else:
            assert kw["dqkv_dtype"] == ("te", kw["q"].dtype)
        q, k, v, o, do = kw["q"], kw["k"], kw["v"], kw["o"], kw["d_o"]
        stats, rng_state = kw["aux_ctx_tensors"]
        assert rng_state.shape == (2,)
        spans, heads, group = _segments_of(kw), q.shape[1], q.shape[1] // k.shape[1]
        assert stats.shape == _stats_shape(layout, kw, q.shape[0], heads)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b, (q0, q1, k0, k1) in enumerate(spans):  # the flash backward from the given statistics
            lse = stats[b, :, : q1 - q0, 0] if layout == "segments" else stats[q0:q1, :, 0].t()
            p = torch.exp(_scores(q, k, kw, q0, q1, k0, k1) - lse.unsqueeze(-1))
            kk, vv = (x[k0:k1].repeat_interleave(group, 1) for x in (k, v))
            dp = torch.einsum("qhd,khd->hqk", do[q0:q1], vv)
            ds = p * (dp - (do[q0:q1] * o[q0:q1]).sum(-1).t().unsqueeze(-1)) * kw["attn_scale"]
            dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, kk)
            dk[k0:k1] = torch.einsum("hqk,qhd->khd", ds, q[q0:q1]).unflatten(1, (-1, group)).sum(2)
            dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, do[q0:q1]).unflatten(1, (-1, group)).sum(2)
        return [dq, dk, dv, None]

    api = API[version]
    fused_attn = types.ModuleType("transformer_engine.pytorch.cpp_extensions.fused_attn")
    fused_attn.fused_attn_fwd = with_signature(fwd, *api["fwd"])
    fused_attn.fused_attn_bwd = with_signature(bwd, *api["bwd"])
    fused_attn.FusedAttnBackend = {"F16_arbitrary_seqlen": "F16_arbitrary_seqlen", "No_Backend": "No_Backend"}
    fused_attn.QKVLayout = {"thd_thd_thd": "thd_thd_thd"}
    fused_attn.AttnBiasType = {"no_bias": "no_bias"}
    fused_attn.AttnMaskType = {"padding": "padding", "padding_causal": "padding_causal"}
    if minor >= 8:
        fused_attn.SoftmaxType = {"vanilla": "vanilla"}
    constants = types.ModuleType("transformer_engine.pytorch.constants")
    constants.TE_DType = {dtype: ("te", dtype) for dtype in (torch.float16, torch.bfloat16, torch.float32)}
    tex = types.ModuleType("transformer_engine_torch")
    tex.get_fused_attn_backend = positional(select, selector_parameters(minor))
    tex.get_cudnn_version = lambda: gpu["cudnn"]
    names = ["transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.cpp_extensions"]
    modules = {name: types.ModuleType(name) for name in names}
    modules[fused_attn.__name__], modules[constants.__name__], modules[tex.__name__] = fused_attn, constants, tex
    return modules


@pytest.fixture
def fresh_caches(monkeypatch):
    """Clear the backend choice, the TE API and version caches before and after a test."""
    monkeypatch.setattr(te_fused, "_STATS_LAYOUT", {})
    with cleared_caches(te_fused._te_api, te_fused.te_version_problem):
        yield


def install_fake_te(monkeypatch, version, layout="tokens", sm=90, cudnn=90800):
    """Put a stand-in TE `version` in place, on a stand-in GPU (sm, cudnn), with te_fused allowed on CPU
    tensors (the selector runs under torch.cuda.device, which a CPU build cannot enter)."""
    gpu, calls = dict(sm=sm, cudnn=cudnn), collections.Counter()
    for name, module in fake_te(version, layout, gpu, calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(te_fused, "installed_te_version", lambda: f"{version}.0")
    monkeypatch.setattr(te_fused.TeFusedBackend, "supports", classmethod(lambda cls, device, dtype: True))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: divmod(sm, 10))
    return calls


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
