"""Ring attention on 2, 3, 4 and 8 gloo ranks against the single-process float64 reference.

Cases with `value_dim` give V a narrower head dim than q and k (multi-latent attention). Rings named in a
case's `latent` are latent rings (`latent_ring_attention`, multi-latent attention's latent circulating):
their up-projection weight's gradient is each member's share, summed over the ring against the reference.

Each launch runs many cases back to back (spawning ranks is the expensive part). A case is a list of
rings, each with its documents; every rank runs the rings it belongs to in list order (the runtime's
global order), then one backward over all of them, so ranks in several rings and overlapping rings of
different ranks are exercised together. Cases with a sink (Megatron's off-by-one and learnable softmax)
share one sink over their rings; the sink's gradient, summed over the ranks' rows, equals the reference's.
"""

import torch
import torch.distributed as dist
from attention_reference import reference_latent_with_grads, reference_with_grads
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from megatron_hdp.attention import count_traffic, ring_attention, zigzag_token_indices
from megatron_hdp.attention.latent_ring import latent_ring_attention
from megatron_hdp.comm.launch import run_gloo

TOL = dict(rtol=1e-5, atol=1e-5)


def _case(rings, *, heads=(4, 2), causal=True, seed=0, head_dim=8, window=None, value_dim=None, sink=None,
          latent=()):
    """`value_dim`: V's (and the output's) head dim, narrower than q's and k's in multi-latent attention.
    `sink`: None, "off-by-one" or "learnable" (Megatron's softmax_type), one sink for all K/V rings of the
    case. `latent`: ids of the rings that are latent rings (heads[0] heads, `LATENT_DIMS`)."""
    rings = [(tuple(r), tuple(s)) for r, s in rings]
    return dict(rings=rings, heads=heads, causal=causal, seed=seed, dim=head_dim, window=window, dv=value_dim,
                sink=sink, latent=tuple(latent))


def _sink(case):
    """The case's sink logits [Hq]: zeros (off-by-one), drawn (learnable), or None."""
    if case["sink"] is None:
        return None
    if case["sink"] == "off-by-one":
        return torch.zeros(case["heads"][0])
    return torch.randn(case["heads"][0], generator=torch.Generator().manual_seed(case["seed"]))


LATENT_DIMS = dict(qk_head_dim=6, v_head_dim=4)
ROPE_DIM, LATENT_RANK = 2, 5


