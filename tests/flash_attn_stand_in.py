"""A stand-in flash-attn of a given release, for CPU tests: `sys.modules` entries whose varlen functions have
that release's exact parameter lists (`SIGNATURES`) and compute with plain torch, and `install`, which puts
them in place on a stand-in GPU. Shared by the backend's own tests and the core attention's option tests."""

import importlib.machinery
import sys
import types

import torch
from kernel_stand_ins import segment_attention, with_signature

from megatron_hdp.attention.backends import Segments, flash_attn_varlen, grads_by_recompute

CPU = torch.device("cpu")

_FWD_REQUIRED = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p"]
_FWD_REQUIRED += ["softmax_scale", "causal"]
_BWD_REQUIRED = ["dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k"]
_BWD_REQUIRED += ["max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal"]
SIGNATURES = {  # (forward required, optional), (backward required, optional), forward result count
    "2.6.3": (
        (_FWD_REQUIRED, ["window_size", "softcap", "alibi_slopes", "return_softmax", "block_table", "leftpad_k"]
         + ["seqused_k"]),
        (_BWD_REQUIRED + ["window_size", "softcap", "alibi_slopes", "deterministic"], ["rng_state"]),
        8,
    ),
    "2.7.4": (
        (_FWD_REQUIRED, ["window_size_left", "window_size_right", "softcap", "alibi_slopes", "return_softmax"]
         + ["block_table", "leftpad_k", "seqused_k", "zero_tensors"]),
        (_BWD_REQUIRED + ["window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic"],
         ["rng_state", "zero_tensors"]),
        4,
    ),
}
SIGNATURES["2.8.3"] = SIGNATURES["2.7.4"]  # unchanged between these tags


def fake_flash_attn(version: str) -> dict[str, types.ModuleType]:
    """sys.modules entries of a stand-in flash-attn `version`."""
    (fwd_sig, bwd_sig, num_results) = SIGNATURES[version]

    def segments_of(kw):
        cu_q, cu_k = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
        lengths_q, lengths_k = (tuple(b - a for a, b in zip(cu, cu[1:])) for cu in (cu_q, cu_k))
        segments = Segments(lengths_q, lengths_k, CPU)
        assert (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (segments.max_q, segments.max_k)
        window = kw.get("window_size", (-1, -1)) if num_results == 8 else (
            kw.get("window_size_left", -1), kw.get("window_size_right", -1))  # the defaults, where there are
        assert kw["dropout_p"] == 0.0 and kw.get("softcap", 0.0) == 0.0
        # flash-attn 2.x's mha_varlen_fwd / _bwd: CHECK_SHAPE(v, total_k, num_heads_k, head_size)
        assert kw["v"].shape[-1] == kw["q"].shape[-1], "v must have q's head size in FlashAttention-2"
        return segments, tuple(window)

    def fwd(**kw):
        segments, window = segments_of(kw)
        out, lse = segment_attention(kw["q"], kw["k"], kw["v"], segments, kw["causal"], kw["softmax_scale"], window)
        rng_state = torch.zeros(2, dtype=torch.int64)
        if num_results == 8:  # out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state
            return out, kw["q"], kw["k"], kw["v"], out, lse, None, rng_state
        return out, lse, None, rng_state

    def bwd(**kw):
        segments, window = segments_of(kw)
        grads = grads_by_recompute(
            lambda q, k, v: segment_attention(q, k, v, segments, kw["causal"], kw["softmax_scale"], window),
            kw["dout"], kw["q"], kw["k"], kw["v"], kw["out"], kw["softmax_lse"],
        )
        for target, grad in zip((kw["dq"], kw["dk"], kw["dv"]), grads):
            target.copy_(grad)
        softmax_d = (kw["dout"] * kw["out"]).sum(-1).t()
        return (kw["dq"], kw["dk"], kw["dv"], softmax_d) if num_results == 8 else softmax_d

    package = types.ModuleType("flash_attn")
    package.__version__ = version
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, origin="flash_attn/__init__.py")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_varlen_forward = with_signature(fwd, *fwd_sig)
    interface._flash_attn_varlen_backward = with_signature(bwd, *bwd_sig)
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def install(monkeypatch, modules: dict, version: str | None, capability=(9, 0)):
    for name in ("flash_attn", "flash_attn.flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(flash_attn_varlen, "installed_flash_attn_version", lambda: version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
