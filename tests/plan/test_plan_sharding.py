"""Data-aware sharding and the offload decision, against brute force over the cost model's definitions."""

import dataclasses

import numpy as np
import pytest

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.zigzag import zigzag_num_tokens, zigzag_token_counts
from megatron_hdp.plan.search.packing import best_fit
from megatron_hdp.plan.cost.presets import analytic_cost_model
from megatron_hdp.plan.cost.sharding import (
    max_member_tokens,
    min_ring_size,
    shard_sequences,
    shard_time,
    whole_times,
)

LLAMA = analytic_cost_model("llama-7b")


def brute_force_ring_size(length, *, capacity, num_ranks, cm, max_ratio, pp_size=1):
    """The smallest k whose every zigzag member fits, from the definitions (Eq. 3 + host memory)."""
    for k in range(1, num_ranks + 1):
        ok = True
        needed_max = 0.0
        for p in range(k):
            t = length if k == 1 else zigzag_num_tokens(length, k, p)
            if t <= capacity:
                continue
            need = 1 - cm.activation_bytes(capacity) / cm.activation_bytes(t)
            hidden = cm.hidden_offload_ratio(seq_len=length, num_tokens=t, ring_size=k)
            host = need * cm.activation_bytes(t) * cm.num_layers / pp_size * (9 / 8)  # pinned per offloaded byte
            if need > min(max_ratio, hidden) + 1e-12 or (cm.host_memory_bytes is not None and host > cm.host_memory_bytes):
                ok = False
                break
            needed_max = max(needed_max, need)
        if ok:
            return k, needed_max
    return None, None


def test_max_member_tokens_matches_layout():
    for length in range(1, 200):
        for k in range(1, 40):
            assert max_member_tokens(length, k) == max(
                (length if k == 1 else zigzag_num_tokens(length, k, p)) for p in range(k))


