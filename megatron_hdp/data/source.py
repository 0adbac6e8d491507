"""What the HDP loader needs from a dataset: plan lengths before any token is read, and partial reads.

A `DocumentSource` exposes, per sample, the plan length L (the number of model input positions) and reads
raw tokens by range. By the project's label convention a sample of plan length L has L + 1 raw tokens
(inputs = raw[0:L], labels = raw[1:L+1]), so a source built from raw token counts n has L = n - 1 and a
sample with fewer than 2 raw tokens is an error (it would have no position to train on).

Documents longer than the model's sequence length are cut into pieces (`DocumentPieces`): a document of
n raw tokens has n - 1 trainable positions (each predicts the next token); piece j holds positions
[j*S, min((j+1)*S, n-1)) and reads raw tokens [j*S, end + 1), so its last label is the first input token
of the next piece. Every next-token prediction of the document is trained exactly once, as in the
uncut document; only attention stops at the piece boundary (each piece is its own sequence).

The Megatron adapters (indexed `.bin/.idx`, GPTDataset, BlendedDataset, SFT) live in
`megatron_hdp.megatron.datasets.sources`, the only layer allowed to import Megatron; this module holds the
protocol, the document cutting, the map-style adapter for datasets that carry a `lengths` array, and the
checks every adapter shares: too-short samples and the explicit truncate-or-reject rule for over-long ones.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from megatron_hdp.config import OVERLONG_DOCUMENTS, OverlongDocuments

logger = logging.getLogger(__name__)


@runtime_checkable
class DocumentSource(Protocol):
    """A dataset as the HDP loader sees it.

    `lengths[i]` is sample i's plan length L (int64, >= 1); `read(i, start, end)` returns its raw tokens
    [start, end) with 0 <= start <= end <= L + 1 and reads nothing else — that is what lets each rank load
    only its own shards. `bytes_read` counts the token bytes read so far (tests and benchmarks check it).
    A source whose data has its own loss mask also has `read_loss_mask(i, start, end)`: 0/1 for input
    positions [start, end) (the loader passes it to the collation when present). A source that knows where
    its samples come from also has `origin(i)`: {"dataset": str, "document": int, "offset": int}, what
    `--hdp-save-plans` writes next to each planned sequence.
    """

    lengths: np.ndarray
    bytes_read: int

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray: ...


def plan_lengths_from_raw(raw_counts: np.ndarray | Sequence[int], *, what: str = "sample") -> np.ndarray:
    """Plan lengths L = n - 1 from raw token counts n; a sample with n < 2 raises ValueError naming it."""
    raw = np.asarray(raw_counts, dtype=np.int64)
    if raw.ndim != 1:
        raise ValueError(f"raw token counts must be one-dimensional, got shape {raw.shape}")
    short = np.flatnonzero(raw < 2)
    if short.size:
        shown = ", ".join(f"{what} {i} ({raw[i]} tokens)" for i in short[:5])
        raise ValueError(
            f"{short.size} {what}(s) have fewer than 2 raw tokens: {shown}; a training sequence needs at "
            "least one input token and its next-token label (remove empty documents from the dataset)"
        )
    return raw - 1


class DocumentPieces:
    """Documents in a given order, each cut into consecutive pieces of at most `max_length` positions.

    `documents[k]` is the id of the k-th document in visiting order and `raw_counts[k]` its raw token
    count. Piece i is positions [offset[i], offset[i] + lengths[i]) of document `document[i]` and reads raw
    tokens [offset[i], offset[i] + lengths[i] + 1) (module docstring: the last label of a piece is the
    first token of the next one). Pieces of one document are consecutive, in document order. A document
    of fewer than 2 raw tokens has no position to train and yields no piece (`num_dropped` counts them).
    """

    def __init__(self, documents: np.ndarray | Sequence[int], raw_counts: np.ndarray | Sequence[int], *,
                 max_length: int | None):
        documents = np.asarray(documents, dtype=np.int64)
        positions = np.asarray(raw_counts, dtype=np.int64) - 1
        if documents.shape != positions.shape or documents.ndim != 1:
            raise ValueError(f"documents {documents.shape} and raw_counts {positions.shape} must be equal 1-D shapes")
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        positions = np.maximum(positions, 0)
        step = int(positions.max(initial=1)) if max_length is None else int(max_length)
        counts = -(-positions // step)  # ceil; 0 for a document without a position
        self.num_dropped = int(np.count_nonzero(counts == 0))
        first = np.repeat(np.cumsum(counts) - counts, counts)
        self.document = np.repeat(documents, counts)
        self.offset = (np.arange(int(counts.sum()), dtype=np.int64) - first) * step
        self.lengths = np.minimum(np.repeat(positions, counts) - self.offset, step)
        if not self.lengths.size:
            raise ValueError("no document has the 2 raw tokens a training sequence needs")


def limit_lengths(
    lengths: np.ndarray, *, max_length: int | None, overlong: OverlongDocuments = "error", why: str = "max_length"
) -> np.ndarray:
    """Apply a maximum sequence length: reject over-long samples, or truncate them — never silently.

    `overlong="error"` raises ValueError listing the first over-long samples; `"truncate"` keeps their
    first `max_length` positions (a truncated sample still reads its label token max_length from the
    source, which exists because the sample is longer) and logs how many were cut. `why` names where the
    limit comes from, for the messages.
    """
    if overlong not in OVERLONG_DOCUMENTS:
        raise ValueError(f"overlong must be one of {OVERLONG_DOCUMENTS}, got {overlong!r}")
    if max_length is None:
        return lengths
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    over = np.flatnonzero(lengths > max_length)
    if not over.size:
        return lengths
    if overlong == "error":
        shown = ", ".join(f"sample {i} (length {lengths[i]})" for i in over[:5])
        raise ValueError(
            f"{over.size} sample(s) are longer than {max_length} tokens ({why}): {shown}; truncate them with "
            "--hdp-overlong-documents truncate, or raise the limit"
        )
    logger.warning("truncating %d of %d samples to %d tokens (%s)", over.size, lengths.size, max_length, why)
    return np.minimum(lengths, max_length)


class MapStyleSource:
    """Adapter for any map-style dataset with a per-sample `lengths` array of raw token counts (SFT).

    `dataset[i]` must return the sample's raw token ids: an array, or a dict holding them under `key`.
    With `loss_mask_key`, the dict also holds a per-raw-token target mask (1 where that token is a label
    that counts, e.g. the answer of an SFT pair); input position p then counts when raw token p + 1 does.
    A map-style dataset cannot read part of a sample, so reads fetch the sample and slice it; they check
    that the sample has exactly the token count `lengths` promised, since a plan built on wrong lengths
    would train on the wrong tokens.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        lengths: np.ndarray | Sequence[int] | None = None,
        key: str = "tokens",
        loss_mask_key: str | None = None,
    ):
        raw = getattr(dataset, "lengths", None) if lengths is None else lengths
        if raw is None:
            raise ValueError(f"{type(dataset).__name__} has no `lengths` attribute and no lengths were given")
        raw = np.asarray(raw, dtype=np.int64)
        if raw.shape != (len(dataset),):
            raise ValueError(f"lengths has shape {raw.shape} but the dataset has {len(dataset)} samples")
        self.dataset = dataset
        self.key = key
        self.loss_mask_key = loss_mask_key
        self.lengths = plan_lengths_from_raw(raw)
        self.bytes_read = 0
        if loss_mask_key is not None:
            self.read_loss_mask = self._read_loss_mask

    def _sample(self, sample_id: int, field: str, start: int, end: int) -> np.ndarray:
        sample = self.dataset[sample_id]
        values = np.asarray(sample[field] if isinstance(sample, dict) else sample)
        expected = int(self.lengths[sample_id]) + 1
        if values.shape != (expected,):
            raise ValueError(
                f"sample {sample_id} has {values.size} {field!r} entries but the dataset's lengths say {expected}: "
                "the lengths array disagrees with the data"
            )
        if not 0 <= start <= end <= expected:
            raise ValueError(f"read [{start}, {end}) is outside sample {sample_id}'s {expected} tokens")
        self.bytes_read += values.nbytes
        return values

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Raw tokens [start, end) of sample `sample_id` (the whole sample is fetched, then sliced)."""
        return self._sample(sample_id, self.key, start, end)[start:end]

    def _read_loss_mask(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Loss mask of input positions [start, end): the target mask of raw tokens [start + 1, end + 1)."""
        return self._sample(sample_id, self.loss_mask_key, start, end + 1)[start + 1:end + 1]
