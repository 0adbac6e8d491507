"""`megatron.training.pretrain` with --hdp and multi-token prediction (--mtp-num-layers 1 and 2) equals plain
Megatron on the planned pieces.

Same documents and reference as tests/test_pretrain.py (plain single-process Megatron, each saved piece its
own padded sample, --eod-mask-loss: HDP's MTP weights read the documents' loss masks), with Megatron's own
MTP block: depth 1 on a pool of 4 ranks (pieces over 24 tokens on rings) with the off-by-one attention sink
and a sliding window on alternate layers (MTP and sinks together), depth 2 with PP = 2 on a pool of 2
pipelines (the MTP block on the last stage; the reference has the same PP layout, since Megatron seeds each
stage's initialization by its stage). Two steps: the second step's loss is taken after an update that
the MTP gradients moved, and the MTP loss scale is 0.5, so that wrong MTP gradients would put it beyond
the tolerance; Megatron logs the MTP loss of every depth in both
runs (HDP's is the mean over the planned micro-batches of each one's MTP loss per loss token, plain
Megatron's the mean over its one-document micro-batches: close, not equal).

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
            "--data-cache-path", str(tmp_path / "cache"), "--mtp-num-layers", str(depth), *MTP_SCALE, *flags]
    hdp_flags = ["--hdp", "--hdp-capacity", str(capacity), "--no-hdp-offload", "--hdp-save-plans", plans_dir]
    hdp = run_pretrain(argv + hdp_flags, script=script, python_path=python_path)
    pp = "--pipeline-model-parallel-size" in flags
    reference = run_pretrain(argv, world_size=4 if pp else 1, python_path=python_path,
                             reference_plans=(plans_dir, data_prefix))
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == STEPS
    # install() gave Megatron-LM's model builder our MTP spec: every MTP layer attends with HDP's attention
    assert [names for rank in hdp if (names := rank["mtp_attention"])] == [["HDPCoreAttention"] * depth] * (
        2 if pp else 4)
    assert {n for rank in reference for n in rank["mtp_attention"]} == {"DotProductAttention"}
    assert any(len(s["ring"]) > 1 for plan in read_saved_plans(plans_dir) for s in plan["sequences"])
    # Megatron's own MTP log, every depth, every step, on the ranks that hold the MTP block
    names = {f"mtp_{d + 1} loss" for d in range(depth)}
    logged = [rank["mtp"] for rank in hdp if rank["mtp"] and rank["mtp"][0]]
    expected = [rank["mtp"] for rank in reference if rank["mtp"] and rank["mtp"][0]]
    assert logged and expected and all(len(steps) == STEPS for steps in logged + expected)
    for got, want in zip(logged[0], expected[0]):
        assert set(got) == set(want) == names
        assert all(got[n] == pytest.approx(want[n], rel=0.2) for n in names), (logged, expected)

