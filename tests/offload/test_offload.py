"""Activation offloading on CPU: numerics survive the round trip, the byte accounting is exact, r=0 is a no-op.

The same hooks run on CUDA with streams; here the copies are synchronous host-to-host, which is enough to
check that every saved tensor of the chosen layers goes out and comes back bit for bit.
"""

import math
import subprocess
import sys
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from megatron_hdp.offload import ActivationOffloader, OffloadConfig
from megatron_hdp.offload.microbatch import MicrobatchOffload, select_prefix
from megatron_hdp.offload import pool as pool_module
from megatron_hdp.offload.pool import HostBufferPool, bucket_bytes
from megatron_hdp.plan.cost.model import HOST_BUFFER_OVERHEAD
from megatron_hdp.offload.reference_model import ReferenceGPT
from megatron_hdp.offload.stats import OffloadStats, StatsRecord
from megatron_hdp.offload.transfers import Transfers
from megatron_hdp.plan.cost.presets import ModelShape

SHAPE = ModelShape(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=128, vocab_size=97)
ALL = OffloadConfig(min_tensor_bytes=0)


def _model():
    torch.manual_seed(0)
    return ReferenceGPT(SHAPE)


def _batch(seed=1, seq=48):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, SHAPE.vocab_size, (2, seq), generator=gen),
            torch.randint(0, SHAPE.vocab_size, (2, seq), generator=gen))


def _step(model, offloader, ratios, batches):
    """Forwards of all micro-batches first, then their backwards (the 1F1B warm-up order)."""
    model.zero_grad()
    losses = []
    for ratio, (tokens, labels) in zip(ratios, batches):
        with offloader.microbatch(ratio=ratio):
            losses.append(model(tokens, labels))
    for loss in losses:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return [loss.detach() for loss in losses], grads


def _expected_bytes(model, batch, ratio, config):
    """Bytes the documented rule moves, from a separate pass that only records saved tensors.

    Per layer call, the eligible saved tensors are grouped by storage; a storage's bytes are the span its
    saved views cover, started on a 512-byte boundary; in each of the first L - R layers, storages are
    taken in first-save order while the midpoint of each lies within min(1, ratio * L / (L - R)) of the
    layer's total.
    """
    layers = list(model.layers)
    ratio = min(1.0, ratio * len(layers) / (len(layers) - config.num_resident_layers))
    params = {t.untyped_storage().data_ptr() for layer in layers for t in [*layer.parameters(), *layer.buffers()]}
    per_layer = []  # per layer call: {storage address: [first byte, end byte]} in first-save order
    inside = [False]

    def begin(module, args):
        per_layer.append({})
        inside[0] = True

    def end(module, args, output):
        inside[0] = False

    def pack(t):
        nbytes = t.numel() * t.element_size()
        eligible = (type(t) is torch.Tensor and not (t.is_leaf and t.requires_grad)
                    and t.untyped_storage().data_ptr() not in params and nbytes >= max(1, config.min_tensor_bytes))
        if inside[0] and eligible:
            first = t.storage_offset() * t.element_size()
            last = first + t.element_size() * (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())))
            span = per_layer[-1].setdefault(t.untyped_storage().data_ptr(), [first - first % 512, last])
            span[0], span[1] = min(span[0], first - first % 512), max(span[1], last)
        return t

    hooks = [h for layer in layers for h in (layer.register_forward_pre_hook(begin), layer.register_forward_hook(end))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*batch)
    for hook in hooks:
        hook.remove()
    total = 0
    for spans in per_layer[: len(layers) - config.num_resident_layers]:
        sizes = [end - start for start, end in spans.values()]
        target, taken = ratio * sum(sizes), 0
        for size in sizes:
            if taken + size / 2 > target:
                break
            taken += size
        total += taken
    return total


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_loss_and_gradients_equal_without_offload(ratio):
    model, batch = _model(), _batch()
    reference = _step(model, ActivationOffloader(layers=model.layers, config=ALL), [0.0], [batch])
    offloader = ActivationOffloader(layers=model.layers, config=ALL)
    losses, grads = _step(model, offloader, [ratio], [batch])
    assert torch.equal(losses[0], reference[0][0])
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    stats = offloader.pop_step_stats()
    assert stats.num_microbatches == 1
    assert stats.bytes_offloaded == _expected_bytes(model, batch, ratio, ALL)
    assert stats.bytes_prefetched == stats.bytes_offloaded
    if ratio == 0.0:
        assert stats == OffloadStats(num_microbatches=1)
        assert offloader.pool.num_allocations == 0
    else:
        assert stats.num_tensors > 0 and stats.exposed_wait_s > 0
        assert stats.num_late_fetches == 0  # every group came back through a backward hook
    if ratio == 0.5:  # half of all four layers' bytes, taken from the first three
        every_layer = _expected_bytes(model, batch, 1.0, OffloadConfig(num_resident_layers=0, min_tensor_bytes=0))
        assert 0.4 * every_layer < stats.bytes_offloaded < 0.6 * every_layer


