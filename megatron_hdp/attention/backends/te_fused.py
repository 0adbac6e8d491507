"""Transformer Engine's cuDNN fused attention (`pip install transformer-engine[pytorch]`), when installed.

TE's public `DotProductAttention` returns no log-sum-exp and its backward takes no external out/lse, so,
like TE's own ring attention (`AttnFuncWithCPAndKVP2P` in
`transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py`), this backend calls
the low-level `fused_attn_fwd` / `fused_attn_bwd` of `transformer_engine.pytorch.cpp_extensions.fused_attn`
with the cuDNN sub-backend "F16_arbitrary_seqlen": layout "thd_thd_thd" (separate packed q, k, v),
cu_seqlens without padding (the padded offsets are the cu_seqlens themselves, as TE's
DotProductAttention passes for THD), GQA by head counts, no dropout, no bias. V may have another head
dim than Q and K (multi-latent attention, 192 / 128): cuDNN takes it natively with separate q, k, v
layouts (TE's own selector disables fused attention for unequal head dims only in packed layouts,
`get_attention_backend`), and the selector below is asked with both head dims.

Masks. Ragged (THD) input needs a padding mask type in cuDNN, so a causal block is "padding_causal"
and a full block (the off-diagonal ring steps, q and kv lengths differ) is "padding". The ring asks
for causal only on blocks with as many q as kv rows, where the top-left diagonal is the plain one.

Which shapes have a kernel. TE's C++ fails with NVTE_ERROR when `nvte_get_fused_attn_backend`
(`common/fused_attn/fused_attn.cpp`) finds no cuDNN kernel: THD needs sm >= 90, equal q/kv head counts
before cuDNN 9.6, head dim > 128 only on sm90 with cuDNN >= 9.5 (training), 64-bit ragged offsets
(heads * head_dim * max_seqlen > 2^31 - 1) cuDNN >= 9.5, and more by version. `shape_problem` asks that
same selector (`transformer_engine_torch.get_fused_attn_backend`, positional; its parameter list grew:
TE 2.5 `is_training` first, 2.8 `softmax_type`, 2.9 `return_max_logit`, 2.10 `cuda_graph`,
2.12 `deterministic`; read from `pytorch/csrc/extensions.h` at v2.0..v2.18 and main) with the real
dtype, head counts, head dim, both masks (a causal ring uses "padding_causal" on its diagonal and
"padding" elsewhere), the window the calls pass, and the length bucket, so the dispatcher falls through
to the next backend where TE has no kernel. Asked once per shape signature (the dispatcher caches).

Softmax statistics. The first aux tensor is the natural-log log-sum-exp of the scaled scores in one
of three layouts, chosen inside TE's C++ (`fused_attn_f16_arbitrary_seqlen.cu`: ragged stats when the
cuDNN runtime is >= 9.6 and, from TE 2.14, the GPU is not sm120): packed [T, H, 1] (TE >= 2.11),
packed with the rows padded to `get_max_tokens(T)` (TE 2.0 - 2.10: 1024, the next power of two up to
32768, then multiples of 32768; `common/fused_attn/utils.cu`; rows past T are never written), or
per segment [B, H, max_seqlen_q, 1]. TE's ring predicts it from the cuDNN version; this backend reads
it from the shape the forward returns, which cannot disagree with the kernel, and remembers it per
device for the backward, which must get the statistics back in the same layout. Our layout is
[H, T] float32: packed is one transpose, per segment is a gather (scatter back) of each segment's rows.

API versions. TE 2.x only (the releases Megatron-Core 0.19 is written against; 1.x had another
signature): all arguments go by keyword, and the two call shapes of 2.x are told apart by the
parameters `fused_attn_bwd` has: up to 2.14 it takes a `dqkv_dtype`; from 2.15 it takes
`o_format` / `do_format` / `dqkv_layout` instead (which default to "sbhd", so "thd" must be passed).
Another major version is refused, with the installed version in the message. Not run in this
repository's CI (no GPU there): `tests/attention/test_attention_gpu.py` checks it against the float64
reference wherever TE and a GPU are present.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import re
from typing import Callable

import torch

from megatron_hdp.attention.backends.base import (
    AttentionBackend,
    BlockWindow,
    KernelShape,
    Segments,
    half_precision_cuda_problem,
    offset_window_problem,
    segment_rows,
    window_pair,
)

logger = logging.getLogger(__name__)

SUPPORTED_MAJOR = 2
"""The TE major version whose `fused_attn_fwd` / `fused_attn_bwd` signatures this file is written for."""
_STATS_LAYOUT: dict[str, str] = {}
"""Per device, the statistics layout the forward returned (the backward needs the same): "tokens"
[T, H, 1], "max_tokens" [get_max_tokens(T), H, 1] or "segments" [B, H, max_seqlen_q, 1]."""
_MASKS = ("padding", "padding_causal")
"""Masks a THD call uses: a full block needs a padding mask in cuDNN, a causal one padding_causal."""


def installed_te_version() -> str | None:
    """The installed transformer_engine version string, without importing it; None when absent."""
    try:
        return importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def te_version_problem() -> str | None:
    """Why the installed TE cannot be used by this backend (None: it can). Warns once when installed."""
    version = installed_te_version()
    if version is None:
        return "transformer_engine is not installed (pip install transformer-engine[pytorch])"
    match = re.match(r"(\d+)\.", version)
    if match is None or int(match.group(1)) != SUPPORTED_MAJOR:
        problem = (
            f"transformer_engine {version} is installed, but the te_fused backend supports TE "
            f"{SUPPORTED_MAJOR}.x only (its fused_attn_fwd/fused_attn_bwd signatures)"
        )
        logger.warning("%s; other attention backends will be used", problem)
        return problem
    return None


def te_minor_version() -> int:
    """The minor version of the installed TE 2.x (call only when `te_version_problem()` is None)."""
    return int(re.match(r"\d+\.(\d+)", installed_te_version()).group(1))


def get_max_tokens(num_tokens: int) -> int:
    """TE's `get_max_tokens` (`common/fused_attn/utils.cu`): the row count of packed statistics in
    TE 2.0 - 2.10. 1024 up to 1024 tokens, then the next power of two up to 32768, then multiples of 32768."""
    log2 = max(num_tokens - 1, 0).bit_length()
    if log2 <= 10:
        return 1024
    if log2 <= 15:
        return 1 << log2
    return -(-num_tokens // 32768) * 32768


def _selector_args(shape: KernelShape, mask: str, minor: int) -> list:
    """The positional arguments of `get_fused_attn_backend` of TE 2.`minor` for one THD call shape."""
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.cpp_extensions import fused_attn

    te_dtype = TE_DType[shape.dtype]
    args = [True] if minor >= 5 else []  # is_training
    args += [te_dtype, te_dtype, fused_attn.QKVLayout["thd_thd_thd"], fused_attn.AttnBiasType["no_bias"]]
    args.append(fused_attn.AttnMaskType[mask])
    if minor >= 8:
        args.append(fused_attn.SoftmaxType["vanilla"])
    args += [0.0, shape.heads_q, shape.heads_kv, shape.max_seqlen, shape.max_seqlen, shape.head_dim, shape.value_dim]
    causal = mask == "padding_causal"
    args += (shape.window_left, 0) if causal and shape.window else window_pair(causal, None)
    args += [False] * ((minor >= 9) + (minor >= 10))  # return_max_logit, cuda_graph
    args += [shape.deterministic] * (minor >= 12)  # TE >= 2.12 selects kernels by determinism too
    return args


def te_shape_problem(shape: KernelShape) -> str | None:
    """Why TE's own selector finds no fused kernel for THD calls of `shape` (None: it finds one)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend

    problem = offset_window_problem(shape)
    if problem is not None:
        return problem
    minor = te_minor_version()
    with torch.cuda.device(shape.device):
        for mask in _MASKS:
            backend = tex.get_fused_attn_backend(*_selector_args(shape, mask, minor))
            if backend != FusedAttnBackend["F16_arbitrary_seqlen"]:
                capability = ".".join(map(str, torch.cuda.get_device_capability(shape.device)))
                dims = f"{shape.head_dim}" + (f" (v {shape.value_dim})" if shape.head_dim_v is not None else "")
                return (
                    f"TE 2.{minor}'s selector finds no fused kernel for THD, mask {mask}, {shape.heads_q} q / "
                    f"{shape.heads_kv} kv heads, head dim {dims}, segments up to {shape.max_seqlen} "
                    f"on compute capability {capability} with cuDNN {tex.get_cudnn_version()}"
                )
    return None


