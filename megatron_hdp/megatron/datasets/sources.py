"""Megatron datasets as HDP document sources, and the drop-in replacement for Megatron's data loader.

HDP plans documents, not Megatron's fixed `--seq-length` windows: each adapter (a
`megatron_hdp.data.source.DocumentSource`: plan lengths before any token is read, partial reads, and
`origin(i)` for `--hdp-save-plans`) turns a Megatron dataset into its documents, in Megatron's own order.

- `IndexedDocumentSource` — a bare megatron-core `IndexedDataset` (`.bin/.idx`): one sample per document.
  Lengths come straight from the `.idx`; `read` takes a slice of the mmap'd `.bin`.
- `GPTDocumentSource` — a `GPTDataset` (and `MockGPTDataset`): the documents of its low-level dataset in
  the order of its `document_index` (Megatron's split, epochs, shuffling and seed), each document one
  sequence; one longer than `--seq-length` becomes consecutive pieces of at most `--seq-length`
  positions (`megatron_hdp.data.source.DocumentPieces`). With `eod_mask_loss`, input positions holding
  the EOD token get loss mask 0, as Megatron's `_get_ltor_masks_and_position_ids` does.
- `BlendedDocumentSource` — a `BlendedDataset`: its members' pieces interleaved so that each member's
  share of the *tokens* follows the blend weights (`data.blend.token_blend_order`); over an epoch of the
  blend the shares are exact (`data.blend.blend_quotas`).
- `SFTConversationSource` (`megatron_hdp.megatron.datasets.sft_source`) — Megatron's `SFTDataset`: each
  conversation one sequence with its loss mask.

`build_hdp_data_loader(dataset, consumed_samples, cost_model=...)` has the shape of Megatron's
`build_pretraining_data_loader` and reads Megatron's arguments and parallel state.
`write_indexed_dataset` writes an indexed dataset with megatron-core's own builder (the corpora of
`megatron_hdp.harness.build_dataset`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional

import numpy as np
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset
from megatron.core.datasets.indexed_dataset import (
    DType, IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path)
from megatron.core.datasets.megatron_dataset import MegatronDataset

from megatron_hdp.config import HDPConfig
from megatron_hdp.data.blend import blend_quotas, leading_pieces, token_blend_order
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.data.source import DocumentPieces, DocumentSource, MapStyleSource, plan_lengths_from_raw
from megatron_hdp.plan.cost.model import CostModel

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"
MOCK_DATASET_NAME = "mock"
"""The `source.dataset` name of mock documents in saved plans."""


def _check_files(prefix: str) -> None:
    """Clear errors for a missing or foreign file, before megatron-core's asserts."""
    for path, what in ((get_idx_path(prefix), "index"), (get_bin_path(prefix), "data")):
        if not os.path.isfile(path):
            raise ValueError(f"missing {what} file {path}: a Megatron indexed dataset is PREFIX.bin + PREFIX.idx")
    with open(get_idx_path(prefix), "rb") as stream:
        header = stream.read(len(_INDEX_HEADER))
    if header != _INDEX_HEADER:
        raise ValueError(f"{get_idx_path(prefix)} is not a Megatron index file (header {header!r})")


def indexed_dataset_exists(prefix: str) -> bool:
    """Whether both files of the indexed dataset at `prefix` (PREFIX.bin, PREFIX.idx) are there."""
    return os.path.isfile(get_idx_path(prefix)) and os.path.isfile(get_bin_path(prefix))


