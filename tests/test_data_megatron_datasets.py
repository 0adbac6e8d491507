"""Megatron dataset adapters and the indexed-dataset builder, against megatron-core's own readers."""

import json

import numpy as np
import pytest
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import Split

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.data.source import MapStyleSource
from megatron_hdp.megatron.build_dataset import build_demo_dataset, main, synthetic_lengths, write_indexed_dataset
from megatron_hdp.megatron.datasets import (
    BlendedSampleSource,
    GPTSampleSource,
    IndexedDocumentSource,
    build_hdp_data_loader,
    document_source,
)
from megatron_hdp.plan.presets import analytic_cost_model

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


def _assert_samples_equal(source, dataset):
    assert len(source.lengths) == len(dataset)
    for i in range(len(dataset)):
        item = dataset[i]
        raw = source.read(i, 0, int(source.lengths[i]) + 1)
        np.testing.assert_array_equal(raw[:-1], item["tokens"].numpy())
        np.testing.assert_array_equal(raw[1:], item["labels"].numpy())
        np.testing.assert_array_equal(source.read(i, 5, 41), raw[5:41])  # a range inside the sample


def test_gpt_and_blended_sources_read_megatrons_samples(gpt_datasets):
    gpt, blended = gpt_datasets
    source = document_source(gpt)
    assert isinstance(source, GPTSampleSource) and (source.lengths == SEQ_LENGTH).all()
    _assert_samples_equal(source, gpt)
    blend = document_source(blended)
    assert isinstance(blend, BlendedSampleSource)
    _assert_samples_equal(blend, blended)
    before = blend.bytes_read
    blend.read(7, 10, 20)
    assert blend.bytes_read - before == 10 * 2  # uint16 tokens: only the range is read


def test_loader_over_gpt_samples_keeps_megatrons_order(gpt_datasets):
    gpt, _ = gpt_datasets
    config = HDPConfig(hdp_capacity=48, hdp_offload=False, hdp_policy="balance")
    loaders = [HDPDataLoader(document_source(gpt), rank=r, num_ranks=2, config=config, seed=0, shuffle=False,
                             global_batch_size=4, cost_model=analytic_cost_model("llama-7b")) for r in range(2)]
    steps = [next(loader) for loader in loaders]
    np.testing.assert_array_equal(steps[0].sample_ids, [0, 1, 2, 3])
    tokens = sorted(t for step in steps for mb in step.microbatches for t in mb.tokens[mb.loss_mask > 0].tolist())
    assert tokens == sorted(np.concatenate([gpt[i]["tokens"].numpy() for i in range(4)]).tolist())
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


def _megatron_rank(rank, world_size, prefix):
    from types import SimpleNamespace

    from megatron_hdp.megatron.initialize import destroy_hdp, initialize_hdp
    from megatron_hdp.megatron.training_compat import require_megatron_training

    require_megatron_training()
    from megatron.training.global_vars import set_args

    initialize_hdp()
    set_args(SimpleNamespace(seed=5, global_batch_size=6, sequence_parallel=False, hdp=True, hdp_capacity=64,
                             hdp_offload=False, hdp_policy="balance", hdp_global_batch_tokens=None))
    loader = build_hdp_data_loader(prefix, 0, cost_model=analytic_cost_model("llama-7b"))
    steps = [next(loader) for _ in range(2)]
    loader.close()
    destroy_hdp()
    return [(s.plan.digest(), s.sample_ids.tolist(), s.consumed_samples,
             sorted(t for mb in s.microbatches for t in mb.tokens[mb.loss_mask > 0].tolist())) for s in steps]


def test_build_hdp_data_loader_reads_megatrons_args_and_parallel_state(tmp_path):
    docs = [np.arange(n) + 1000 * d for d, n in enumerate(np.random.default_rng(4).integers(2, 120, 20))]
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, docs, vocab_size=20_000)
    ranks = run_gloo(_megatron_rank, 2, prefix, timeout_s=240)
    for index, (r0, r1) in enumerate(zip(*ranks)):
        assert r0[:3] == r1[:3] and r0[2] == 6 * (index + 1)  # same plan, 6 documents a step
        expected = np.random.default_rng((5, 0)).permutation(20)[6 * index: 6 * index + 6]  # seed 5, epoch 0
        assert r0[1] == expected.tolist()
        assert sorted(r0[3] + r1[3]) == sorted(t for d in expected for t in docs[d][:-1].tolist())
