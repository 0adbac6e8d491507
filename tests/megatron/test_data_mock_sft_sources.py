"""Mock (--mock-data, --hdp-mock-mix) and SFT (--sft) datasets as HDP documents, against Megatron's own objects.

Mock: Megatron's MockGPTDataset (and ours with lengths from a named mix) built by Megatron's
BlendedMegatronDatasetBuilder; the planned documents follow the dataset's document_index, their lengths
the mix, their tokens Megatron's mock content rule. SFT: Megatron's SFTDataset over a JSONL file written
here (a byte-level chat tokenizer stands in for the HuggingFace one); each conversation is one sequence
whose tokens and loss mask equal the positions Megatron's packed sample gives that conversation.
"""

import json

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset, MockGPTLowLevelDataset
from megatron.core.datasets.utils import Split

from megatron_hdp.config import MOCK_MIXES
from megatron_hdp.megatron.datasets.sources import GPTDocumentSource, document_source
from megatron_hdp.megatron.datasets.mock_mix import mix_document_lengths, mock_gpt_dataset_type
from megatron_hdp.megatron.datasets.sft_source import SFTConversationSource
from megatron_hdp.megatron.compat.versions import require_megatron_training, use_prebuilt_dataset_helpers
from megatron_hdp.plan.lengths import DISTRIBUTIONS

require_megatron_training()
use_prebuilt_dataset_helpers()

from megatron.training.datasets.sft_dataset import IGNORE_INDEX, SFTDataset  # noqa: E402

SEQ_LENGTH = 4096


class _Tokenizer:
    """The few tokenizer fields Megatron's GPT datasets read."""

    vocab_size = 32000
    eod = 0
    pad = 1
    unique_identifiers = {"class": "_Tokenizer"}


def _mock_train_dataset(dataset_type, *, seed: int, num_samples: int = 64):
    config = GPTDatasetConfig(random_seed=seed, sequence_length=SEQ_LENGTH, tokenizer=_Tokenizer(), split="100,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    return BlendedMegatronDatasetBuilder(dataset_type, [num_samples, 0, 0], lambda: True, config).build()[0]


def test_mock_mix_documents_follow_the_mix_and_megatrons_order():
    dataset = _mock_train_dataset(mock_gpt_dataset_type("byted"), seed=11)
    source = document_source(dataset)
    assert isinstance(source, GPTDocumentSource) and source.origin(0)["dataset"] == "mock"
    low = dataset.dataset
    np.testing.assert_array_equal(low.sequence_lengths, mix_document_lengths("byted", num_documents=low.size, seed=11))
    order = np.asarray(dataset.document_index)
    first_documents = source.pieces.document[np.flatnonzero(source.pieces.offset == 0)]
    np.testing.assert_array_equal(first_documents, order)  # every document, in Megatron's shuffled order
    raw = low.sequence_lengths[order].astype(np.int64)
    assert source.lengths.sum() == (raw - 1).sum() and source.lengths.max() == SEQ_LENGTH
    assert 0.7 < np.mean(raw <= 4096) < 0.9 and raw.max() > 100 * SEQ_LENGTH  # ByteScale's byted shape
    for i in (0, 1, int(np.argmax(source.pieces.offset > 0)), source.lengths.size - 1):
        document, offset, length = int(source.pieces.document[i]), int(source.pieces.offset[i]), int(source.lengths[i])
        if low.sequence_lengths[document] > 10**6:
            continue  # Megatron's rule builds the whole document: skip the 2M-token ones
        megatron = MockGPTLowLevelDataset.__getitem__(low, document)  # Megatron's own mock content rule
        np.testing.assert_array_equal(source.read(i, 0, length + 1), megatron[offset:offset + length + 1])
    assert dataset[0]["tokens"].shape == (SEQ_LENGTH,)  # plain Megatron still reads it (no --hdp)


def test_megatrons_own_mock_is_planned_by_document_and_mix_names_are_checked():
    dataset = _mock_train_dataset(MockGPTDataset, seed=3)
    source = document_source(dataset)
    raw = dataset.dataset.sequence_lengths[np.asarray(dataset.document_index)]
    assert source.pieces.num_dropped == int(np.sum(raw < 2))  # a 1-token mock document has nothing to predict
    assert source.lengths.sum() == int(np.sum(raw[raw >= 2] - 1))
    assert MOCK_MIXES == DISTRIBUTIONS
    with pytest.raises(ValueError, match="unknown --hdp-mock-mix 'zipf'"):
        mock_gpt_dataset_type("zipf")


class _ChatTokenizer:
    """Byte-level chat tokenizer with Megatron's SFT interface: only assistant tokens are targets."""

    vocab_size = 256
    eod = 2
    pad = 1
    unique_identifiers = {"class": "_ChatTokenizer"}

    def tokenize_conversation(self, conversation, return_target, add_generation_prompt):
        tokens, targets = [], []
        for message in conversation:
            ids = list(f"{message['role']}:{message['content']}\n".encode())
            tokens += ids
            targets += ids if message["role"] == "assistant" else [IGNORE_INDEX] * len(ids)
        return np.array(tokens + [self.eod]), np.array(targets + [self.eod])


def _conversation(system: str, *turns: str) -> list[dict]:
    roles = ["user", "assistant"] * len(turns)
    return [{"role": "system", "content": system}] + [{"role": r, "content": t} for r, t in zip(roles, turns)]


def test_sft_conversations_are_sequences_with_megatrons_loss_mask(tmp_path):
    path = tmp_path / "chat.jsonl"
    lines = [_conversation("be brief", "hi", "hello!") + _conversation("count", "1 2", "3 4 5", "and?", "6"),
             _conversation("x", "what is 2+2?", "4")]
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in lines))
    messages = [json.loads(line)["messages"] for line in path.read_text().splitlines()]  # the low-level dataset
    config = GPTDatasetConfig(random_seed=1, sequence_length=256, tokenizer=_ChatTokenizer(), split="100,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              create_attention_mask=False, context_parallel_size=1)
    sft = SFTDataset(messages, str(path), np.arange(2), 3, Split.train, config)  # 3 samples: line 0 again
    source = document_source(sft)
    assert isinstance(source, SFTConversationSource)
    assert [source.origin(i)["document"] for i in range(len(source.lengths))] == [0, 0, 1, 0, 0]

    conversation, megatron_loss_tokens = 0, 0
    for sample in range(len(sft)):
        item = sft[sample]  # Megatron's packed sample: conversations at cu_seqlens, positions restarting
        megatron_loss_tokens += int(item["loss_mask"].sum())
        bounds = np.unique(item["cu_seqlens"].numpy())  # the last run also holds the pack's padding
        for start in bounds[:-1].tolist():
            length = int(source.lengths[conversation])
            assert source.origin(conversation)["offset"] == start
            np.testing.assert_array_equal(source.read(conversation, 0, length), item["tokens"][start:start + length])
            mask = source.read_loss_mask(conversation, 0, length)
            np.testing.assert_array_equal(mask, item["loss_mask"][start:start + length].numpy())
            counted = mask > 0
            np.testing.assert_array_equal(source.read(conversation, 1, length + 1)[counted],
                                          item["labels"][start:start + length].numpy()[counted])
            conversation += 1
    assert conversation == len(source.lengths)
    # no loss token is lost: a conversation's last input would predict the next one's system prompt,
    # which Megatron masks, and the padding counts nowhere
    ours = sum(source.read_loss_mask(c, 0, int(n)).sum() for c, n in enumerate(source.lengths))
    assert ours == megatron_loss_tokens > 0
