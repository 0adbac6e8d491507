"""The latent ring in one process (every position of rings of 1-5) against Megatron's MLA math in float64.

`simulated_latent_ring_attention` runs the k ring programs of `latent_ring_attention` in lockstep; the
reference (`attention_reference.reference_latent_attention`) up-projects the whole latent densely, as
Megatron's `linear_kv_up_proj` does, and attends in float64. The gloo runs of the same programs are in
tests/attention/test_ring_attention.py, their bytes in tests/comm/test_ring_traffic.py.
"""

import re

import pytest
import torch
from attention_reference import reference_latent_with_grads

from megatron_hdp.attention.backends import get_backend
from megatron_hdp.attention.latent_ring import LatentKV, latent_ring_attention, simulated_latent_ring_attention
from megatron_hdp.attention.ring_function import simulated_ring_function
from megatron_hdp.attention.virtual_ring import VirtualRing

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


def _check(seqlens, ring_size, *, causal=True, window=None, dtype=torch.float64, tol=1e-10, seed=0, sink=False):
    """The simulated ring against the float64 reference; `sink`: with a learnable sink (a logit per head)."""
    q, latent, k_rope, weight, dout = _inputs(seqlens, dtype=dtype, seed=seed)
    logits = torch.linspace(-1.0, 2.0, HEADS, dtype=dtype) if sink else None
    want = reference_latent_with_grads(q, latent, k_rope, weight, dout, seqlens, causal=causal, scale=0.3,
                                       window=window, sink=logits, **DIMS)
    leaves = [x.requires_grad_() for x in (q, latent, k_rope, weight, *([logits] if sink else []))]
    out = simulated_latent_ring_attention(*leaves[:3], up_weight=leaves[3], seqlens=seqlens, ring_size=ring_size,
                                          causal=causal, softmax_scale=0.3, window=window,
                                          sink=leaves[4] if sink else None, **DIMS)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    assert len(got) == len(want)
    for name, g, w in zip(("out", "dq", "dlatent", "dk_rope", "dup_weight", "dsink"), got, want):
        assert g.dtype == dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=lambda m: f"k={ring_size} {name}: {m}")


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5])
def test_every_position_of_rings_of_one_to_five(ring_size):
    """Documents shorter than 2k (positions holding nothing of them), equal to 2k, longer; causal,
    non-causal and windowed (the direct plan): out and the gradients of q, latent, k_rope, up_weight."""
    k = ring_size
    seqlens = [1, 2 * k - 1, 2 * k + 1, 23]
    for causal, window, seed in ((True, None, 1), (False, None, 2), (True, 3, 3)):
        _check(seqlens, ring_size, causal=causal, window=window, seed=seed + 10 * k)


@pytest.mark.parametrize("ring_size", [1, 2, 3, 4, 5])
def test_a_sink_on_rings_of_one_to_five(ring_size):
    """A learnable sink (Megatron's `softmax_offset`, an extra softmax column per head), applied after the
    ring's merge as on the K/V ring: out and the gradients of q, latent, k_rope, up_weight and the sink
    (summed over the positions' rows) equal the float64 reference, causal and with a sliding window."""
    k = ring_size
    for window, seed in ((None, 4), (3, 5)):
        _check([1, 2 * k - 1, 2 * k + 1, 23], ring_size, window=window, seed=seed + 10 * k, sink=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 5e-2)])
def test_half_and_single_precision(dtype, tol):
    """Results come back in the input dtype; blocks accumulate in fp32."""
    _check([5, 31, 12], 3, dtype=dtype, tol=tol, seed=4)


class _RoundedBlocks(LatentKV):
    """The negative control: each block's weight-gradient product rounded to the input dtype before it is
    added (what a half-precision matmul of the block would give)."""

    def add_block_grads(self, rows, held, dk, dv, held_grads):
        before = self.weight_gradient().clone()
        super().add_block_grads(rows, held, dk, dv, held_grads)
        self.weight_grad = before + (self.weight_grad - before).to(self.weight.dtype).to(before.dtype)


def _weight_grad_error(source_class, seed):
    """Relative error against float64 of the up-projection weight's gradient the members of a bf16 ring of 5
    accumulate (their fp32 shares summed, before the cast back to bf16), with sources of `source_class`."""
    seqlens, size = [40, 57, 33, 64], 5
    q, latent, k_rope, weight, dout = _inputs(seqlens, dtype=torch.bfloat16, seed=seed)
    want = reference_latent_with_grads(q, latent, k_rope, weight, dout, seqlens, causal=True, scale=0.3, **DIMS)[4]
    made = []

    def make(*inputs):
        made.append(source_class(*inputs, **DIMS))
        return made[-1]

    ring = VirtualRing.of(seqlens, size, causal=True, device=q.device, window=None)
    leaves = [x.requires_grad_() for x in (q, latent, k_rope, weight)]
    outs = simulated_ring_function(ring.shards(*leaves[:3]), shared=leaves[3:], make_source=make, sink=None,
                                   plans=ring.plans, backend=get_backend("auto", device=q.device, dtype=q.dtype),
                                   scale=0.3, grad_dtype=None)
    torch.autograd.grad(ring.packed(outs), leaves[3], dout)
    got = sum(source.weight_gradient() for source in made[-size:])  # the backward's sources
    assert got.dtype == torch.float32
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_weight_gradient_accumulates_in_fp32(seed):
    """In bf16 each member adds every block's dW = dKV^T latent in fp32 (`LatentKV.add_block_grads`): its
    accumulated share is closer to the float64 gradient than when each block's product is rounded to bf16
    first (`_RoundedBlocks`, the negative control)."""
    accumulated, rounded = _weight_grad_error(LatentKV, seed), _weight_grad_error(_RoundedBlocks, seed)
    assert accumulated < rounded < 1e-2, (accumulated, rounded)


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


