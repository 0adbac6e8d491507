"""Multi-token prediction's inputs of one chunk: its tokens, labels, positions and loss mask d positions
ahead (d = 1..D), read from the D tokens after the chunk, so that no rank needs another's tokens.

Megatron's `MultiTokenPredictionBlock` shifts input ids, position ids, labels and the loss mask one
position left per depth (`roll_tensor`), a document at a time (its packed path rolls inside each
`cu_seqlens` segment and puts 0 where a roll leaves the segment). Depth d at position p of a document of
L positions (raw tokens raw[0..L], loss mask m[0..L-1]) therefore sees

    token raw[p + d], label raw[p + d + 1], position p + d, loss mask m[p + d]      when p + d < L,
    0 everywhere else (the last d positions of the document have no depth-d target).

Under HDP a zigzag shard's position p + d may lie in the next chunk of the document, which another ring
member holds. The collation reads raw tokens [a, b + 1 + D) and the mask of [a, b + D) for a chunk
[a, b) (clipped at the document's end), which is all depth 1..D needs: `shifted_chunk` is pure index
arithmetic on those reads.

Each depth's loss is normalised per document, as Megatron normalises it per sequence: with
`calculate_per_token_loss` it scales depth d's token losses by (loss tokens) / (loss tokens left after
d rolls) of its micro-batch, which for the one-document micro-batches of plain training (and of the
exactness references) is M / M_d with M = sum(m) and M_d = sum(m[d:]) of that document. The weights
ride in the shifted loss mask (`depth_weights`), so a document keeps them whatever HDP packs beside it or
however a ring splits it, and Megatron's own per-micro-batch ratio must then be 1: its MTP loss takes the
loss mask `MTPRolls.normaliser` (it sums to 1: the count Megatron takes before rolling) and each roll of
it answers the count 1 (the count after). Counting the micro-batch's own tokens instead would drop the
depth-d gradient of a micro-batch whose chunks hold no loss token but whose next positions do (a ring
chunk inside an SFT prompt): M = 0 there.

`MTPRolls` is what Megatron's MTP block gets for its rolls of one micro-batch (megatron/layers/mtp.py answers
Megatron's `roll_tensor` from it): the chain of each input over depths 0..D.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import numpy as np
import torch


def depth_weights(loss_mask_head: np.ndarray, *, num_loss_tokens: float, depth: int) -> np.ndarray:
    """[depth] float64: M / M_d for d = 1..depth, 0 where M_d = 0 (no position keeps a depth-d target).

    `loss_mask_head`: the document's loss mask at its first `depth` positions (fewer for a shorter
    document); `num_loss_tokens`: M, its loss mask summed over the whole document. M_d = M - (the first d
    entries), since the loss mask rolled d times keeps exactly m[d:]."""
    head = np.zeros(depth, dtype=np.float64)
    head[: min(depth, len(loss_mask_head))] = loss_mask_head[:depth]
    kept = num_loss_tokens - np.cumsum(head)
    return np.divide(num_loss_tokens, kept, out=np.zeros(depth), where=kept > 0)


def shifted_chunk(
    raw: np.ndarray, loss_mask: np.ndarray, *, start: int, end: int, length: int, weights: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Depth 1..D inputs of chunk [start, end) of a document of `length` positions (module docstring).

    `raw`: the document's raw tokens [start, min(end + 1 + D, length + 1)); `loss_mask`: its loss mask at
    positions [start, min(end + D, length)); `weights`: `depth_weights` of the document (D of them).
    Returns (tokens, labels, positions, loss_mask), each [D, end - start]: int64, int64, int64 and float32
    (the mask times its depth's weight)."""
    depth = len(weights)
    count = end - start
    assert len(raw) == min(end + 1 + depth, length + 1) - start, (len(raw), start, end, length, depth)
    assert len(loss_mask) == min(end + depth, length) - start, (len(loss_mask), start, end, length, depth)
    ahead = np.arange(count)[None, :] + np.arange(1, depth + 1)[:, None]  # [D, n]: p + d - start
    inside = ahead < length - start  # p + d < L
    at = np.where(inside, ahead, 0)
    tokens = np.where(inside, raw[at], 0).astype(np.int64)
    labels = np.where(inside, raw[np.where(inside, ahead + 1, 0)], 0).astype(np.int64)
    positions = np.where(inside, start + ahead, 0).astype(np.int64)
    mask = np.where(inside, loss_mask[at], 0.0) * weights[:, None]
    return tokens, labels, positions, mask.astype(np.float32)


