"""CUDA kernels behind the backend interface, against the float64 reference (skipped without a GPU).

Each available CUDA backend runs the local varlen path and the in-process ring (whose block backward
takes the merged out/lse, the part a kernel's own autograd never exercises).
"""

import pytest
import torch
from attention_reference import reference_with_grads

from megatron_hdp.attention import available_backends, local_varlen_attention, simulated_ring_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SEQLENS = [1, 7, 64, 129, 300]


def _cases():
    """(dtype, backend) for every CUDA backend available here (none without a GPU)."""
    if not torch.cuda.is_available():
        return []
    return [(dtype, name) for dtype in (torch.bfloat16, torch.float32) for name in available_backends("cuda", dtype)]


def _inputs(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(SEQLENS)
    return [torch.randn(total, h, 64, generator=gen, device="cuda", dtype=dtype) for h in (8, 2, 2, 8)]


@pytest.mark.parametrize("dtype,backend", _cases())
@pytest.mark.parametrize("ring_size", [1, 3, 4])
def test_cuda_backend_local_and_ring(dtype, backend, ring_size):
    q, k, v, dout = _inputs(dtype)
    want = reference_with_grads(q, k, v, dout, SEQLENS, causal=True, scale=0.125)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if ring_size == 1:
        out = local_varlen_attention(*leaves, seqlens=SEQLENS, softmax_scale=0.125, backend=backend)
    else:
        out = simulated_ring_attention(
            *leaves, seqlens=SEQLENS, ring_size=ring_size, softmax_scale=0.125, backend=backend
        )
    got = [out, *torch.autograd.grad(out, leaves, dout)]
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m: f"{backend} {name}: {m}")
