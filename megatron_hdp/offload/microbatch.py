"""The offload state of one micro-batch: its saved tensors, grouped by layer, out and back again.

Autograd's saved-tensor hooks hand every tensor saved for backward to `pack` during the forward and ask
for it back through `unpack` during the backward. The layer hooks of `ActivationOffloader` bracket each
layer's forward (`begin_layer` / `end_layer`), so the tensors a layer saves form one group:

- forward, at the end of the layer: the group's first storages (in the order they were saved) holding
  about `ratio` of its bytes (the per-layer ratio the offloader derives from the plan's) are copied to
  host buffers in one batch and released on the device;
- backward, when the gradient of a layer's output arrives (its backward is about to start): the group
  of the layer before it is prefetched, so the copy runs under this layer's backward;
- `unpack` waits for the group's prefetch (compute never reads a tensor still in flight) and fetches a
  group nobody prefetched on the spot.

The unit that moves is a storage, not a tensor: the saved views of one storage (q, k and v of one QKV
projection; the two halves of a gated MLP's FC1 output) travel as one copy of the byte span they cover
and come back as views with the same offsets and strides. So the device memory freed is what was
counted, and the backward sees the exact layouts it saw before, which keeps results bit-identical.

All state is per micro-batch (the hooks close over this object), so 1F1B schedules that run several
forwards before their backwards keep each micro-batch's tensors apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from megatron_hdp.offload.pool import HostBuffer, HostBufferPool
from megatron_hdp.offload.stats import StatsRecord
from megatron_hdp.offload.transfers import Transfers

SPAN_ALIGNMENT = 512
"""Spans start on this byte boundary of their storage, so restored views keep the alignment (mod the
allocator's own 512 bytes) that kernels may pick their code path by."""


def byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """Half-open byte interval of its storage that a (non-empty) tensor view touches."""
    size = tensor.element_size()
    first = tensor.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    return first * size, (last + 1) * size


@dataclass(eq=False)
class _Packed:
    """What autograd keeps for one save: the tensor itself until its storage moves, then how to rebuild it."""

    slot: "_Slot"
    tensor: torch.Tensor | None
    byte_offset: int
    size: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(eq=False)
class _Slot:
    """One device storage of a group: the span of it that saved views cover moves as one copy."""

    group: "_Group"
    storage: torch.UntypedStorage | None
    start: int
    end: int
    saves: list[_Packed] = field(default_factory=list)
    refs: int = 0
    """Saves whose unpack has not happened yet."""
    host: list[torch.Tensor] | None = None
    """The span's host copy: consecutive views of its buffer's pieces."""
    buffer: HostBuffer | None = None
    restored: torch.Tensor | None = None
    """uint8 device tensor holding the span again after the prefetch."""

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class _Group:
    """The saved storages of one layer call in one micro-batch."""

    def __init__(self) -> None:
        self.slots: dict[int, _Slot] = {}
        """By storage address (all are alive while the layer runs, so addresses are unique)."""
        self.offloaded: list[_Slot] = []
        self.offload_event: Any = None
        self.prefetched = False
        self.arrived: Any = None
        self.waited = False


def select_prefix(nbytes: list[int], ratio: float) -> int:
    """How many of a layer's saved storages, taken in save order, make up `ratio` of its bytes.

    A storage is taken while its midpoint lies within ratio * total, so the offloaded bytes are within
    half a storage of the target; ratio 0 takes none and ratio 1 takes all.
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
        param_storages: set[int],
    ) -> None:
        self.ratio = ratio
        self._transfers = transfers
        self._pool = pool
        self._record = record
        self._min_tensor_bytes = max(1, min_tensor_bytes)
        self._param_storages = param_storages
        self._groups: list[_Group] = []
        self._current: _Group | None = None

    # --- forward -------------------------------------------------------------------------------
    def begin_layer(self, *, resident: bool) -> None:
        """A layer's forward starts; its saved tensors form a new group unless the layer is resident."""
        self._current = None if resident else _Group()
        if self._current is not None:
            self._groups.append(self._current)

    def end_layer(self, output: Any) -> None:
        """A layer's forward ended: offload its group's share and arm the prefetch of the one before."""
        group, self._current = self._current, None
        if group is not None:
            slots = list(group.slots.values())
            group.slots = {}
            count = select_prefix([slot.nbytes for slot in slots], self.ratio)
            self._offload(group, slots[:count])
            for slot in slots:  # from here on only the _Packed entries reach the device tensors
                slot.storage = None
                slot.saves.clear()
        anchor = _first_grad_tensor(output)
        if anchor is not None and self._groups:
            previous = len(self._groups) - (1 if group is None else 2)
            anchor.register_hook(self._backward_hook(group, previous))

    def pack(self, tensor: torch.Tensor) -> Any:
        """Saved-tensor pack hook: tensors saved inside an offloading layer join their storage's slot."""
        group = self._current
        if group is None or not self._eligible(tensor):
            return tensor
        storage = tensor.untyped_storage()
        offset, end = byte_span(tensor)
        start = offset - offset % SPAN_ALIGNMENT
        slot = group.slots.get(storage.data_ptr())
        if slot is None:
            slot = _Slot(group, storage, start, end)
            group.slots[storage.data_ptr()] = slot
        slot.start, slot.end = min(slot.start, start), max(slot.end, end)
        slot.refs += 1
        packed = _Packed(slot, tensor, offset, tensor.shape, tensor.stride(), tensor.dtype)
        slot.saves.append(packed)
        return packed

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """Activations only: not parameters, buffers or views of them, not user leaves, not tiny."""
        return (
            type(tensor) is torch.Tensor
            and tensor.layout == torch.strided
            and tensor.device == self._transfers.device
            and not (tensor.is_leaf and tensor.requires_grad)
            and tensor.numel() * tensor.element_size() >= self._min_tensor_bytes
            and tensor.untyped_storage().data_ptr() not in self._param_storages
        )

    def _offload(self, group: _Group, slots: list[_Slot]) -> None:
        if not slots:
            return
        copies = []
        for slot in slots:
            slot.buffer = self._pool.acquire(slot.nbytes)
            slot.host = slot.buffer.views(slot.nbytes)
            offset = slot.start
            for host, ready in zip(slot.host, slot.buffer.ready):
                source = torch.empty(0, dtype=torch.uint8, device=self._transfers.device)
                source.set_(slot.storage, offset, (host.numel(),), (1,))
                copies.append((source, host, ready))
                offset += host.numel()
        start = self._transfers.sync_seconds
        group.offload_event = self._transfers.to_host(copies)
        group.offloaded = slots
        for slot in slots:
            for packed in slot.saves:
                packed.tensor = None
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
            slot.restored, slot.host, slot.buffer = tensor, None, None
        stats = self._record.stats
        stats.bytes_prefetched += sum(slot.nbytes for slot in group.offloaded)
        stats.exposed_wait_s += self._transfers.sync_seconds - start

    def unpack(self, packed: Any) -> torch.Tensor:
        """Saved-tensor unpack hook: the tensor back on the device, waiting for its prefetch if needed."""
        if isinstance(packed, torch.Tensor):
            return packed
        slot: _Slot = packed.slot
        group = slot.group
        if packed.tensor is not None:
            tensor = packed.tensor
        else:
            if slot.restored is None and slot.host is None:
                raise RuntimeError(
                    "an offloaded activation was unpacked after its backward consumed it; activation "
                    "offloading supports one backward per forward (no retain_graph / double backward)"
                )
            if slot.restored is None:  # no backward hook prefetched it: the copy is fully exposed
                self._prefetch(group)
                self._record.stats.num_late_fetches += 1
            if not group.waited:
                group.waited = True
                needed = self._transfers.wait(group.arrived, [s.restored for s in group.offloaded])
                if needed is not None:
                    self._record.add_wait(needed, group.arrived)
            item = packed.dtype.itemsize
            tensor = torch.empty(0, dtype=packed.dtype, device=self._transfers.device)
            offset = (packed.byte_offset - slot.start) // item
            tensor.set_(slot.restored.untyped_storage(), offset, packed.size, packed.stride)
        slot.refs -= 1
        if slot.refs == 0:
            slot.restored = None
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
