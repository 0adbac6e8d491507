"""Megatron dataset adapters (documents of GPT and blended datasets) and the indexed-dataset builder,
against megatron-core's own readers and index."""

import contextlib
import json
import logging

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.data.source import MapStyleSource
from megatron_hdp.harness.build_dataset import build_demo_dataset, main, synthetic_lengths
from megatron_hdp.data.blend import blend_quotas, leading_pieces, token_blend_order
from megatron_hdp.megatron.datasets.sources import (
    BlendedDocumentSource,
    GPTDocumentSource,
    IndexedDocumentSource,
    build_hdp_data_loader,
    document_source,
    write_indexed_dataset,
)
from megatron_hdp.plan.cost.presets import analytic_cost_model

SEQ_LENGTH = 64


class _Tokenizer:
    """The few tokenizer fields GPTDataset reads."""

    vocab_size = 1000
    eod = 0
    pad = -1
    unique_identifiers = {"class": "_Tokenizer"}


@pytest.fixture(scope="module")
def gpt_datasets(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("gpt") / "docs")
    rng = np.random.default_rng(2)
    write_indexed_dataset(prefix, [rng.integers(1, 1000, n) for n in rng.integers(2, 150, 60)], vocab_size=1000)
    config = GPTDatasetConfig(
        random_seed=1, sequence_length=SEQ_LENGTH, tokenizer=_Tokenizer(), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, split="100,0,0",
    )
    indexed = IndexedDataset(prefix)
    first = GPTDataset(indexed, prefix, np.arange(len(indexed)), 40, Split.train, config)
    second = GPTDataset(indexed, prefix, np.arange(0, len(indexed), 3), 20, Split.train, config)
    return first, BlendedDataset([first, second], [0.6, 0.4], 50, config)


def test_gpt_source_plans_megatrons_documents_in_its_order_cut_at_seq_length(gpt_datasets):
    gpt, _ = gpt_datasets
    source = document_source(gpt)
    assert isinstance(source, GPTDocumentSource)
    indexed = gpt.dataset
    order = np.asarray(gpt.document_index)  # Megatron's split, epochs and shuffled order
    expected = [(int(d), o, min(SEQ_LENGTH, len(indexed[d]) - 1 - o))
                for d in order for o in range(0, len(indexed[d]) - 1, SEQ_LENGTH)]
    assert list(zip(source.pieces.document.tolist(), source.pieces.offset.tolist(), source.lengths.tolist())) == expected
    assert source.lengths.max() == SEQ_LENGTH and (source.lengths < SEQ_LENGTH).mean() > 0.5
    for i in range(len(expected)):
        document, offset, length = expected[i]
        np.testing.assert_array_equal(source.read(i, 0, length + 1), indexed[document][offset:offset + length + 1])
        assert source.origin(i) == {"dataset": indexed.path_prefix, "document": document, "offset": offset}
    before = source.bytes_read
    source.read(3, 2, 9)
    assert source.bytes_read - before == 7 * 2  # uint16 tokens: only the range is read
    assert not hasattr(source, "read_loss_mask")  # without --eod-mask-loss every position counts


def test_eod_mask_loss_masks_eod_inputs_as_megatron_does(tmp_path):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    prefix = str(tmp_path / "eod")
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(0, 8, n), _Tokenizer.eod) for n in rng.integers(1, 90, 12)]  # EOD inside too
    write_indexed_dataset(prefix, docs, vocab_size=1000)
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ_LENGTH, tokenizer=_Tokenizer(), split="100,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=True)
    indexed = IndexedDataset(prefix)
    source = document_source(GPTDataset(indexed, prefix, np.arange(len(indexed)), 4, Split.train, config))
    masked = 0
    for i, length in enumerate(source.lengths.tolist()):
        tokens = torch.from_numpy(source.read(i, 0, length).astype(np.int64))
        _, megatron_mask, _ = _get_ltor_masks_and_position_ids(tokens, _Tokenizer.eod, False, False, True, False)
        np.testing.assert_array_equal(source.read_loss_mask(i, 0, length), megatron_mask.numpy())
        masked += int((megatron_mask == 0).sum())
    assert masked > 0