@dataclasses.dataclass(frozen=True)
class _TeApi:
    """TE's two fused-attention entry points and what differs between the 2.x call shapes."""

    fwd: Callable
    bwd: Callable
    sub_backend: object
    """FusedAttnBackend["F16_arbitrary_seqlen"]: cuDNN's fp16/bf16 kernels for any sequence length."""
    te_dtypes: dict | None
    """TE 2.0 - 2.14: torch dtype -> TE dtype for the bwd's `dqkv_dtype`; None from 2.15."""

    def fwd_kwargs(self) -> dict:
        return {} if self.te_dtypes is not None else {"o_format": "thd"}

    def bwd_kwargs(self, dtype: torch.dtype) -> dict:
        if self.te_dtypes is not None:
            return {"dqkv_dtype": self.te_dtypes[dtype]}
        return {"o_format": "thd", "do_format": "thd", "dqkv_layout": "thd_thd_thd"}


@functools.cache
def _te_api() -> _TeApi:
    from transformer_engine.pytorch.cpp_extensions.fused_attn import FusedAttnBackend, fused_attn_bwd, fused_attn_fwd

    te_dtypes = None
    if "dqkv_dtype" in inspect.signature(fused_attn_bwd).parameters:  # TE 2.0 - 2.14
        from transformer_engine.pytorch.constants import TE_DType

        te_dtypes = TE_DType
    return _TeApi(fused_attn_fwd, fused_attn_bwd, FusedAttnBackend["F16_arbitrary_seqlen"], te_dtypes)


