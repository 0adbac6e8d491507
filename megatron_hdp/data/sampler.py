"""HDPSampler: which documents form each global batch — the same answer on every rank, with no messages.

Megatron's pretraining sampler hands each DP rank a fixed slice of every global batch. Under HDP the
whole global batch is planned at once, so this sampler yields the global batch itself (like Megatron's
Hybrid-CP sampler): the sample ids and their plan lengths, read from the index, no token touched.

Order. Epoch e visits every sample once, in the permutation drawn by `numpy.random.default_rng((seed,
e))` (or in dataset order with `shuffle=False`, for datasets that shuffle themselves, like GPTDataset).
A global batch never crosses an epoch boundary: the last batch of an epoch takes what is left. Hence
every sample is trained exactly once per epoch, and `consumed_samples` — the number of documents trained
so far, which is what Megatron checkpoints — alone says where to resume: epoch = consumed // N and the
next batch starts at position consumed % N of that epoch's order.

Size. Either `global_batch_size` documents, or a `global_batch_tokens` budget: documents are taken in
order while their plan lengths fit the budget; the first one that does not fit starts the next batch.
A document longer than the whole budget forms a batch of its own (it is never dropped or split across
steps, which would break exactly-once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np


@dataclass(frozen=True)
class GlobalBatch:
    """One step's documents: dataset sample ids in planning order and their plan lengths."""

    epoch: int
    sample_ids: np.ndarray
    lengths: np.ndarray
    consumed_samples: int
    """Documents consumed before this batch (the resume point that yields this batch)."""

    @property
    def num_samples(self) -> int:
        return int(self.sample_ids.size)

    @property
    def next_consumed_samples(self) -> int:
        """Documents consumed once this batch is trained: what to checkpoint after the step."""
        return self.consumed_samples + self.num_samples

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class HDPSampler:
    """Deterministic global batches over a dataset's plan lengths (see the module docstring)."""

    def __init__(
        self,
        lengths: np.ndarray,
        *,
        seed: int,
        global_batch_size: Optional[int] = None,
        global_batch_tokens: Optional[int] = None,
        consumed_samples: int = 0,
        shuffle: bool = True,
        max_epochs: Optional[int] = None,
    ):
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or self.lengths.size == 0:
            raise ValueError(f"lengths must be a non-empty 1-D array, got shape {self.lengths.shape}")
        if (global_batch_size is None) == (global_batch_tokens is None):
            raise ValueError(
                f"give exactly one of global_batch_size ({global_batch_size}) and "
                f"global_batch_tokens ({global_batch_tokens})"
            )
        if global_batch_size is not None and global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
        if global_batch_tokens is not None and global_batch_tokens < 1:
            raise ValueError(f"global_batch_tokens must be >= 1, got {global_batch_tokens}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"max_epochs must be >= 1, got {max_epochs}")
        self.seed = int(seed)
        self.global_batch_size = global_batch_size
        self.global_batch_tokens = global_batch_tokens
        self.consumed_samples = int(consumed_samples)
        self.shuffle = shuffle
        self.max_epochs = max_epochs
        self._epoch: Optional[int] = None
        self._order = np.empty(0, dtype=np.int64)
        self._prefix = np.empty(0, dtype=np.int64)

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample ids in the order epoch `epoch` visits them (a permutation of 0..N-1)."""
        self._load_epoch(epoch)
        return self._order

    def _load_epoch(self, epoch: int) -> None:
        if self._epoch == epoch:
            return
        if self.shuffle:
            order = np.random.default_rng((self.seed, epoch)).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples, dtype=np.int64)
        self._order = order.astype(np.int64, copy=False)
        if self.global_batch_tokens is not None:
            self._prefix = np.concatenate(([0], np.cumsum(self.lengths[self._order])))
        self._epoch = epoch

    def batch_at(self, consumed_samples: int) -> GlobalBatch:
        """The global batch trained after `consumed_samples` documents (a batch boundary of this sampler)."""
        epoch, start = divmod(int(consumed_samples), self.num_samples)
        self._load_epoch(epoch)
        if self.global_batch_tokens is None:
            end = min(start + self.global_batch_size, self.num_samples)
        else:
            budget_end = self._prefix[start] + self.global_batch_tokens
            end = int(np.searchsorted(self._prefix, budget_end, side="right")) - 1
            end = min(max(end, start + 1), self.num_samples)
        ids = self._order[start:end]
        return GlobalBatch(epoch=epoch, sample_ids=ids, lengths=self.lengths[ids], consumed_samples=int(consumed_samples))

    def __iter__(self) -> Iterator[GlobalBatch]:
        """Global batches from `consumed_samples` on, through `max_epochs` epochs (forever when unset)."""
        consumed = self.consumed_samples
        while self.max_epochs is None or consumed < self.max_epochs * self.num_samples:
            batch = self.batch_at(consumed)
            yield batch
            consumed = batch.next_consumed_samples