class MTPRolls:
    """What each of Megatron's MTP rolls of one micro-batch gives: the chains of its input ids, labels,
    position ids and loss mask over depths 0..D, a tensor known by identity (why, and the one copy of
    the labels recognised otherwise: megatron/layers/mtp.py)."""

    def __init__(self, *, tokens: list[torch.Tensor], labels: list[torch.Tensor], position_ids: list[torch.Tensor],
                 loss_mask: list[torch.Tensor]):
        """Each argument: the tensors of depths 0..D as the model sees them ([1, T]); depth 0 is what the
        forward step passes to the model."""
        self.chains = {"input_ids": tokens, "labels": labels, "position_ids": position_ids, "loss_mask": loss_mask}
        mask = loss_mask[0]
        self.normaliser = torch.zeros_like(mask)
        """The loss mask Megatron's MTP loss is called with (megatron/layers/mtp.py): one 1, then zeros; its rolls
        are the loss mask's."""
        self.normaliser.view(-1)[:1] = 1
        self._unit = torch.ones((), dtype=mask.dtype, device=mask.device)
        self._links = {id(t): (name, d) for name, chain in self.chains.items() for d, t in enumerate(chain)}
        self._links[id(self.normaliser)] = ("loss_mask", 0)
        self._copy_of: Optional[tuple[torch.Tensor, tuple[str, int]]] = None
        """While Megatron's MTP loss runs (`copying`): (its labels, their link), until their one copy is rolled."""

    @classmethod
    def of_batch(cls, batch: Any) -> "MTPRolls":
        """The rolls of a `PackedMicroBatch` collated with an MTP depth, [1, T] views of its tensors."""
        def chain(first: torch.Tensor, ahead: torch.Tensor) -> list[torch.Tensor]:
            return [first[None]] + [ahead[d][None] for d in range(ahead.shape[0])]

        return cls(tokens=chain(batch.tokens, batch.mtp_tokens), labels=chain(batch.labels, batch.mtp_labels),
                   position_ids=chain(batch.position_ids, batch.mtp_position_ids),
                   loss_mask=chain(batch.loss_mask, batch.mtp_loss_mask))

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The depth-0 tensors to call the model with."""
        return {name: chain[0] for name, chain in self.chains.items()}

    @contextlib.contextmanager
    def copying(self, labels: torch.Tensor) -> Iterator[None]:
        """The scope of Megatron's MTP loss (`process_mtp_loss`) called with `labels` (one of this
        micro-batch's tensors): it copies them (`mtp_labels = labels.clone()`) before its first roll, so
        inside this scope, and only there, the first tensor rolled that is none of the micro-batch's own
        and has their dtype and shape is that copy, and continues their chain. Anywhere else (the MTP
        layers' rolls of the input ids, say) such a tensor is refused, never taken for the labels."""
        self._copy_of = (labels, self._known(labels))
        try:
            yield
        finally:
            self._copy_of = None

    def _known(self, tensor: torch.Tensor) -> tuple[str, int]:
        """(chain, depth) of one of the micro-batch's own tensors, by identity."""
        link = self._links.get(id(tensor))
        if link is None or (self.chains[link[0]][link[1]] is not tensor and tensor is not self.normaliser):
            raise ValueError(
                f"HDP cannot roll this tensor ({tensor.dtype}, {tuple(tensor.shape)}) for multi-token prediction: it "
                "is none of the inputs the micro-batch carries the rolls of (input ids, position ids, labels, loss "
                "mask). This Megatron rolls something HDP was not written for (megatron_hdp/megatron/layers/mtp.py)"
            )
        return link

    def _link(self, tensor: torch.Tensor) -> tuple[str, int]:
        copy = self._copy_of
        if id(tensor) not in self._links and copy is not None and (tensor.dtype, tensor.shape) == (
                copy[0].dtype, copy[0].shape):
            self._copy_of = None  # process_mtp_loss copies its labels once
            return copy[1]
        return self._known(tensor)

    def loss_tokens(self, labels: torch.Tensor) -> tuple[int, Optional[torch.Tensor]]:
        """(d, the depth-d loss tokens as a bool [1, T]) when `labels` is this micro-batch's depth-d labels
        (d >= 1, by identity: what a roll handed out), else (0, None). The loss tokens are where the
        depth-d loss mask is non-zero, each counted once whatever its document's weight."""
        name, depth = self._links.get(id(labels), ("", 0))
        if name != "labels" or not depth or self.chains[name][depth] is not labels:
            return 0, None
        return depth, self.chains["loss_mask"][depth] > 0

    def roll(self, tensor: torch.Tensor, *, shifts: int = -1, dims: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next link of `tensor`'s chain, its sum; for the loss mask 1, the normaliser's sum: module
        docstring): the answer to Megatron's `roll_tensor(tensor, shifts, dims)`, which must be one position
        left."""
        if shifts != -1 or dims not in (-1, tensor.dim() - 1):
            raise ValueError(f"HDP's MTP rolls shift one position along the last dimension, got shifts={shifts}, "
                             f"dims={dims}")
        name, depth = self._link(tensor)
        chain = self.chains[name]
        if depth + 1 >= len(chain):
            raise ValueError(f"the micro-batch carries {len(chain) - 1} MTP depths of {name}, but the model "
                             f"rolls it {depth + 1} times: collate with mtp_depth = mtp_num_layers")
        rolled = chain[depth + 1]
        if name == "loss_mask":  # Megatron's original / rolled count: 1 / 1 (the weights are in the mask)
            return rolled, self._unit
        return rolled, rolled.sum()
