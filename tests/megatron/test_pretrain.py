"""`megatron.training.pretrain` through examples/pretrain_gpt_hdp.py on 4 gloo ranks with --hdp, on documents.

The indexed dataset has known document lengths, most shorter than --seq-length (64), three longer ones
(cut into pieces of at most 64 positions). The HDP run (capacity 24: pieces longer than that run ring
attention inside Megatron's own layers, offloading part of their activations) saves its plans with
--hdp-save-plans. Checked: the planned sequence lengths are exactly the documents' (split at
--seq-length), one epoch's documents appear exactly once, each sequence's saved source names its piece,
and every step's loss equals an independent reference: plain single-process Megatron (no --hdp, same
model, seed and initial weights) trained on each saved piece as its own padded sample
(tests/pretrain_harness.PlannedPiecesDataset), the same documents per step. Both runs use
--eod-mask-loss: HDP's mask comes from its document source, the reference's from Megatron's rule.

With sinks (`test_pretrain_with_sinks_matches_plain_megatron`): gpt-oss's attention, `--softmax-type
learnable` with a sliding window on alternate layers (`SINKS`), trained the same two ways; with
MEGATRON_LM_DIR set, by that checkout's patched pretrain_gpt.py and its own `megatron` package.
With multi-latent attention the same documents give the same losses on 1 rank (whole) as on 4 (rings).
"""

import numpy as np
import pytest
from pretrain_harness import (
    MLA,
    TINY,
    assert_same_losses,
    assert_whole_and_rings_agree,
    expected_pieces,
    checkout_entry,
    pretrain_rank,
    read_saved_plans,
    run_pretrain,
)

from megatron_hdp.comm.launch import run_gloo

SEQ_LENGTH = 64
DOCS_PER_STEP = 8
STEPS = 4
# 24 short documents (3-64 raw tokens: one piece each) and three longer ones: 200 raw tokens = 199
# positions = pieces 64+64+64+7, 129 = 64+64, 66 = 64+1. 32 pieces = 4 steps of 8 documents; 1,300-ish
# tokens, so Megatron's GPTDataset (sized for 32 windows of 64) builds two epochs with the first one
# shuffled on its own: its first 32 pieces are exactly one epoch.
RAW_LENGTHS = [*np.random.default_rng(7).integers(3, 65, 24).tolist(), 200, 129, 66]
COMMON = TINY + ["--seq-length", str(SEQ_LENGTH), "--global-batch-size", str(DOCS_PER_STEP),
                 "--train-iters", str(STEPS), "--eod-mask-loss"]
EOD = 255  # NullTokenizer's EOD: --vocab-size - 1; the counting documents hold it inside some documents
SINKS = {kind: ["--softmax-type", kind, "--window-size", "(8,0)", "--window-attn-skip-freq", "2"]
         for kind in ("learnable", "off-by-one")}
"""gpt-oss's attention on the tiny model: a sink of each kind, the sliding window on alternate layers."""


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory) -> str:
    from megatron_hdp.harness.build_dataset import synthetic_documents
    from megatron_hdp.megatron.datasets.sources import write_indexed_dataset

    prefix = str(tmp_path_factory.mktemp("data") / "docs")
    lengths = np.array(RAW_LENGTHS)
    write_indexed_dataset(prefix, synthetic_documents(lengths, vocab_size=256, seed=3), vocab_size=256)
    return prefix


