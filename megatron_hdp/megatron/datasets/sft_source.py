"""Megatron's `SFTDataset` (`--sft`) as an HDP document source: each conversation one sequence.

Megatron packs the conversations of a JSONL line (a new one starts at each "system" message) into one
`--seq-length` sample, restarting positions per conversation and padding the rest. HDP plans the
conversations themselves, in Megatron's sample order (sample i is line `indices[i % len(indices)]`),
tokenized by the dataset's own tokenizer (`tokenize_conversation(..., return_target=True)`). A
conversation of n tokens is a sequence of plan length n - 1: input position p predicts token p + 1 and
counts in the loss exactly when Megatron's would: its target is neither IGNORE_INDEX (prompts) nor the
pad token. A conversation longer than `--seq-length` is not cut (an answer without its prompt would be
wrong to train): the loader's `--hdp-overlong-documents` rule rejects or truncates it, as Megatron
truncates its pack. Conversations are tokenized once, when the source is built (an SFT corpus has no
index of lengths); each distinct JSONL line once, however many epochs the dataset repeats it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_hdp.data.source import plan_lengths_from_raw


def is_sft_dataset(dataset: Any) -> bool:
    """Whether `dataset` is Megatron-LM's SFTDataset (megatron.training ships it since 0.19)."""
    try:
        from megatron.training.datasets.sft_dataset import SFTDataset
    except ImportError:
        return False
    return isinstance(dataset, SFTDataset)


class SFTConversationSource:
    """The conversations of an SFTDataset, with their loss masks (module docstring)."""

    def __init__(self, dataset: Any):
        from megatron.training.datasets.sft_dataset import IGNORE_INDEX

        tokenizer = dataset.config.tokenizer
        self.name = str(dataset.dataset_path)
        lines = np.asarray(dataset.indices, dtype=np.int64)
        tokens, counted, conversation_lines, conversation_offsets = [], [], [], []
        spans: dict[int, range] = {}  # JSONL line -> its conversations
        for line in np.unique(lines).tolist():
            first, offset = len(tokens), 0
            for conversation in dataset._split_conversations(dataset.dataset[line]):
                ids, targets = tokenizer.tokenize_conversation(conversation, return_target=True,
                                                               add_generation_prompt=False)
                ids, targets = np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=np.int64)
                tokens.append(ids)
                counted.append(((targets != IGNORE_INDEX) & (targets != tokenizer.pad)).astype(np.float32))
                conversation_lines.append(line)
                conversation_offsets.append(offset)
                offset += ids.size
            spans[line] = range(first, len(tokens))
        order = [c for line in lines[np.arange(len(dataset)) % lines.size].tolist() for c in spans[line]]
        self.conversation = np.asarray(order, dtype=np.int64)
        self._tokens, self._counted = tokens, counted
        self._line = np.asarray(conversation_lines, dtype=np.int64)
        self._offset = np.asarray(conversation_offsets, dtype=np.int64)
        self.lengths = plan_lengths_from_raw([tokens[c].size for c in self.conversation], what="conversation")
        self.bytes_read = 0

    def read(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Raw tokens [start, end) of conversation `sample_id`."""
        tokens = self._tokens[self.conversation[sample_id]]
        if not 0 <= start <= end <= tokens.size:
            raise ValueError(f"read [{start}, {end}) is outside conversation {sample_id}'s {tokens.size} tokens")
        self.bytes_read += (end - start) * tokens.itemsize
        return tokens[start:end]

    def read_loss_mask(self, sample_id: int, start: int, end: int) -> np.ndarray:
        """Loss mask of input positions [start, end): whether the target of token p + 1 counts."""
        return self._counted[self.conversation[sample_id]][start + 1:end + 1]

    def origin(self, sample_id: int) -> dict:
        conversation = int(self.conversation[sample_id])
        return {"dataset": self.name, "document": int(self._line[conversation]),
                "offset": int(self._offset[conversation])}
