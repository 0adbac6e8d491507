"""The latent ring in one process (every position of rings of 1-5) against Megatron's MLA math in float64.

`simulated_latent_ring_attention` runs the k ring programs of `latent_ring_attention` in lockstep; the
reference (`attention_reference.reference_latent_attention`) up-projects the whole latent densely, as
Megatron's `linear_kv_up_proj` does, and attends in float64. The gloo runs of the same programs are in
tests/test_ring_attention.py, their bytes in tests/test_ring_traffic.py.
"""

import re

import pytest
import torch
from attention_reference import reference_latent_with_grads

from megatron_hdp.attention.latent_ring import latent_ring_attention, simulated_latent_ring_attention

HEADS, QK_DIM, ROPE_DIM, V_DIM, RANK = 4, 6, 2, 4, 5
DIMS = dict(qk_head_dim=QK_DIM, v_head_dim=V_DIM)


def _inputs(seqlens, *, dtype=torch.float64, seed=0, heads=HEADS):
    """q, latent, k_rope, up_weight, dout of packed documents (the weight scaled so K/V are O(1))."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    shapes = ((total, heads, QK_DIM + ROPE_DIM), (total, RANK), (total, 1, ROPE_DIM),
              (heads * (QK_DIM + V_DIM), RANK), (total, heads, V_DIM))
    q, latent, k_rope, weight, dout = (torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes)
    return [x.to(dtype) for x in (q, latent, k_rope, weight / RANK**0.5, dout)]


def _check(seqlens, ring_size, *, causal=True, window=None, dtype=torch.float64, tol=1e-10, seed=0):
    q, latent, k_rope, weight, dout = _inputs(seqlens, dtype=dtype, seed=seed)
    want = reference_latent_with_grads(q, latent, k_rope, weight, dout, seqlens, causal=causal, scale=0.3,
                                       window=window, **DIMS)
    leaves = [x.requires_grad_() for x in (q, latent, k_rope, weight)]
    out = simulated_latent_ring_attention(*leaves[:3], up_weight=leaves[3], seqlens=seqlens, ring_size=ring_size,
                                          causal=causal, softmax_scale=0.3, window=window, **DIMS)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    for name, g, w in zip(("out", "dq", "dlatent", "dk_rope", "dup_weight"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=lambda m: f"k={ring_size} {name}: {m}")


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5])
def test_every_position_of_rings_of_one_to_five(ring_size):
    """Documents shorter than 2k (positions holding nothing of them), equal to 2k, longer; causal,
    non-causal and windowed (the direct plan): out and the gradients of q, latent, k_rope, up_weight."""
    k = ring_size
    seqlens = [1, 2 * k - 1, 2 * k, 2 * k + 1, 23]
    for causal, window, seed in ((True, None, 1), (False, None, 2), (True, 3, 3)):
        _check(seqlens, ring_size, causal=causal, window=window, seed=seed + 10 * k)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_half_and_single_precision(dtype, tol):
    """Results come back in the input dtype; blocks accumulate in fp32."""
    _check([5, 31, 12], 3, dtype=dtype, tol=tol, seed=4)


def test_a_position_holding_no_token_returns_zero_weight_gradient():
    """A document of one token on a ring of two: position 1 holds nothing and attends nothing."""
    _check([1], 2, seed=5)


def test_bad_calls_name_the_offending_value():
    q, latent, k_rope, weight, _ = _inputs([8])
    call = dict(up_weight=weight, seqlens=[8], ring_size=2, **DIMS)
    cases = [
        (dict(q=q[:, :, :-1]), "q's head dim 7 must be qk_head_dim + the RoPE key's 6 + 2"),
        (dict(k_rope=k_rope.expand(8, 2, ROPE_DIM)), "k_rope must be one RoPE key shared by all heads"),
        (dict(latent=latent[:7]), "latent has 7 tokens but seqlens give this rank 8 tokens"),
        (dict(up_weight=weight[:-1]), "up_weight must be [heads x (qk_head_dim + v_head_dim), kv_lora_rank] = [40, 5]"),
        (dict(latent=latent.float()), "must share dtype and device"),
        (dict(ring_size=0), "ring_size must be >= 1"),
        (dict(window=-1), "window must be None or an int >= 0"),
    ]
    for change, message in cases:
        args = dict(q=q, latent=latent, k_rope=k_rope, **call) | change
        with pytest.raises(ValueError, match=re.escape(message)):
            simulated_latent_ring_attention(args.pop("q"), args.pop("latent"), args.pop("k_rope"), **args)
    with pytest.raises(ValueError, match="needs torch.distributed initialized"):  # before any message
        latent_ring_attention(q, latent, k_rope, up_weight=weight, seqlens=[8], ring=[5, 6], **DIMS)


def test_a_ring_of_one_needs_no_process_group():
    """`latent_ring_attention` over a ring of one rank attends locally, without torch.distributed."""
    seqlens = [3, 9]
    q, latent, k_rope, weight, dout = _inputs(seqlens, seed=6)
    want = reference_latent_with_grads(q, latent, k_rope, weight, dout, seqlens, causal=True, scale=0.3, **DIMS)
    leaves = [x.requires_grad_() for x in (q, latent, k_rope, weight)]
    out = latent_ring_attention(*leaves[:3], up_weight=leaves[3], seqlens=seqlens, ring=[0], softmax_scale=0.3,
                                **DIMS)
    for g, w in zip((out, *torch.autograd.grad(out, leaves, dout)), want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
