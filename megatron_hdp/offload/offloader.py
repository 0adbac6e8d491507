"""Selective activation offloading (ByteScale's third lever), one context per micro-batch.

    offloader = ActivationOffloader(layers=model.decoder.layers)
    with offloader.microbatch(ratio=plan_ratio):      # forward of one micro-batch
        loss = model(...)
    loss.backward()                                  # may run later (1F1B), outside the context
    stats = offloader.pop_step_stats()               # once per step

What `ratio` means: the plan's r (ByteScale Eq. 3, `plan/cost/sharding.py`) is the fraction of the
micro-batch's layer activations to move, and the planner's memory model is (1 - r) * Act(t) per layer.
The last `num_resident_layers` R of the L attached layers must stay (their backward starts as soon as
the forward ends, before any prefetch of theirs could land), so each other layer moves its first saved
storages (in save order) holding min(1, r * L / (L - R)) of its bytes: in total r of the activations,
as planned, whenever r <= (L - R) / L. A fraction of every layer, rather than all of the first layers,
because:
- it is what the cost model assumes (`CostModel.hidden_offload_ratio`): each layer's D2H copy of about
  r * Act(t) hides under one layer's forward (T(t) / 3; the prefetch under one layer's backward). Whole-layer selection would push Act(t) per
  layer through the link during the first layers, more than one layer's compute hides exactly when the
  planner chose r < 1 because bandwidth is short;
- memory relief is spread evenly over the forward, and every layer's prefetch is small and runs under
  the backward of the layer after it.

What moves: tensors autograd saves inside the attached layers that are plain strided tensors on the
offload device of at least `min_tensor_bytes`, excluding parameters, buffers and any view of them (their
storage is compared with the layers' own, which also catches `weight.t()` saved by a linear layer and
parameters living in Megatron DDP's contiguous buffer), and leaf tensors that require grad (inputs the
caller still holds). The saved views of one storage move together, as one copy of the byte span they
cover, and come back with their offsets and strides (see `microbatch.py`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from megatron_hdp.offload.microbatch import MicrobatchOffload, check_ratio
from megatron_hdp.offload.pool import HostBufferPool
from megatron_hdp.offload.stats import OffloadStats, StatsRecord
from megatron_hdp.offload.transfers import Transfers

logger = logging.getLogger(__name__)


@dataclass
class OffloadConfig:
    """How activation offloading picks what to move (the ratio comes from the plan per micro-batch)."""

    num_resident_layers: int = 1
    """Last layers whose activations never leave the device: their backward starts right after the
    forward, before any prefetch of theirs could land."""

    min_tensor_bytes: int = 1 << 20
    """Saved tensors smaller than this stay on the device (norm statistics, softmax LSE): a copy of
    them costs more in launch overhead than it frees."""

    def __post_init__(self) -> None:
        if self.num_resident_layers < 0:
            raise ValueError(f"num_resident_layers must be >= 0, got {self.num_resident_layers}")
        if self.min_tensor_bytes < 0:
            raise ValueError(f"min_tensor_bytes must be >= 0, got {self.min_tensor_bytes}")


class ActivationOffloader:
    """Owns the layer hooks, the transfer streams and the pinned-buffer pool of one model chunk.

    The layers must be the transformer layers in forward order (e.g. a Megatron `TransformerBlock`'s
    `layers`), none nested in another; each is bracketed by a forward pre-hook and a forward hook.
    """

    def __init__(
        self,
        *,
        layers: Sequence[nn.Module],
        config: OffloadConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("ActivationOffloader needs at least one layer, got none")
        self.config = config or OffloadConfig()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._transfers = Transfers(self.device)
        self.pool = HostBufferPool(pin_memory=self.device.type == "cuda")
        self._active: MicrobatchOffload | None = None
        self._records: list[StatsRecord] = []
        self._warned_short = False
        num_offloadable = len(self.layers) - self.config.num_resident_layers
        if num_offloadable <= 0:
            logger.warning(
                "all %d layers are resident (num_resident_layers=%d): activation offloading moves nothing",
                len(self.layers),
                self.config.num_resident_layers,
            )
        self._handles = []
        for index, layer in enumerate(self.layers):
            resident = index >= num_offloadable
            self._handles.append(layer.register_forward_pre_hook(self._begin_hook(resident)))
            self._handles.append(layer.register_forward_hook(self._end_hook()))

    def _begin_hook(self, resident: bool):
        def hook(module: nn.Module, args: tuple) -> None:
            if self._active is not None:
                self._active.begin_layer(resident=resident)

        return hook

    def _end_hook(self):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if self._active is not None:
                self._active.end_layer(output)

        return hook

    @contextlib.contextmanager
    def microbatch(self, *, ratio: float) -> Iterator[OffloadStats]:
        """Run one micro-batch's forward inside this context to offload `ratio` of its activations.

        Yields the micro-batch's stats, which fill in as its forward and backward run. Ratio 0 installs
        no hooks at all. The backward may run after the context closed, and other micro-batches'
        forwards may come in between (1F1B).
        """
        ratio = check_ratio(ratio)
        if self._active is not None:
            raise RuntimeError("offloader.microbatch() contexts cannot nest: one forward at a time")
        record = StatsRecord(OffloadStats(num_microbatches=1))
        self._records.append(record)
        if ratio == 0.0 or self.config.num_resident_layers >= len(self.layers):
            yield record.stats
            return
        num_offloadable = len(self.layers) - self.config.num_resident_layers
        if ratio * len(self.layers) > num_offloadable and not self._warned_short:
            self._warned_short = True
            logger.warning(
                "offload ratio %g exceeds what %d of %d layers can move (%d stay resident): moving %g instead",
                ratio, num_offloadable, len(self.layers), self.config.num_resident_layers,
                num_offloadable / len(self.layers),
            )
        self._active = MicrobatchOffload(
            ratio=min(1.0, ratio * len(self.layers) / num_offloadable),
            transfers=self._transfers,
            pool=self.pool,
            record=record,
            min_tensor_bytes=self.config.min_tensor_bytes,
            param_storages=self._layer_storages(),
        )
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._active.pack, self._active.unpack):
                yield record.stats
        finally:
            self._active = None

    def _layer_storages(self) -> set[int]:
        """Storages of the layers' parameters and buffers, read afresh (DDP may have moved them)."""
        tensors = itertools.chain.from_iterable(
            itertools.chain(layer.parameters(), layer.buffers()) for layer in self.layers
        )
        return {t.untyped_storage().data_ptr() for t in tensors}

    def pop_step_stats(self) -> OffloadStats:
        """Sum of the micro-batches since the last call (their backwards must have run); resets.

        On CUDA this waits for the transfers whose stall it measures.
        """
        total = OffloadStats()
        for record in self._records:
            total = total + record.resolve()
        self._records = []
        logger.debug("%s", total.summary())
        return total

    def detach(self) -> None:
        """Remove the layer hooks (the pool keeps its buffers until `pool.clear()`)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def pop_offload_stats(offloaders: Sequence[ActivationOffloader]) -> Optional[OffloadStats]:
    """The step's `OffloadStats` of this rank, summed over its model chunks' offloaders (None: none)."""
    if not offloaders:
        return None
    return sum((offloader.pop_step_stats() for offloader in offloaders[1:]), offloaders[0].pop_step_stats())