def test_blended_source_honours_the_weights_by_tokens(gpt_datasets):
    gpt, blended = gpt_datasets
    blend = document_source(blended)
    assert isinstance(blend, BlendedDocumentSource)
    members = [document_source(member) for member in blended.datasets]
    # each member's pieces are taken in the member's own (Megatron) order, from its start
    for member_id, member in enumerate(members):
        taken = blend.dataset_sample_index[blend.dataset_index == member_id]
        np.testing.assert_array_equal(taken, np.arange(taken.size))
        i = int(np.flatnonzero(blend.dataset_index == member_id)[3])
        np.testing.assert_array_equal(blend.read(i, 0, int(blend.lengths[i]) + 1),
                                      member.read(3, 0, int(member.lengths[3]) + 1))
        assert blend.origin(i) == member.origin(3)
    # at every prefix each member's tokens are within the stated bound of its weight's share
    weights = np.array([0.6, 0.4])
    tokens = np.zeros((blend.lengths.size, 2))
    tokens[np.arange(blend.lengths.size), blend.dataset_index] = blend.lengths
    taken = np.cumsum(tokens, axis=0)
    error = taken - np.cumsum(blend.lengths)[:, None] * weights
    assert (error <= SEQ_LENGTH).all() and (error >= -2 * SEQ_LENGTH).all()
    for start in range(0, blend.lengths.size - 8, 8):  # a global batch of 8 documents
        batch = tokens[start:start + 8].sum(axis=0)
        assert np.abs(batch - batch.sum() * weights).max() <= 3 * SEQ_LENGTH

def test_sized_blend_epoch_is_exact_by_tokens(gpt_datasets):
    _, blended = gpt_datasets
    blend = document_source(blended)
    members = [document_source(member) for member in blended.datasets]
    # the epoch holds Megatron's size x seq-length tokens; 0.6 / 0.4 of 50 x 64 = 1920 / 1280 exactly
    per_member = np.bincount(blend.dataset_index, weights=blend.lengths).astype(int)
    assert per_member.tolist() == [1920, 1280] and blend.lengths.sum() == 50 * SEQ_LENGTH
    for member_id, member in enumerate(members):
        taken = blend.dataset_sample_index[blend.dataset_index == member_id]
        lengths = blend.lengths[blend.dataset_index == member_id]
        # the member's leading pieces, whole but for the last, which is cut where the share ends
        np.testing.assert_array_equal(lengths[:-1], member.lengths[taken[:-1]])
        assert 1 <= lengths[-1] <= member.lengths[taken[-1]]
        last = int(np.flatnonzero(blend.dataset_index == member_id)[-1])
        np.testing.assert_array_equal(blend.read(last, 0, int(blend.lengths[last]) + 1),
                                      member.read(int(taken[-1]), 0, int(blend.lengths[last]) + 1))
    # Megatron sized the members with a margin, so their pieces go on past the epoch
    assert blend.lengths.size < len(members[0].lengths) + len(members[1].lengths)


@pytest.mark.parametrize("seed", range(20))
def test_blend_quotas_are_the_weights_shares_to_a_token(seed):
    rng = np.random.default_rng(seed)
    members = int(rng.integers(2, 6))
    weights = rng.random(members) + 0.01
    lengths = [rng.integers(1, 300, int(rng.integers(1, 60))) for _ in range(members)]
    tokens = np.array([piece.sum() for piece in lengths])
    budget = int(rng.integers(1, 2 * tokens.sum()))
    quotas = blend_quotas(tokens, weights, budget)
    epoch = int(quotas.sum())
    assert epoch <= budget and (quotas <= tokens).all()
    assert np.abs(quotas - epoch * weights / weights.sum()).max() < 1
    if epoch < budget:  # only because some member could not supply one more token's share
        assert ((epoch + 1) * weights / weights.sum() > tokens).any()
    for piece, quota in zip(lengths, quotas):
        cut = leading_pieces(piece, int(quota))
        assert cut.sum() == quota and (cut[:-1] == piece[:cut.size - 1]).all()
    with pytest.raises(ValueError, match="fewer than"):
        leading_pieces(lengths[0], int(tokens[0]) + 1)


