"""Megatron datasets as HDP document sources, and the drop-in replacement for Megatron's data loader.

Adapters (each a `megatron_hdp.data.source.DocumentSource`: plan lengths from the index, partial reads):

- `IndexedDocumentSource` — a megatron-core `IndexedDataset` (`.bin/.idx`): one sample per sequence of the
  index (as GPTDataset counts them; a `.idx` written without sentence splitting has one sequence per
  document). Lengths come straight from the `.idx`; `read` takes a slice of the mmap'd `.bin` through
  `IndexedDataset.get(idx, offset, length)`, so a rank touches only the bytes of its own shards.
- `GPTSampleSource` — a `GPTDataset`: its fixed-length samples (seq_length + 1 raw tokens, in Megatron's
  own shuffled order), each read piecewise from the documents it spans.
- `BlendedSampleSource` — a `BlendedDataset`: the blend's samples, each read from its member dataset.

`build_hdp_data_loader(dataset, consumed_samples, cost_model=...)` has the shape of Megatron's
`build_pretraining_data_loader` and reads Megatron's arguments and parallel state.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.indexed_dataset import IndexedDataset, get_bin_path, get_idx_path

from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.data.source import DocumentSource, MapStyleSource, plan_lengths_from_raw
from megatron_hdp.plan.cost_model import CostModel

_INDEX_HEADER = b"MMIDIDX\x00\x00"


def _check_files(prefix: str) -> None:
    """Clear errors for a missing or foreign file, before megatron-core's asserts."""
    for path, what in ((get_idx_path(prefix), "index"), (get_bin_path(prefix), "data")):
        if not os.path.isfile(path):
            raise ValueError(f"missing {what} file {path}: a Megatron indexed dataset is PREFIX.bin + PREFIX.idx")
    with open(get_idx_path(prefix), "rb") as stream:
        header = stream.read(len(_INDEX_HEADER))
    if header != _INDEX_HEADER:
        raise ValueError(f"{get_idx_path(prefix)} is not a Megatron index file (header {header!r})")


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


class GPTSampleSource:
    """A GPTDataset's samples: each spans one or more documents of the underlying IndexedDataset.

    Sample i of the dataset is the raw token stream of its documents (in the dataset's document order)
    from a start position, seq_length + 1 tokens long (the extra token is the last label); `read` walks
    only the documents the requested range touches.
    """

    def __init__(self, dataset: GPTDataset):
        if not dataset.config.add_extra_token_to_sequence:
            raise ValueError("GPTDataset must draw samples with add_extra_token_to_sequence=True (labels = next tokens)")
        if dataset.shuffle_index is None:
            dataset._query_document_sample_shuffle_indices(0)  # loads Megatron's lazily mmap'd indices
        self.indexed = IndexedDocumentSource(dataset.dataset)
        self.document_index = np.asarray(dataset.document_index, dtype=np.int64)
        doc_lengths = self.indexed._raw[self.document_index]
        self.doc_starts = np.concatenate(([0], np.cumsum(doc_lengths)))
        sample_index = np.asarray(dataset.sample_index, dtype=np.int64)
        positions = self.doc_starts[sample_index[:, 0]] + sample_index[:, 1]
        shuffle = np.asarray(dataset.shuffle_index, dtype=np.int64)
        self.starts = positions[shuffle]
        ends = np.minimum(positions[shuffle + 1] + 1, self.doc_starts[-1])
        self.lengths = plan_lengths_from_raw(ends - self.starts)

    @property
    def bytes_read(self) -> int:
        return self.indexed.bytes_read

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Raw tokens [start, end) of sample `sample_id`, read from the documents it spans."""
        size = int(self.lengths[sample_id]) + 1
        if not 0 <= start <= end <= size:
            raise ValueError(f"read [{start}, {end}) is outside sample {sample_id}'s {size} tokens")
        low, high = int(self.starts[sample_id]) + start, int(self.starts[sample_id]) + end
        pos = int(np.searchsorted(self.doc_starts, low, side="right")) - 1
        pieces = []
        while low < high:  # positions in the stream of the dataset's documents, one document at a time
            offset = low - int(self.doc_starts[pos])
            take = min(high, int(self.doc_starts[pos + 1])) - low
            pieces.append(self.indexed.read(int(self.document_index[pos]), offset, offset + take))
            low += take
            pos += 1
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=self.indexed.dataset.index.dtype)


class BlendedSampleSource:
    """A BlendedDataset's samples, each read from the member dataset the blend assigns it to."""

    def __init__(self, dataset: BlendedDataset):
        if dataset.dataset_index is None:
            dataset[0]  # loads Megatron's lazily mmap'd blend indices
        self.members = [document_source(member) for member in dataset.datasets]
        self.dataset_index = np.asarray(dataset.dataset_index, dtype=np.int64)
        self.dataset_sample_index = np.asarray(dataset.dataset_sample_index, dtype=np.int64)
        self.lengths = np.empty(self.dataset_index.size, dtype=np.int64)
        for member_id, member in enumerate(self.members):
            mask = self.dataset_index == member_id
            self.lengths[mask] = member.lengths[self.dataset_sample_index[mask]]

    @property
    def bytes_read(self) -> int:
        return sum(member.bytes_read for member in self.members)

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        member = self.members[self.dataset_index[sample_id]]
        return member.read(int(self.dataset_sample_index[sample_id]), start, end)


def document_source(dataset: Any) -> DocumentSource:
    """The DocumentSource for a Megatron dataset, an indexed-dataset prefix, or a dataset with `lengths`."""
    if isinstance(dataset, (str, IndexedDataset)):
        return IndexedDocumentSource(dataset)
    if isinstance(dataset, GPTDataset):
        return GPTSampleSource(dataset)
    if isinstance(dataset, BlendedDataset):
        return BlendedSampleSource(dataset)
    if isinstance(dataset, DocumentSource):
        return dataset
    if hasattr(dataset, "lengths"):
        return MapStyleSource(dataset)
    raise ValueError(
        f"cannot read lengths from a {type(dataset).__name__}: HDP needs an IndexedDataset, GPTDataset, "
        "BlendedDataset, a map-style dataset with a `lengths` array, or a DocumentSource"
    )


def build_hdp_data_loader(
    dataset: Any, consumed_samples: int, *, cost_model: CostModel, max_length: Optional[int] = None
) -> Optional[HDPDataLoader]:
    """Megatron's `build_pretraining_data_loader(dataset, consumed_samples)`, planned by HDP.

    Reads `get_args()` (seed, global batch size, HDP flags, sequence parallelism) and the data-parallel
    group, which is the HDP domain. An `HDPDataLoader` passed as the dataset (what a datasets provider
    returns under `--dataloader-type external`) is returned unchanged. Megatron's `--num-workers` N >= 1
    plans and reads in N worker processes; 0 in a background thread. GPT and blended datasets are
    already shuffled by Megatron, so they are taken in order; an IndexedDataset (documents) is shuffled
    per epoch.
    """
    from megatron.core import parallel_state

    from megatron_hdp.megatron.training_compat import require_megatron_training

    require_megatron_training()
    from megatron.training import get_args

    if dataset is None or isinstance(dataset, HDPDataLoader):
        return dataset  # `--dataloader-type external`: a loader the user built is used as it is
    args = get_args()
    source = document_source(dataset)
    from megatron_hdp.megatron.args import token_multiple

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
        shuffle=not isinstance(dataset, (GPTDataset, BlendedDataset)),
        pp_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pad_to_multiple=token_multiple(args),
        workers=getattr(args, "num_workers", 0),
        group=parallel_state.get_data_parallel_group(),
    )
