"""What an HDP run may change when it resumes from a checkpoint, and what it may not.

The document stream of an HDP run (the sampler's global batches, step by step) depends on the seed, the
consumed-sample count Megatron checkpoints, the batch flags and the documents' lengths; the number of
ranks it is planned on does not enter it. So a run may resume on another number of HDP ranks (fewer
nodes after a failure, more when they return) and train the same documents with the same losses, up to
summation order. Two things would change it, and are refused (one line each, naming the flag):

- the model-parallel sizes (TP, PP, EP): an HDP rank is one model-parallel group, and the capacity, the
  cost model and the plans are sized for the group the checkpoint's run had;
- the lengths the documents are trained at. Every document must fit the pool: `--hdp-capacity` x the
  pool's ranks, stretched by the offloading the cost model allows (`loader.pool_length_limit`), at
  least the longest document (GPT documents are already cut at --seq-length). Under
  `--hdp-overlong-documents error` (the default) the loader refuses a pool that cannot hold one before
  training starts; under `truncate` it would cut them shorter or longer than the checkpoint's run did,
  so a resume must keep the cut where it was.

Pure: reads the checkpoint's saved arguments (Megatron's argparse namespace) like any namespace.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from megatron_hdp.config import HDPConfig

MODEL_PARALLEL_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def model_parallel_changes(saved: Any, current: Any) -> list[str]:
    """One line per model-parallel size `current` (this run's arguments) changes from `saved` (the
    checkpoint's), naming the flag and its checkpoint value."""
    problems = []
    for name in MODEL_PARALLEL_SIZES:
        old, new = getattr(saved, name, 1) or 1, getattr(current, name, 1) or 1
        if old != new:
            flag = "--" + name.replace("_", "-")
            problems.append(
                f"{flag} {new} with --hdp: the checkpoint in --load was saved with {flag} {old}, and an HDP run "
                f"resumes on its checkpoint's tensor, pipeline and expert parallel sizes (only the number of HDP "
                f"ranks may change); use {flag} {old}"
            )
    return problems


def truncation_change(loader: Any, saved: Any) -> Optional[str]:
    """Why `loader` (an `HDPDataLoader` of the resumed run) would train the checkpoint's documents at other
    lengths than the run that saved `saved` did, or None. Only `--hdp-overlong-documents truncate` can:
    `error` refuses any document the pool cannot hold before training."""
    config: HDPConfig = loader.config
    if not getattr(saved, "hdp", False) or config.hdp_overlong_documents != "truncate":
        return None
    lengths = np.asarray(loader.source.lengths, dtype=np.int64)
    longest = int(lengths.max())
    before, _ = loader.sample_length_limit(
        lengths, getattr(saved, "seq_length", None), num_ranks=saved.data_parallel_size,
        config=HDPConfig.from_namespace(saved), cost_model=loader.cost_model)
    now = loader.length_limit
    if min(before or longest, longest) == min(now or longest, longest):
        return None
    return (
        f"--hdp-capacity {config.hdp_capacity} on {loader.num_ranks} HDP ranks truncates documents to "
        f"{min(now or longest, longest)} tokens, but the checkpoint's run (--hdp-capacity {saved.hdp_capacity} on "
        f"{saved.data_parallel_size} ranks) trained them at {min(before or longest, longest)} "
        "(--hdp-overlong-documents truncate): a resume would change the documents; choose --hdp-capacity so that "
        "the cut stays where it was"
    )
