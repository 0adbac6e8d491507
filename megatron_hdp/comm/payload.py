"""Several per-token tensors travelling a ring as one message, each part a contiguous view of it.

A ring step moves, per token it holds, a few tensors together: the K/V ring K [T, Hkv, D] and V
[T, Hkv, Dv], and their gradients on the way back. `Payload` lays them out in one flat buffer, all rows
of the first part, then all rows of the second, so one `Post` moves them, a token costs exactly the
sum of the parts' widths (multi-latent attention's K is 192 wide and its V 128: no padding on the wire),
and every part splits back out as a contiguous view, the layout the kernels take.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class Payload:
    """The per-token shapes of the parts of one ring message (rows vary per ring position)."""

    row_shapes: tuple[tuple[int, ...], ...]
    """Per part, the shape of one token's slice (e.g. (heads, head_dim))."""

    @classmethod
    def of(cls, *parts: torch.Tensor) -> Payload:
        """The payload of `parts`, each [T, ...] with the same T."""
        assert len({p.shape[0] for p in parts}) == 1, [tuple(p.shape) for p in parts]
        return cls(tuple(tuple(p.shape[1:]) for p in parts))

    @property
    def row_numel(self) -> int:
        """Elements one token adds to the message."""
        return sum(math.prod(shape) for shape in self.row_shapes)

    def pack(self, *parts: torch.Tensor) -> torch.Tensor:
        """One flat buffer holding `parts` (in this payload's order and shapes)."""
        assert tuple(tuple(p.shape[1:]) for p in parts) == self.row_shapes, [tuple(p.shape) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts])

    def empty(self, like: torch.Tensor, rows: int, *, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised buffer for `rows` tokens on `like`'s device (dtype: `like`'s by default)."""
        return like.new_empty(rows * self.row_numel, dtype=dtype or like.dtype)

    def split(self, buffer: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of `buffer` as contiguous views [rows, *shape] (writes go through to the buffer)."""
        rows, rest = divmod(buffer.numel(), self.row_numel)
        assert rest == 0 and buffer.dim() == 1, (tuple(buffer.shape), self.row_shapes)
        views, offset = [], 0
        for shape in self.row_shapes:
            size = rows * math.prod(shape)
            views.append(buffer[offset : offset + size].view(rows, *shape))
            offset += size
        return tuple(views)