def test_pretrain_plans_documents_and_matches_each_document_as_its_own_sequence(data_prefix, tmp_path):
    plans_dir = str(tmp_path / "plans")
    data = ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache")]
    hdp_flags = ["--hdp", "--hdp-capacity", "24", "--hdp-save-plans", plans_dir]
    hdp = run_gloo(pretrain_rank, 4, COMMON + data + hdp_flags, timeout_s=240,
                   env={"LOCAL_RANK": "0", "WORLD_SIZE": "4"})

    plans = read_saved_plans(plans_dir)
    assert len(plans) == STEPS
    planned = [(s["source"]["document"], s["source"]["offset"], s["length"]) for p in plans for s in p["sequences"]]
    assert all(s["source"]["dataset"] == data_prefix for p in plans for s in p["sequences"])
    # the planner saw the documents: lengths are the pieces' (not 64-token windows), each piece once
    assert sorted(planned) == sorted(expected_pieces(RAW_LENGTHS, SEQ_LENGTH))
    assert [len(p["sequences"]) for p in plans] == [DOCS_PER_STEP] * STEPS
    assert max(s["length"] for p in plans for s in p["sequences"]) == SEQ_LENGTH
    assert any(len(s["ring"]) > 1 for p in plans for s in p["sequences"])  # pieces longer than 24 use rings
    for document in range(len(RAW_LENGTHS)):  # a long document's pieces come one after another
        offsets = [offset for doc, offset, _ in planned if doc == document]
        assert offsets == sorted(offsets)

    # --eod-mask-loss has something to mask: some planned input positions hold the EOD token
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    indexed = IndexedDataset(data_prefix)
    assert any((indexed.get(doc, offset=offset, length=length) == EOD).any() for doc, offset, length in planned)

    reference = run_gloo(pretrain_rank, 1, COMMON + data, (plans_dir, data_prefix), timeout_s=240,
                         env={"LOCAL_RANK": "0", "WORLD_SIZE": "1"})[0]
    losses = hdp[0]["losses"]
    assert len(losses) == len(reference["losses"]) == STEPS
    assert all(run["losses"] == losses for run in hdp)  # Megatron reports the DP-reduced loss everywhere
    # same documents, same initial weights: every step's loss equals the plain run's (exact gradients,
    # RoPE positions inside each piece, the per-token loss over the step's documents)
    assert losses == pytest.approx(reference["losses"], rel=1e-5, abs=1e-6)

    first = hdp[0]["stats"][0]
    assert first["hdp/sequences"] == DOCS_PER_STEP
    assert [s["hdp/tokens"] for s in hdp[0]["stats"]] == [sum(s["length"] for s in p["sequences"]) for p in plans]
    for run in hdp:
        assert all(s["hdp/offload-GB"] == s["hdp/prefetch-GB"] > 0 for s in run["stats"])
        # Megatron's consumed_train_samples (what it checkpoints and resumes from) counts HDP's documents
        assert run["consumed"] == [DOCS_PER_STEP * (i + 1) for i in range(STEPS)]


@pytest.mark.timeout(900)  # two pretrain runs (4 ranks with --hdp, 1 plain); shared hosts stretch them
def test_pretrain_with_sinks_matches_plain_megatron(data_prefix, tmp_path):
    """`--softmax-type learnable --window-size (8,0) --window-attn-skip-freq 2` (gpt-oss's attention) under
    --hdp (capacity 24: the long pieces run on rings): every step's loss equals plain Megatron (its own
    attention with the sink, one process, the same seed, so the sink is drawn by the same init_method draw)
    on the planned pieces. Our entry point on the installed megatron-core, or MEGATRON_LM_DIR's patched
    pretrain_gpt.py. The off-by-one sink trains with MTP in `tests/megatron/test_pretrain_mtp.py`."""
    script, python_path = checkout_entry(tmp_path)
    plans_dir = str(tmp_path / "plans")
    argv = COMMON + ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache"), *SINKS["learnable"]]
    argv[argv.index("--train-iters") + 1] = "3"
    hdp = run_pretrain(argv + ["--hdp", "--hdp-capacity", "24", "--no-hdp-offload", "--hdp-save-plans", plans_dir],
                       script=script, python_path=python_path)
    reference = run_pretrain(argv, world_size=1, reference_plans=(plans_dir, data_prefix), python_path=python_path)
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == 3 and any(len(s["ring"]) > 1 for p in read_saved_plans(plans_dir) for s in p["sequences"])


def test_pretrain_with_multi_latent_attention_matches_whole_documents_on_rings(data_prefix, tmp_path):
    """`--hdp --multi-latent-attention` (a query latent, latent norms, YaRN) with a learnable sink and
    core-attention recompute (`--recompute-granularity selective`): 4 ranks running the longer pieces on
    latent rings (`--hdp-ring-kind latent`) give the losses of 1 rank running every document whole, step
    by step. (MLA on K/V rings: through Megatron-LM's script in tests/megatron/test_patch.py, and against the
    float64 reference in tests/megatron/test_megatron_mla.py.)"""
    data = ["--data-path", data_prefix, "--data-cache-path", str(tmp_path / "cache")]
    argv = TINY + MLA + ["--seq-length", str(SEQ_LENGTH), "--global-batch-size", str(DOCS_PER_STEP),
                         "--train-iters", "3", "--softmax-type", "learnable", "--recompute-granularity",
                         "selective"] + data
    losses = assert_whole_and_rings_agree(argv, seq_length=SEQ_LENGTH, ring_kinds=("latent",))
    assert len(losses) == 3 and losses[-1] < losses[0]