@pytest.mark.parametrize("capacity", [7, 100, 4096])
def test_no_offload_is_ceil_unless_zigzag_rounds_up(capacity):
    for length in list(range(1, 3 * capacity + 5, max(1, capacity // 7))) + [capacity, capacity + 1]:
        k, ratio = min_ring_size(length, capacity=capacity, num_ranks=10**6, cost_model=LLAMA, max_offload_ratio=0.0)
        expected, _ = brute_force_ring_size(length, capacity=capacity, num_ranks=10**6 if length < 10**4 else 64,
                                            cm=LLAMA, max_ratio=0.0)
        assert k == expected and ratio == 0.0
        assert k in (-(-length // capacity), -(-length // capacity) + 1)


@pytest.mark.parametrize("capacity", [7, 64])
def test_no_offload_ring_size_at_every_length(capacity):
    """Every length up to 6 C (the stride above skips most of those where ceil(s/k) fits C but zigzag
    rounding gives a member C + 1 tokens, which `min_ring_size` checks only when the two differ)."""
    for length in range(capacity + 1, 6 * capacity):
        k, _ = min_ring_size(length, capacity=capacity, num_ranks=10**6, cost_model=LLAMA, max_offload_ratio=0.0)
        assert k == brute_force_ring_size(length, capacity=capacity, num_ranks=10**6, cm=LLAMA, max_ratio=0.0)[0]


@pytest.mark.parametrize("host", [None, 2e9, 50e9])
@pytest.mark.parametrize("max_ratio", [0.3, 0.9, 1.0])
def test_offload_ring_size_is_the_smallest_feasible(host, max_ratio):
    cm = CostModel(**{**LLAMA.to_dict(), "host_memory_bytes": host})
    capacity = 2048
    for length in (2049, 5000, 30000, 200_000, 1_000_000):
        expected, need = brute_force_ring_size(length, capacity=capacity, num_ranks=4096, cm=cm, max_ratio=max_ratio)
        k, ratio = min_ring_size(length, capacity=capacity, num_ranks=4096, cost_model=cm, max_offload_ratio=max_ratio)
        assert k == expected
        assert ratio == pytest.approx(need, abs=1e-12)
        assert ratio <= max_ratio + 1e-12
        assert k <= -(-length // capacity)


def test_offload_shrinks_rings_of_long_sequences_only_where_it_hides():
    capacity = 16384
    k_off, r_off = min_ring_size(1 << 20, capacity=capacity, num_ranks=4096, cost_model=LLAMA, max_offload_ratio=1.0)
    k_no, r_no = min_ring_size(1 << 20, capacity=capacity, num_ranks=4096, cost_model=LLAMA, max_offload_ratio=0.0)
    assert k_no == 64 and r_no == 0.0
    assert k_off < k_no and 0 < r_off <= 1
    # a slow D2H link hides almost nothing, so almost no offload is allowed
    slow = CostModel(**{**LLAMA.to_dict(), "d2h_bandwidth": 1e3})
    k_slow, _ = min_ring_size(1 << 20, capacity=capacity, num_ranks=4096, cost_model=slow, max_offload_ratio=1.0)
    assert k_slow == k_no


def test_too_long_and_bad_arguments_raise():
    with pytest.raises(ValueError, match="length 1000 does not fit even on all 4 ranks"):
        min_ring_size(1000, capacity=100, num_ranks=4, cost_model=LLAMA, max_offload_ratio=0.0, seq=3)
    with pytest.raises(ValueError, match="capacity must be a positive"):
        shard_sequences([5], capacity=0, num_ranks=4, cost_model=LLAMA, max_offload_ratio=0.0)
    with pytest.raises(ValueError, match="num_ranks must be positive"):
        shard_sequences([5], capacity=10, num_ranks=0, cost_model=LLAMA, max_offload_ratio=0.0)


def test_whole_times_is_the_cost_model():
    lengths = [1, 17, 4096, 123457]
    for pp in (1, 4):
        vector = whole_times(lengths, cost_model=LLAMA, pp_size=pp)
        scalar = [shard_time(LLAMA, seq_len=s, num_tokens=s, ring_size=1, pp_size=pp) for s in lengths]
        np.testing.assert_allclose(vector, scalar, rtol=1e-12)
        mb = [LLAMA.microbatch_time([(s, s, ())], pp_size=pp) - LLAMA.microbatch_time([], pp_size=pp) for s in lengths]
        np.testing.assert_allclose(vector, mb, rtol=1e-9)


def _optimal_bins(sizes, capacity):
    """Fewest bins, by brute force over assignments (tiny inputs only)."""
    best = len(sizes)

    def place(i, rooms):
        nonlocal best
        if len(rooms) >= best:
            return
        if i == len(sizes):
            best = len(rooms)
            return
        for b in range(len(rooms)):
            if rooms[b] >= sizes[i]:
                rooms[b] -= sizes[i]
                place(i + 1, rooms)
                rooms[b] += sizes[i]
        place(i + 1, rooms + [capacity - sizes[i]])

    place(0, [])
    return best


def test_best_fit_packs_within_capacity_and_near_optimal():
    rng = np.random.default_rng(0)
    for _ in range(40):
        capacity = int(rng.integers(5, 40))
        sizes = rng.integers(1, capacity + 1, size=int(rng.integers(1, 9))).tolist()
        for order in ("decreasing", "given"):
            bins = best_fit(sizes, capacity=capacity, order=order)
            assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
            assert all(sum(sizes[i] for i in b) <= capacity for b in bins)
        assert len(best_fit(sizes, capacity=capacity)) <= 11 / 9 * _optimal_bins(sizes, capacity) + 1


def test_best_fit_gives_oversize_items_their_own_bin():
    bins = best_fit([30, 4, 5], capacity=10)
    assert [0] in bins and sorted(map(sorted, bins)) == [[0], [1, 2]]


def _best_fit_by_definition(sizes, capacity, decreasing):
    """Best fit written from its definition: scan every open bin for the least room that still fits
    (ties: the earliest bin); items of at least the capacity get a bin of their own."""
    order = range(len(sizes))
    if decreasing:
        order = sorted(order, key=lambda i: (-sizes[i], i))
    bins, rooms = [], []
    for item in order:
        if sizes[item] >= capacity:
            bins.append([item])
            rooms.append(0)
            continue
        fits = [b for b in range(len(bins)) if 0 < rooms[b] and sizes[item] <= rooms[b]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
        else:
            b = len(bins)
            bins.append([])
            rooms.append(capacity)
        bins[b].append(item)
        rooms[b] -= sizes[item]
    return bins


def test_best_fit_matches_its_definition_exactly():
    """Same bins, same order, same tie-breaking as the O(items x bins) definition (many equal sizes)."""
    rng = np.random.default_rng(1)
    for _ in range(200):
        capacity = int(rng.integers(1, 60))
        sizes = rng.integers(1, int(rng.choice([4, capacity + 1, 2 * capacity + 2])), size=int(rng.integers(0, 40))).tolist()
        for order in ("decreasing", "given"):
            assert best_fit(sizes, capacity=capacity, order=order) == _best_fit_by_definition(
                sizes, capacity, order == "decreasing")


def test_zigzag_token_counts_are_every_positions_zigzag_num_tokens():
    """The array form (`ep_floor`'s ring pieces) against the per-position definition, short documents with
    empty chunks included; every token held once."""
    for length in (1, 2, 3, 7, 64, 1000, 131_071):
        for ring_size in (1, 2, 3, 5, 8, 365):
            counts = zigzag_token_counts(length, ring_size)
            assert counts.tolist() == [zigzag_num_tokens(length, ring_size, p) for p in range(ring_size)]
            assert counts.sum() == length


@pytest.mark.parametrize("max_ratio", [1.0, 0.5, 0.0])
def test_the_lower_bound_from_the_shardings_ring_sizes_is_the_bound(max_ratio):
    """balance hands `step_time_lower_bound` the D(s) its sharding found (`fewest`) instead of finding them
    again, and the member times of a bound under another EP size (`sizers`): the bound must be the one it
    finds itself, to the bit (it decides which candidates run), sequences beyond C that offloading lets run
    whole (D(s) = 1) included."""
    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.plan.lengths import sample_global_batch
    from megatron_hdp.plan.timeline.bounds import step_time_lower_bound

    for model, ranks, mix, seed in (("llama-7b", 64, "byted", 0), ("mixtral-8x7b", 1024, "github", 1),
                                    ("llama-7b", 16, "github", 2)):
        cost_model = analytic_cost_model(model, "h100")
        lengths = np.asarray(sample_global_batch(mix, num_tokens=ranks * 2 * 8192, seed=seed, max_length=ranks * 4096))
        limits = dict(num_ranks=ranks, capacity=8192, cost_model=cost_model, max_offload_ratio=max_ratio)
        sharding = shard_sequences(lengths, **limits)
        long = lengths > 8192
        fewest = dict(zip(lengths[long].tolist(), sharding.ring_sizes[long].tolist()))
        assert step_time_lower_bound(lengths, **limits, fewest=fewest) == step_time_lower_bound(lengths, **limits)
        sizers = {}  # shared by cost models that differ in the EP size only (balance's EP and EP-1 passes)
        for ep in (8, 1, 4):
            model_ep = dataclasses.replace(cost_model, expert_parallel_size=ep)
            shared = step_time_lower_bound(lengths, **{**limits, "cost_model": model_ep}, fewest=fewest, sizers=sizers)
            assert shared == step_time_lower_bound(lengths, **{**limits, "cost_model": model_ep}), ep
        assert len(sizers) == 1
        with pytest.raises(AssertionError, match="beyond the EP size"):
            other = dataclasses.replace(cost_model, b1=2 * cost_model.b1)
            step_time_lower_bound(lengths, **{**limits, "cost_model": other}, fewest=fewest, sizers=sizers)


def test_pack_for_pipelines_without_pp_is_best_fit_per_rank():
    """Without PP every rank's whole sequences are packed best fit; ranks holding none or one take the
    shortcut (no bin, or one bin of that sequence): the bins best_fit itself gives them."""
    from megatron_hdp.plan.search.packing import pack_for_pipelines

    rng = np.random.default_rng(7)
    ranks = [rng.integers(1, 40_000, size=int(rng.choice([0, 1, 1, 2, 5]))).tolist() for _ in range(200)]
    got = pack_for_pipelines([(sizes, [1.0] * len(sizes), []) for sizes in ranks], capacity=16384, overhead=0.1,
                             pp_size=1)
    assert got == [best_fit(sizes, capacity=16384) for sizes in ranks]
