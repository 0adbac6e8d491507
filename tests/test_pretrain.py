"""`megatron.training.pretrain` through examples/pretrain_gpt_hdp.py on 4 gloo ranks, with and without --hdp.

Same tiny GPT, same indexed dataset (megatron-core's GPTDataset over a synthetic corpus), same seed. The
HDP run's capacity (24 tokens) is below the sample length (64), so every sample is split over a ring of
ranks and runs ring attention inside Megatron's own layers, offloading part of its activations (the plan's
ratio, through the offloader install() attaches). The reference is the plain Megatron run on the same
samples: every step's loss must be equal, and must go down. The HDP run sets its batch as
a token budget, and Megatron's consumed_train_samples must count HDP's documents (resume).
"""

import pytest
from pretrain_harness import TINY_GPT as TINY
from pretrain_harness import run_pretrain

# The same 8 samples a step, as a token budget; Megatron's nominal --global-batch-size is lowered to 4, so
# its own per-step increment of consumed_train_samples (4) differs from the 8 documents HDP consumes.
HDP = ["--hdp", "--hdp-capacity", "24", "--hdp-global-batch-tokens", "512", "--global-batch-size", "4"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    from megatron_hdp.megatron.build_dataset import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("data"), num_docs=256, vocab_size=256, max_length=256)


def test_pretrain_with_hdp_matches_megatron_and_learns(data_prefix, tmp_path):
    data = ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache")]
    plain = run_pretrain(TINY + data)
    hdp = run_pretrain(TINY + data + HDP)

    # Megatron reports the DP-reduced loss on every last-stage rank; with PP 1 that is every rank.
    reference = plain[0]["losses"]
    losses = hdp[0]["losses"]
    assert len(losses) == len(reference) == 4
    assert all(run["losses"] == losses for run in hdp)
    # same data and initial weights: every step's loss equals plain Megatron's (exact gradients and RoPE
    # positions, or the losses after the first update would drift apart)
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]

    # the HDP run really split the samples (the planner puts each 64-token sample on a ring of 2 ranks that
    # offload a quarter of their activations, rather than 3 ranks without) and offloaded on every rank
    first = hdp[0]["stats"][0]
    assert first["hdp/sequences"] == 8 and first["hdp/tokens"] == 8 * 64
    assert first["hdp/rings"] == 8
    for run in hdp:
        assert all(s["hdp/offload-GB"] == s["hdp/prefetch-GB"] > 0 for s in run["stats"])
    assert plain[0]["stats"][0] == {}

    # resume accounting: Megatron's consumed_train_samples (what it checkpoints and resumes the loader
    # from) counts the documents HDP consumed, not --global-batch-size per step
    assert plain[0]["consumed"] == [8, 16, 24, 32]
    documents = [int(s["hdp/sequences"]) for s in hdp[0]["stats"]]
    assert all(run["consumed"] == [sum(documents[: i + 1]) for i in range(4)] == [8, 16, 24, 32] for run in hdp)
