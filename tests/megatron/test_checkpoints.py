"""Checkpoints as users move them, through `megatron.training.pretrain` on gloo ranks (tests/pretrain_harness.py).

One chain of runs of the tiny GPT (`--ckpt-format torch_dist`, Megatron's default, with the distributed
optimizer, as every large run) serves every check, each run's per-step losses, HDP figures (sample ids,
plan digest, token counts) and weights recorded by the harness (not Megatron's log line: after a start its
second line averages two steps):

    P   plain Megatron, 4 ranks, iterations 1-2, saved                 (a short-context run; the dense
        chain's with --context-parallel-size 2: tests/cp_stand_in.py)
    H   --hdp, 4 ranks, from P's checkpoint, iterations 3-6, saved at 4 (continued with HDP)
    H4  --hdp from H's iteration-4 checkpoint on 4 ranks, iterations 5-6 (a resume)
    H2  ... on 2 ranks (--hdp-capacity 32: 2 x 24 cannot hold a 64-token document), H8 on 8 ranks
    P'  plain Megatron from H's iteration-4 checkpoint, on 2 ranks, iteration 5 (back to plain Megatron)
    R   plain Megatron in one process from P's checkpoint: iterations 3-4 on the documents H planned
        (each piece its own padded sample, `PlannedPiecesDataset`), then iteration 5 on Megatron's own
        samples, the ones P' trains: the single-process reference for both directions

Checked: H starts from P's weights exactly and its steps equal R's (plain -> HDP; the dense chain's P
saves under CP 2, DP 2 x CP 2 with the optimizer sharded over the 4, continued on an HDP pool of 4 and in R
on 1); P' starts from H's weights exactly and its step equals R's (HDP -> plain); P's and H's checkpoint
files hold the same keys and shapes; H4 repeats H to the bit (losses, sample ids, plan digests, token and
micro-batch counts, every weight); H2 and H8 train the same document stream with the same losses and
weights up to summation order; a resume that changes TP is refused in one line naming the flag. The same
chain for a MoE model on 2 ranks (P, H, H2 and P' on 2 ranks, --hdp-capacity 32; no distributed
optimizer: `torch_dist` without it); a short one (P, H, H4, H2) for --bf16 with the distributed optimizer
and a MoE model on EP 2; and a resume with virtual pipeline stages in the `torch` format with the
distributed optimizer. `torch` without it: tests/megatron/test_fault_restart.py. Every run starts processes that
import torch and Megatron, so the chains are as short as the checks allow (the resume on 8 ranks is the
one long run).
"""

import shutil
from pathlib import Path

import pytest
import torch
from pretrain_harness import TINY, run_pretrain

from megatron_hdp.comm.launch import RankFailed

pytestmark = pytest.mark.timeout(3600)  # a test may start up to four runs of its chain; minutes on an idle host

HDP = ["--hdp", "--hdp-capacity", "24"]
"""Documents cut at 64 tokens, capacity 24: pieces longer than 24 tokens run on rings."""
DETERMINISTIC_STATS = ("hdp/tokens", "hdp/sequences", "hdp/rings", "hdp/balance", "hdp/microbatches-max",
                       "hdp/microbatches-min", "hdp/microbatches-this-rank", "hdp/est-step-time-s",
                       "hdp/ring-attention-GB")
"""HDP's per-step figures that the plan fixes (the others are measured times)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> list[str]:
    from megatron_hdp.harness.build_dataset import build_demo_dataset

    work = tmp_path_factory.mktemp("ckpt")
    prefix = build_demo_dataset(work / "data", num_docs=256, vocab_size=256, max_length=256)
    return ["--data-path", prefix, "--data-cache-path", str(work / "cache")]


def _run(argv, *, world_size=4, **kwargs):
    return run_pretrain(argv, world_size=world_size, record_weights=True, timeout_s=1200, **kwargs)


def _by_iteration(rank: dict) -> dict:
    """{iteration: (loss, sample ids, plan digest, deterministic stats)} of one rank's record."""
    return {
        iteration: (rank["losses"][i] if rank["losses"] else None, rank["ids"][i] if rank["ids"] else None,
                    rank["digests"][i] if rank["digests"] else None,
                    {name: rank["stats"][i].get(name) for name in DETERMINISTIC_STATS})
        for i, iteration in enumerate(rank["iterations"])
    }


def assert_same_weights(got: dict, expected: dict, *, exact: bool = True) -> None:
    """Every parameter equal (to the bit, or up to summation order)."""
    assert got.keys() == expected.keys()
    for name in expected:
        if exact:
            assert torch.equal(got[name], expected[name]), name
        else:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-5, msg=name)


