"""Pipeline parallelism under `megatron.training.pretrain` with --hdp: PP = 2, TP = 2 x PP = 2 and virtual
pipeline stages (2 model chunks per stage, Megatron's interleaved schedule) x PP = 2 on 4 gloo ranks.

HDP plans documents (pieces of at most --seq-length 64 positions), and a micro-batch holds what its plan
packs: at PP 2 (a pool of 2 pipelines, --hdp-capacity 40) pieces longer than 40 are split over rings,
at TP 2 x PP 2 (a pool of 1, capacity 160) several documents share a micro-batch. Either way the tensors
between pipeline stages change length from one micro-batch to the next, never --seq-length as Megatron
assumes; install() turns on Megatron's `variable_seq_lengths` for that (benchmarks/pp_shapes_bench.py
measures it against padding every micro-batch to the step's longest). Without it these runs crashed
(gloo: "Received data size doesn't match expected size", or a RoPE size mismatch on stage 2).

The reference is plain Megatron with the same flags and the same TP x PP layout, trained on each
document piece the HDP run planned (its saved plans) as its own padded sample
(`pretrain_harness.PlannedPiecesDataset`): the same documents per step, so every step's loss is equal up
to summation order. The layout must be the same: Megatron seeds each pipeline stage's weight
initialization with seed + 100 x its stage (initialize.py `_set_random_seed`), so runs of different PP
sizes start from different weights.
"""

import pytest
from pretrain_harness import TINY, assert_same_losses, read_saved_plans, run_pretrain

pytestmark = pytest.mark.timeout(1800)  # six runs of 4 ranks; seconds each on an idle machine

STEPS = 3
COMMON = TINY + ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", str(STEPS)]


VPP2 = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1"]
"""Megatron's interleaved schedule: 4 layers, 2 model chunks of one layer on each of the 2 stages."""


@pytest.mark.parametrize(
    "layout, capacity",
    [(["--pipeline-model-parallel-size", "2"], 40),
     (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 160),
     (VPP2, 40)],
    ids=["pp2", "tp2xpp2", "vpp2xpp2"],
)
def test_pipeline_parallel_hdp_matches_plain_megatron_on_the_planned_documents(demo_data_prefix, tmp_path, layout, capacity):
    plans_dir = str(tmp_path / "plans")
    data = ["--data-path", demo_data_prefix, "--data-cache-path", str(tmp_path / "cache")] + layout
    hdp_flags = ["--hdp", "--hdp-capacity", str(capacity), "--no-hdp-offload", "--hdp-save-plans", plans_dir]
    hdp = run_pretrain(COMMON + data + hdp_flags)
    reference = run_pretrain(COMMON + data, reference_plans=(plans_dir, demo_data_prefix))
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    # the losses come from the last stage only (2 ranks: a DP pair, or a TP pair)
    assert sum(bool(rank["losses"]) for rank in hdp) == 2

    # what ran between the stages: documents of many lengths, none cut to a fixed window
    plans = read_saved_plans(plans_dir)
    lengths = [s["length"] for plan in plans for s in plan["sequences"]]
    assert len(plans) == STEPS and len(set(lengths)) > 4 and max(lengths) <= 64
    rings = [len(s["ring"]) for plan in plans for s in plan["sequences"]]
    assert max(rings) == (2 if capacity < 64 else 1)  # pieces over 40 tokens on a ring of the pool of 2
