"""The offload state of one micro-batch: its saved tensors, grouped by layer, out and back again.

Autograd's saved-tensor hooks hand every tensor saved for backward to `pack` during the forward and ask
for it back through `unpack` during the backward. The layer hooks of `ActivationOffloader` bracket each
layer's forward (`begin_layer` / `end_layer`), so the tensors a layer saves form one group:

- forward, at the end of the layer: the group's first tensors (in the order they were saved) holding
  about `ratio` of its bytes are copied to host buffers in one batch and released on the device;
- backward, when the gradient of a layer's output arrives (its backward is about to start): the group
  of the layer before it is prefetched, so the copy runs under this layer's backward;
- `unpack` waits for the group's prefetch (compute never reads a tensor still in flight) and fetches a
  group nobody prefetched on the spot.

All state is per micro-batch (the hooks close over this object), so 1F1B schedules that run several
forwards before their backwards keep each micro-batch's tensors apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from megatron_hdp.offload.pool import HostBuffer, HostBufferPool
from megatron_hdp.offload.stats import StatsRecord
from megatron_hdp.offload.transfers import Transfers


def is_dense(tensor: torch.Tensor) -> bool:
    """True when the tensor's elements fill a contiguous span exactly once, in some dimension order."""
    dims = sorted((st, sz) for sz, st in zip(tensor.shape, tensor.stride()) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """Row-major strides of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(eq=False)
class _Slot:
    """One distinct saved tensor of a group (saved once or several times)."""

    group: "_Group"
    tensor: torch.Tensor | None
    """On the device: before it is offloaded, after it is prefetched; None while on host or consumed."""
    nbytes: int
    refs: int = 0
    """Saves of this tensor whose unpack has not happened yet."""
    moved: bool = False
    """Chosen for offload (its device copy, once back, comes from the group's prefetch)."""
    host: torch.Tensor | None = None
    buffer: HostBuffer | None = None


class _Group:
    """The saved tensors of one layer call in one micro-batch."""

    def __init__(self, position: int) -> None:
        self.position = position
        self.slots: list[_Slot] = []
        self.by_key: dict[tuple, _Slot] = {}
        self.offloaded: list[_Slot] = []
        self.offload_event: Any = None
        self.prefetched = False
        self.arrived: Any = None
        self.waited = False
        self.live = 0
        """Slots some unpack still needs; at zero the group lets go of them."""


def select_prefix(nbytes: list[int], ratio: float) -> int:
    """How many of a layer's saved tensors, taken in save order, make up `ratio` of its bytes.

    A tensor is taken while its midpoint lies within ratio * total, so the offloaded bytes are within
    half a tensor of the target; ratio 0 takes none and ratio 1 takes all.
    """
    target, taken = ratio * sum(nbytes), 0
    for count, size in enumerate(nbytes):
        if taken + size / 2 > target:
            return count
        taken += size
    return len(nbytes)


class MicrobatchOffload:
    """Per-micro-batch offload state and the pack/unpack hooks that feed it."""

    def __init__(
        self,
        *,
        ratio: float,
        transfers: Transfers,
        pool: HostBufferPool,
        record: StatsRecord,
        min_tensor_bytes: int,
        pinned_storages: set[int],
    ) -> None:
        self.ratio = ratio
        self._transfers = transfers
        self._pool = pool
        self._record = record
        self._min_tensor_bytes = max(1, min_tensor_bytes)
        self._pinned_storages = pinned_storages
        self._groups: list[_Group] = []
        self._current: _Group | None = None

    # --- forward -------------------------------------------------------------------------------
    def begin_layer(self, *, resident: bool) -> None:
        """A layer's forward starts; its saved tensors form a new group unless the layer is resident."""
        self._current = None if resident else _Group(len(self._groups))
        if self._current is not None:
            self._groups.append(self._current)

    def end_layer(self, output: Any) -> None:
        """A layer's forward ended: offload its group's share and arm the prefetch of the one before."""
        group, self._current = self._current, None
        if group is not None:
            count = select_prefix([slot.nbytes for slot in group.slots], self.ratio)
            self._offload(group, group.slots[:count])
            group.by_key.clear()
        anchor = _first_grad_tensor(output)
        if anchor is not None and self._groups:
            previous = len(self._groups) - (1 if group is None else 2)
            anchor.register_hook(self._backward_hook(group, previous))

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: tensors saved inside an offloading layer go into its group."""
        group = self._current
        if group is None or not self._eligible(tensor):
            return tensor
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        slot = group.by_key.get(key)
        if slot is None:
            slot = _Slot(group, tensor, tensor.numel() * tensor.element_size())
            group.by_key[key] = slot
            group.slots.append(slot)
            group.live += 1
        slot.refs += 1
        return slot

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """Activations only: not parameters, buffers or views of them, not user leaves, not tiny."""
        return (
            type(tensor) is torch.Tensor
            and tensor.layout == torch.strided
            and tensor.device.type == self._transfers.device.type
            and not (tensor.is_leaf and tensor.requires_grad)
            and tensor.numel() * tensor.element_size() >= self._min_tensor_bytes
            and tensor.untyped_storage().data_ptr() not in self._pinned_storages
        )

    def _offload(self, group: _Group, slots: list[_Slot]) -> None:
        copies = []
        for slot in slots:
            tensor = slot.tensor
            slot.buffer = self._pool.acquire(slot.nbytes)
            flat = slot.buffer.data[: slot.nbytes].view(tensor.dtype)
            stride = tensor.stride() if is_dense(tensor) else contiguous_strides(tensor.shape)
            slot.host = flat.as_strided(tensor.shape, stride)
            copies.append((tensor, slot.host, slot.buffer.ready))
        if not copies:
            return
        start = self._transfers.sync_seconds
        group.offload_event = self._transfers.to_host(copies)
        group.offloaded = slots
        for slot in slots:
            slot.tensor, slot.moved = None, True
        stats = self._record.stats
        stats.num_tensors += len(slots)
        stats.bytes_offloaded += sum(slot.nbytes for slot in slots)
        stats.exposed_wait_s += self._transfers.sync_seconds - start

    # --- backward ------------------------------------------------------------------------------
    def _backward_hook(self, group: _Group | None, previous: int):
        def hook(grad: torch.Tensor) -> None:
            if group is not None:
                self._prefetch(group)
            if previous >= 0:
                self._prefetch(self._groups[previous])

        return hook

    def _prefetch(self, group: _Group) -> None:
        if group.prefetched or not group.offloaded:
            return
        group.prefetched = True
        start = self._transfers.sync_seconds
        tensors, group.arrived = self._transfers.to_device(
            [slot.host for slot in group.offloaded], after=group.offload_event
        )
        for slot, tensor in zip(group.offloaded, tensors):
            self._pool.release(slot.buffer, ready=group.arrived)
            slot.tensor, slot.host, slot.buffer = tensor, None, None
        stats = self._record.stats
        stats.bytes_prefetched += sum(slot.nbytes for slot in group.offloaded)
        stats.exposed_wait_s += self._transfers.sync_seconds - start

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor back on the device, waiting for its prefetch if needed."""
        if isinstance(packed, torch.Tensor):
            return packed
        slot: _Slot = packed
        group = slot.group
        if slot.tensor is None and slot.host is not None:
            self._prefetch(group)
        if slot.tensor is None:
            raise RuntimeError(
                "an offloaded activation was unpacked after its backward consumed it; activation "
                "offloading supports one backward per forward (no retain_graph / double backward)"
            )
        if slot.moved and not group.waited:
            group.waited = True
            needed = self._transfers.wait(group.arrived, [s.tensor for s in group.offloaded])
            if needed is not None:
                self._record.add_wait(needed, group.arrived)
        tensor = slot.tensor
        slot.refs -= 1
        if slot.refs == 0:
            slot.tensor = None
            group.live -= 1
            if group.live == 0:
                group.slots, group.offloaded = [], []
        return tensor


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of a layer's output that gradients flow into (Megatron layers return tuples)."""
    candidates: Iterable[Any] = output if isinstance(output, (tuple, list)) else (output,)
    for item in candidates:
        if isinstance(item, torch.Tensor) and item.requires_grad:
            return item
    return None


def check_ratio(ratio: float) -> float:
    """`ratio` as a float in [0, 1], or ValueError naming it."""
    ratio = float(ratio)
    if not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
        raise ValueError(f"offload ratio must be in [0, 1], got {ratio}")
    return ratio