def assert_within_bf16_regrouping(got: dict, expected: dict, *, lr: float = 3e-3) -> None:
    """bf16 weights one step after the same weights, planned on another pool: its plan groups the documents
    into other micro-batches, so the bf16 matmuls sum in another order and the gradients differ at bf16's
    precision (~2^-8), not only by reduction order. Adam turns that into a different update only where an
    element's gradient is near zero, by at most about lr: so every element within lr, and most bitwise equal
    (a gradient wrong for the whole batch moves far more of them). Seen 2026-11-29: 96-99.4% equal, the
    rest within 0.16 lr (`pretrain_harness.TINY`'s 3e-3)."""
    assert got.keys() == expected.keys()
    for name in expected:
        difference = (got[name].float() - expected[name].float()).abs()
        assert float(difference.max()) <= lr, name
        assert float((difference == 0).float().mean()) >= 0.9, name


def _checkpoint_keys(directory: Path) -> dict:
    """Key -> size of every entry of a torch_dist checkpoint (its DCP metadata)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    return {key: tuple(getattr(entry, "size", ())) for key, entry in metadata.items()}


class Chain:
    """The runs of one chain (module docstring), started on first use and kept for the module. With
    `script` (a patched Megatron-LM pretrain_gpt.py) P, H and P' run it, and every run, R too, runs on the
    `megatron` package of `python_path` (the checkout's)."""

    def __init__(self, root: Path, common: list[str], *, iterations: int, resume_at: int, world_size: int = 4,
                 hdp: tuple[str, ...] = tuple(HDP), plain: tuple[str, ...] = (), script=None,
                 python_path: tuple[str, ...] = ()):
        self.root, self.common, self.resume_at, self.hdp, self.plain = root, common, resume_at, list(hdp), list(plain)
        self.iterations, self.world_size = iterations, world_size
        self.script, self.python_path = script, python_path
        self.runs: dict[str, list[dict]] = {}

    def run(self, argv, world_size=None, **kwargs):
        return _run(argv, script=self.script, python_path=self.python_path,
                    world_size=world_size or self.world_size, **kwargs)

    def __getitem__(self, name: str) -> list[dict]:
        if name not in self.runs:
            self.runs[name] = getattr(self, f"_{name}")()
        return self.runs[name]

    def _plain(self):
        return self.run(self.common + self.plain + ["--save", str(self.root / "plain"), "--save-interval", "1000",
                                       "--exit-interval", "2"])

    def _hdp(self):
        self["plain"]
        return self.run(self.common + self.hdp + ["--load", str(self.root / "plain"), "--save", str(self.root / "hdp"),
                                                  "--save-interval", str(self.resume_at),
                                                  "--hdp-save-plans", str(self.root / "plans")])

    def resumed(self, *extra: str, world_size=None) -> list[dict]:
        self["hdp"]
        return self.run(self.common + self.hdp + ["--load", str(self.root / "hdp"), "--ckpt-step",
                                                  str(self.resume_at), *extra], world_size=world_size)

    def _back_to_plain(self):
        self["hdp"]
        return self.run(self.common + ["--load", str(self.root / "hdp"), "--ckpt-step", str(self.resume_at),
                                       "--exit-interval", str(self.resume_at + 1)], world_size=2)

    def _reference(self):
        """R: one process, from P's checkpoint, on H's documents up to the resume point, then plain."""
        self["hdp"]
        plans = self.root / "reference_plans"
        plans.mkdir(exist_ok=True)
        for iteration in range(3, self.resume_at + 1):
            name = f"iter_{iteration:07d}.json"
            shutil.copy(self.root / "plans" / name, plans / name)
        prefix = self.common[self.common.index("--data-path") + 1]
        return _run(self.common + ["--load", str(self.root / "plain"), "--exit-interval", str(self.resume_at + 1)],
                    world_size=1, reference_plans=(str(plans), prefix), python_path=self.python_path)


DENSE = ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "6", "--ckpt-format", "torch_dist",
         "--use-distributed-optimizer", "--no-load-rng"]
MOE = ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "4", "--ckpt-format", "torch_dist",
       "--no-load-rng", "--num-experts", "4", "--moe-router-topk", "2"]


MOE_EP_BF16 = MOE + ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
                     "--use-distributed-optimizer", "--bf16"]
"""bf16 weights with the distributed optimizer's fp32 main parameters, experts on EP groups of 2 (the
optimizer shards dense parameters over 4 ranks, expert parameters over their expert-data-parallel 2)."""


