"""The cost model's ring traffic against the bytes a real multi-rank gloo run sends.

`CostModel.ring_bytes` must count exactly what `ring_attention` (forward + backward) puts on the wire,
per dtype (bf16: dK/dV travel in fp32; fp32: everything fp32) and ring size k = 2..5. One gloo run of five
ranks plays every case; the counters are `megatron_hdp.comm.traffic`'s.
"""

from __future__ import annotations

import torch

from megatron_hdp.attention import count_traffic, ring_attention, zigzag_token_indices
from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.plan.cost_model import CostModel

HKV, HQ, DIM = 2, 4, 8
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# per ring size: documents whose lengths are multiples of 2k (every member holds the same tokens), and
# uneven ones (members differ; each member's buffer still makes the same trips, so the ring's total holds)
CASES = [(k, dtype, [4 * k, 2 * k]) for k in (2, 3, 4, 5) for dtype in DTYPES]
CASES += [(k, dtype, [2 * k + 1, 3, 7 * k - 1]) for k in (3, 4) for dtype in DTYPES]


def _run(rank, world_size):
    sent = []
    for k, dtype, seqlens in CASES:
        with count_traffic() as traffic:
            if rank < k:
                gen = torch.Generator().manual_seed(k)
                rows = zigzag_token_indices(seqlens, k, rank)
                q, kk, v = (torch.randn(sum(seqlens), h, DIM, generator=gen)[rows].to(DTYPES[dtype]).requires_grad_()
                            for h in (HQ, HKV, HKV))
                ring_attention(q, kk, v, seqlens=seqlens, ring=list(range(k))).sum().backward()
        sent.append(traffic.bytes_sent)
    return sent


def _model(dtype: str) -> CostModel:
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    return CostModel(a1=0.0, b1=0.0, g=0.0, a2=0.0, b2=0.0, kv_bytes_per_token=2 * HKV * DIM * element,
                     activation_dtype_bytes=element, num_layers=1, ring_bandwidth=1.0)


def test_cost_model_counts_the_bytes_ring_attention_sends():
    by_rank = run_gloo(_run, 5, timeout_s=240)
    for c, (k, dtype, seqlens) in enumerate(CASES):
        model = _model(dtype)
        tokens = [len(zigzag_token_indices(seqlens, k, p)) for p in range(k)]
        predicted = [model.ring_bytes(num_tokens=t, ring_size=k) for t in tokens]
        measured = [by_rank[rank][c] for rank in range(k)]
        where = f"k={k} {dtype} seqlens={seqlens}"
        assert sum(measured) == sum(predicted), where
        if len(set(tokens)) == 1:
            assert measured == predicted, where
        assert all(by_rank[rank][c] == 0 for rank in range(k, 5)), where
    # the headline numbers: per member, in units of its own K+V buffer
    assert _model("bf16").ring_bytes(num_tokens=1, ring_size=2) == 6 * _model("bf16").kv_bytes_per_token
    assert _model("bf16").ring_bytes(num_tokens=1, ring_size=4) == 14 * _model("bf16").kv_bytes_per_token
    assert _model("fp32").ring_bytes(num_tokens=1, ring_size=4) == 10 * _model("fp32").kv_bytes_per_token
