"""What an HDP run may change when it resumes from a checkpoint, and what it may not.

The document stream of an HDP run (the sampler's global batches, step by step) depends on the seed, the
consumed-sample count Megatron checkpoints, the batch flags and the documents' lengths; the number of
ranks it is planned on does not enter it. So a run may resume on another number of HDP ranks (fewer
nodes after a failure, more when they return) and train the same documents with the same losses, up to
summation order. Two things would change it, and are refused (one line each, naming the flag):

- the model-parallel layout (TP, PP, EP, the expert tensor-parallel size ETP, the virtual pipeline
  stages): an HDP rank is one model-parallel group, and the capacity, the cost model, the planner's expert
  units (lcm(TP, ETP x EP) / TP ranks) and the plans' interleaved order are sized for the layout the
  checkpoint's run had (refusing is the simple, safe answer: none of them is re-derived at a resume);
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

MODEL_PARALLEL_SIZES = (
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
    ("expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
    ("virtual_pipeline_model_parallel_size", "--num-virtual-stages-per-pipeline-rank"),
)
"""(Megatron's resolved argument, the flag that sets it) of every size a resume keeps. Megatron resolves an
unset ETP to TP and a single virtual stage to None; a checkpoint older than a size saved none of it. An ETP
equal to TP on both sides follows TP: its change is TP's, reported once."""


def _size(args: Any, name: str) -> int:
    """`args`' value of the size `name`, with Megatron's defaults for a missing or unset one."""
    value = getattr(args, name, None)
    if value is None and name == "expert_tensor_parallel_size":
        return _size(args, "tensor_model_parallel_size")
    return value or 1


def model_parallel_changes(saved: Any, current: Any) -> list[str]:
    """One line per model-parallel size (`MODEL_PARALLEL_SIZES`) `current` (this run's arguments) changes
    from `saved` (the checkpoint's), naming the flag, both values and the fix."""
    problems = []
    for name, flag in MODEL_PARALLEL_SIZES:
        old, new = _size(saved, name), _size(current, name)
        follows_tp = name == "expert_tensor_parallel_size" and (old, new) == (
            _size(saved, "tensor_model_parallel_size"), _size(current, "tensor_model_parallel_size"))
        if old != new and not follows_tp:
            problems.append(
                f"{flag} {new} with --hdp: the checkpoint in --load was saved with {flag} {old}, and an HDP run "
                f"resumes on its checkpoint's model-parallel layout (TP, PP, EP, ETP and virtual pipeline stages; "
                f"only the number of HDP ranks may change); use {flag} {old}"
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