@pytest.fixture(scope="module")
def dense(data, tmp_path_factory) -> Chain:
    return Chain(tmp_path_factory.mktemp("dense"), TINY + data + DENSE, iterations=6, resume_at=4,
                 plain=("--context-parallel-size", "2"))  # the checkpoint a long-context run starts from


@pytest.fixture(scope="module")
def moe(data, tmp_path_factory) -> Chain:
    return Chain(tmp_path_factory.mktemp("moe"), TINY + data + MOE, iterations=4, resume_at=3, world_size=2,
                 hdp=("--hdp", "--hdp-capacity", "32"))  # a pool of 2 holds a 64-token document at 32


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_plain_megatron_to_hdp_and_back_train_as_one_process_would(model, request):
    chain = request.getfixturevalue(model)
    check_round_trip(chain, moe=model == "moe")
    if model == "dense":  # P trained and saved under context parallelism: DP 2 x CP 2
        from megatron.core.dist_checkpointing import load_common_state_dict

        saved = load_common_state_dict(str(chain.root / "plain" / "iter_0000002"))["args"]
        assert (saved.context_parallel_size, saved.data_parallel_size) == (2, 2)


def test_the_round_trip_through_megatron_lms_patched_pretrain_gpt(tmp_path):
    """The same with MEGATRON_LM_DIR's patched pretrain_gpt.py and its own megatron (main: megatron-core 0.20)."""
    from test_patch import _patched_checkout

    root, script, prefix = _patched_checkout(tmp_path)
    common = TINY + ["--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")] + DENSE
    common[common.index("--train-iters") + 1] = "4"
    check_round_trip(Chain(tmp_path, common, iterations=4, resume_at=3, script=script, python_path=(str(root),)),
                     moe=False)


def check_round_trip(chain: Chain, *, moe: bool) -> None:
    """P -> H -> P' against R (module docstring)."""
    plain, hdp, back, reference = chain["plain"], chain["hdp"], chain["back_to_plain"], chain["reference"][0]
    at = chain.resume_at
    assert [r["iterations"] for r in (plain[0], hdp[0], back[0], reference)] == [
        [1, 2], list(range(3, chain.iterations + 1)), [at + 1], list(range(3, at + 2))]
    # HDP continues from the plain checkpoint's weights, and its steps are the one-process plain steps
    assert_same_weights(hdp[0]["weights"][2], plain[0]["weights"][2])
    for iteration in range(3, at + 1):
        assert_same_weights(hdp[0]["weights"][iteration], reference["weights"][iteration], exact=False)
    # plain Megatron continues from the HDP checkpoint's weights, and its step is the one-process step
    assert_same_weights(back[0]["weights"][at], hdp[0]["weights"][at])
    assert_same_weights(back[0]["weights"][at + 1], reference["weights"][at + 1], exact=False)
    assert back[-1]["losses"] == pytest.approx(reference["losses"][-1:], rel=1e-5)
    # the two checkpoint files hold the same keys and shapes
    saved = _checkpoint_keys(chain.root / "hdp" / f"iter_{at:07d}")
    assert saved == _checkpoint_keys(chain.root / "plain" / "iter_0000002")
    assert any(".mlp.experts." in key for key in saved) == moe


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_resumed_hdp_run_repeats_the_uninterrupted_one_to_the_bit(model, request):
    chain: Chain = request.getfixturevalue(model)
    whole, resumed, at = chain["hdp"], chain.resumed(), chain.resume_at
    for rank in range(chain.world_size):
        assert resumed[rank]["iterations"] == list(range(at + 1, chain.iterations + 1))
        expected = _by_iteration(whole[rank])
        for iteration, record in _by_iteration(resumed[rank]).items():
            assert record == expected[iteration], (rank, iteration)  # loss, ids, digest, HDP's figures
        for iteration, weights in resumed[rank]["weights"].items():
            assert_same_weights(weights, whole[rank]["weights"][iteration])


@pytest.mark.parametrize("world_size, capacity", [(2, 32), (8, 24)], ids=["2-ranks", "8-ranks"])
def test_a_4_rank_checkpoint_resumes_on_another_number_of_ranks(dense, world_size, capacity):
    whole = dense["hdp"]
    resumed = dense.resumed("--hdp-capacity", str(capacity), world_size=world_size)
    expected = _by_iteration(whole[0])
    for iteration, (loss, ids, _, stats) in _by_iteration(resumed[0]).items():
        assert ids == expected[iteration][1], iteration  # the same documents, step by step
        assert loss == pytest.approx(expected[iteration][0], rel=1e-5)
        assert (stats["hdp/tokens"], stats["hdp/sequences"]) == (
            expected[iteration][3]["hdp/tokens"], expected[iteration][3]["hdp/sequences"])
    assert sorted(resumed[0]["weights"]) == [4, 5, 6]
    assert_same_weights(resumed[0]["weights"][4], whole[0]["weights"][4])  # resharded, to the bit
    for iteration in (5, 6):
        assert_same_weights(resumed[-1]["weights"][iteration], whole[0]["weights"][iteration], exact=False)