@functools.lru_cache(maxsize=256)
def _padded_rows(segments: Segments, max_seqlen: int) -> torch.Tensor:
    """For each packed q row, its index b * max_seqlen + i in padded [B, max_seqlen] statistics."""
    segment, position = segment_rows(segments.cu_seqlens_q, segments.cu_q[-1])
    return segment * max_seqlen + position


def stats_layout(stats: torch.Tensor, segments: Segments) -> str:
    """Which of TE's statistics layouts `stats` is in (see `_STATS_LAYOUT`)."""
    if stats.dim() == 4:
        return "segments"
    num_tokens = segments.cu_q[-1]
    if stats.shape[0] == num_tokens:
        return "tokens"
    assert stats.shape[0] == get_max_tokens(num_tokens), (tuple(stats.shape), segments.seqlens_q)
    return "max_tokens"


def stats_to_lse(stats: torch.Tensor, segments: Segments) -> torch.Tensor:
    """TE's softmax statistics ([T or max_tokens, H, 1] packed or [B, H, S, 1]) as our lse [H, T], float32."""
    if stats_layout(stats, segments) != "segments":
        return stats[: segments.cu_q[-1]].squeeze(-1).t().float().contiguous()
    batch, heads, max_seqlen, _ = stats.shape
    assert batch == segments.num_segments, (tuple(stats.shape), segments.seqlens_q)
    flat = stats.squeeze(-1).transpose(0, 1).reshape(heads, batch * max_seqlen)
    return flat.index_select(1, _padded_rows(segments, max_seqlen)).float()


