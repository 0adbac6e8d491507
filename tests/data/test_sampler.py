"""HDPSampler, length checks, the map-style source and the prefetch thread: pure, single-process."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hdp.data.prefetch import Prefetcher
from megatron_hdp.data.sampler import HDPSampler
from megatron_hdp.data.source import DocumentPieces, MapStyleSource, limit_lengths, plan_lengths_from_raw


def _epoch(sampler, epoch):
    """All batches of one epoch, from its first document."""
    batches, consumed = [], epoch * sampler.num_samples
    while consumed < (epoch + 1) * sampler.num_samples:
        batch = sampler.batch_at(consumed)
        batches.append(batch)
        consumed = batch.next_consumed_samples
    return batches


def _greedy_reference(lengths_in_order, budget):
    """Brute-force token batching: add documents while they fit; an oversized one stands alone."""
    batches, current, used = [], [], 0
    for length in lengths_in_order:
        if current and used + length > budget:
            batches.append(current)
            current, used = [], 0
        current.append(length)
        used += length
    batches.append(current)
    return batches


def test_document_batches_cover_each_epoch_once_in_a_seeded_order():
    lengths = np.arange(1, 24)
    sampler = HDPSampler(lengths, seed=5, global_batch_size=5)
    for epoch in range(2):
        batches = _epoch(sampler, epoch)
        assert [b.num_samples for b in batches] == [5, 5, 5, 5, 3]  # the last batch takes what is left
        ids = np.concatenate([b.sample_ids for b in batches])
        assert sorted(ids) == list(range(23))
        np.testing.assert_array_equal(ids, np.random.default_rng((5, epoch)).permutation(23))
        for b in batches:
            np.testing.assert_array_equal(b.lengths, lengths[b.sample_ids])
    assert not np.array_equal(sampler.epoch_order(0), sampler.epoch_order(1))
    unshuffled = HDPSampler(lengths, seed=5, global_batch_size=5, shuffle=False)
    np.testing.assert_array_equal(np.concatenate([b.sample_ids for b in _epoch(unshuffled, 0)]), np.arange(23))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    budget=st.integers(1, 120),
    seed=st.integers(0, 3),
)
def test_token_batches_match_the_greedy_reference(lengths, budget, seed):
    lengths = np.array(lengths)
    sampler = HDPSampler(lengths, seed=seed, global_batch_tokens=budget)
    batches = _epoch(sampler, 0)
    expected = _greedy_reference(lengths[sampler.epoch_order(0)].tolist(), budget)
    assert [b.lengths.tolist() for b in batches] == expected
    for b in batches:
        assert b.num_tokens <= budget or b.num_samples == 1


@settings(max_examples=15, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=2, max_size=25), cut=st.integers(0, 12), tokens=st.booleans())
def test_resume_from_consumed_samples_continues_the_same_batches(lengths, cut, tokens):
    size = {"global_batch_tokens": 40} if tokens else {"global_batch_size": 3}
    full = HDPSampler(np.array(lengths), seed=11, max_epochs=3, **size)
    batches = list(full)
    assert sum(b.num_samples for b in batches) == 3 * len(lengths)
    cut = min(cut, len(batches) - 1)
    resumed = list(HDPSampler(np.array(lengths), seed=11, max_epochs=3, consumed_samples=batches[cut].consumed_samples, **size))
    assert len(resumed) == len(batches) - cut
    for a, b in zip(batches[cut:], resumed):
        assert a.epoch == b.epoch and a.consumed_samples == b.consumed_samples
        np.testing.assert_array_equal(a.sample_ids, b.sample_ids)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"global_batch_size": 2, "global_batch_tokens": 9}, "exactly one"),
        ({}, "exactly one"),
        ({"global_batch_size": 0}, "global_batch_size"),
        ({"global_batch_tokens": 4, "consumed_samples": -1}, "consumed_samples"),
    ],
)
def test_sampler_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HDPSampler(np.array([3, 4]), seed=0, **kwargs)


def test_raw_counts_become_plan_lengths_and_short_documents_are_named():
    np.testing.assert_array_equal(plan_lengths_from_raw([2, 10]), [1, 9])
    with pytest.raises(ValueError, match=r"document 1 \(0 tokens\), document 3 \(1 tokens\)"):
        plan_lengths_from_raw([5, 0, 7, 1], what="document")


def test_documents_are_cut_into_pieces_that_train_every_next_token_once():
    pieces = DocumentPieces([7, 3, 9, 4], [1, 5, 10, 11], max_length=5)  # 0, 4, 9 and 10 positions
    assert pieces.num_dropped == 1  # one raw token: nothing to predict
    assert list(zip(pieces.document.tolist(), pieces.offset.tolist(), pieces.lengths.tolist())) == [
        (3, 0, 4), (9, 0, 5), (9, 5, 4), (4, 0, 5), (4, 5, 5)]
    # piece [offset, offset + L) reads raw tokens up to offset + L + 1: consecutive pieces overlap by the
    # one token that is the last label of one and the first input of the next, so each label is used once
    whole = DocumentPieces([0], [12], max_length=None)
    assert whole.lengths.tolist() == [11] and whole.offset.tolist() == [0]
    with pytest.raises(ValueError, match="2 raw tokens"):
        DocumentPieces([0, 1], [1, 0], max_length=4)


def test_overlong_samples_are_rejected_or_truncated_explicitly(caplog):
    lengths = np.array([5, 50, 7, 90])
    with pytest.raises(ValueError, match=r"sample 1 \(length 50\), sample 3 \(length 90\).*--hdp-overlong-documents"):
        limit_lengths(lengths, max_length=40, overlong="error")
    with caplog.at_level("WARNING"):
        np.testing.assert_array_equal(limit_lengths(lengths, max_length=40, overlong="truncate"), [5, 40, 7, 40])
    assert "truncating 2 of 4 samples" in caplog.text
    assert limit_lengths(lengths, max_length=None) is lengths


class _SFT:
    """A map-style dataset of token lists with a `lengths` array (raw token counts)."""

    def __init__(self, docs, lengths=None):
        self.docs = docs
        self.lengths = [len(d) for d in docs] if lengths is None else lengths

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"tokens": np.array(self.docs[i])}


def test_map_style_source_reads_ranges_and_catches_lying_lengths():
    source = MapStyleSource(_SFT([[1, 2, 3, 4], [7, 8]]))
    np.testing.assert_array_equal(source.lengths, [3, 1])
    np.testing.assert_array_equal(source.read(0, 1, 4), [2, 3, 4])
    liar = MapStyleSource(_SFT([[1, 2, 3, 4], [7, 8]], lengths=[4, 5]))
    with pytest.raises(ValueError, match="sample 1 has 2 'tokens' entries but the dataset's lengths say 5"):
        liar.read(1, 0, 2)
    with pytest.raises(ValueError, match="has no `lengths`"):
        MapStyleSource([np.arange(3)])


def test_prefetcher_runs_ahead_propagates_errors_and_closes():
    produced = []

    def numbers():
        for i in range(5):
            produced.append(i)
            yield i

    prefetcher = Prefetcher(numbers, depth=2)
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert produced[:3] == [0, 1, 2]  # two queued plus one waiting to be queued, before any consumption
    assert list(prefetcher) == [0, 1, 2, 3, 4]

    def failing():
        yield 1
        raise KeyError("broken document")

    prefetcher = Prefetcher(failing)
    assert next(prefetcher) == 1
    with pytest.raises(KeyError, match="broken document"):
        next(prefetcher)

    def endless():
        while True:
            yield 0

    before = threading.active_count()
    prefetcher = Prefetcher(endless, depth=1)
    next(prefetcher)
    prefetcher.close()
    assert not prefetcher.alive and threading.active_count() == before
    with pytest.raises(StopIteration):
        next(prefetcher)


def test_map_style_loss_mask_marks_input_positions_whose_label_is_a_target():
    docs = [{"tokens": np.arange(10, 16), "targets": np.array([0, 0, 0, 1, 1, 1])}]  # prompt 3, answer 3
    source = MapStyleSource(_ListOf(docs), loss_mask_key="targets")
    # input positions 0..4 predict raw tokens 1..5; positions 2, 3, 4 predict answer tokens
    np.testing.assert_array_equal(source.read_loss_mask(0, 0, 5), [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(source.read_loss_mask(0, 1, 3), [0, 1])
    assert not hasattr(MapStyleSource(_ListOf(docs)), "read_loss_mask")


class _ListOf(list):
    @property
    def lengths(self):
        return [len(d["tokens"]) for d in self]


def test_data_layer_imports_without_megatron():
    """docs/architecture.md: data/ uses torch but never Megatron (the adapters live in megatron_hdp/megatron/)."""
    import subprocess
    import sys

    blocker = (
        "import importlib, importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'megatron':\n"
        "            raise ImportError(f'layer violation: {name} imported')\n"
        "sys.meta_path.insert(0, Block())\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
    )
    modules = [f"megatron_hdp.data.{name}" for name in ("source", "sampler", "prefetch", "loader")]
    result = subprocess.run([sys.executable, "-c", blocker, *modules], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
