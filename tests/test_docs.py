"""The project explains itself truthfully: the map's paths exist, the docs point only inside the
repository and name only public API, the Development section names only tools the project installs, and
the public API resolves (its planning half without torch or Megatron).

The references are the filesystem and the package's own `__all__`; nothing here is parsed by the code
under test.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_hdp

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"
USER_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^[\w./-]+(\.py|\.md|\.sh|\.patch|/)$")
_DOTTED = re.compile(r"\bmegatron_hdp(\.[A-Za-z_]\w*)+")


def named_paths(text: str) -> list[str]:
    """Every code span of `text` that is a file or folder path (ends in .py, .md, .sh, .patch or /)."""
    return [span for span in _CODE_SPAN.findall(text) if _PATH.match(span) and "/" in span]


def missing_paths(text: str, root: Path = REPO) -> list[str]:
    """The paths `text` names that exist neither from the repository root nor from the package's folder."""
    return [p for p in named_paths(text) if not (root / p).exists() and not (root / "megatron_hdp" / p).exists()]


def test_every_path_the_map_names_exists():
    text = ARCHITECTURE.read_text()
    assert len(named_paths(text)) > 60  # the map names the files of every layer and every contract
    assert missing_paths(text) == []


def test_a_moved_module_is_caught():
    """Planted: a path the map names that the code no longer has."""
    assert missing_paths("see `megatron_hdp/plan/cost_model.py` and `plan/cost/model.py`") == [
        "megatron_hdp/plan/cost_model.py"]


def test_every_sub_package_is_on_the_map():
    """A new sub-package of plan/ or megatron/ is added to the map when it is made."""
    text = ARCHITECTURE.read_text()
    for layer in ("plan", "megatron"):
        for sub in sorted(p for p in (REPO / "megatron_hdp" / layer).iterdir() if (p / "__init__.py").exists()):
            assert f"{layer}/{sub.name}/" in text, f"docs/architecture.md does not place {layer}/{sub.name}/"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: p.name)
def test_docs_point_only_inside_the_repository(doc):
    """No link or reference leaves the repository: the design brief beside it is not part of a clone."""
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#]+)", text):  # markdown links
        if not target.startswith(("http://", "https://")):
            assert (doc.parent / target).resolve().is_relative_to(REPO), f"{doc.name} links {target}"
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"
    assert "DESIGN.md" not in text and "STYLE.md" not in text, f"{doc.name} sends the reader outside the repository"


ENTRY_NAMES = frozenset({
    "megatron_hdp.megatron", "megatron_hdp.megatron.install", "megatron_hdp.megatron.add_hdp_args",
    "megatron_hdp.harness.run_pretrain", "megatron_hdp.cli", "megatron_hdp.__all__",
})
"""Documented entry points beside `megatron_hdp`'s own names: what `pretrain_gpt.py` imports (`import
megatron_hdp.megatron as hdp`: `install`, `add_hdp_args`), and the `python -m` entry modules."""


def non_public_names(text: str) -> list[str]:
    """The dotted `megatron_hdp.` names of `text` that are neither public API nor a documented entry."""
    names = (match.group(0) for match in _DOTTED.finditer(text))
    return [name for name in names
            if name not in ENTRY_NAMES and name.removeprefix("megatron_hdp.") not in megatron_hdp.__all__]


@pytest.mark.parametrize("doc", [d for d in USER_DOCS if d != ARCHITECTURE], ids=lambda p: p.name)
def test_user_docs_name_only_public_api(doc):
    """The guides tell users to import public names; the map (docs/architecture.md) is for contributors."""
    assert non_public_names(doc.read_text()) == []


def test_an_internal_name_in_a_guide_is_caught():
    text = "call `megatron_hdp.megatron.core_api.step.HDPTrainer` or `megatron_hdp.HDPTrainer`"
    assert non_public_names(text) == ["megatron_hdp.megatron.core_api.step.HDPTrainer"]


def development_commands(readme: str) -> list[str]:
    """The program of each command line in the README's Development section's code block."""
    section = readme.split("## Development", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split()[0] for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_development_names_only_installed_tools():
    """A contributor's commands run with what `make setup` installs (the venv's python and its modules)."""
    programs = development_commands((REPO / "README.md").read_text())
    assert programs and set(programs) <= {".", "python", "make", "megatron-hdp"}, programs


def test_the_public_api_resolves():
    for name in megatron_hdp.__all__:
        assert getattr(megatron_hdp, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'plan_step'"):
        megatron_hdp.plan_step  # noqa: B018


_PLAN_WITHOUT_TORCH = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'megatron'):
            raise ImportError(f'blocked: {name}')
sys.meta_path.insert(0, Block())
import megatron_hdp
cost = megatron_hdp.analytic_cost_model(megatron_hdp.model_shape('llama-7b'), hardware='h100')
config = megatron_hdp.HDPConfig(hdp_capacity=4096)
plan = megatron_hdp.make_plan([9000, 3000, 1000, 500], num_ranks=4, config=config, cost_model=cost)
assert isinstance(plan, megatron_hdp.StepPlan) and len(plan.sequences) == 4
"""


def test_a_driver_without_torch_plans_through_the_public_api():
    result = subprocess.run([sys.executable, "-c", _PLAN_WITHOUT_TORCH], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def cross_folder_test_imports(tests: Path) -> list[str]:
    """`from test_x import ...` statements that reach a test module of another folder of `tests`: such a
    folder would not run alone (shared helpers belong at the top of tests/, beside conftest.py)."""
    found = []
    for path in sorted(tests.glob("*/test_*.py")):
        for line in path.read_text().splitlines():
            match = re.match(r"\s*from (test_\w+) import", line)
            if match and not (path.parent / f"{match.group(1)}.py").exists():
                found.append(f"{path.relative_to(tests)}: {line.strip()}")
    return found


def test_each_test_folder_runs_alone(tmp_path):
    assert cross_folder_test_imports(REPO / "tests") == []
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "test_a.py").write_text("from test_b import X\n")  # planted: test_b is elsewhere
    assert cross_folder_test_imports(tmp_path) == ["plan/test_a.py: from test_b import X"]
