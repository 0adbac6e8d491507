"""`megatron.training.pretrain` with --hdp and multi-token prediction (--mtp-num-layers 1 and 2) equals plain
Megatron on the planned pieces.

Same documents and reference as tests/megatron/test_pretrain.py (plain single-process Megatron, each saved piece its
own padded sample, --eod-mask-loss: HDP's MTP weights read the documents' loss masks), with Megatron's own
MTP block: depth 1 on a pool of 4 ranks (pieces over 24 tokens on rings) with the off-by-one attention sink
and a sliding window on alternate layers (MTP and sinks together), depth 2 with PP = 2 on a pool of 2
pipelines (the MTP block on the last stage; the reference has the same PP layout, since Megatron seeds each
stage's initialization by its stage). Two steps with SGD (whose update is the gradient itself, where
Adam's first step would only keep its signs) and the MTP loss scale 0.5: the weights after every step
equal the reference's to 1e-4 of the step's update, so the gradients are those of plain Megatron with each
document its own micro-batch (Megatron's MTP normalisation per micro-batch, M / M_k, applied per
document), on rings as whole. The `mtp_k loss` HDP logs is the token-level mean over the global batch
(megatron/layers/mtp.py): it equals the reference's depth-k token-loss sum over its depth-k loss-token count
(from the reference's per-micro-batch log values and counts, which Megatron itself averages per
micro-batch) to 5e-6.

With MEGATRON_LM_DIR set (a Megatron-LM checkout, tag core_v0.19.0 or main, dataset helpers built) the HDP
runs go through the checkout's own pretrain_gpt.py with our patch and both runs use the checkout's
`megatron` (megatron-core 0.20 for main): install() must reach the MTP block of that release's model
builder too.
"""

import pytest
from pretrain_harness import assert_same_losses, checkout_entry, read_saved_plans, run_pretrain
from test_pretrain import COMMON, SINKS, data_prefix  # noqa: F401  (the documents, as a fixture)

pytestmark = pytest.mark.timeout(1800)

STEPS = 2
MTP_SCALE = ["--mtp-loss-scaling-factor", "0.5"]
SGD = ["--optimizer", "sgd", "--lr", "0.1"]
"""Updates large enough to move the second step's loss, equal to lr x the gradient (momentum aside)."""
CASES = {
    "mtp1-hdp4-sinks": (1, SINKS["off-by-one"], 24),
    "mtp2-pp2xhdp2": (2, ["--pipeline-model-parallel-size", "2"], 40),
}
"""name -> (MTP depth, other flags, HDP capacity). Depth 1 runs with gpt-oss's attention (the off-by-one sink,
a window on alternate layers): MTP and sinks together, its MTP layer's attention windowed and sunk as
Megatron's."""


@pytest.mark.parametrize("name", list(CASES))
def test_pretrain_with_mtp_matches_plain_megatron_on_the_planned_documents(data_prefix, tmp_path, name):  # noqa: F811
    depth, flags, capacity = CASES[name]
    script, python_path = checkout_entry(tmp_path)
    plans_dir = str(tmp_path / "plans")
    argv = [*COMMON, "--train-iters", str(STEPS), "--data-path", data_prefix,
            "--data-cache-path", str(tmp_path / "cache"), "--mtp-num-layers", str(depth), *MTP_SCALE, *SGD, *flags]
    hdp_flags = ["--hdp", "--hdp-capacity", str(capacity), "--no-hdp-offload", "--hdp-save-plans", plans_dir]
    hdp = run_pretrain(argv + hdp_flags, script=script, python_path=python_path, record_weights=True)
    pp = "--pipeline-model-parallel-size" in flags
    reference = run_pretrain(argv, world_size=4 if pp else 1, python_path=python_path,
                             reference_plans=(plans_dir, data_prefix), record_weights=True)
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == STEPS
    # install() gave Megatron-LM's model builder our MTP spec: every MTP layer attends with HDP's attention
    assert [names for rank in hdp if (names := rank["mtp_attention"])] == [["HDPCoreAttention"] * depth] * (
        2 if pp else 4)
    assert {n for rank in reference for n in rank["mtp_attention"]} == {"DotProductAttention"}
    assert any(len(s["ring"]) > 1 for plan in read_saved_plans(plans_dir) for s in plan["sequences"])
    # the weights after each step: rank by rank (the same stage layout), every replica of the 1-stage run
    for rank, run in enumerate(hdp):
        want = reference[rank if pp else 0]["weights"]
        assert sorted(run["weights"]) == sorted(want) == list(range(STEPS + 1))
        for step in range(1, STEPS + 1):
            for name, value in want[step].items():
                update = float((value - want[step - 1][name]).abs().max())
                error = float((run["weights"][step][name] - value).abs().max())
                assert error <= 1e-4 * update + 1e-8, (rank, step, name, error, update)
    # Megatron's MTP log, every depth, every step, on the ranks that hold the MTP block: the token-level
    # mean, whatever the placement
    names = {f"mtp_{d + 1} loss" for d in range(depth)}
    logged = [rank["mtp"] for rank in hdp if rank["mtp"] and rank["mtp"][0]]
    sums = [rank["mtp_tokens"] for rank in reference if rank["mtp_tokens"] and rank["mtp_tokens"][0]]
    assert logged and sums and all(len(steps) == STEPS for steps in logged + sums)
    for step in range(STEPS):
        expected = {n: sum(rank[step][n][0] for rank in sums) / sum(rank[step][n][1] for rank in sums) for n in names}
        for rank in logged:
            assert set(rank[step]) == names
            assert all(rank[step][n] == pytest.approx(expected[n], rel=5e-6) for n in names), (step, logged, expected)
