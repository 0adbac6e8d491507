"""`--mock-data --hdp-mock-mix NAME`: Megatron's mock GPT dataset with document lengths from a named mix.

Megatron's `MockGPTDataset` draws 100,000 documents of 1-4,095 tokens (uniform). To try HDP without
data on the lengths it is built for, `mock_gpt_dataset_type(mix)` returns a `MockGPTDataset` whose
low-level dataset draws the same number of document lengths from one of `megatron_hdp.plan.lengths`'
mixes (ByteScale's `byted` / `github`, or a shared real mix), seeded by `--seed`. Everything else is
Megatron's: the split, the epochs and the shuffled `document_index` (so `GPTDocumentSource` plans these
documents as it plans real ones), and the content: document position p holds (p + 1) mod vocab, its last
token is EOD. Tokens are generated only for the range read, so a 2M-token document costs nothing until
a rank reads its shard.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset

from megatron_hdp.plan.lengths import DISTRIBUTIONS, SYNTHETIC, real_mix, synthetic_lengths


def mix_document_lengths(mix: str, *, num_documents: int, seed: int) -> np.ndarray:
    """`num_documents` raw document lengths drawn from the named mix (seeded), each >= 2 tokens."""
    if mix in SYNTHETIC:
        lengths = synthetic_lengths(mix, num_sequences=num_documents, seed=seed)
    elif mix in DISTRIBUTIONS:
        lengths = np.random.default_rng(seed).choice(real_mix(mix), size=num_documents)
    else:
        raise ValueError(f"unknown --hdp-mock-mix {mix!r}; known: {', '.join(DISTRIBUTIONS)}")
    return np.maximum(lengths, 2)


class MixMockLowLevelDataset(MockGPTLowLevelDataset):
    """Megatron's mock documents (same content rule), with lengths drawn from a named mix."""

    def __init__(self, tokenizer, *, mix: str, seed: int) -> None:  # noqa: ANN001 (a Megatron tokenizer)
        self.vocab_size = tokenizer.vocab_size
        self.eod_token = tokenizer.eod
        self.mix = mix
        self.sequence_lengths = mix_document_lengths(mix, num_documents=self.size, seed=seed).astype(np.int32)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of document `idx`, generated for that range only."""
        size = int(self.sequence_lengths[idx])
        length = size - offset if length is None else length
        positions = np.arange(offset, offset + length, dtype=np.int64)
        tokens = (positions + 1) % self.vocab_size
        tokens[positions == size - 1] = self.eod_token
        return tokens


def mock_gpt_dataset_type(mix: str) -> type[MockGPTDataset]:
    """A MockGPTDataset class whose documents follow `mix` (named after it, so Megatron's dataset
    cache never mixes two mixes up)."""
    mix_document_lengths(mix, num_documents=1, seed=0)  # rejects an unknown name before any dataset is built

    class MixMockGPTDataset(MockGPTDataset):
        @staticmethod
        def build_low_level_dataset(dataset_path: Optional[str], config: GPTDatasetConfig) -> MixMockLowLevelDataset:
            return MixMockLowLevelDataset(config.tokenizer, mix=mix, seed=config.random_seed)

    MixMockGPTDataset.__name__ = MixMockGPTDataset.__qualname__ = f"MockGPTDataset_{mix}"
    return MixMockGPTDataset
