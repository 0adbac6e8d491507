"""DESIGN.md's layer order, checked from the imports: a dependency that runs back up a layer fails here.

Two checks. The first reads every module of the package with `ast` (no import runs): each `import` and
`from ... import` statement, at module level or inside a function, and every string constant that is a
dotted `megatron_hdp.<layer>...` or `megatron.<module>...` path (what `importlib.import_module` would
load), must name a layer that `MAY_IMPORT` puts below the module's own; torch and Megatron only where
DESIGN.md allows them (Megatron: only the integration layer, megatron/). The
second imports the pure layers in a subprocess with torch and Megatron blocked, which also catches a
third-party import that pulls torch in behind our back.
"""

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_hdp

ROOT = Path(megatron_hdp.__file__).parent

MAY_IMPORT: dict[str, frozenset[str]] = {
    "__init__": frozenset(),
    "config": frozenset(),
    "run_logs": frozenset(),
    "quantization": frozenset(),
    "plan": frozenset({"config"}),
    "sim": frozenset({"config", "plan"}),
    "comm": frozenset({"config", "plan"}),
    "attention": frozenset({"config", "plan", "comm"}),
    "offload": frozenset({"config", "plan", "comm"}),
    "data": frozenset({"config", "plan", "comm", "attention"}),
    "megatron": frozenset({"config", "quantization", "plan", "comm", "attention", "offload", "data"}),
    "harness": frozenset({"config", "quantization", "plan", "sim", "comm", "attention", "offload", "data", "megatron"}),
    "commands": frozenset({"config", "run_logs", "quantization", "plan", "sim", "comm", "attention", "offload", "data",
                           "megatron", "harness"}),
}
"""Layer (a subpackage, or a top-level module) -> the layers below it, the only ones it may import.
From DESIGN.md: plan/ and sim/ are pure; comm/, attention/, offload/, data/ use torch, not Megatron;
quantization.py holds TE's padding rules (no import); megatron/ is the integration (the only layer that
imports Megatron), harness/ drives it for evidence,
commands/ are the CLI."""

SAME_LAYER = {"cli": "commands"}
"""Top-level modules that belong to a subpackage's layer: the CLI entry point is the commands' layer (a
command may start `python -m megatron_hdp.cli`)."""

NO_TORCH = frozenset({"__init__", "config", "run_logs", "plan", "sim"})
"""Layers that never import torch (nor anything built on it)."""
TORCH_BUILT = ("torch", "transformer_engine", "flash_attn", "apex", "megatron")
MEGATRON_ALLOWED = frozenset({"megatron"})
"""The only layer that imports Megatron (`megatron.core`, `megatron.training`): the integration. The
harnesses, the commands and everything below reach Megatron only through its functions."""

_MODULE_PATH = re.compile(r"(megatron_hdp|megatron)(\.[A-Za-z_]\w*)+")


def layer_of(path: Path, root: Path) -> str:
    """The layer of a module file: its subpackage under `root` (megatron_hdp/), or the top-level module's name."""
    parts = path.relative_to(root).parts
    layer = parts[0] if len(parts) > 1 else path.stem
    return SAME_LAYER.get(layer, layer)


def imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every module `path` imports or names as a full `megatron_hdp.` or `megatron.`
    module path."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(("megatron_hdp", *path.relative_to(root).parent.parts))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append((node.lineno, module))
            if module == "megatron_hdp":  # `from megatron_hdp import plan` imports the layer it names
                names += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_PATH.fullmatch(node.value):
            names.append((node.lineno, node.value))
    return names


def violations(root: Path = ROOT) -> list[str]:
    """Every import of every module under `root` that breaks the layer order, as 'file:line: why'."""
    found = []
    for path in sorted(root.rglob("*.py")):
        layer = layer_of(path, root)
        if layer not in MAY_IMPORT:
            found.append(f"{path.relative_to(root)}: layer {layer!r} is not in MAY_IMPORT (place it in the order)")
            continue
        for line, name in imported_names(path, root):
            parts = name.split(".")
            where = f"{path.relative_to(root)}:{line}"
            if parts[0] == "megatron_hdp" and len(parts) > 1:
                target = SAME_LAYER.get(parts[1], parts[1])
                if target != layer and target not in MAY_IMPORT[layer]:
                    found.append(f"{where}: {layer} imports {name} (layer {target} is not below {layer})")
            elif parts[0] in TORCH_BUILT and layer in NO_TORCH:
                found.append(f"{where}: {layer} imports {name} (pure layer: no torch)")
            elif parts[0] == "megatron" and layer not in MEGATRON_ALLOWED:
                found.append(f"{where}: {layer} imports {name} (only {sorted(MEGATRON_ALLOWED)} import Megatron)")
    return found