def test_interleaved_microbatches_keep_their_own_tensors():
    """F0 F1 F2, then B0 B1 B2, each with its own ratio, as 1F1B does in its warm-up."""
    model = _model()
    batches = [_batch(seed) for seed in (1, 2, 3)]
    reference = _step(model, ActivationOffloader(layers=model.layers, config=ALL), [0.0] * 3, batches)
    offloader = ActivationOffloader(layers=model.layers, config=ALL)
    losses, grads = _step(model, offloader, [1.0, 0.0, 0.5], batches)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference[0]))
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)
    stats = offloader.pop_step_stats()
    expected = sum(_expected_bytes(model, b, r, ALL) for b, r in zip(batches, [1.0, 0.0, 0.5]))
    assert stats.num_microbatches == 3 and stats.bytes_offloaded == expected == stats.bytes_prefetched


def test_every_layer_offloading_is_still_exact():
    model, batch = _model(), _batch()
    reference = _step(model, ActivationOffloader(layers=model.layers, config=ALL), [0.0], [batch])
    config = OffloadConfig(num_resident_layers=0, min_tensor_bytes=0)
    offloader = ActivationOffloader(layers=model.layers, config=config)
    _, grads = _step(model, offloader, [1.0], [batch])
    assert all(torch.equal(grads[name], grad) for name, grad in reference[1].items())
    stats = offloader.pop_step_stats()
    assert stats.bytes_offloaded == _expected_bytes(model, batch, 1.0, config) > _expected_bytes(model, batch, 1.0, ALL)
    assert stats.num_late_fetches == 0  # the last layer's group is fetched by its own output's hook


def test_backward_reads_the_prefetched_copies(monkeypatch):
    """Corrupting what comes back changes the gradients: the backward really uses the round trip."""
    model, batch = _model(), _batch()
    reference = _step(model, ActivationOffloader(layers=model.layers, config=ALL), [0.0], [batch])
    original = Transfers.to_device

    def corrupted(self, hosts, *, after):
        tensors, event = original(self, hosts, after=after)
        return [t.zero_() for t in tensors], event

    monkeypatch.setattr(Transfers, "to_device", corrupted)
    _, grads = _step(model, ActivationOffloader(layers=model.layers, config=ALL), [1.0], [batch])
    assert not torch.equal(grads["layers.0.qkv.weight"], reference[1]["layers.0.qkv.weight"])
    assert torch.equal(grads["layers.3.qkv.weight"], reference[1]["layers.3.qkv.weight"])  # resident


def test_parameters_and_their_views_never_move(monkeypatch):
    model = _model()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved = []
    original = Transfers.to_host

    def spy(self, copies):
        moved.extend(t.untyped_storage().data_ptr() for t, _, _ in copies)
        return original(self, copies)

    monkeypatch.setattr(Transfers, "to_host", spy)
    _step(model, ActivationOffloader(layers=model.layers, config=ALL), [1.0], [_batch()])
    assert moved and not params.intersection(moved)


def test_small_tensors_stay_and_pool_is_reused_across_steps():
    model, batch = _model(), _batch()
    config = OffloadConfig(min_tensor_bytes=2 * 48 * SHAPE.hidden_size * 4)  # one [2, 48, h] fp32 tensor
    offloader = ActivationOffloader(layers=model.layers, config=config)
    _step(model, offloader, [1.0], [batch])
    first = offloader.pop_step_stats()
    allocations = offloader.pool.num_allocations
    assert first.bytes_offloaded == _expected_bytes(model, batch, 1.0, config) > 0
    assert first.bytes_offloaded < _expected_bytes(model, batch, 1.0, ALL)
    _step(model, offloader, [1.0], [batch])
    assert offloader.pop_step_stats().bytes_offloaded == first.bytes_offloaded
    assert offloader.pool.num_allocations == allocations


