"""The DeepSeek-V3 EP 32 cell's batches, shared by the benchmarks that study it (`ep_gap.py`,
`ep_unit_bound.py`): `simulate --model deepseek-v3 --gpus 2048 --tp 8 --ep 32 --context 128K`'s batches
by default, 4 C-token micro-batches a rank, one per mix and seed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Iterator

import numpy as np

from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.lengths import sample_global_batch
from megatron_hdp.sim.cluster import ClusterSpec
from megatron_hdp.sim.compare import MICROBATCHES_PER_RANK


def parse_cell_arguments(description: str, results: Path) -> argparse.Namespace:
    """The command line's cell flags: model, GPUs, TP, EP, context, mixes, seeds, and where the result goes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--gpus", type=int, default=2048)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--ep", type=int, default=32)
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--dists", nargs="+", default=["github", "byted"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--out", default=str(results))
    return parser.parse_args()


def cell_batches(args: argparse.Namespace) -> Iterator[tuple[str, int, np.ndarray, CostModel, int, int]]:
    """(mix, seed, lengths, cost model, C, HDP ranks) of each batch the flags name."""
    spec = ClusterSpec(model=args.model, num_gpus=args.gpus, tp_size=args.tp, ep_size=args.ep)
    cost, capacity, ranks = spec.cost_model(), spec.rank_capacity, spec.num_ranks
    for dist in args.dists:
        for seed in args.seeds:
            lengths = np.asarray(sample_global_batch(dist, num_tokens=MICROBATCHES_PER_RANK * capacity * ranks,
                                                     seed=seed, max_length=args.context))
            yield dist, seed, lengths, cost, capacity, ranks