def test_a_resume_that_changes_tp_is_refused_in_one_line(dense):
    dense["hdp"]
    with pytest.raises(RankFailed) as failed:
        dense.resumed("--tensor-model-parallel-size", "2", world_size=2)
    line = next(line for line in str(failed.value).splitlines() if line.startswith("ValueError: "))
    assert line == (
        "ValueError: --tensor-model-parallel-size 2 with --hdp: the checkpoint in --load was saved with "
        "--tensor-model-parallel-size 1, and an HDP run resumes on its checkpoint's model-parallel layout (TP, PP, "
        "EP, ETP and virtual pipeline stages; only the number of HDP ranks may change); use "
        "--tensor-model-parallel-size 1")


def test_a_resume_with_virtual_pipeline_stages_in_the_torch_format_repeats_the_run(data, tmp_path):
    vpp = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage",
           "1", "--seq-length", "64", "--global-batch-size", "8", "--train-iters", "4", "--ckpt-format", "torch",
           "--use-distributed-optimizer", "--no-load-rng", "--hdp", "--hdp-capacity", "40", "--no-hdp-offload"]
    argv = TINY + data + vpp
    whole = _run(argv + ["--save", str(tmp_path), "--save-interval", "2"])
    # what a run stopped after iteration 2 leaves (the torch format's load takes its iteration from this
    # file even with --ckpt-step 2, and then trains nothing: megatron-core 0.19.2)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2")
    resumed = _run(argv + ["--load", str(tmp_path)])
    assert sum(bool(rank["losses"]) for rank in whole) == 2  # the last stage's DP pair logs them
    for rank in range(4):
        expected = _by_iteration(whole[rank])
        assert resumed[rank]["iterations"] == [3, 4]
        for iteration, record in _by_iteration(resumed[rank]).items():
            assert record == expected[iteration], (rank, iteration)
        for iteration, weights in resumed[rank]["weights"].items():
            assert_same_weights(weights, whole[rank]["weights"][iteration])


def test_a_bf16_moe_ep2_checkpoint_resumes_exactly_on_4_ranks_and_on_2(data, tmp_path):
    """P (plain, 4 ranks) -> H (--hdp, saved at 3) -> H4 and H2 from it: --bf16 with the distributed
    optimizer and EP 2. H4 repeats H to the bit, so the fp32 main parameters and Adam's moments came back
    (bf16 weights alone cannot restore them); H2 starts from H's weights exactly (resharded, experts
    included), its loss equals H's, and its step equals H's up to the bf16 regrouping of its own plan
    (`assert_within_bf16_regrouping`)."""
    chain = Chain(tmp_path, TINY + data + MOE_EP_BF16, iterations=4, resume_at=3)
    plain, whole = chain["plain"], chain["hdp"]
    assert_same_weights(whole[0]["weights"][2], plain[0]["weights"][2])  # plain bf16 -> HDP: the saved weights
    assert all(value.dtype == torch.bfloat16 for value in whole[0]["weights"][4].values())
    saved = _checkpoint_keys(tmp_path / "hdp" / "iter_0000003")
    assert saved == _checkpoint_keys(tmp_path / "plain" / "iter_0000002")
    assert any(".mlp.experts." in key for key in saved)
    resumed = chain.resumed()
    for rank in range(4):  # experts differ between the EP ranks: every rank's weights
        assert resumed[rank]["iterations"] == [4]
        assert _by_iteration(resumed[rank]) == {4: _by_iteration(whole[rank])[4]}, rank
        for iteration in (3, 4):
            assert_same_weights(resumed[rank]["weights"][iteration], whole[rank]["weights"][iteration])
    fewer = chain.resumed("--hdp-capacity", "32", world_size=2)  # EP 2 on 2 ranks: expert data parallelism 1
    for rank in range(2):
        assert fewer[rank]["ids"] == whole[rank]["ids"][-1:]
        assert_same_weights(fewer[rank]["weights"][3], whole[rank]["weights"][3])
        assert_within_bf16_regrouping(fewer[rank]["weights"][4], whole[rank]["weights"][4])
    assert fewer[0]["losses"] == pytest.approx(whole[0]["losses"][-1:], rel=1e-5)
