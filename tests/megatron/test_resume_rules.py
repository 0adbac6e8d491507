"""What an HDP resume may change (megatron_hdp/data/resume.py): the pool's size, not the model-parallel sizes,
and not the lengths the documents are trained at. Pure: Megatron's saved arguments are namespaces, the
loader is built on a synthetic source (no process group). The same refusal through `megatron.training`'s
own checkpoint loading: tests/megatron/test_checkpoints.py (`test_a_resume_that_changes_tp_is_refused_in_one_line`)."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_hdp.config import HDPConfig
from megatron_hdp.data.loader import HDPDataLoader, pool_length_limit
from megatron_hdp.data.resume import model_parallel_changes, truncation_change
from megatron_hdp.data.source import MapStyleSource
from megatron_hdp.plan.cost.presets import analytic_cost_model

COST_MODEL = analytic_cost_model("llama-7b")


def _sizes(tp=1, pp=1, ep=1, etp=None, vpp=None):
    """Megatron's resolved arguments (validate_args): ETP None becomes TP, one virtual stage is None."""
    return SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           expert_model_parallel_size=ep, expert_tensor_parallel_size=tp if etp is None else etp,
                           virtual_pipeline_model_parallel_size=vpp)


def test_only_the_pool_may_change_not_tp_pp_ep_etp_or_virtual_stages():
    assert model_parallel_changes(_sizes(2, 2, 2, etp=1, vpp=2), _sizes(2, 2, 2, etp=1, vpp=2)) == []
    assert model_parallel_changes(SimpleNamespace(), _sizes()) == []  # an old checkpoint without the sizes: 1
    # ...and without ETP (older than it): ETP was TP
    assert model_parallel_changes(SimpleNamespace(tensor_model_parallel_size=2), _sizes(tp=2)) == []
    (tp,) = model_parallel_changes(_sizes(tp=2), _sizes(tp=4))  # ETP follows TP on both sides: one line
    assert tp == ("--tensor-model-parallel-size 4 with --hdp: the checkpoint in --load was saved with "
                  "--tensor-model-parallel-size 2, and an HDP run resumes on its checkpoint's model-parallel layout "
                  "(TP, PP, EP, ETP and virtual pipeline stages; only the number of HDP ranks may change); use "
                  "--tensor-model-parallel-size 2")
    problems = model_parallel_changes(_sizes(pp=2, ep=4), _sizes(pp=1, ep=2))
    assert [p.split()[0] for p in problems] == ["--pipeline-model-parallel-size", "--expert-model-parallel-size"]
    assert all("\n" not in p for p in problems)


@pytest.mark.parametrize("saved, current, flag, old, new", [
    (_sizes(tp=2, ep=2, etp=1), _sizes(tp=2, ep=2, etp=2), "--expert-tensor-parallel-size", 1, 2),
    (_sizes(tp=2, ep=2), _sizes(tp=2, ep=2, etp=1), "--expert-tensor-parallel-size", 2, 1),  # ETP left to TP, then set
    (_sizes(pp=2, vpp=2), _sizes(pp=2, vpp=4), "--num-virtual-stages-per-pipeline-rank", 2, 4),
    (_sizes(pp=2, vpp=2), _sizes(pp=2), "--num-virtual-stages-per-pipeline-rank", 2, 1),  # dropped: 1 stage
    (_sizes(pp=2), _sizes(pp=2, vpp=2), "--num-virtual-stages-per-pipeline-rank", 1, 2),
], ids=["etp-1-to-2", "etp-2-to-1", "vpp-2-to-4", "vpp-2-to-none", "vpp-none-to-2"])
def test_a_resume_that_changes_etp_or_the_virtual_stages_is_refused_in_one_line(saved, current, flag, old, new):
    (problem,) = model_parallel_changes(saved, current)
    assert problem.startswith(f"{flag} {new} with --hdp: the checkpoint in --load was saved with {flag} {old}, ")
    assert problem.endswith(f"; use {flag} {old}") and "\n" not in problem
    # TP changed together with an ETP that did not follow it: both named
    assert [p.split()[0] for p in model_parallel_changes(_sizes(tp=2, etp=1), _sizes(tp=1, etp=2))] == [
        "--tensor-model-parallel-size", "--expert-tensor-parallel-size"]