def lse_to_stats(lse: torch.Tensor, segments: Segments, *, layout: str) -> torch.Tensor:
    """Our lse [H, T] in the `layout` TE's backward reads (see `_STATS_LAYOUT`; padding rows 0)."""
    lse = lse.float()
    if layout == "tokens":
        return lse.t().contiguous().unsqueeze(-1)
    if layout == "max_tokens":
        stats = lse.new_zeros(get_max_tokens(lse.shape[1]), lse.shape[0], 1)
        stats[: lse.shape[1], :, 0] = lse.t()
        return stats
    heads, batch, max_seqlen = lse.shape[0], segments.num_segments, segments.max_q
    flat = lse.new_zeros(heads, batch * max_seqlen)
    flat.index_copy_(1, _padded_rows(segments, max_seqlen), lse)
    return flat.view(heads, batch, max_seqlen).transpose(0, 1).contiguous().unsqueeze(-1)


def _mask(causal: bool) -> str:
    return "padding_causal" if causal else "padding"


def _call_kwargs(
    q, k, v, *, segments: Segments, causal: bool, scale: float, sub_backend, window: BlockWindow | None
) -> dict:
    """The keyword arguments `fused_attn_fwd` and `fused_attn_bwd` share: packed THD tensors without
    padding, the mask and its window (an aligned sliding window is (left, 0) under the causal mask, as
    TE's `check_set_window_size` makes it), the scale, no dropout and no bias."""
    return dict(
        max_seqlen_q=segments.max_q,
        max_seqlen_kv=segments.max_k,
        cu_seqlens_q=segments.cu_seqlens_q,
        cu_seqlens_kv=segments.cu_seqlens_k,
        q=q.contiguous(),
        k=k.contiguous(),
        v=v.contiguous(),
        fake_dtype=q.dtype,
        fused_attention_backend=sub_backend,
        cu_seqlens_q_padded=segments.cu_seqlens_q,
        cu_seqlens_kv_padded=segments.cu_seqlens_k,
        attn_scale=scale,
        dropout=0.0,
        qkv_layout="thd_thd_thd",
        attn_bias_type="no_bias",
        attn_mask_type=_mask(causal),
        window_size=window_pair(causal, window),
    )


class TeFusedBackend(AttentionBackend):
    """One TE fused-attention (cuDNN) call per block, all segments at once."""

    name = "te_fused"

    @classmethod
    def unsupported_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why this backend cannot run on `device` with `dtype` (None: it can)."""
        return half_precision_cuda_problem(device, dtype, te_version_problem, "cuDNN fused attention")

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return cls.unsupported_reason(device, dtype) is None

    @classmethod
    def shape_problem(cls, shape: KernelShape) -> str | None:
        return te_shape_problem(shape)

    def forward(self, q, k, v, *, segments: Segments, causal: bool, scale: float, window: BlockWindow | None = None):
        api = _te_api()
        out, aux = api.fwd(
            is_training=True,
            **_call_kwargs(
                q, k, v, segments=segments, causal=causal, scale=scale, sub_backend=api.sub_backend, window=window
            ),
            **api.fwd_kwargs(),
        )[:2]
        stats = aux[0]
        _STATS_LAYOUT[str(q.device)] = stats_layout(stats, segments)
        return out, stats_to_lse(stats, segments)

    def backward(
        self, dout, q, k, v, out, lse, *, segments: Segments, causal: bool, scale: float,
        window: BlockWindow | None = None,
    ):
        api = _te_api()
        layout = _STATS_LAYOUT.get(str(q.device))
        assert layout is not None, f"te_fused backward on {q.device} before any forward there"
        rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)  # no dropout: never read
        dq, dk, dv = api.bwd(
            o=out.contiguous(),
            d_o=dout.contiguous(),
            aux_ctx_tensors=[lse_to_stats(lse, segments, layout=layout), rng_state],
            deterministic=self.deterministic,
            **_call_kwargs(
                q, k, v, segments=segments, causal=causal, scale=scale, sub_backend=api.sub_backend, window=window
            ),
            **api.bwd_kwargs(q.dtype),
        )[:3]
        return dq, dk, dv
