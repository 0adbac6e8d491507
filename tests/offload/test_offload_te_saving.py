"""Offloading what Transformer Engine's FP8 linears save: every byte counted is a byte freed.

Issue 21 item 4 asked whether TE's FP8 weight workspace (cached across micro-batches, so it stays on the
device) reaches our pack hook as plain uint8 tensors and is copied and counted although nothing is freed.
TE's source (v2.8; the same in v2.18) says how a linear saves for backward (module/linear.py, forward):

* the weight workspace comes from `get_weight_workspace(cache_name="weight" if is_first_microbatch is not
  None else None)` (module/base.py). Cached (Megatron's TE linears pass is_first_microbatch unless
  --disable-parameter-transpose-cache), it is built with `quantizer.internal = False` "to ensure the
  tensor in the cache is an instance of torch.Tensor ... internal=True would cause the data to be removed
  in prepare_for_saving": a `Float8Tensor` (a torch.Tensor subclass). Uncached, it is an internal
  `Float8TensorBase` (not a torch.Tensor), made anew for this call.
* `prepare_for_saving(saved_inputmat, weightmat, weight, bias)` (tensor/quantized_tensor.py) passes a
  torch.Tensor (the cached `Float8Tensor`, an FP8 parameter under --fp8-param-gather) through whole and
  splits only the internal storage classes into their plain `_data`, `_transpose`, `_scale_inv`
  (tensor/_internal/float8_tensor_base.py `prepare_for_saving`), which it also detaches from the object.

So the cached workspace reaches the pack hook as a `Float8Tensor`, which `_eligible` refuses
(`type(tensor) is torch.Tensor`), and so does an FP8 parameter (also a leaf that requires grad); the
plain tensors that do pass belong to the quantized input and an uncached workspace, both made for this
micro-batch and referenced afterwards only by autograd: offloading them frees them. The claim is refuted;
this test holds it with a stand-in that saves exactly as TE does.
"""

import weakref

import torch

from megatron_hdp.offload.microbatch import MicrobatchOffload
from megatron_hdp.offload.pool import HostBufferPool
from megatron_hdp.offload.stats import OffloadStats, StatsRecord
from megatron_hdp.offload.transfers import Transfers


class Float8Standin(torch.Tensor):
    """TE's `Float8Tensor`: a torch.Tensor subclass (its FP8 bytes; the scale is left out here)."""


MADE: list[weakref.ref] = []
"""Every plain tensor the stand-in made for one call (quantized input, uncached workspace)."""


def _quantize(x: torch.Tensor) -> torch.Tensor:
    data = (x.detach() * 16).round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    MADE.append(weakref.ref(data))
    return data


class StandinFP8Linear(torch.autograd.Function):
    """y = x W^T, saving for backward what TE's `_Linear.forward` saves (module/linear.py)."""

    @staticmethod
    def forward(ctx, x, weight, cache):
        x_data, x_transpose = _quantize(x), _quantize(x.t().contiguous())  # internal: plain tensors
        if cache is not None:  # cache_name="weight": a Float8Tensor kept across micro-batches
            if "weight" not in cache:
                cache["weight"] = weight.detach().abs().to(torch.uint8).as_subclass(Float8Standin)
            weight_saved = [cache["weight"]]
        else:  # internal Float8TensorBase, split by prepare_for_saving into _data, _transpose, _scale_inv
            scale_inv = torch.ones(1)
            MADE.append(weakref.ref(scale_inv))
            weight_saved = [_quantize(weight), _quantize(weight.t().contiguous()), scale_inv]
        ctx.save_for_backward(x_data, x_transpose, *weight_saved, weight)
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        x_data, _, *_, weight = ctx.saved_tensors
        return grad @ weight, grad.t() @ x_data.view(torch.int8).float(), None


def _microbatch(weight: torch.Tensor, cache) -> StatsRecord:
    record = StatsRecord(OffloadStats())
    mb = MicrobatchOffload(ratio=1.0, transfers=Transfers(torch.device("cpu")), pool=HostBufferPool(pin_memory=False),
                           record=record, min_tensor_bytes=1, param_storages={weight.untyped_storage().data_ptr()})
    MADE.clear()
    x = torch.randn(256, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(mb.pack, mb.unpack):
        mb.begin_layer(resident=False)
        out = StandinFP8Linear.apply(x, weight, cache)
        mb.end_layer(out)
    freed = sum(ref() is None for ref in MADE)
    made_bytes = {"cached": 2 * 256 * 64, "uncached": 2 * 256 * 64 + 2 * 64 * 64 + 4}[
        "cached" if cache is not None else "uncached"]
    assert freed == len(MADE), "every plain tensor the layer made for this call was offloaded and freed"
    assert record.stats.bytes_offloaded == made_bytes, (record.stats.bytes_offloaded, made_bytes)
    out.sum().backward()
    return record


def test_only_bytes_that_are_freed_are_offloaded_and_counted():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    cache: dict = {}
    for _ in range(2):  # the cached workspace serves both micro-batches and stays on the device
        _microbatch(weight, cache)
        assert type(cache["weight"]) is Float8Standin
    _microbatch(weight, None)  # uncached: the workspace is this call's own and goes with it