@pytest.mark.parametrize("max_piece", [pool_module.MAX_PIECE_BYTES, 8192])
def test_round_trip_is_a_real_copy_with_the_same_layout(monkeypatch, max_piece):
    """Also with spans split over many host pieces (8 KiB pieces: the qkv span is 768 KiB)."""
    monkeypatch.setattr(pool_module, "MAX_PIECE_BYTES", max_piece)
    record = StatsRecord(OffloadStats())
    mb = MicrobatchOffload(ratio=1.0, transfers=Transfers(torch.device("cpu")), pool=HostBufferPool(pin_memory=False),
                           record=record, min_tensor_bytes=0, param_storages=set())
    qkv = torch.randn(1024, 3 * 64)
    q, k, v = qkv.split(64, dim=1)  # three strided views of one storage
    other = torch.randn(64, 256).t()  # a transposed tensor of its own
    originals = [x.clone() for x in (q, k, v, other)]
    mb.begin_layer(resident=False)
    packed = [mb.pack(x) for x in (q, k, v, other, q)]  # q saved twice
    mb.end_layer(None)
    qkv.zero_(), other.zero_()  # what the device memory holds after the offload no longer matters
    back = [mb.unpack(p) for p in packed]
    for got, want, old in zip(back, originals + originals[:1], (q, k, v, other, q)):
        assert torch.equal(got, want) and got.stride() == old.stride() and got.data_ptr() != old.data_ptr()
    assert back[0].untyped_storage().data_ptr() == back[1].untyped_storage().data_ptr()  # still one storage
    assert record.stats.num_tensors == 2 and record.stats.bytes_offloaded == (1024 * 192 + 64 * 256) * 4
    assert record.stats.bytes_prefetched == record.stats.bytes_offloaded
    assert record.stats.num_late_fetches == 1  # no layer output, so no hook: fetched on first unpack
    with pytest.raises(RuntimeError, match="retain_graph"):
        mb.unpack(packed[1])


def test_offloaded_device_tensors_are_released_and_the_rest_kept():
    mb = MicrobatchOffload(ratio=0.5, transfers=Transfers(torch.device("cpu")), pool=HostBufferPool(pin_memory=False),
                           record=StatsRecord(OffloadStats()), min_tensor_bytes=0, param_storages=set())
    first, second = torch.randn(256, 64), torch.randn(256, 64)
    refs = [weakref.ref(first), weakref.ref(second)]
    mb.begin_layer(resident=False)
    packed = [mb.pack(first), mb.pack(second)]
    del first, second
    mb.end_layer(None)
    assert refs[0]() is None and refs[1]() is not None  # the first half moved, the second stayed
    assert [mb.unpack(p).shape for p in packed] == [(256, 64), (256, 64)]


def test_retain_graph_second_backward_is_refused():
    model, batch = _model(), _batch()
    offloader = ActivationOffloader(layers=model.layers, config=ALL)
    with offloader.microbatch(ratio=1.0):
        loss = model(*batch)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph"):
        loss.backward()


@pytest.mark.parametrize("ratio", [-0.1, 1.5, math.nan])
def test_bad_ratio_is_named(ratio):
    offloader = ActivationOffloader(layers=_model().layers)
    with pytest.raises(ValueError, match="offload ratio"):
        with offloader.microbatch(ratio=ratio):
            pass


def test_bad_config_and_nesting():
    with pytest.raises(ValueError, match="num_resident_layers"):
        OffloadConfig(num_resident_layers=-1)
    with pytest.raises(ValueError, match="min_tensor_bytes"):
        OffloadConfig(min_tensor_bytes=-1)
    with pytest.raises(ValueError, match="at least one layer"):
        ActivationOffloader(layers=[])
    offloader = ActivationOffloader(layers=_model().layers)
    with offloader.microbatch(ratio=0.5), pytest.raises(RuntimeError, match="nest"):
        with offloader.microbatch(ratio=0.5):
            pass


def test_a_ratio_beyond_the_offloadable_layers_warns_once(caplog):
    model, batch = _model(), _batch()
    offloader = ActivationOffloader(layers=model.layers, config=ALL)
    _step(model, offloader, [0.75, 0.9, 1.0], [batch] * 3)  # 3 of 4 layers can move at most 0.75
    assert [r.message for r in caplog.records].count(
        "offload ratio 0.9 exceeds what 3 of 4 layers can move (1 stay resident): moving 0.75 instead") == 1
    assert len(caplog.records) == 1


