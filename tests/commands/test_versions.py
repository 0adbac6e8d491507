"""README's "Supported versions" table, setup.py's requirements and the runtime version checks agree."""

import ast
import importlib.metadata
import re
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[2]


def _table() -> dict[str, str]:
    """Package -> 'Supported' cell of README.md's table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported versions", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    return {name.strip(): cell.strip() for name, cell in rows[1:]}


def _requirements() -> dict[str, Requirement]:
    """Every requirement of setup.py (install_requires and extras), by distribution name."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setup")
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
    texts = keywords["install_requires"] + [r for extra in keywords["extras_require"].values() for r in extra]
    return {Requirement(text).name: Requirement(text) for text in texts}


def _lines(cell: str) -> set[tuple[int, int]]:
    """'0.19.x, 0.20.x' -> {(0, 19), (0, 20)}."""
    return {(int(a), int(b)) for a, b in re.findall(r"(\d+)\.(\d+)\.x", cell)}


def _floor(cell: str) -> Version:
    return Version(re.search(r">= ?([\d.]+)", cell).group(1))


def test_torch_floor_is_setup_pys_and_no_lower_than_megatron_cores():
    table, requirement = _table()["torch"], _requirements()["torch"]
    assert requirement.specifier == f">={_floor(table)}"
    mcore = [Requirement(r) for r in importlib.metadata.requires("megatron-core") or [] if r.startswith("torch")]
    assert mcore and all(Version(str(_floor(table))) in r.specifier for r in mcore)  # megatron-core's own floor


def test_megatron_core_lines_match_setup_py_and_the_runtime_check():
    from megatron_hdp.megatron.compat.versions import SUPPORTED_MCORE

    lines = _lines(_table()["megatron-core"])
    assert lines == set(SUPPORTED_MCORE)
    spec = _requirements()["megatron-core"].specifier
    candidates = {(0, minor) for minor in range(10, 40)}
    assert {line for line in candidates if Version(f"{line[0]}.{line[1]}.0") in spec} == lines
    assert all(Version(f"{a}.{b}.9") in spec for a, b in lines)


def test_transformer_engine_major_matches_the_te_extra_and_the_backend():
    from megatron_hdp.attention.backends.te_fused import SUPPORTED_MAJOR

    assert _table()["transformer-engine"].startswith(f"{SUPPORTED_MAJOR}.x")
    spec = _requirements()["transformer-engine"].specifier
    assert Version(f"{SUPPORTED_MAJOR}.0") in spec and Version(f"{SUPPORTED_MAJOR}.99") in spec
    assert Version(f"{SUPPORTED_MAJOR - 1}.99") not in spec and Version(f"{SUPPORTED_MAJOR + 1}.0") not in spec


def test_flash_attn_range_matches_its_extra_and_the_backend():
    from megatron_hdp.attention.backends.flash_attn_varlen import MIN_VERSION

    cell, spec = _table()["flash-attn"], _requirements()["flash-attn"].specifier
    major, minor = MIN_VERSION
    assert _floor(cell) == Version(f"{major}.{minor}") and f"< {major + 1}" in cell
    assert Version(f"{major}.{minor}.0") in spec and Version(f"{major}.{minor - 1}.9") not in spec
    assert Version(f"{major + 1}.0") not in spec


def test_the_backend_api_checks_pass_on_this_torch():
    """The torch_varlen and flex backends look for the keyword / class they call (README: torch >= 2.10
    and >= 2.9); on this torch (2.13) both must be found, or the backends would stand aside needlessly."""
    import inspect

    from torch.nn.attention import flex_attention, varlen

    assert "window_size" in inspect.signature(varlen.varlen_attn).parameters
    assert hasattr(flex_attention, "AuxRequest")


def test_setup_installs_what_megatron_cores_default_checkpoints_need():
    """megatron-core's torch_dist writer (dist_checkpointing/strategies/filesystem_async.py) raises "psutil is
    not installed" at every save, and megatron-core does not declare it: both of the Makefile's install
    branches and setup.py install it (a fresh `make setup` could save no torch_dist checkpoint without)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert filesystem_async.HAVE_PSUTIL
    assert "psutil" in _requirements()
    branches = (ROOT / "Makefile").read_text().split("\telse \\")
    assert len(branches) == 2 and all("psutil" in branch for branch in branches)