def write_indexed_dataset(
    prefix: str | os.PathLike, documents: Iterable[np.ndarray], *, vocab_size: int
) -> tuple[int, int]:
    """Write `documents` (1-D integer arrays of raw token ids) as an indexed dataset at `prefix`.

    Token ids must lie in [0, vocab_size); the token dtype is megatron-core's choice for that vocabulary
    (uint16 up to 65,500 ids, int32 beyond). Returns (documents, tokens) written.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    prefix = str(prefix)
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=DType.optimal_dtype(vocab_size))
    num_docs = num_tokens = 0
    for doc in documents:
        doc = np.asarray(doc)
        if doc.ndim != 1 or (doc.size and (doc.min() < 0 or doc.max() >= vocab_size)):
            builder.data_file.close()
            os.unlink(get_bin_path(prefix))
            raise ValueError(f"document {num_docs} is not a 1-D array of token ids in [0, {vocab_size})")
        builder.add_document(doc, [doc.size])
        num_docs += 1
        num_tokens += doc.size
    builder.finalize(get_idx_path(prefix))
    logger.info("wrote %s.{bin,idx}: %d documents, %d tokens", prefix, num_docs, num_tokens)
    return num_docs, num_tokens


class IndexedDocumentSource:
    """A megatron-core IndexedDataset read by byte range (see the module docstring)."""

    def __init__(self, dataset: IndexedDataset | str):
        if isinstance(dataset, str):
            _check_files(dataset)
            dataset = IndexedDataset(dataset, multimodal=False, mmap=True)
        self.dataset = dataset
        index = dataset.index
        self.itemsize = int(np.dtype(index.dtype).itemsize)
        self._raw = np.asarray(index.sequence_lengths, dtype=np.int64)
        if self._raw.size == 0:
            raise ValueError(f"indexed dataset {dataset.path_prefix} has no documents")
        described = int(index.sequence_pointers[-1]) + int(self._raw[-1]) * self.itemsize
        actual = os.path.getsize(get_bin_path(dataset.path_prefix))
        if described != actual:
            raise ValueError(
                f"{get_bin_path(dataset.path_prefix)} has {actual} bytes but its .idx describes {described}: the "
                ".bin and .idx do not belong together (or one is truncated)"
            )
        self.lengths = plan_lengths_from_raw(self._raw, what="document")
        self.bytes_read = 0

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Raw tokens [start, end) of document `sample_id`, copied out of the mmap'd `.bin`."""
        if not 0 <= start <= end <= self._raw[sample_id]:
            raise ValueError(f"read [{start}, {end}) is outside document {sample_id}'s {self._raw[sample_id]} tokens")
        tokens = np.array(self.dataset.get(int(sample_id), offset=int(start), length=int(end - start)))
        self.bytes_read += tokens.nbytes
        return tokens

    def origin(self, sample_id: int) -> dict:
        return {"dataset": self.dataset.path_prefix, "document": int(sample_id), "offset": 0}


class GPTDocumentSource:
    """A GPTDataset's documents in its `document_index` order, cut at its sequence length (module docstring).

    Works for any low-level dataset with `sequence_lengths` and `get(idx, offset, length)`: Megatron's
    IndexedDataset and its mock datasets.
    """

    def __init__(self, dataset: GPTDataset):
        if not dataset.config.add_extra_token_to_sequence:
            raise ValueError("GPTDataset must draw samples with add_extra_token_to_sequence=True (labels = next tokens)")
        if dataset.document_index is None:
            dataset._query_document_sample_shuffle_indices(0)  # loads Megatron's lazily mmap'd indices
        self.low_level = dataset.dataset
        self.name = MOCK_DATASET_NAME if isinstance(dataset, MockGPTDataset) else str(self.low_level.path_prefix)
        order = np.asarray(dataset.document_index, dtype=np.int64)
        raw = np.asarray(self.low_level.sequence_lengths, dtype=np.int64)[order]
        self.pieces = DocumentPieces(order, raw, max_length=dataset.config.sequence_length)
        if self.pieces.num_dropped:
            logger.warning("%s: %d of %d documents have fewer than 2 tokens (nothing to predict) and are skipped",
                           self.name, self.pieces.num_dropped, order.size)
        self.lengths = self.pieces.lengths
        self.bytes_read = 0
        if dataset.config.eod_mask_loss:
            self.eod = int(dataset.config.tokenizer.eod)
            self.read_loss_mask = self._eod_loss_mask

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Raw tokens [start, end) of piece `sample_id` (end <= its length + 1: the last label)."""
        if not 0 <= start <= end <= self.lengths[sample_id] + 1:
            raise ValueError(f"read [{start}, {end}) is outside piece {sample_id}'s {self.lengths[sample_id] + 1} tokens")
        offset = int(self.pieces.offset[sample_id]) + start
        tokens = np.asarray(self.low_level.get(int(self.pieces.document[sample_id]), offset=offset, length=end - start))
        self.bytes_read += tokens.nbytes
        return tokens

    def _eod_loss_mask(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Megatron's --eod-mask-loss: an input position holding the EOD token does not count."""
        return (self.read(sample_id, start, end) != self.eod).astype(np.float32)

    def origin(self, sample_id: int) -> dict:
        return {"dataset": self.name, "document": int(self.pieces.document[sample_id]),
                "offset": int(self.pieces.offset[sample_id])}


