"""HDPDataLoader on 4 gloo processes: the plan-digest check over torch.distributed, and agreement with the
single-process run of the same 4 ranks. Megatron-free on purpose (the children only import torch), so
the launch stays cheap; the indexed-dataset reads are covered in test_data_loader.py."""

from collections import Counter

import numpy as np

from megatron_hdp.comm.launch import run_gloo
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader
from megatron_hdp.data.source import MapStyleSource
from megatron_hdp.plan.cost.presets import analytic_cost_model

STRIDE = 1 << 12
NUM_RANKS = 4
CONFIG = HDPConfig(hdp_capacity=64, hdp_global_batch_tokens=400, hdp_offload=False, hdp_policy="balance")


class _Documents:
    """Map-style dataset: document d holds tokens d * STRIDE + position (each token says where it is)."""

    def __init__(self):
        rng = np.random.default_rng(1)
        self.lengths = np.clip(rng.lognormal(np.log(25), 1.0, 30).astype(int), 2, 150)
        self.lengths[[4, 21]] = [200, 240]

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, d):
        return d * STRIDE + np.arange(self.lengths[d])


def _loader(rank, seed=3):
    return HDPDataLoader(MapStyleSource(_Documents()), rank=rank, num_ranks=NUM_RANKS, config=CONFIG,
                         cost_model=analytic_cost_model("llama-7b"), seed=seed, max_epochs=1)


def _held(step):
    """(document, position) of every loss token of a rank's step; each label must be the next token."""
    held = []
    for mb in step.microbatches:
        real = mb.loss_mask > 0
        assert (mb.labels[real] == mb.tokens[real] + 1).all()
        assert (mb.tokens[real] % STRIDE == mb.position_ids[real]).all()
        held += [(int(t) // STRIDE, int(t) % STRIDE) for t in mb.tokens[real]]
    return held


def _rank(rank, world_size):
    with _loader(rank) as loader:
        steps = [(step.plan.digest(), _held(step)) for step in loader]
    with _loader(rank, seed=3 + (rank == 2)) as disagreeing:  # rank 2 samples other documents
        try:
            next(disagreeing)
            error = None
        except RuntimeError as exc:
            error = str(exc)
    return steps, error


def test_gloo_ranks_match_the_single_process_run_and_reject_disagreeing_plans():
    results = run_gloo(_rank, NUM_RANKS, timeout_s=240)
    reference = [_loader(rank) for rank in range(NUM_RANKS)]
    lengths = _Documents().lengths
    num_steps = 0
    for index, per_rank in enumerate(zip(*reference)):
        num_steps += 1
        assert [results[r][0][index][0] for r in range(NUM_RANKS)] == [s.plan.digest() for s in per_rank]
        assert [results[r][0][index][1] for r in range(NUM_RANKS)] == [_held(s) for s in per_rank]
        together = Counter(p for r in range(NUM_RANKS) for p in results[r][0][index][1])
        assert together == Counter((int(d), p) for d in per_rank[0].sample_ids for p in range(lengths[d] - 1))
    assert num_steps > 1 and all(len(results[r][0]) == num_steps for r in range(NUM_RANKS))
    for rank in range(NUM_RANKS):
        assert "ranks planned different global batches" in results[rank][1]
        assert "[2]" in results[rank][1]  # the message names the odd rank out
        reference[rank].close()
