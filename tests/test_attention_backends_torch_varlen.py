"""The torch varlen backend against the `varlen_attn` signatures of the torch releases it meets: 2.13 (takes
`enable_gqa` and refuses Hq != Hkv without it) and 2.11/2.12 (no such argument: the NGC containers' and the
lent H100's torch, where passing it raised TypeError). Stand-ins with each release's exact keyword-only
signature record what the backend passes; the kernels themselves run only on a GPU."""

import torch
import torch.nn.attention.varlen as varlen_module

from megatron_hdp.attention.backends import torch_varlen
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