# --- the core attention's router: whole documents, a latent ring and a K/V ring in one micro-batch (gloo) ---
ROUTER_SINK = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
"""A learnable sink's logits (one per head) on every group of the router's micro-batch."""
DOCS = (5, 6, 9, 4, 7)  # seq 0 whole on rank 0, seq 1 whole on rank 1, seqs 2-3 a latent ring (0, 1), seq 4 a K/V ring (1, 0)
STARTS = [sum(DOCS[:i]) for i in range(len(DOCS))]


def _packed_rows(rank):
    """The micro-batch's groups and its rows of the documents packed doc after doc."""
    from megatron_hdp.attention.layout import AttentionGroup
    from megatron_hdp.attention import zigzag_token_indices

    whole = torch.arange(STARTS[rank], STARTS[rank] + DOCS[rank])
    latent = zigzag_token_indices(DOCS[2:4], 2, rank) + STARTS[2]
    kv = zigzag_token_indices(DOCS[4:], 2, (1, 0).index(rank)) + STARTS[4]
    bounds = [0, len(whole), len(whole) + len(latent), len(whole) + len(latent) + len(kv)]
    groups = (AttentionGroup((rank,), (rank,), (DOCS[rank],), tuple(bounds[0:2])),
              AttentionGroup((0, 1), (2, 3), DOCS[2:4], tuple(bounds[1:3]), ring_kind="latent"),
              AttentionGroup((1, 0), (4,), DOCS[4:], tuple(bounds[2:4])))
    return groups, torch.cat([whole, latent, kv])


def _router_rank(rank, world_size):
    from megatron_hdp.attention.core_attention import HDPBatchMeta, LatentRingInputs, hdp_core_attention

    groups, rows = _packed_rows(rank)
    q, latent, k_rope, weight, dout = _inputs(DOCS, dtype=torch.float32, seed=7)
    leaves = [x[rows].requires_grad_() for x in (q, latent, k_rope)] + [weight.requires_grad_()]
    leaves.append(ROUTER_SINK.float().requires_grad_())
    q, latent, k_rope, weight, sink = leaves
    kv = (latent @ weight.t()).view(len(rows), HEADS, -1)  # the layer's own up-projection (whole and K/V groups)
    key = torch.cat([kv[..., :QK_DIM], k_rope.expand(-1, HEADS, -1)], -1)
    unread = torch.zeros(len(rows), 1, 1).index_fill_(0, torch.arange(*groups[1].tokens), torch.nan)
    key, kv = key + unread, kv + unread  # a latent group's K/V rows are never read: NaN there must not show
    meta = HDPBatchMeta(groups=groups, hdp_global_ranks=(0, 1), position_ids=torch.zeros(len(rows), dtype=torch.long))
    out = hdp_core_attention(q, key, kv[..., QK_DIM:], meta=meta, softmax_scale=0.3, sink=sink,
                             latent=LatentRingInputs(latent, k_rope, weight, **DIMS))
    out.backward(dout[rows])
    return [x.detach().numpy() for x in (out, *(leaf.grad for leaf in leaves))]


def test_core_attention_routes_latent_ring_groups_to_the_latent_ring():
    """On 2 gloo ranks, a micro-batch of a whole document, a latent ring group and a K/V ring group
    (`AttentionGroup.ring_kind`, the plan's), with a learnable sink on all of them: out and the gradients
    of q, latent, k_rope, the up-projection weight and the sink (both summed over the ranks) equal
    Megatron's MLA math in float64."""
    from megatron_hdp.comm.launch import run_gloo

    by_rank = run_gloo(_router_rank, 2, timeout_s=240)
    inputs = _inputs(DOCS, dtype=torch.float32, seed=7)
    want = reference_latent_with_grads(*inputs, DOCS, causal=True, scale=0.3, sink=ROUTER_SINK, **DIMS)
    for rank, got in enumerate(by_rank):
        rows = _packed_rows(rank)[1]
        for name, g, w in zip(("out", "dq", "dlatent", "dk_rope"), got, want):
            torch.testing.assert_close(torch.from_numpy(g).double(), w[rows], rtol=2e-5, atol=2e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
    for index, name in ((4, "dup_weight"), (5, "dsink")):
        summed = sum(torch.from_numpy(got[index]).double() for got in by_rank)
        torch.testing.assert_close(summed, want[index], rtol=2e-5, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_core_attention_refuses_a_latent_group_without_latent_inputs():
    from megatron_hdp.attention.core_attention import HDPBatchMeta, hdp_core_attention
    from megatron_hdp.attention.layout import AttentionGroup

    groups = (AttentionGroup((0, 1), (0,), (8,), (0, 4), ring_kind="latent"),)
    meta = object.__new__(HDPBatchMeta)  # no ring plans: the refusal comes before any ring work
    object.__setattr__(meta, "groups", groups)
    object.__setattr__(meta, "segments", (None,))
    q = torch.zeros(4, HEADS, QK_DIM + ROPE_DIM)
    with pytest.raises(ValueError, match="runs latent rings in this micro-batch but no latent inputs"):
        hdp_core_attention(q, q, q[..., :V_DIM], meta=meta)
