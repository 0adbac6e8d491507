"""HDPDataLoader on a real indexed dataset written with megatron-core's IndexedDatasetBuilder.

Every token of the test corpus says where it comes from (token = document * STRIDE + position), so a
collated micro-batch can be checked against the dataset without trusting the collation order: each
input must sit at its own position, its label must be the next position of the same document, and the
positions of all ranks together must be each sampled document's [0, L) exactly once.
"""

import dataclasses
import os
import shutil
from collections import Counter

import numpy as np
import pytest
import torch

from megatron_hdp.config import HDPConfig
from megatron_hdp.data.collate import collate_microbatch
from megatron_hdp.data.loader import HDPDataLoader, pool_length_limit
from megatron_hdp.data.source import MapStyleSource
from megatron_hdp.megatron.datasets.sources import IndexedDocumentSource, write_indexed_dataset
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.presets import analytic_cost_model

STRIDE = 1 << 12
NUM_RANKS = 4
CONFIG = HDPConfig(hdp_capacity=96, hdp_global_batch_tokens=600, hdp_offload=False, hdp_policy="balance")
COST_MODEL = analytic_cost_model("llama-7b")


def _raw_lengths():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(30), 0.9, 40).astype(int), 2, 200)
    lengths[[3, 17, 29]] = [300, 250, 380]  # longer than one rank's capacity: split over rings
    return lengths


