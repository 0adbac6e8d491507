"""patches/: the pretrain_gpt.py patch applies to Megatron-LM core_v0.19.0 and main, calls only what we
export, and the patched script trains with and without --hdp.

Megatron-LM's pretrain_gpt.py is not stored in this repository (patches/README.md says why). The tests
that need it read it from a Megatron-LM checkout named by MEGATRON_LM_DIR (the tag or main; a bare git
mirror also works for applying, at MEGATRON_LM_REF, default core_v0.19.0) and are skipped, with that
reason, when none is given; they fetch nothing. docs/megatron_lm.md says how to point them at either.
"""

import hashlib
import inspect
import math
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
PATCH = PATCHES / "pretrain_gpt.patch"
KNOWN = dict(line.split() for line in (PATCHES / "pretrain_gpt.py.sha256").read_text().splitlines())
"""sha256 of each upstream pretrain_gpt.py the patch was checked on -> its release (core_v0.19.0, main-0.20.0)."""


def _megatron_lm_dir() -> Path:
    where = os.environ.get("MEGATRON_LM_DIR")
    if not where:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.19.0 or main) or git mirror")
    return Path(where)


def _upstream_pretrain_gpt() -> bytes:
    """Megatron-LM's pretrain_gpt.py from MEGATRON_LM_DIR (checkout, or bare git at MEGATRON_LM_REF)."""
    root = _megatron_lm_dir()
    if (root / "pretrain_gpt.py").is_file():
        return (root / "pretrain_gpt.py").read_bytes()
    ref = os.environ.get("MEGATRON_LM_REF", "core_v0.19.0")
    shown = subprocess.run(["git", f"--git-dir={root}", "show", f"{ref}:pretrain_gpt.py"], capture_output=True)
    if shown.returncode != 0:
        pytest.skip(f"{root} has no pretrain_gpt.py and no git ref {ref}")
    return shown.stdout


def _apply(target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PATCHES / "apply.sh"), str(target)], capture_output=True, text=True)


def test_patch_applies_to_the_checkout(tmp_path):
    upstream = _upstream_pretrain_gpt()
    release = KNOWN.get(hashlib.sha256(upstream).hexdigest())
    assert release, f"MEGATRON_LM_DIR's pretrain_gpt.py is none of the files the patch was checked on: {KNOWN}"
    (tmp_path / "pretrain_gpt.py").write_bytes(upstream)
    run = _apply(tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"is Megatron-LM {release}'s pretrain_gpt.py" in run.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pretrain_gpt.py"]  # no .orig/.rej left behind
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    assert "partial(hdp.add_hdp_args, then=" in patched and "hdp.install(args)" in patched
    compile(patched, "pretrain_gpt.py", "exec")
    # install() must come before the model config is read from args (it may set the attention spec).
    assert patched.index("hdp.install(args)") < patched.index("gpt_config_from_args(args")
    again = _apply(tmp_path)
    assert again.returncode == 0 and "already has" in again.stdout


def _patched_checkout(tmp_path: Path) -> tuple[Path, Path, str]:
    """(checkout, patched pretrain_gpt.py, indexed dataset prefix); skips without a built checkout."""
    from pretrain_harness import megatron_lm_checkout, patched_pretrain_gpt

    from megatron_hdp.harness.build_dataset import build_demo_dataset

    _megatron_lm_dir()
    root = megatron_lm_checkout()
    script = patched_pretrain_gpt(root, tmp_path)
    prefix = build_demo_dataset(tmp_path / "data", num_docs=128, vocab_size=256, max_length=256)
    return root, script, prefix


def test_patched_pretrain_gpt_trains_with_and_without_hdp(tmp_path):
    """The patched script of the checkout, with the checkout's own `megatron` (core and training; for main
    that is megatron-core 0.20), trains a tiny GPT on 4 CPU ranks: plainly, and with --hdp."""
    from pretrain_harness import TINY, logged_losses, run_pretrain

    root, script, prefix = _patched_checkout(tmp_path)
    argv = TINY + ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "3",
                   "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")]
    plans_dir = tmp_path / "plans"
    for flags in ([], ["--hdp", "--hdp-capacity", "40", "--no-hdp-offload", "--hdp-save-plans", str(plans_dir)]):
        run = run_pretrain(argv + flags, script=script, python_path=(str(root),))
        losses = logged_losses(run)
        assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        assert bool(run[0]["stats"][0]) == bool(flags)  # HDP statistics exactly when --hdp is set

    # the patched script's --hdp run planned Megatron's documents (pieces of at most --seq-length), each
    # piece at most once, and its losses equal plain Megatron (our entry point, the checkout's megatron, one
    # process) trained on the same pieces, each its own padded sample
    from pretrain_harness import expected_pieces, read_saved_plans

    index = (Path(prefix + ".idx")).read_bytes()  # Megatron's layout: magic 9, version 8, dtype 1, count 8, ...
    count = int(np.frombuffer(index, dtype=np.int64, count=1, offset=18)[0])
    raw = np.frombuffer(index, dtype=np.int32, count=count, offset=34).tolist()  # ... documents 8, lengths
    pieces = {(doc, offset): length for doc, offset, length in expected_pieces(raw, 64)}
    planned = [(s["source"]["document"], s["source"]["offset"], s["length"])
               for plan in read_saved_plans(plans_dir) for s in plan["sequences"]]
    assert len(planned) == 3 * 8 and len(set(planned)) == len(planned)
    assert all(pieces[(doc, offset)] == length for doc, offset, length in planned)
    reference = run_pretrain(argv, world_size=1, python_path=(str(root),), reference_plans=(str(plans_dir), prefix))
    assert losses == pytest.approx(logged_losses(reference), rel=1e-5, abs=1e-6)


