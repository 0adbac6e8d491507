"""Pipeline parallelism under `megatron.training.pretrain` with --hdp: PP = 2 and TP = 2 x PP = 2 on 4 gloo ranks.

The micro-batches of an HDP step have the lengths the plan packs (at most --hdp-capacity tokens: 40 at
PP 2, split samples; 160 at TP 2 x PP 2, two samples a micro-batch; never --seq-length 64), so the
tensors between pipeline stages have another shape than Megatron's fixed one, and in general a different
one each micro-batch; install() turns on Megatron's `variable_seq_lengths` for that (benchmarks/pp_shapes_bench.py
measures it against padding every micro-batch to the step's longest). Without it these runs crashed
(gloo: "Received data size doesn't match expected size").

The reference is plain Megatron with the same flags and the same TP x PP layout: Megatron seeds each
pipeline stage's weight initialization with seed + 100 x its stage (initialize.py `_set_random_seed`), so
runs of different PP sizes start from different weights and only runs of one layout can be compared.
Same samples per step, same initial weights: every step's loss is equal up to summation order.
"""

import pytest
from pretrain_harness import TINY_GPT, assert_same_losses, run_pretrain

pytestmark = pytest.mark.timeout(1200)  # four runs of 4 ranks; seconds each on an idle machine


@pytest.fixture(scope="module")
def data_args(tmp_path_factory) -> list[str]:
    from megatron_hdp.megatron.build_dataset import build_demo_dataset

    root = tmp_path_factory.mktemp("pp")
    prefix = build_demo_dataset(root / "data", num_docs=256, vocab_size=256, max_length=256)
    return ["--data-path", prefix, "--data-cache-path", str(root / "cache"), "--train-iters", "3"]


@pytest.mark.parametrize(
    "layout, capacity, rings, microbatches",
    [
        # pool of 2 pipelines: each 64-token sample split over a ring of 2, micro-batches of 32 tokens
        (["--pipeline-model-parallel-size", "2"], 40, 8, 8),
        # pool of 1 pipeline: two samples packed per micro-batch, 128 tokens between stages, not 64
        (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"], 160, 0, 4),
    ],
    ids=["pp2", "tp2xpp2"],
)
def test_pipeline_parallel_hdp_matches_plain_megatron(data_args, layout, capacity, rings, microbatches):
    plain = run_pretrain(TINY_GPT + data_args + layout)
    hdp = run_pretrain(TINY_GPT + data_args + layout + ["--hdp", "--hdp-capacity", str(capacity), "--no-hdp-offload"])
    losses = assert_same_losses(hdp, plain)
    assert len(losses) == 3 and losses[-1] < losses[0]
    # the losses come from the last stage only (2 ranks: a DP pair, or a TP pair)
    assert [bool(rank["losses"]) for rank in hdp] == [bool(rank["losses"]) for rank in plain]
    assert sum(bool(rank["losses"]) for rank in hdp) == 2
    # the plan HDP ran: micro-batches of another length than --seq-length between the stages
    first = hdp[0]["stats"][0]
    assert first["hdp/sequences"] == 8 and first["hdp/tokens"] == 8 * 64
    assert first["hdp/rings"] == rings and first["hdp/microbatches-max"] == microbatches