def test_every_import_points_down_the_layer_order():
    assert violations() == []


INTEGRATION_SHARE = 0.20
"""The most of the package's Python (non-blank lines) the integration layer, megatron/, may hold: it holds
only the integration (flags, install(), initialize, layer spec, forward step, datasets, shims, Megatron's
own policies); what works without Megatron lives in the layers below it, what drives it in harness/."""


def non_blank_lines(paths: list[Path]) -> int:
    """Lines of `paths` that hold more than whitespace."""
    return sum(1 for path in paths for line in path.read_text().splitlines() if line.strip())


def test_the_integration_layer_stays_small():
    package = non_blank_lines(sorted(ROOT.rglob("*.py")))
    integration = non_blank_lines(sorted((ROOT / "megatron").rglob("*.py")))
    assert integration <= INTEGRATION_SHARE * package, (
        f"megatron/ holds {integration} of the package's {package} non-blank Python lines "
        f"({integration / package:.1%} > {INTEGRATION_SHARE:.0%}): move what needs no Megatron, or is not "
        "integration, to its layer")


def test_the_order_has_no_cycle():
    """'below' is a partial order: repeatedly peeling layers whose allowed imports are all peeled empties it."""
    left = dict(MAY_IMPORT)
    while left:
        bottom = [layer for layer, below in left.items() if not below & left.keys() - {layer}]
        assert bottom, f"cycle among {sorted(left)}"
        for layer in bottom:
            del left[layer]


@pytest.mark.parametrize(
    "relative, code, expected",
    [
        ("attention/leak.py", "from megatron_hdp.data.collate import collate_microbatch\n", "attention imports"),
        ("plan/leak.py", "import importlib\nM = importlib.import_module('megatron_hdp.megatron.policies')\n",
         "plan imports megatron_hdp.megatron.policies"),
        ("plan/leak.py", "def f():\n    import torch\n", "pure layer: no torch"),
        ("data/leak.py", "from megatron.core import parallel_state\n", "import Megatron"),
        ("harness/leak.py", "def f():\n    import megatron.training\n", "harness imports megatron.training"),
        ("commands/leak.py", "import importlib\nM = importlib.import_module('megatron.core.parallel_state')\n",
         "commands imports megatron.core.parallel_state"),
        ("comm/leak.py", "from ..megatron import step\n", "comm imports megatron_hdp.megatron "),
        ("sim/leak.py", "from megatron_hdp import offload\n", "sim imports megatron_hdp.offload "),
        ("newlayer/leak.py", "x = 1\n", "not in MAY_IMPORT"),
    ],
)
def test_a_planted_leak_is_found(tmp_path, relative, code, expected):
    """Each kind of leak, planted in a package tree of one file, is reported with its file."""
    path = tmp_path / relative
    path.parent.mkdir(parents=True)
    path.write_text(code)
    found = violations(tmp_path)
    assert len(found) == 1 and expected in found[0] and found[0].startswith(relative), found


PURE_LAYERS = ("megatron_hdp.plan", "megatron_hdp.sim", "megatron_hdp.config")

_BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'megatron'):
            raise ImportError(f'layer violation: {name} imported')
sys.meta_path.insert(0, Block())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
"""


def _pure_modules() -> list[str]:
    names = ["megatron_hdp.config", "megatron_hdp.run_logs"]
    for layer in ("plan", "sim"):
        if (ROOT / layer).is_dir():
            names.append(f"megatron_hdp.{layer}")
            names += [f"megatron_hdp.{layer}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / layer)])]
    return names


def test_pure_layers_import_without_torch_or_megatron():
    modules = _pure_modules()
    assert "megatron_hdp.plan.step_plan" in modules
    result = subprocess.run([sys.executable, "-c", _BLOCKER, *modules], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_blocker_would_catch_a_violation():
    result = subprocess.run([sys.executable, "-c", _BLOCKER, "megatron_hdp.comm.launch", "torch"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "layer violation" in result.stderr