def _documents(lengths):
    return [d * STRIDE + np.arange(n) for d, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """(prefix, raw lengths) of a 40-document indexed dataset with int32 tokens."""
    lengths = _raw_lengths()
    prefix = str(tmp_path_factory.mktemp("corpus") / "docs")
    write_indexed_dataset(prefix, _documents(lengths), vocab_size=len(lengths) * STRIDE)
    return prefix, lengths


def _loader(prefix, rank, **kwargs):
    options = dict(rank=rank, num_ranks=NUM_RANKS, config=CONFIG, cost_model=COST_MODEL, seed=7, max_epochs=1)
    options.update(kwargs)
    return HDPDataLoader(IndexedDocumentSource(prefix), **options)


def _positions(step):
    """(document, position) of every loss token this rank received in `step`, checking each token."""
    held = []
    for mb in step.microbatches:
        real = mb.loss_mask > 0
        assert int(real.sum()) == mb.num_loss_tokens == mb.num_tokens - mb.num_padding
        tokens, labels, positions = mb.tokens[real], mb.labels[real], mb.position_ids[real]
        torch.testing.assert_close(tokens % STRIDE, positions)  # the token of position p is raw[p]
        torch.testing.assert_close(labels, tokens + 1)  # its label is raw[p + 1] of the same document
        held.append(torch.stack([tokens // STRIDE, positions], 1))
    return torch.cat(held).tolist() if held else []


def _expected_positions(step, lengths):
    return Counter((int(d), p) for d in step.sample_ids for p in range(int(lengths[d]) - 1))


def _plan_read_bytes(step, rank, itemsize):
    """Bytes a rank must read for `step`: each non-empty chunk [a, b) of its shards needs raw [a, b + 1)."""
    return itemsize * sum(b - a + 1 for mb in step.plan.microbatches(rank) for sh in mb.shards for a, b in sh.chunks if b > a)


@pytest.mark.parametrize("policy", ["balance", "static"])
def test_four_ranks_cover_each_document_once_per_step_and_read_only_their_ranges(corpus, policy):
    prefix, lengths = corpus
    config = dataclasses.replace(CONFIG, hdp_policy=policy)
    loaders = [_loader(prefix, rank, config=config) for rank in range(NUM_RANKS)]
    steps = list(zip(*loaders))
    assert sum(len(s[0].sample_ids) for s in steps) == len(lengths)  # one epoch: every document once
    assert any(len(seq.ring) > 1 for s in steps for seq in s[0].plan.sequences), "the corpus must exercise rings"
    expected_bytes = [0] * NUM_RANKS
    for per_rank in steps:
        assert len({s.plan.digest() for s in per_rank}) == 1
        plan, ids = per_rank[0].plan, per_rank[0].sample_ids
        assert plan.lengths == [int(lengths[d]) - 1 for d in ids]
        held = Counter()
        for rank, step in enumerate(per_rank):
            mine = Counter(map(tuple, _positions(step)))
            planned = Counter((int(ids[sh.seq]), p) for mb in plan.microbatches(rank) for sh in mb.shards
                              for a, b in sh.chunks for p in range(a, b))
            assert mine == planned  # a rank receives exactly the tokens of its own shards
            held += mine
            expected_bytes[rank] += _plan_read_bytes(step, rank, itemsize=4)
        assert held == _expected_positions(per_rank[0], lengths)  # together: every position exactly once
    for rank, loader in enumerate(loaders):
        assert loader.source.bytes_read == expected_bytes[rank]
        loader.close()
    # A trainer that collates itself gets the same micro-batches from step.read_tokens, without new reads.
    for per_rank in steps:
        for rank, step in enumerate(per_rank):
            again = [collate_microbatch(step.plan, mb, step.read_tokens, rank=rank) for mb in step.plan.microbatches(rank)]
            assert len(again) == len(step.microbatches)
            assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(again, step.microbatches))
    assert [loader.source.bytes_read for loader in loaders] == expected_bytes
    total = sum(expected_bytes)
    assert total < 1.1 * 4 * lengths.sum()  # the corpus is read about once in all, not once per rank


def test_resume_after_k_steps_equals_the_uninterrupted_run(corpus):
    prefix, lengths = corpus
    rank = 1
    full = list(_loader(prefix, rank, max_epochs=2))
    assert full[-1].consumed_samples == 2 * len(lengths)
    epoch_end = next(i for i, s in enumerate(full) if s.epoch == 1)
    for k in (2, epoch_end + 1):  # stop inside the first epoch, and inside the second
        with _loader(prefix, rank, max_epochs=2, consumed_samples=full[k - 1].consumed_samples) as resumed:
            rest = list(resumed)
        assert len(rest) == len(full) - k
        for a, b in zip(full[k:], rest):
            assert a.plan.digest() == b.plan.digest() and a.consumed_samples == b.consumed_samples
            np.testing.assert_array_equal(a.sample_ids, b.sample_ids)
            assert len(a.microbatches) == len(b.microbatches)
            for x, y in zip(a.microbatches, b.microbatches):
                assert torch.equal(x.tokens, y.tokens) and torch.equal(x.labels, y.labels)


def test_overlong_documents_error_or_truncate(corpus):
    prefix, lengths = corpus
    small = dataclasses.replace(CONFIG, hdp_capacity=64)  # without offloading 4 x 64 = 256 tokens < 299, 379
    with pytest.raises(ValueError, match=r"4 ranks x hdp_capacity 64 hold with no offloading\): sample 3 \(length 299\), "
                                         r"sample 29 \(length 379\);"):
        _loader(prefix, 0, config=small)
    with pytest.raises(ValueError, match=r"the model's max_length 200\): sample 3 \(length 299\)"):
        _loader(prefix, 0, max_length=200)
    truncate = dataclasses.replace(small, hdp_overlong_documents="truncate", hdp_policy="static")
    loaders = [_loader(prefix, rank, config=truncate) for rank in range(NUM_RANKS)]
    cut = np.minimum(lengths - 1, 256)
    for per_rank in zip(*loaders):
        held = Counter(p for step in per_rank for p in map(tuple, _positions(step)))
        assert held == Counter((int(d), p) for d in per_rank[0].sample_ids for p in range(cut[d]))


def test_the_pool_limit_with_offloading_is_the_planners():
    # With offloading a rank may hold more than its capacity; the limit is what make_plan itself accepts.
    config = dataclasses.replace(CONFIG, hdp_capacity=64, hdp_offload=True, hdp_max_offload_ratio=0.5)
    limit = pool_length_limit(10_000, num_ranks=NUM_RANKS, config=config, cost_model=COST_MODEL)
    assert 256 < limit < 10_000
    make_plan([limit, 5], num_ranks=NUM_RANKS, config=config, cost_model=COST_MODEL)
    with pytest.raises(ValueError, match="ranks"):
        make_plan([limit + 1, 5], num_ranks=NUM_RANKS, config=config, cost_model=COST_MODEL)
    assert pool_length_limit(limit, num_ranks=NUM_RANKS, config=config, cost_model=COST_MODEL) is None


def test_corrupt_or_mismatched_inputs_give_clear_errors(corpus, tmp_path):
    prefix, lengths = corpus
    with pytest.raises(ValueError, match=r"missing index file .*missing\.idx"):
        IndexedDocumentSource(str(tmp_path / "missing"))
    broken = str(tmp_path / "broken")
    shutil.copy(prefix + ".idx", broken + ".idx")
    with open(prefix + ".bin", "rb") as src, open(broken + ".bin", "wb") as dst:
        dst.write(src.read()[:-8])  # truncated .bin
    with pytest.raises(ValueError, match="do not belong together"):
        IndexedDocumentSource(broken)
    os.replace(broken + ".bin", broken + ".idx")
    open(broken + ".bin", "wb").close()
    with pytest.raises(ValueError, match="is not a Megatron index file"):
        IndexedDocumentSource(broken)
    empty = str(tmp_path / "empty")
    write_indexed_dataset(empty, [np.arange(5), np.arange(0), np.arange(3), np.arange(1)], vocab_size=8)
    with pytest.raises(ValueError, match=r"document 1 \(0 tokens\), document 3 \(1 tokens\)"):
        IndexedDocumentSource(empty)


class _LyingSFT:
    """A map-style dataset whose `lengths` promise one more token than sample 2 has."""

    def __init__(self):
        self.docs = [np.arange(n) for n in (40, 30, 20, 50)]
        self.lengths = [40, 30, 21, 50]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return self.docs[i]


def test_lengths_that_disagree_with_the_data_fail_on_the_consumer_side():
    loaders = [
        HDPDataLoader(MapStyleSource(_LyingSFT()), rank=rank, num_ranks=2, cost_model=COST_MODEL, seed=0,
                      config=dataclasses.replace(CONFIG, hdp_global_batch_tokens=None), global_batch_size=4)
        for rank in range(2)
    ]
    with pytest.raises(ValueError, match="sample 2 has 20 'tokens' entries but the dataset's lengths say 21"):
        for loader in loaders:
            next(loader)
    for loader in loaders:
        loader.close()


def test_a_batch_the_policy_cannot_plan_names_its_samples():
    # 150 tokens fit 3 ranks of 64 under the balance rule, but static DP x CP needs a power-of-two CP of 4.
    dataset = _LyingSFT()
    dataset.docs[3], dataset.lengths = np.arange(151), [40, 30, 20, 151]
    config = dataclasses.replace(CONFIG, hdp_capacity=64, hdp_policy="static")
    with HDPDataLoader(MapStyleSource(dataset), rank=0, num_ranks=3, config=config, cost_model=COST_MODEL, seed=0,
                       max_epochs=1) as loader:
        with pytest.raises(ValueError, match=r"consumed_samples=0 .*longest sample 3 with 150 tokens.*static CP group"):
            next(loader)


class _SFTPairs:
    """SFT samples as dicts: tokens d * STRIDE + position, and a target mask (the answer half counts)."""

    def __init__(self):
        self.lengths = np.random.default_rng(5).integers(4, 150, 12)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, d):
        n = self.lengths[d]
        return {"tokens": d * STRIDE + np.arange(n), "targets": (np.arange(n) >= n // 2).astype(np.int8)}


def test_an_sft_loss_mask_reaches_the_micro_batches():
    dataset = _SFTPairs()
    loaders = [HDPDataLoader(MapStyleSource(dataset, loss_mask_key="targets"), rank=rank, num_ranks=2, seed=0,
                             config=CONFIG, cost_model=COST_MODEL, max_epochs=1) for rank in range(2)]
    for per_rank in zip(*loaders):
        counted = []
        for step in per_rank:
            assert step.read_loss_mask is not None
            for mb in step.microbatches:
                counted += [(t // STRIDE, t % STRIDE) for t in mb.tokens[mb.loss_mask > 0].tolist()]
                assert mb.num_loss_tokens == int((mb.loss_mask > 0).sum())
        # position p counts exactly when its label, raw token p + 1, is a target
        assert sorted(counted) == sorted((d, p) for d in per_rank[0].sample_ids.tolist()
                                         for p in range(dataset.lengths[d] - 1) if p + 1 >= dataset.lengths[d] // 2)


def test_worker_processes_and_synchronous_mode_yield_the_threads_steps(corpus):
    prefix, _ = corpus
    threaded = [(s.plan.digest(), s.sample_ids.tolist(), [mb.tokens for mb in s.microbatches], s.read_tokens(0, 0, 2))
                for s in _loader(prefix, 2)]
    for options in ({"workers": 2}, {"workers": 1, "prefetch": 2}, {"prefetch": 0}):
        with _loader(prefix, 2, **options) as loader:
            steps = [(s.plan.digest(), s.sample_ids.tolist(), [mb.tokens for mb in s.microbatches],
                      s.read_tokens(0, 0, 2)) for s in loader]
        assert [s[:2] for s in steps] == [s[:2] for s in threaded], options
        for (*_, tokens, first), (*_, expected, expected_first) in zip(steps, threaded):
            assert all(torch.equal(a, b) for a, b in zip(tokens, expected)) and len(tokens) == len(expected)
            np.testing.assert_array_equal(first, expected_first)  # read_tokens works in the consumer
    loaders = [HDPDataLoader(MapStyleSource(_LyingSFT()), rank=rank, num_ranks=2, cost_model=COST_MODEL, seed=0,
                             config=CONFIG, workers=1) for rank in range(2)]
    with pytest.raises(ValueError, match="sample 2 has 20 'tokens' entries"):  # raised in a worker process
        for loader in loaders:
            next(loader)
    for loader in loaders:
        loader.close()


def test_a_loader_given_a_function_plans_each_step_with_the_cost_model_it_returns(corpus):
    """install()'s runtime hands its loaders `HDPRuntime.current_cost_model`, which the online refit
    updates: the step planned after the update is the planner's plan under the new model."""
    prefix, _ = corpus
    current = [COST_MODEL]
    slower = dataclasses.replace(COST_MODEL, a1=COST_MODEL.a1 * 8, g=COST_MODEL.g * 3)
    with _loader(prefix, 0, cost_model=lambda: current[0], prefetch=0) as loader:
        first = next(loader)
        current[0] = slower
        second = next(loader)
    for step, model in ((first, COST_MODEL), (second, slower)):
        expected = make_plan(step.plan.lengths, num_ranks=NUM_RANKS, config=CONFIG, cost_model=model)
        assert step.plan.digest() == expected.digest()
    assert second.plan.digest() != make_plan(second.plan.lengths, num_ranks=NUM_RANKS, config=CONFIG,
                                             cost_model=COST_MODEL).digest()
