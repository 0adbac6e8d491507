"""Measure the cost model's per-layer coefficients and the offload link on this machine.

For a model shape, one `ReferenceLayer` (the shape's GEMMs and the fused causal attention kernel) runs
forward + backward on one document of each length s of a sweep:

    T(s)   = a1 * s^2 + b1 * s + g     fitted to the fastest of a few timed steps
    Act(s) = a2 * s + b2               fitted to the bytes of the distinct storages autograd keeps

Both fits are the project's one fit (`megatron_hdp.plan.cost.fit`: non-negative least squares, T's relative to
each time so that short sequences count as much as long ones). A MoE shape's layer runs a dense MLP of
the mean width a token runs through (`ModelShape.mlp_widths`: its top-k experts, shared experts, dense
layers), and `expert_share` is measured as the seconds per token of a gated MLP of the routed experts'
widths (`ModelShape.routed_expert_widths`) over the layer's linear work (`measure_expert_share`). A
multi-latent attention shape also gets `up_projection_time` (the forward of the latent's K/V
up-projection, timed per token) and
`latent_bytes_per_token` (the latent and RoPE key in the activation dtype, counted). The D2H/H2D bandwidths are timed with
pinned buffers and CUDA events on a GPU; on CPU the figure is a host memcpy, and the result says so.
The GPU is the real target; on CPU the same code runs small shapes, which is how CI tests it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.utils.checkpoint

from megatron_hdp.offload.reference_model import ReferenceLayer, rope_tables
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.cost.fit import fit_activation, fit_compute, fitted_cost_model
from megatron_hdp.plan.cost.presets import ModelShape

logger = logging.getLogger(__name__)

CALIBRATED_RECOMPUTE = ("none", "full")
"""The --recompute-granularity settings `calibrate` can measure."""


@dataclass(frozen=True)
class LayerSample:
    """One measured point of the sweep."""

    seq_len: int
    seconds: float
    """Forward + backward seconds of one layer on one document of seq_len tokens (fastest run)."""
    activation_bytes: int
    """Bytes of the distinct storages the layer saves for backward (its input included; the RoPE tables,
    which a model computes once for all layers, not)."""


@dataclass(frozen=True)
class Bandwidth:
    """Offload link speeds in bytes/s and how they were obtained."""

    d2h: float
    h2d: float
    source: str
    """'cuda-pinned' (pinned host buffers, CUDA events) or 'host-memcpy' (no GPU: a CPU copy)."""


@dataclass(frozen=True)
class Calibration:
    """The fitted cost model and the measurements behind it."""

    cost_model: CostModel
    samples: tuple[LayerSample, ...]
    bandwidth: Bandwidth
    device: str
    dtype: str

    def predicted_seconds(self, seq_len: int) -> float:
        """T(seq_len) from the fitted coefficients."""
        cm = self.cost_model
        return cm.a1 * seq_len**2 + cm.b1 * seq_len + cm.g

    def report(self) -> dict:
        """Measurements, fit and provenance as a JSON-ready dict."""
        return {
            "device": self.device,
            "dtype": self.dtype,
            "bandwidth_source": self.bandwidth.source,
            "samples": [
                {**dataclasses.asdict(s), "predicted_seconds": self.predicted_seconds(s.seq_len)}
                for s in self.samples
            ],
            "cost_model": self.cost_model.to_dict(),
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _fastest_seconds(fns: Sequence[Callable[[], object]], *, device: torch.device, repeats: int) -> list[float]:
    """The fastest of `repeats` timed calls of each function, after one warm-up call of each.

    The rounds go over all functions in turn, so a burst of other work on the machine hits one round of
    every function rather than every round of one; and it can only add time, hence the minimum.
    """
    for fn in fns:
        fn()  # warm-up: kernel selection, allocator growth
    rounds = [[_timed(fn, device) for fn in fns] for _ in range(repeats)]
    return [min(times) for times in zip(*rounds)]


def _layer_step(
    layer: ReferenceLayer, seq_len: int, *, device: torch.device, dtype: torch.dtype, recompute: str = "none"
):
    """A forward + backward of `layer` on one document of `seq_len` tokens, and its saved bytes.

    `recompute="full"` runs the layer as Megatron's full recomputation does (torch's reentrant
    checkpoint: only the input is saved, the forward runs again in the backward)."""
    if recompute == "full":
        run_layer = functools.partial(torch.utils.checkpoint.checkpoint, layer, use_reentrant=True)
    else:
        run_layer = layer
    x = torch.randn(1, seq_len, layer.proj.in_features, device=device, dtype=dtype, requires_grad=True)
    cos, sin = rope_tables(seq_len, layer.head_dim, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    # Parameters are no activation; the RoPE tables are computed once per model, not per layer.
    shared = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), cos, sin)}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in shared:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layer(x, cos, sin)
    return (lambda: run_layer(x, cos, sin).backward(grad)), sum(storages.values())


def measure_layer(
    *,
    shape: ModelShape,
    seq_lens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
    repeats: int,
    recompute: str = "none",
) -> list[LayerSample]:
    """Time and activation bytes of one layer, forward + backward, for each document length (under full
    recomputation when `recompute="full"`)."""
    if recompute not in CALIBRATED_RECOMPUTE:
        raise ValueError(
            f"calibrate measures recompute granularity {' or '.join(CALIBRATED_RECOMPUTE)}, got {recompute!r} "
            "(selective recompute of Megatron's core attention has no counterpart in the reference layer)"
        )
    if any(seq_len <= 0 for seq_len in seq_lens):
        raise ValueError(f"sequence lengths must be positive, got {list(seq_lens)}")
    torch.manual_seed(0)
    layer = ReferenceLayer(shape, device=device, dtype=dtype)
    steps = [_layer_step(layer, seq_len, device=device, dtype=dtype, recompute=recompute) for seq_len in seq_lens]
    seconds = _fastest_seconds([step for step, _ in steps], device=device, repeats=repeats)
    samples = [LayerSample(s, t, act) for s, t, (_, act) in zip(seq_lens, seconds, steps)]
    for sample in samples:
        logger.info("s=%d: %.3f ms, %.1f MiB saved", sample.seq_len, sample.seconds * 1e3, sample.activation_bytes / 2**20)
    layer.zero_grad(set_to_none=True)
    return samples


def measure_bandwidth(*, device: torch.device, nbytes: int = 256 << 20, repeats: int = 5) -> Bandwidth:
    """D2H and H2D bytes/s with pinned host memory (CUDA), or a host memcpy figure (CPU)."""
    if device.type != "cuda":
        src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        (seconds,) = _fastest_seconds([lambda: dst.copy_(src)], device=device, repeats=repeats)
        return Bandwidth(nbytes / seconds, nbytes / seconds, "host-memcpy")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        times = []
        for _ in range(repeats + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return nbytes / statistics.median(times[1:])

    return Bandwidth(timed(host, dev), timed(dev, host), "cuda-pinned")


def _gated_mlp_step(width: int, *, hidden: int, seq_len: int, device: torch.device,
                    dtype: torch.dtype) -> Callable[[], object]:
    """Forward + backward of a SwiGLU MLP of `width` channels on `seq_len` tokens of `hidden` channels."""
    gate_up = torch.randn(hidden, 2 * width, device=device, dtype=dtype, requires_grad=True)
    down = torch.randn(width, hidden, device=device, dtype=dtype, requires_grad=True)
    x = torch.randn(seq_len, hidden, device=device, dtype=dtype, requires_grad=True)

    def step() -> None:
        gate, up = (x @ gate_up).chunk(2, dim=-1)
        (torch.nn.functional.silu(gate) * up @ down).sum().backward()

    return step


def _projections_step(shape: ModelShape, *, seq_len: int, device: torch.device,
                      dtype: torch.dtype) -> Callable[[], object]:
    """Forward + backward of a layer's attention projections (QKV and output, `ReferenceLayer`'s) on
    `seq_len` tokens."""
    h = shape.hidden_size
    qkv = torch.randn(h, shape.q_channels + 2 * shape.kv_channels, device=device, dtype=dtype, requires_grad=True)
    proj = torch.randn(shape.q_channels, h, device=device, dtype=dtype, requires_grad=True)
    x = torch.randn(seq_len, h, device=device, dtype=dtype, requires_grad=True)
    attended = torch.randn(seq_len, shape.q_channels, device=device, dtype=dtype, requires_grad=True)
    return lambda: ((x @ qkv).sum() + (attended @ proj).sum()).backward()


def measure_expert_share(*, shape: ModelShape, seq_lens: Sequence[int], device: torch.device, dtype: torch.dtype,
                         repeats: int) -> float:
    """`CostModel.expert_share` on this device: of one layer's linear work (its attention projections and
    an MLP of the mean width a token runs through, `_layer_shape`), the share of the routed experts' (an
    MLP of `shape.routed_expert_widths()`), from the summed fastest times of each over `seq_lens`: the
    ratio of two linear works timed alike, so no fit (a noisy CPU can zero a fitted b1)."""
    torch.manual_seed(0)
    dense, h = _layer_shape(shape), shape.hidden_size
    kw = dict(device=device, dtype=dtype)
    routed = [_gated_mlp_step(max(1, round(shape.routed_expert_widths())), hidden=h, seq_len=s, **kw) for s in seq_lens]
    linear = [step for s in seq_lens for step in (_projections_step(dense, seq_len=s, **kw),
                                                   _gated_mlp_step(dense.ffn_hidden_size, hidden=h, seq_len=s, **kw))]
    seconds = _fastest_seconds(routed + linear, device=device, repeats=repeats)
    return min(1.0, sum(seconds[:len(routed)]) / sum(seconds[len(routed):]))


def measure_up_projection_seconds(*, shape: ModelShape, seq_lens: Sequence[int], device: torch.device,
                                  dtype: torch.dtype, repeats: int) -> float:
    """`CostModel.up_projection_time`: seconds per token of one forward K/V up-projection of multi-latent
    attention (latent -> every head's K without RoPE and V, `linear_kv_up_proj`), the summed fastest
    times over `seq_lens` divided by their tokens."""
    torch.manual_seed(0)
    heads = shape.num_attention_heads
    weight = torch.randn(shape.kv_lora_rank, heads * (shape.qk_head_dim + shape.v_head_dim), device=device, dtype=dtype)
    latents = [torch.randn(s, shape.kv_lora_rank, device=device, dtype=dtype) for s in seq_lens]
    seconds = _fastest_seconds([lambda latent=latent: latent @ weight for latent in latents], device=device,
                               repeats=repeats)
    return sum(seconds) / sum(seq_lens)


def _layer_shape(shape: ModelShape) -> ModelShape:
    """The dense shape `ReferenceLayer` runs for `shape`: a MoE shape's MLP at the mean width a token runs
    through (module docstring)."""
    if not shape.num_experts:
        return shape
    return dataclasses.replace(shape, ffn_hidden_size=round(shape.mlp_widths()), num_experts=0, moe_router_topk=1,
                               num_dense_layers=0, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=0)


def calibrate(
    *,
    shape: ModelShape,
    seq_lens: Sequence[int],
    device: torch.device,
    dtype: torch.dtype,
    ring_bandwidth: float,
    repeats: int = 3,
    bandwidth_bytes: int = 256 << 20,
    host_memory_bytes: float | None = None,
    recompute: str = "none",
) -> Calibration:
    """Measure a layer of `shape` over `seq_lens` and the offload link; fit the cost model; for a MoE
    shape measure `expert_share`, for multi-latent attention `up_projection_time` (module docstring).

    `ring_bandwidth` (bytes/s of a ring link) is not measured here: one device has no ring.
    `host_memory_bytes` (pinned host memory one rank may fill) is recorded as given. `recompute` (none or
    full) is measured, and recorded in the cost model (`recompute_granularity`).
    """
    if repeats <= 0:
        raise ValueError(f"repeats must be positive, got {repeats}")
    samples = measure_layer(
        shape=_layer_shape(shape), seq_lens=sorted(set(seq_lens)), device=device, dtype=dtype, repeats=repeats,
        recompute=recompute,
    )
    seq_lens = [x.seq_len for x in samples]
    bandwidth = measure_bandwidth(device=device, nbytes=bandwidth_bytes, repeats=repeats)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    timing = dict(seq_lens=seq_lens, device=device, dtype=dtype, repeats=repeats)
    extra = {}
    if shape.num_experts:
        extra["expert_share"] = measure_expert_share(shape=shape, **timing)
    if shape.is_mla:
        extra["up_projection_time"] = measure_up_projection_seconds(shape=shape, **timing)
        extra["latent_bytes_per_token"] = float(dtype_bytes * shape.latent_channels)
    cost_model = fitted_cost_model(
        fit_compute(seq_lens, [x.seconds for x in samples]),
        fit_activation(seq_lens, [x.activation_bytes for x in samples]),
        kv_bytes_per_token=float(dtype_bytes * shape.kv_ring_channels),
        activation_dtype_bytes=dtype_bytes,
        num_layers=shape.num_layers,
        ring_bandwidth=ring_bandwidth,
        d2h_bandwidth=bandwidth.d2h,
        h2d_bandwidth=bandwidth.h2d,
        host_memory_bytes=host_memory_bytes,
        recompute_granularity=recompute,
        **extra,
    )
    return Calibration(cost_model, tuple(samples), bandwidth, str(device), str(dtype).removeprefix("torch."))
