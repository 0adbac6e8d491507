"""patches/: the pretrain_gpt.py patch applies to Megatron-LM core_v0.19.0 and calls only what we export.

Megatron-LM's pretrain_gpt.py is not stored in this repository (patches/README.md says why). The apply
test reads it from a Megatron-LM checkout or git mirror named by MEGATRON_LM_DIR and is skipped, with
that reason, when none is given; the other tests always run.
"""

import hashlib
import inspect
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
PATCH = PATCHES / "pretrain_gpt.patch"
RELEASE = "core_v0.19.0"


def _upstream_pretrain_gpt() -> bytes:
    """Megatron-LM's pretrain_gpt.py at the supported release, from MEGATRON_LM_DIR (checkout or bare git)."""
    where = os.environ.get("MEGATRON_LM_DIR")
    if not where:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout or git mirror to test applying the patch")
    root = Path(where)
    if (root / "pretrain_gpt.py").is_file():
        return (root / "pretrain_gpt.py").read_bytes()
    shown = subprocess.run(
        ["git", f"--git-dir={root}", "show", f"{RELEASE}:pretrain_gpt.py"], capture_output=True, check=False
    )
    if shown.returncode != 0:
        pytest.skip(f"{root} has no pretrain_gpt.py and no git tag {RELEASE}")
    return shown.stdout


def test_patch_applies_to_the_supported_release(tmp_path):
    upstream = _upstream_pretrain_gpt()
    expected = (PATCHES / "pretrain_gpt.py.sha256").read_text().split()[0]
    assert hashlib.sha256(upstream).hexdigest() == expected, "MEGATRON_LM_DIR is not at core_v0.19.0"
    (tmp_path / "pretrain_gpt.py").write_bytes(upstream)
    run = subprocess.run(["bash", str(PATCHES / "apply.sh"), str(tmp_path)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    patched = (tmp_path / "pretrain_gpt.py").read_text()
    assert "partial(hdp.add_hdp_args, then=" in patched and "hdp.install(args)" in patched
    compile(patched, "pretrain_gpt.py", "exec")
    # install() must come before the model config is read from args (it may set the attention spec).
    assert patched.index("hdp.install(args)") < patched.index("gpt_config_from_args(args")
    again = subprocess.run(["bash", str(PATCHES / "apply.sh"), str(tmp_path)], capture_output=True, text=True)
    assert again.returncode == 0 and "already has" in again.stdout


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