class BlendedDocumentSource:
    """A BlendedDataset's members' documents, blended by tokens (`token_blend_order`), exact per epoch.

    A blend built without a size (Megatron's "use every member fully") takes every piece of every member.
    A blend built with a size holds `size` x `sequence_length` tokens, as Megatron's does: each member
    contributes exactly its weight's share of them (`blend_quotas`, to a whole token) from its own pieces in
    order, the last one cut where the share ends. Either way the epoch's shares are exact and within a
    global batch they are within `token_blend_order`'s bound.
    """

    def __init__(self, dataset: BlendedDataset):
        self.members = [document_source(member) for member in dataset.datasets]
        member_lengths = [np.asarray(member.lengths, dtype=np.int64) for member in self.members]
        member_tokens = np.array([lengths.sum() for lengths in member_lengths], dtype=np.int64)
        if dataset.size is None:
            quotas = member_tokens
        else:
            quotas = blend_quotas(member_tokens, np.asarray(dataset.weights, dtype=np.float64),
                                  int(dataset.size) * int(dataset.config.sequence_length))
            member_lengths = [leading_pieces(lengths, int(quota)) for lengths, quota in zip(member_lengths, quotas)]
        self.member_tokens = quotas
        self.weights = quotas / quotas.sum()
        self.dataset_index, self.dataset_sample_index = token_blend_order(member_lengths, self.weights)
        self.lengths = np.empty(self.dataset_index.size, dtype=np.int64)
        for member_id, lengths in enumerate(member_lengths):
            mask = self.dataset_index == member_id
            self.lengths[mask] = lengths[self.dataset_sample_index[mask]]
        if any(hasattr(member, "read_loss_mask") for member in self.members):
            self.read_loss_mask = self._read_loss_mask

    @property
    def bytes_read(self) -> int:
        return sum(member.bytes_read for member in self.members)

    def _member(self, sample_id: int) -> tuple[Any, int]:
        return self.members[self.dataset_index[sample_id]], int(self.dataset_sample_index[sample_id])

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        member, index = self._member(sample_id)
        return member.read(index, start, end)

    def _read_loss_mask(self, sample_id: int, start: int, end: int) -> np.ndarray:
        member, index = self._member(sample_id)
        if hasattr(member, "read_loss_mask"):
            return member.read_loss_mask(index, start, end)
        return np.ones(end - start, dtype=np.float32)

    def origin(self, sample_id: int) -> dict:
        member, index = self._member(sample_id)
        return member.origin(index)


def document_source(dataset: Any) -> DocumentSource:
    """The DocumentSource for a Megatron dataset, an indexed-dataset prefix, or a dataset with `lengths`."""
    from megatron_hdp.megatron.datasets.sft_source import SFTConversationSource, is_sft_dataset

    if isinstance(dataset, (str, IndexedDataset)):
        return IndexedDocumentSource(dataset)
    if isinstance(dataset, GPTDataset):
        return GPTDocumentSource(dataset)
    if isinstance(dataset, BlendedDataset):
        return BlendedDocumentSource(dataset)
    if is_sft_dataset(dataset):
        return SFTConversationSource(dataset)
    if isinstance(dataset, DocumentSource):
        return dataset
    if hasattr(dataset, "lengths"):
        return MapStyleSource(dataset)
    raise ValueError(
        f"cannot read lengths from a {type(dataset).__name__}: HDP needs an IndexedDataset, GPTDataset, "
        "BlendedDataset, SFTDataset, a map-style dataset with a `lengths` array, or a DocumentSource"
    )


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning(message)


def build_hdp_data_loader(
    dataset: Any, consumed_samples: int, *, cost_model: CostModel | Callable[[], CostModel],
    max_length: Optional[int] = None,
) -> Optional[HDPDataLoader]:
    """Megatron's `build_pretraining_data_loader(dataset, consumed_samples)`, planned by HDP.

    Reads `get_args()` (seed, global batch size, HDP flags, sequence parallelism) and the data-parallel
    group, which is the HDP domain. An `HDPDataLoader` passed as the dataset (what a datasets provider
    returns under `--dataloader-type external`) is returned unchanged. Megatron's `--num-workers` N >= 1
    plans and reads in N worker processes; 0 in a background thread. Megatron's datasets (GPT, blended,
    SFT) come in Megatron's own order, so they are taken in order; a bare IndexedDataset or map-style
    dataset is shuffled per epoch. `cost_model`: the model, or a function returning the current one
    (`HDPRuntime.current_cost_model`). The loader leaves the plan-agreement check to the step
    (`data.prepare.prepare_step`, which install()'s forward_backward runs).
    """
    from megatron.core import parallel_state

    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.training import get_args

    if dataset is None or isinstance(dataset, HDPDataLoader):
        return dataset  # `--dataloader-type external`: a loader the user built is used as it is
    args = get_args()
    if getattr(args, "reset_attention_mask", False) or getattr(args, "reset_position_ids", False):
        _say_once("--reset-attention-mask / --reset-position-ids have no effect with --hdp: every document is "
                  "its own sequence (attention and positions already stop at document boundaries)")
    source = document_source(dataset)
    from megatron_hdp.data.quantization import token_multiple

    return HDPDataLoader(
        source,
        rank=parallel_state.get_data_parallel_rank(),
        num_ranks=parallel_state.get_data_parallel_world_size(),
        config=HDPConfig.from_namespace(args),
        cost_model=cost_model,
        seed=args.seed,
        consumed_samples=consumed_samples,
        global_batch_size=args.global_batch_size,
        max_length=max_length,
        shuffle=not isinstance(dataset, (MegatronDataset, BlendedDataset)),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        vpp_size=parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
        pad_to_multiple=token_multiple(args),
        mtp_depth=args.mtp_num_layers or 0,
        workers=getattr(args, "num_workers", 0),
        group=parallel_state.get_data_parallel_group(),
        check_plans=False,
    )