def test_weighted_data_path_blend_built_by_megatron_is_exact_per_epoch(tmp_path):
    """`--data-path 0.7 A 0.3 B`: Megatron's builder sizes the blend and its members (with its margin)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_hdp.megatron.compat.versions import use_prebuilt_dataset_helpers

    use_prebuilt_dataset_helpers()
    rng = np.random.default_rng(9)
    prefixes = []
    for name, high in (("short", 60), ("long", 400)):
        prefixes.append(str(tmp_path / name))
        write_indexed_dataset(prefixes[-1], [rng.integers(1, 1000, n) for n in rng.integers(2, high, 80)],
                              vocab_size=1000)
    config = GPTDatasetConfig(random_seed=3, sequence_length=SEQ_LENGTH, tokenizer=_Tokenizer(), split="100,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              blend=(prefixes, [0.7, 0.3]))
    blended = BlendedMegatronDatasetBuilder(GPTDataset, [123, 0, 0], lambda: True, config).build()[0]
    assert isinstance(blended, BlendedDataset) and blended.size >= 123  # Megatron rounds the sizes up
    blend = document_source(blended)
    per_member = np.bincount(blend.dataset_index, weights=blend.lengths).astype(int)
    epoch = blended.size * SEQ_LENGTH
    assert per_member.sum() == epoch and np.abs(per_member - epoch * np.array([0.7, 0.3])).max() < 1
    for member_id, member in enumerate(blended.datasets):  # each member's documents in Megatron's order
        pieces = document_source(member).pieces
        taken = blend.dataset_sample_index[blend.dataset_index == member_id]
        np.testing.assert_array_equal(taken, np.arange(taken.size))
        np.testing.assert_array_equal(pieces.document[taken][pieces.offset[taken] == 0],
                                      np.asarray(member.document_index)[:np.count_nonzero(pieces.offset[taken] == 0)])


def test_blend_without_size_takes_every_document_of_every_member(gpt_datasets):
    gpt, blended = gpt_datasets
    whole = BlendedDataset(blended.datasets, [len(member) for member in blended.datasets], None, blended.config)
    blend = document_source(whole)
    members = [document_source(member) for member in blended.datasets]
    # Megatron's size-less blend uses every member fully: by tokens, every piece once, so each member's
    # share of the epoch's tokens is exactly its share of the data
    np.testing.assert_array_equal(np.bincount(blend.dataset_index), [len(m.lengths) for m in members])
    assert blend.lengths.sum() == sum(m.lengths.sum() for m in members)


def test_token_blend_order_is_exact_when_pieces_allow_it():
    lengths = [np.full(30, 10), np.full(20, 5)]
    member, sample = token_blend_order(lengths, np.array([3.0, 1.0]))
    np.testing.assert_array_equal(np.bincount(member), [30, 20])  # 300 and 100 tokens: exactly 3:1
    with pytest.raises(ValueError, match="positive weight per member"):
        token_blend_order(lengths, np.array([1.0, 0.0]))


def test_loader_over_gpt_documents_keeps_megatrons_order(gpt_datasets):
    gpt, _ = gpt_datasets
    config = HDPConfig(hdp_capacity=48, hdp_offload=False, hdp_policy="balance")
    source = document_source(gpt)
    loaders = [HDPDataLoader(source, rank=r, num_ranks=2, config=config, seed=0, shuffle=False,
                             global_batch_size=4, cost_model=analytic_cost_model("llama-7b")) for r in range(2)]
    steps = [next(loader) for loader in loaders]
    np.testing.assert_array_equal(steps[0].sample_ids, [0, 1, 2, 3])
    assert steps[0].plan.lengths == source.lengths[:4].tolist()
    tokens = sorted(t for step in steps for mb in step.microbatches for t in mb.tokens[mb.loss_mask > 0].tolist())
    assert tokens == sorted(np.concatenate([source.read(i, 0, int(source.lengths[i])) for i in range(4)]).tolist())
    for loader in loaders:
        loader.close()


def test_document_source_dispatch_and_unknown_datasets(gpt_datasets, tmp_path):
    gpt, _ = gpt_datasets
    assert isinstance(document_source(gpt.dataset), IndexedDocumentSource)

    class WithLengths(list):
        lengths = [3, 2]

    assert isinstance(document_source(WithLengths([np.arange(3), np.arange(2)])), MapStyleSource)
    with pytest.raises(ValueError, match="cannot read lengths from a list"):
        document_source([1, 2])


def test_builder_cli_reads_text_jsonl_and_token_files(tmp_path):
    (tmp_path / "a.txt").write_text("héllo")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "ab"}) + "\n\n" + json.dumps({"text": "xyz"}) + "\n")
    (tmp_path / "ids.txt").write_text("5 6 7\n\n9 10\n")
    np.save(tmp_path / "doc.npy", np.array([11, 12, 13, 14]))
    cases = [
        (["--text", str(tmp_path / "a.txt")], [list("héllo".encode())]),
        (["--jsonl", str(tmp_path / "b.jsonl")], [list(b"ab"), list(b"xyz")]),
        (["--tokens", str(tmp_path / "ids.txt"), str(tmp_path / "doc.npy"), "--vocab", "20"],
         [[5, 6, 7], [9, 10], [11, 12, 13, 14]]),
    ]
    for number, (argv, expected) in enumerate(cases):
        prefix = str(tmp_path / f"out{number}")
        assert main(["--out", prefix, *argv]) == 0
        written = IndexedDataset(prefix)
        assert [written[i].tolist() for i in range(len(written))] == expected
    with pytest.raises(ValueError, match=r"document 1 is not a 1-D array of token ids in \[0, 20\)"):
        write_indexed_dataset(str(tmp_path / "bad"), [np.arange(3), np.array([1, 25])], vocab_size=20)


def test_synthetic_corpus_is_seeded_long_tailed_and_learnable(tmp_path):
    lengths = synthetic_lengths(4000, seed=3, median=100, max_length=4000)
    np.testing.assert_array_equal(lengths, synthetic_lengths(4000, seed=3, median=100, max_length=4000))
    assert lengths.min() >= 2 and lengths.max() <= 4000
    assert 70 < np.median(lengths) < 140 and lengths.max() > 20 * np.median(lengths)
    byted = synthetic_lengths(4000, seed=3, distribution="byted", max_length=65536)
    assert byted.max() == 65536 and 0.7 < np.mean(byted <= 4096) < 0.9  # ByteScale: ~80% of samples <= 4K
    with pytest.raises(ValueError, match="unknown distribution 'zipf'"):
        synthetic_lengths(10, seed=0, distribution="zipf")
    prefix = build_demo_dataset(tmp_path, num_docs=50, vocab_size=64, max_length=300)
    assert build_demo_dataset(tmp_path, num_docs=50, vocab_size=64, max_length=300) == prefix  # reused
    source = IndexedDocumentSource(prefix)
    assert len(source.lengths) == 50 and source.lengths.max() < 300
    doc = source.read(0, 0, int(source.lengths[0]) + 1).astype(int)
    strides = np.unique((doc[1:] - doc[:-1]) % 64)
    assert len(strides) == 1 and strides[0] in (1, 2, 3)  # a document counts with one stride


def _build_like_pretrain_gpt(prefix: str, rank: int) -> list[bool]:
    """Whether this rank gets a training dataset from a builder told to build on rank 0 only (as
    pretrain_gpt.py tells TP ranks other than 0): plainly, and under install()'s datasets wrapper."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder

    from megatron_hdp.megatron.compat.versions import use_prebuilt_dataset_helpers
    from megatron_hdp.megatron.pretrain.wrappers import datasets_built_on_every_rank

    use_prebuilt_dataset_helpers()
    config = GPTDatasetConfig(random_seed=1, sequence_length=SEQ_LENGTH, tokenizer=_Tokenizer(), split="100,0,0",
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              blend=([prefix], None))
    built = []
    for scope in (contextlib.nullcontext, datasets_built_on_every_rank):
        with scope():
            train = BlendedMegatronDatasetBuilder(GPTDataset, [8, 0, 0], lambda: rank == 0, config).build()[0]
        built.append(train is not None)
    return built