def _loader(lengths, *, num_ranks, capacity, overlong="truncate", max_length=64):
    config = HDPConfig(hdp=True, hdp_capacity=capacity, hdp_offload=False, hdp_overlong_documents=overlong)
    source = MapStyleSource([np.zeros(n, dtype=np.int64) for n in lengths], lengths=lengths)
    return HDPDataLoader(source, rank=0, num_ranks=num_ranks, config=config, cost_model=COST_MODEL, seed=1,
                         global_batch_size=4, max_length=max_length)


def _saved(*, num_ranks, capacity, overlong="truncate", hdp=True, seq_length=64):
    return SimpleNamespace(hdp=hdp, hdp_capacity=capacity, hdp_offload=False, hdp_overlong_documents=overlong,
                           data_parallel_size=num_ranks, seq_length=seq_length)


def test_a_resume_keeps_the_lengths_documents_are_trained_at():
    lengths = [65, 30, 12, 40, 65, 9]  # raw tokens: the longest documents have 64 positions (--seq-length)
    # the constraint: the pool holds the longest document (4 x 24 and 3 x 24 do; 2 x 24 does not, 2 x 32 does)
    assert pool_length_limit(64, num_ranks=3, config=HDPConfig(hdp_capacity=24, hdp_offload=False),
                             cost_model=COST_MODEL) is None
    cut = pool_length_limit(64, num_ranks=2, config=HDPConfig(hdp_capacity=24, hdp_offload=False),
                            cost_model=COST_MODEL)
    assert cut is not None and cut < 64
    saved = _saved(num_ranks=4, capacity=24)
    for num_ranks, capacity in ((4, 24), (2, 32), (8, 24), (3, 24)):  # every document still whole: resumes
        assert truncation_change(_loader(lengths, num_ranks=num_ranks, capacity=capacity), saved) is None
    problem = truncation_change(_loader(lengths, num_ranks=2, capacity=24), saved)
    assert problem == (
        f"--hdp-capacity 24 on 2 HDP ranks truncates documents to {cut} tokens, but the checkpoint's run "
        "(--hdp-capacity 24 on 4 ranks) trained them at 64 (--hdp-overlong-documents truncate): a resume would "
        "change the documents; choose --hdp-capacity so that the cut stays where it was")
    # ...and the other way: a run that cut documents resumed on a pool that holds them whole
    assert "trained them at" in truncation_change(_loader(lengths, num_ranks=4, capacity=24),
                                                  _saved(num_ranks=2, capacity=24))
    # a pool that cuts where the checkpoint's run cut (there: at its --seq-length) resumes
    assert truncation_change(_loader(lengths, num_ranks=2, capacity=24),
                             _saved(num_ranks=4, capacity=24, seq_length=cut)) is None
    # under `error` (the default) the loader itself refuses a pool that cannot hold a document, before training
    with pytest.raises(ValueError, match=r"longer than \d+ tokens \(the most 2 ranks x hdp_capacity 24 hold"):
        _loader(lengths, num_ranks=2, capacity=24, overlong="error")
    assert truncation_change(_loader(lengths, num_ranks=4, capacity=24, overlong="error"), saved) is None
    # a plain checkpoint (no --hdp) was trained on Megatron's windows: nothing of HDP's to keep
    assert truncation_change(_loader(lengths, num_ranks=2, capacity=24), _saved(num_ranks=4, capacity=24, hdp=False)) \
        is None
    assert truncation_change(_loader(lengths, num_ranks=2, capacity=24), None) is None