def test_patched_pretrain_gpt_with_tp2_pp2_matches_plain_megatron(tmp_path):
    """pretrain_gpt.py builds its datasets on TP rank 0 of the first and last stages only; under --hdp
    every rank plans, so install() has every rank build them. TP 2 x PP 2 on 4 ranks, capacity 160 (not
    --seq-length): every step's loss equals plain Megatron with the same layout on the planned pieces."""
    from pretrain_harness import TINY, assert_same_losses, read_saved_plans, run_pretrain

    root, script, prefix = _patched_checkout(tmp_path)
    plans_dir = str(tmp_path / "plans")
    argv = TINY + ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "3",
                   "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
                   "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    hdp = run_pretrain(argv + ["--hdp", "--hdp-capacity", "160", "--no-hdp-offload", "--hdp-save-plans", plans_dir],
                       script=script, python_path=(str(root),))
    reference = run_pretrain(argv, python_path=(str(root),), reference_plans=(plans_dir, prefix))
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert len({s["length"] for plan in read_saved_plans(plans_dir) for s in plan["sequences"]}) > 4


def test_patched_pretrain_gpt_with_moe_at_ep2_matches_plain_megatron(tmp_path):
    """A MoE model (4 experts, top-2, all-to-all dispatcher) with --expert-model-parallel-size 2 on 4 ranks:
    install() gives the planner the EP groups (2 consecutive HDP ranks, checked against Megatron's groups
    when the loader is built), `balance` plans them as units, and every step's loss equals plain Megatron
    with the same layout on the planned pieces."""
    from pretrain_harness import TINY, assert_same_losses, read_saved_plans, run_pretrain

    root, script, prefix = _patched_checkout(tmp_path)
    plans_dir = str(tmp_path / "plans")
    argv = TINY + ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "3",
                   "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
                   "--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                   "--expert-model-parallel-size", "2"]
    hdp = run_pretrain(argv + ["--hdp", "--hdp-capacity", "40", "--no-hdp-offload", "--hdp-save-plans", plans_dir],
                       script=script, python_path=(str(root),))
    reference = run_pretrain(argv, python_path=(str(root),), reference_plans=(plans_dir, prefix))
    losses = assert_same_losses(hdp, reference)
    assert len(losses) == 3 and losses[-1] < losses[0]
    plans = read_saved_plans(plans_dir)
    assert any(len(s["ring"]) > 1 for plan in plans for s in plan["sequences"])  # documents were split


@pytest.mark.timeout(600)  # three launches: whole, K/V rings, latent rings
def test_patched_pretrain_gpt_with_multi_latent_attention_matches_whole_documents_on_rings(tmp_path):
    """The patched script with `--hdp --multi-latent-attention`: the checkout's Megatron builds its MLA
    config and spec, HDP swaps in its MLA module; 4 ranks with K/V rings, and with latent rings, give 1 rank's losses, step by
    step."""
    from pretrain_harness import MLA, TINY, assert_whole_and_rings_agree

    root, script, prefix = _patched_checkout(tmp_path)
    argv = TINY + MLA + ["--seq-length", "64", "--global-batch-size", "8", "--train-iters", "3",
                         "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache")]
    losses = assert_whole_and_rings_agree(argv, seq_length=64, ring_kinds=("kv", "latent"), script=script,
                                          python_path=(str(root),))
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_apply_script_refuses_a_file_it_does_not_fit(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("print('not megatron')\n")
    run = subprocess.run(["bash", str(PATCHES / "apply.sh"), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 1 and "does not apply" in run.stderr
    assert (tmp_path / "pretrain_gpt.py").read_text() == "print('not megatron')\n"  # dry run first: untouched
    assert shutil.which("bash")
    assert subprocess.run(["bash", "-n", str(PATCHES / "apply.sh")]).returncode == 0


def test_patch_is_small_and_calls_what_we_export():
    added = [line[1:] for line in PATCH.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in PATCH.read_text().splitlines() if line.startswith("-") and not line.startswith("---")]
    assert len([line for line in added if line.strip()]) <= 4 and len(removed) <= 2
    import megatron_hdp.megatron as hdp

    for name in set(re.findall(r"\bhdp\.(\w+)", "\n".join(added))):
        assert callable(getattr(hdp, name)), name
    assert "then" in inspect.signature(hdp.add_hdp_args).parameters
    assert list(inspect.signature(hdp.install).parameters)[0] == "args"


def test_install_stays_a_function_after_its_module_is_imported():
    """`hdp.install(args)` in the patch must not turn into a module once the implementation is imported."""
    import importlib

    import megatron_hdp.megatron as hdp

    importlib.import_module(hdp._LAZY["install"])
    assert callable(hdp.install) and hdp.install.__name__ == "install"