def _ring_tensors(case, ring_id):
    """The packed q, k, v and output gradient of one ring's documents (identical on every rank); for a
    latent ring q, latent, k_rope, up_weight and the output gradient."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + ring_id)
    total = sum(case["rings"][ring_id][1])
    if ring_id in case["latent"]:
        heads, (qk, dv) = case["heads"][0], LATENT_DIMS.values()
        shapes = ((total, heads, qk + ROPE_DIM), (total, LATENT_RANK), (total, 1, ROPE_DIM),
                  (heads * (qk + dv), LATENT_RANK), (total, heads, dv))
        return [torch.randn(shape, generator=gen) for shape in shapes]
    (hq, hkv), dim = case["heads"], case["dim"]
    dims = (dim, dim, case["dv"] or dim, case["dv"] or dim)
    return [torch.randn(total, h, d, generator=gen) for h, d in zip((hq, hkv, hkv, hq), dims)]


def _numpy(*tensors):
    """Results cross the process boundary as numpy arrays: torch would share a tensor's memory with the
    parent through the child, which may have exited by the time the parent reads it."""
    return tuple(t.detach().numpy() for t in tensors)


def _run_cases(rank, world_size, cases):
    """Per case: {ring_id: (out, dq, dk, dv)} of this rank's rows ((out, dq, dlatent, dk_rope, dup_weight)
    for a latent ring), the bytes it sent/received, and the gradient of the case's sink from this rank's
    rows (None without a sink or rows)."""
    results = []
    for case in cases:
        leaves, outs, douts, ids = [], [], [], []
        sink = _sink(case)
        if sink is not None:
            sink.requires_grad_()
        with count_traffic() as traffic:
            for ring_id, (ranks, seqlens) in enumerate(case["rings"]):
                if rank not in ranks:
                    continue
                *inputs, dout = _ring_tensors(case, ring_id)
                rows = zigzag_token_indices(seqlens, len(ranks), ranks.index(rank))
                options = dict(seqlens=seqlens, ring=ranks, causal=case["causal"], softmax_scale=0.3,
                               window=case["window"])
                if ring_id in case["latent"]:  # the up-projection weight is every member's, whole
                    mine = [x[rows].requires_grad_() for x in inputs[:3]] + [inputs[3].requires_grad_()]
                    out = latent_ring_attention(*mine[:3], up_weight=mine[3], **options, **LATENT_DIMS)
                else:
                    mine = [x[rows].requires_grad_() for x in inputs]
                    out = ring_attention(*mine, **options, sink=sink)
                outs.append(out)
                leaves.append(mine)
                douts.append(dout[rows])
                ids.append(ring_id)
            if outs:
                torch.autograd.backward(outs, douts)  # one backward over all rings
        results.append(
            (
                {i: _numpy(o, *(x.grad for x in leaf)) for i, o, leaf in zip(ids, outs, leaves)},
                (traffic.bytes_sent, traffic.bytes_received),
                None if sink is None or sink.grad is None else sink.grad.numpy(),
            )
        )
    return results


def _check(cases, world_size):
    by_rank = run_gloo(_run_cases, world_size, cases, timeout_s=240)
    for c, case in enumerate(cases):
        dsink = 0.0  # the reference's sink gradient, summed over the rings of the case
        for ring_id, (ranks, seqlens) in enumerate(case["rings"]):
            *inputs, dout = _ring_tensors(case, ring_id)
            options = dict(causal=case["causal"], scale=0.3, window=case["window"])
            if ring_id in case["latent"]:
                want = reference_latent_with_grads(*inputs, dout, seqlens, **options, **LATENT_DIMS)
                names = ("out", "dq", "dlatent", "dk_rope")
                shares = sum(torch.from_numpy(by_rank[rank][c][0][ring_id][4]).double() for rank in ranks)
                torch.testing.assert_close(shares, want[4], **TOL, msg=lambda m: f"case {case} dup_weight: {m}")
            else:
                want = reference_with_grads(*inputs, dout, seqlens, **options, sink=_sink(case))
                names = ("out", "dq", "dk", "dv")
                if case["sink"] is not None:
                    dsink = dsink + want[4]
            for position, rank in enumerate(ranks):
                rows = zigzag_token_indices(seqlens, len(ranks), position)
                got = by_rank[rank][c][0][ring_id]
                for name, g, w in zip(names, got, want):
                    where = f"case {case} ring {ranks} rank {rank} {name}"
                    torch.testing.assert_close(
                        torch.from_numpy(g).double(), w[rows], **TOL, msg=lambda m: f"{where}: {m}"
                    )
        if case["sink"] is not None:  # each rank's rows' share; Megatron's DDP would sum them over the ranks
            got = sum(torch.from_numpy(r[c][2]).double() for r in by_rank if r[c][2] is not None)
            torch.testing.assert_close(got, dsink, **TOL, msg=lambda m: f"case {case} sink gradient: {m}")
        sent = sum(r[c][1][0] for r in by_rank)
        received = sum(r[c][1][1] for r in by_rank)
        assert sent == received
    return by_rank


def _edge(k):
    return [1, 2 * k - 1, 2 * k, 2 * k + 1]


def test_two_ranks():
    cases = [
        _case([([0, 1], _edge(2))]),
        _case([([1, 0], [9, 1, 4])], heads=(2, 2), causal=False, seed=1),
        _case([([0], [5, 3]), ([1, 0], [11]), ([1], [1, 2]), ([0, 1], [2, 7])], heads=(4, 1), seed=2),
        # sliding windows (Megatron's window_size (w, 0)): smaller than a chunk, about a chunk, several
        _case([([0, 1], _edge(2) + [23]), ([1], [9, 4])], heads=(4, 1), seed=7, window=2),
        _case([([1, 0], [3, 40, 5])], seed=8, window=0),
        _case([([0, 1], [17, 2, 26]), ([0], [12])], heads=(4, 2), seed=9, window=9),
        # multi-latent attention's narrower V (q and k 8 wide, v 4), relayed and windowed (direct)
        _case([([1, 0], _edge(2)), ([0], [6])], seed=20, value_dim=4),
        _case([([0, 1], [3, 31])], heads=(4, 1), seed=21, window=5, value_dim=4),
        # sinks (Megatron's softmax_type), on rings and whole documents, with and without a window
        _case([([1, 0], _edge(2) + [19]), ([0], [6, 2])], heads=(4, 1), seed=16, sink="learnable"),
        _case([([0, 1], [21, 3]), ([1], [8])], seed=17, window=4, sink="off-by-one"),
        # latent rings (of two and of one) beside a K/V ring on the same ranks
        _case([([1, 0], _edge(2) + [9]), ([0], [6]), ([0, 1], [5, 3])], seed=24, latent=(0, 1)),
    ]
    _check(cases, 2)


def test_three_ranks_and_traffic():
    cases = [
        _case([([0, 1, 2], _edge(3) + [17])]),
        _case([([2, 0, 1], [13, 4]), ([1, 2], [6]), ([0], [3]), ([0, 2], [1, 5])], heads=(2, 1), seed=3),
        _case([([1], [4])], seed=4),
        _case([([0, 1, 2], _edge(3) + [37]), ([2, 1], [15])], heads=(4, 1), seed=10, window=3),
        _case([([2, 0, 1], [29, 6, 2]), ([0, 2], [8, 3])], seed=11, window=13),
        _case([([0, 1, 2], _edge(3) + [17])], seed=22, value_dim=4),
        _case([([0, 1, 2], _edge(3) + [25]), ([2, 1], [11]), ([0], [4])], seed=18, sink="learnable"),
        _case([([2, 0, 1], [31, 4]), ([1, 2], [9])], heads=(4, 1), seed=19, window=5, sink="learnable", value_dim=4),
        _case([([2, 0, 1], _edge(3) + [29]), ([2, 1], [11])], seed=25, window=4, latent=(0, 1)),  # windowed
    ]
    by_rank = _check(cases, 3)
    # Cases 0 and 5, a ring over all three ranks, fp32, Hkv=2, D=8 (and Dv = 8, 4): forward (k-1) K+V
    # buffers, backward (k-1) K+V buffers plus k dK+dV buffers; position p sends the buffers of positions
    # p, p-1, ... in turn. A token's K+V is Hkv x (D + Dv) values: a narrower V travels unpadded.
    seqlens = _edge(3) + [17]
    tokens = [len(zigzag_token_indices(seqlens, 3, p)) for p in range(3)]
    for case, value_dim in ((0, 8), (5, 4)):
        per_token = 2 * (8 + value_dim) * 4
        for p in range(3):
            kv_hops = sum(tokens[(p - s) % 3] for s in range(2))
            dkv_hops = sum(tokens[(p - s) % 3] for s in range(3))
            assert by_rank[p][case][1][0] == (2 * kv_hops + dkv_hops) * per_token
    assert by_rank[0][2][1] == (0, 0)  # a ring of one moves nothing, and idle ranks nothing
    assert by_rank[1][2][1] == (0, 0)


def test_four_ranks_overlapping_rings():
    cases = [
        _case([([0, 1, 2, 3], _edge(4) + [30])]),
        _case([([3, 1, 0, 2], [5, 16]), ([2, 0], [9]), ([1, 3, 0], [2, 1, 12]), ([3], [4]), ([1, 2], [3, 3])], seed=5),
        _case([([0, 2], [7]), ([2, 3], [8]), ([3, 1], [6]), ([1, 0], [5])], heads=(2, 2), causal=False, seed=6),
        _case([([0, 1, 2, 3], _edge(4) + [45]), ([3, 1, 0], [19, 2])], heads=(4, 1), seed=12, window=4),
        _case([([3, 1, 0, 2], [33, 9]), ([2, 0], [14])], seed=13, window=11),
        _case([([2, 3, 1, 0], _edge(4)), ([1, 0], [9])], heads=(4, 1), seed=23, value_dim=4),
        _case([([3, 1, 0, 2], _edge(4) + [27]), ([1, 2], [10]), ([0], [3])], seed=20, window=6, sink="learnable"),
        _case([([0, 1, 2, 3], [38, 5]), ([2, 0, 3], [12])], heads=(2, 2), seed=21, sink="off-by-one"),
        # overlapping latent and K/V rings of different ranks, taken in the one global order
        _case([([3, 1, 0, 2], [5, 16]), ([2, 0], [9]), ([1, 3, 0], [2, 1, 12])], seed=26, latent=(0, 2)),
    ]
    _check(cases, 4)


def test_eight_ranks():
    cases = [
        _case([(list(range(8)), _edge(8) + [40])], heads=(2, 1)),
        _case(
            [([7, 2, 5], [20, 3]), (list(range(8)), [33]), ([3], [6]), ([6, 4], [9]), ([5, 0, 7, 1], [14])],
            seed=7,
        ),
    ]
    _check(cases, 8)


_WORLD = 4


@st.composite
def _random_case(draw):
    num_rings = draw(st.integers(1, 3))
    rings = []
    for _ in range(num_rings):
        ranks = draw(st.permutations(range(_WORLD)))[: draw(st.integers(1, _WORLD))]
        seqlens = draw(st.lists(st.integers(1, 20), min_size=1, max_size=3))
        rings.append((ranks, seqlens))
    heads = draw(st.sampled_from([(2, 2), (4, 2), (4, 1)]))
    return _case(rings, heads=heads, causal=draw(st.booleans()), seed=draw(st.integers(0, 10**6)))


def _draw_cases(num_cases):
    """Cases drawn by hypothesis in this process, so that all of them run in one launch of ranks."""
    drawn = []

    @settings(max_examples=num_cases, deadline=None, database=None, phases=[Phase.generate])
    @given(case=_random_case())
    def collect(case):
        drawn.append(case)

    collect()
    return drawn


def test_random_rings():
    """Random non-contiguous, unordered rings (sizes 1 to 4, up to three per case) and documents."""
    _check(_draw_cases(12), _WORLD)


def _bad_calls(rank, world_size):
    """Every rank makes each bad call (all must raise before sending), then one good call must work."""
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    everyone = list(range(world_size))
    length = 6 * world_size  # six tokens per rank
    errors = []
    for call in (
        lambda: ring_attention(q, k, v, seqlens=[length], ring=[r for r in everyone if r != rank]),
        lambda: ring_attention(q, k, v, seqlens=[length], ring=[0, 0, 1]),
        lambda: ring_attention(q, k, v, seqlens=[length], ring=everyone + [world_size]),
        lambda: ring_attention(q[:5], k[:5], v[:5], seqlens=[length], ring=everyone),
        lambda: ring_attention(q, k[:, :1].expand(6, 3, 8), v[:, :1].expand(6, 3, 8), seqlens=[length], ring=everyone),
        lambda: ring_attention(q, k, v, seqlens=[length, 0], ring=everyone),
    ):
        try:
            call()
        except ValueError as err:
            errors.append(str(err))
    group = dist.new_group([0, 1])
    if rank == 2:
        try:
            ring_attention(q, k, v, seqlens=[12], ring=[2, 0], group=group)
        except ValueError as err:
            errors.append(str(err))
    if rank == 2:
        return errors, None
    case = _case([([1, 0], [12])])
    q, k, v, _ = _ring_tensors(case, 0)
    rows = zigzag_token_indices([12], 2, [1, 0].index(rank))
    out = ring_attention(q[rows], k[rows], v[rows], seqlens=[12], ring=[1, 0], group=group, softmax_scale=0.3)
    return errors, _numpy(out)[0]


def test_bad_calls_raise_everywhere_before_any_message():
    results = run_gloo(_bad_calls, 3, timeout_s=120)
    case = _case([([1, 0], [12])])
    q, k, v, dout = _ring_tensors(case, 0)
    want = reference_with_grads(q, k, v, dout, [12], causal=True, scale=0.3)[0]
    for rank, (errors, out) in enumerate(results):
        assert len(errors) == 6 + (rank == 2), errors
        assert f"rank {rank} is not in the ring" in errors[0]
        assert "distinct" in errors[1]
        assert "does not exist in a world of 3 ranks" in errors[2]
        assert "q has 5 tokens but seqlens give this rank 6 tokens" in errors[3]
        assert "kv heads (3) must divide query heads (4)" in errors[4]
        assert "document lengths must be >= 1" in errors[5]
        if rank == 2:
            assert "not a member of the given group" in errors[6]
        else:  # the good call after the bad ones: no stray message was left behind
            rows = zigzag_token_indices([12], 2, [1, 0].index(rank))
            torch.testing.assert_close(torch.from_numpy(out).double(), want[rows], **TOL)


def _steps_needed(seqlens, ring_size, window):
    """Brute force, [position][step]: whether some token of position p sees, within the window, some token
    of its document held by position p - step."""
    starts = [sum(seqlens[:d]) for d in range(len(seqlens))]
    doc_of = {t: d for d, (s, n) in enumerate(zip(starts, seqlens)) for t in range(s, s + n)}
    held = [set(zigzag_token_indices(seqlens, ring_size, p).tolist()) for p in range(ring_size)]
    return [
        [any(doc_of[x] == doc_of[y] and 0 <= x - y <= window for x in held[p] for y in held[(p - s) % ring_size])
         for s in range(ring_size)]
        for p in range(ring_size)
    ]


def test_windowed_ring_moves_only_the_kv_a_window_sees():
    """A windowed ring sends K/V straight to the position that needs it and the dK/dV partials straight
    back, and nothing for a step no token of a position can see. Bytes received by position p (fp32,
    Hkv=1, D=8): the K/V of p - s twice (forward, backward) for each step s p needs, and its own dK/dV
    partials back from p + s for each step s at which p + s needs p; fewer than the relay's buffers."""
    cases = [
        _case([([0, 1, 2, 3], [64])], heads=(2, 1), seed=14, window=3),
        _case([([0, 1, 2, 3], [40, 7, 30])], heads=(2, 1), seed=15, window=5),
    ]
    by_rank = _check(cases, 4)
    per_token = 2 * 1 * 8 * 4
    for c, case in enumerate(cases):
        (ranks, seqlens), = case["rings"]
        tokens = [len(zigzag_token_indices(seqlens, 4, p)) for p in range(4)]
        needed = _steps_needed(seqlens, 4, case["window"])
        for p in range(4):
            kv = sum(2 * tokens[(p - s) % 4] for s in range(1, 4) if needed[p][s])
            partials = sum(tokens[p] for s in range(1, 4) if needed[(p + s) % 4][s])
            want = (kv + partials) * per_token
            assert by_rank[p][c][1][1] == want, (case, p)  # bytes received
            relayed = (2 * sum(tokens[(p - s) % 4] for s in range(3)) + sum(tokens[(p - s) % 4] for s in range(4)))
            assert want < relayed * per_token
        assert sum(not n for row in needed for n in row[1:]) > 0  # some steps are skipped
