"""A stand-in Transformer Engine of a given release, for CPU tests: `fake_te` builds `sys.modules` entries
whose fused-attention functions have that release's exact parameter lists (`API`) and compute with plain
torch, checking the arguments as cuDNN's kernel selection would; `install_fake_te` puts them in place on a
stand-in GPU. Shared by the backend's own tests and the core attention's option tests."""

import collections
import contextlib
import sys
import types

import torch
from kernel_stand_ins import positional, with_signature

from megatron_hdp.attention.backends import te_fused

CPU = torch.device("cpu")

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