def test_detach_removes_the_hooks():
    model, batch = _model(), _batch()
    offloader = ActivationOffloader(layers=model.layers, config=ALL)
    offloader.detach()
    _step(model, offloader, [1.0], [batch])
    assert offloader.pop_step_stats().bytes_offloaded == 0


def test_select_prefix():
    assert select_prefix([], 0.5) == 0
    assert select_prefix([4, 4, 4, 4], 0.0) == 0
    assert select_prefix([4, 4, 4, 4], 1.0) == 4
    assert select_prefix([4, 4, 4, 4], 0.5) == 2
    assert select_prefix([10, 1, 1], 0.4) == 0  # half of the first tensor lies above the target
    assert select_prefix([10, 1, 1], 0.5) == 1


@given(st.integers(min_value=0, max_value=1 << 40))
def test_bucket_holds_the_bytes_with_little_waste(nbytes):
    size = bucket_bytes(nbytes)
    assert size >= nbytes and size % 4096 == 0 and (nbytes < 32768 or size <= nbytes * 1.125)
    assert bucket_bytes(size) == size


def _caching_host_allocator_pins(size: int) -> int:
    """Bytes PyTorch's CachingHostAllocator pins for one request of `size` bytes: the next power of two
    (aten/src/ATen/core/CachingHostAllocator.h, `allocate`: c10::llvm::PowerOf2Ceil; torch 2.13 with
    its default, unlimited pinned_max_round_threshold)."""
    return 1 << (size - 1).bit_length()


def test_pool_reports_what_the_pinned_allocator_really_pins(monkeypatch):
    """Every pinned allocation the pool makes is intercepted and charged as the allocator rounds it; the
    pool's own count must equal that, and stay within the planner's HOST_BUFFER_OVERHEAD of the bytes
    asked for. (A 9/8 x 2^n bucket allocated as one block pins 2^(n+1): nearly twice.)"""
    requests = []
    empty = torch.empty

    def recording_empty(*size, pin_memory=False, **kwargs):
        if pin_memory:
            requests.append(math.prod(size[0] if isinstance(size[0], (tuple, list)) else size))
        return empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    pool = HostBufferPool(pin_memory=True)
    spans = [(9 << 20) + 1, 9 << 20, 1 << 20, (1 << 20) + 4096, 300 << 20, 5 << 27, 3 << 15, 40961]
    buffers = [pool.acquire(n) for n in spans]
    pinned = sum(_caching_host_allocator_pins(n) for n in requests)
    assert pinned == pool.bytes_allocated
    assert pinned <= HOST_BUFFER_OVERHEAD * sum(spans)
    for n, buffer in zip(spans, buffers):
        assert sum(v.numel() for v in buffer.views(n)) == n
        assert sum(_caching_host_allocator_pins(p.numel()) for p in buffer.pieces) <= HOST_BUFFER_OVERHEAD * n
    for buffer in buffers:
        pool.release(buffer)
    count = len(requests)
    again = [pool.acquire(n) for n in spans]  # the same spans again: all from the free lists
    assert len(requests) == count and pool.bytes_allocated == pinned and pool.bytes_free == 0
    pool.release(again[0])
    pool.clear()
    assert pool.bytes_allocated == pinned - sum(p.numel() for p in again[0].pieces)


@given(st.integers(min_value=32768, max_value=1 << 36))
def test_pinned_bytes_of_a_span_are_within_the_planners_overhead(nbytes):
    """The planner budgets HOST_BUFFER_OVERHEAD pinned bytes per offloaded byte (spans >= 32 KiB)."""
    pieces = pool_module.piece_sizes(nbytes)
    assert sum(pieces) >= nbytes
    assert sum(_caching_host_allocator_pins(p) for p in pieces) <= HOST_BUFFER_OVERHEAD * nbytes


def test_offload_and_calibrate_never_import_megatron():
    """docs/architecture.md layering: offload/ never imports Megatron, and `megatron-hdp calibrate` runs without it."""
    code = ("import sys, megatron_hdp.offload, megatron_hdp.harness.calibrate, megatron_hdp.commands.calibrate; "
            "sys.exit(any(m == 'megatron' or m.startswith('megatron.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