def _megatron_rank(rank, world_size, prefix):
    from types import SimpleNamespace

    from megatron_hdp.megatron.core_api.initialize import destroy_hdp, initialize_hdp
    from megatron_hdp.megatron.compat.versions import require_megatron_training

    require_megatron_training()
    from megatron.training.global_vars import set_args

    initialize_hdp()
    set_args(SimpleNamespace(seed=5, global_batch_size=6, sequence_parallel=False, hdp=True, hdp_capacity=64,
                             hdp_offload=False, hdp_policy="balance", hdp_global_batch_tokens=None,
                             reset_attention_mask=True, reset_position_ids=True, mtp_num_layers=None))
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("megatron_hdp.megatron.datasets.sources").addHandler(handler)
    built = _build_like_pretrain_gpt(prefix, rank)
    build_hdp_data_loader(prefix, 0, cost_model=analytic_cost_model("llama-7b")).close()  # e.g. validation
    loader = build_hdp_data_loader(prefix, 0, cost_model=analytic_cost_model("llama-7b"))
    steps = [next(loader) for _ in range(2)]
    loader.close()
    destroy_hdp()
    return built, said, [(s.plan.digest(), s.sample_ids.tolist(), s.consumed_samples,
                   sorted(t for mb in s.microbatches for t in mb.tokens[mb.loss_mask > 0].tolist())) for s in steps]


def test_build_hdp_data_loader_reads_megatrons_args_and_parallel_state(tmp_path):
    docs = [np.arange(n) + 1000 * d for d, n in enumerate(np.random.default_rng(4).integers(2, 120, 20))]
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, docs, vocab_size=20_000)
    built, said, ranks = zip(*run_gloo(_megatron_rank, 2, prefix, timeout_s=240))
    # pretrain_gpt.py builds datasets on TP rank 0 only; install() makes every rank build (every rank plans)
    assert built == ([True, True], [False, True])
    # document boundaries replace --reset-attention-mask/--reset-position-ids: said once per process
    assert all(len(messages) == 1 and "no effect with --hdp" in messages[0] for messages in said)
    for index, (r0, r1) in enumerate(zip(*ranks)):
        assert r0[:3] == r1[:3] and r0[2] == 6 * (index + 1)  # same plan, 6 documents a step
        expected = np.random.default_rng((5, 0)).permutation(20)[6 * index: 6 * index + 6]  # seed 5, epoch 0
        assert r0[1] == expected.tolist()
        assert sorted(r0[3] + r1[3]) == sorted(t for d in expected for t in docs[d][:-1].tolist())
