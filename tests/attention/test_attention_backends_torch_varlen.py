"""The torch varlen backend against the `varlen_attn` signatures of the torch releases it meets: 2.13 (takes
`enable_gqa` and refuses Hq != Hkv without it) and 2.11/2.12 (no such argument: the NGC containers' and the
lent H100's torch, where passing it raised TypeError). Stand-ins with each release's exact keyword-only
signature record what the backend passes; the kernels themselves run only on a GPU."""

import torch
import torch.nn.attention.varlen as varlen_module
from kernel_stand_ins import check_backend_in_ring, cleared_caches, segment_attention

from megatron_hdp.attention.backends import grads_by_recompute, torch_varlen
from megatron_hdp.attention.backends.base import Segments


def _stand_in(calls, *, with_enable_gqa):
    def result(query):
        return torch.zeros_like(query), torch.zeros(query.shape[1], query.shape[0])

    if with_enable_gqa:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            calls.append({"window_size": window_size, "enable_gqa": enable_gqa})
            if query.shape[1] != key.shape[1] and not enable_gqa:
                raise ValueError("Try setting enable_gqa=True for GQA.")
            return result(query)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            calls.append({"window_size": window_size})
            return result(query)
    return varlen_attn


def _forward(monkeypatch, *, with_enable_gqa, kv_heads):
    calls = []
    monkeypatch.setattr(varlen_module, "varlen_attn", _stand_in(calls, with_enable_gqa=with_enable_gqa))
    q = torch.zeros(10, 4, 8, dtype=torch.bfloat16)
    kv = torch.zeros(10, kv_heads, 8, dtype=torch.bfloat16)
    segments = Segments((6, 4), (6, 4), torch.device("cpu"))
    out, lse = torch_varlen.TorchVarlenBackend().forward(q, kv, kv, segments=segments, causal=True, scale=0.3)
    assert out.shape == q.shape and lse.shape == (4, 10)
    return calls


def test_torch_2_11_signature_gets_no_enable_gqa(monkeypatch):
    for kv_heads in (4, 2):
        assert _forward(monkeypatch, with_enable_gqa=False, kv_heads=kv_heads) == [{"window_size": (-1, 0)}]


def test_torch_2_13_signature_gets_enable_gqa_for_gqa(monkeypatch):
    assert _forward(monkeypatch, with_enable_gqa=True, kv_heads=2) == [{"window_size": (-1, 0), "enable_gqa": True}]
    assert _forward(monkeypatch, with_enable_gqa=True, kv_heads=4) == [{"window_size": (-1, 0), "enable_gqa": False}]


def test_narrower_value_head_dim_runs_padded_against_reference(monkeypatch):
    """Multi-latent attention's V, narrower than q and k: aten's FlashAttention-2 (behind `varlen_attn` and
    its backward op) takes V only at q's head size, so stand-ins that refuse anything else and compute in
    plain torch check the backend's zero padding, alone and in a ring of 3, against the float64 reference."""

    def segments_of(cu_q, cu_k):
        lengths = [tuple(b - a for a, b in zip(cu.tolist(), cu.tolist()[1:])) for cu in (cu_q, cu_k)]
        return Segments(*lengths, torch.device("cpu"))

    def window_of(window_size, causal):
        assert tuple(window_size) == ((-1, 0) if causal else (-1, -1))
        return (-1, -1)  # the causal flag makes the mask (a block's causal square is top-left aligned)

    def check_head_size(q, v):  # aten's mha_varlen_fwd / _bwd: CHECK_SHAPE(v, total_k, num_heads_k, head_size)
        assert v.shape[-1] == q.shape[-1], "v must have q's head size in FlashAttention-2"

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                    window_size=(-1, -1), enable_gqa=False):
        check_head_size(query, value)
        causal = tuple(window_size) == (-1, 0)
        return segment_attention(query, key, value, segments_of(cu_seq_q, cu_seq_k), causal, scale,
                                 window_of(window_size, causal))

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, rng_state, scale, window_size):
        check_head_size(q, v)
        segments, window = segments_of(cu_q, cu_k), window_of(window_size, causal)
        return grads_by_recompute(
            lambda q_, k_, v_: segment_attention(q_, k_, v_, segments, causal, scale, window), dout, q, k, v, out, lse
        )

    monkeypatch.setattr(varlen_module, "varlen_attn", varlen_attn)
    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn_backward", backward)
    monkeypatch.setattr(torch_varlen.TorchVarlenBackend, "supports", classmethod(lambda cls, device, dtype: True))
    with cleared_caches():
        check_backend_in_ring("torch_varlen", "torch varlen stand-in")
