"""docs/architecture.md's layer order, checked from the imports: a dependency that runs back up a layer fails here.

Two checks. The first reads every module of the package with `ast` (no import runs): each `import` and
`from ... import` statement, at module level or inside a function, and every string constant that is a
dotted `megatron_hdp.<layer>...` or `megatron.<module>...` path (what `importlib.import_module` would
load), must name a layer that `MAY_IMPORT` puts below the module's own; torch and Megatron only where
docs/architecture.md allows them (Megatron: only the integration layer, megatron/). The
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
    "lazy_exports": frozenset(),
    "config": frozenset(),
    "run_logs": frozenset(),
    "plan": frozenset({"config"}),
    "sim": frozenset({"config", "plan"}),
    "comm": frozenset({"config", "plan"}),
    "attention": frozenset({"config", "plan", "comm"}),
    "offload": frozenset({"config", "plan", "comm"}),
    "data": frozenset({"lazy_exports", "config", "plan", "comm", "attention"}),
    "megatron": frozenset({"config", "plan", "comm", "attention", "offload", "data"}),
    "posttrain": frozenset({"lazy_exports", "config", "plan", "comm", "attention", "offload", "data", "megatron"}),
    "harness": frozenset({"config", "plan", "sim", "comm", "attention", "offload", "data", "megatron", "posttrain"}),
    "commands": frozenset({"config", "run_logs", "plan", "sim", "comm", "attention", "offload", "data", "megatron",
                           "posttrain", "harness"}),
}
"""Layer (a subpackage, or a top-level module) -> the layers below it, the only ones it may import.
From docs/architecture.md: plan/ and sim/ are pure; comm/, attention/, offload/, data/ use torch, not Megatron;
megatron/ is the integration (the only layer that imports Megatron), posttrain/ the door for RL and SFT
frameworks over it (its planning half pure), harness/ drives it for evidence,
commands/ are the CLI."""
MAY_IMPORT["__init__"] = frozenset(MAY_IMPORT)  # the public API: names every layer's entry points, lazily

SAME_LAYER = {"cli": "commands"}
"""Top-level modules that belong to a subpackage's layer: the CLI entry point is the commands' layer (a
command may start `python -m megatron_hdp.cli`)."""

SUB_LAYERS: dict[str, dict[str, frozenset[str]]] = {
    "plan": {
        "plan.contract": frozenset(),
        "plan.lengths": frozenset(),
        "plan.cost": frozenset({"plan.contract"}),
        "plan.timeline": frozenset({"plan.contract", "plan.cost"}),
        "plan.search": frozenset({"plan.contract", "plan.cost", "plan.timeline"}),
        "plan.policies": frozenset({"plan.contract", "plan.cost", "plan.timeline", "plan.search"}),
        "plan.planner": frozenset({"plan.contract", "plan.cost", "plan.timeline", "plan.search", "plan.policies"}),
    },
    "megatron": {
        "megatron.compat": frozenset(),
        "megatron.comparison": frozenset(),
        "megatron.layers": frozenset({"megatron.compat"}),
        "megatron.datasets": frozenset({"megatron.compat"}),
        "megatron.core_api": frozenset({"megatron.compat", "megatron.layers"}),
        "megatron.pretrain": frozenset({"megatron.compat", "megatron.layers", "megatron.datasets",
                                        "megatron.core_api", "megatron.comparison"}),
        "megatron.package": frozenset({"megatron.comparison", "megatron.pretrain"}),
    },
}
"""Inside plan/ and megatron/, each sub-package (or group of top-level modules) -> the ones below it.
plan/: the contract (StepPlan, the zigzag layout, hand plans) at the bottom, then the cost model, the time
of a plan, the search steps, the policies and the planner's entry. megatron/: the version checks and CPU
shims at the bottom; the layer spec and the datasets over them; the Core-API step over the layers; the
pretrain path (install() and its wrappers) over everything; Megatron's own schedulers as comparison
policies beside the rest, never importing the pretrain path (nor being imported by anything but it and
the package's registration)."""

TOP_MODULE_LAYER = {
    "plan": {"step_plan": "plan.contract", "zigzag": "plan.contract", "hand_plan": "plan.contract",
             "flat_ids": "plan.contract",
             "lengths": "plan.lengths", "planner": "plan.planner", "__init__": "plan.planner"},
    "megatron": {"__init__": "megatron.package"},
}
"""The sub-layer of each module at the top of plan/ and megatron/ (a new top-level module must be placed)."""

NO_TORCH = frozenset({"__init__", "lazy_exports", "config", "run_logs", "plan", "sim"})
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


def sub_layer_of(parts: tuple[str, ...]) -> str | None:
    """The sub-layer of a module inside plan/ or megatron/ from its path parts under the package root
    (('plan', 'cost', 'model.py') -> 'plan.cost'); None elsewhere, or for a top-level module not placed."""
    if parts[0] not in SUB_LAYERS or len(parts) < 2:
        return None
    if len(parts) > 2:
        return f"{parts[0]}.{parts[1]}"
    return TOP_MODULE_LAYER[parts[0]].get(Path(parts[1]).stem)


def sub_layer_of_name(parts: list[str]) -> str | None:
    """The sub-layer of a dotted `megatron_hdp.plan...` name (a module, a package, or a module's attribute)."""
    rest = parts[1:]
    if not rest or rest[0] not in SUB_LAYERS or len(rest) < 2:
        return None
    return TOP_MODULE_LAYER[rest[0]].get(rest[1], f"{rest[0]}.{rest[1]}")


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
            if module.split(".")[0] == "megatron_hdp":  # `from megatron_hdp.plan import cost` imports what it names
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
        sub_layer = sub_layer_of(path.relative_to(root).parts)
        if layer in SUB_LAYERS and sub_layer not in SUB_LAYERS[layer]:
            found.append(f"{path.relative_to(root)}: not placed in SUB_LAYERS[{layer!r}] (place it in the order)")
            continue
        reported = set()  # one report per import statement (`from a.b import c` names a.b and a.b.c)
        for line, name in imported_names(path, root):
            if line in reported:
                continue
            parts = name.split(".")
            where = f"{path.relative_to(root)}:{line}"
            before = len(found)
            if parts[0] == "megatron_hdp" and len(parts) > 1:
                target = SAME_LAYER.get(parts[1], parts[1])
                if target != layer and target not in MAY_IMPORT[layer]:
                    found.append(f"{where}: {layer} imports {name} (layer {target} is not below {layer})")
                elif target == layer and sub_layer is not None:
                    inner = sub_layer_of_name(parts)
                    if inner is not None and inner != sub_layer and inner not in SUB_LAYERS[layer][sub_layer]:
                        found.append(f"{where}: {sub_layer} imports {name} ({inner} is not below {sub_layer})")
            elif parts[0] in TORCH_BUILT and layer in NO_TORCH:
                found.append(f"{where}: {layer} imports {name} (pure layer: no torch)")
            elif parts[0] == "megatron" and layer not in MEGATRON_ALLOWED:
                found.append(f"{where}: {layer} imports {name} (only {sorted(MEGATRON_ALLOWED)} import Megatron)")
            if len(found) > before:
                reported.add(line)
    return found


def test_every_import_points_down_the_layer_order():
    assert violations() == []


INTEGRATION_SHARE = 0.21
"""The most of the package's Python (non-blank lines) the integration layer, megatron/, may hold: it holds
only the integration (flags, install(), initialize, layer spec, forward step, datasets, shims, Megatron's
own policies with the plan helpers only they use); what works without Megatron lives in the layers below
it, what drives it in harness/."""


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


@pytest.mark.parametrize("layer", sorted(SUB_LAYERS))
def test_the_sub_layer_order_has_no_cycle(layer):
    """Inside plan/ and megatron/ too, 'below' is a partial order."""
    left = dict(SUB_LAYERS[layer])
    while left:
        bottom = [name for name, below in left.items() if not below & left.keys() - {name}]
        assert bottom, f"cycle among {sorted(left)}"
        for name in bottom:
            del left[name]


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
        ("plan/cost/leak.py", "import importlib\nM = importlib.import_module('megatron_hdp.megatron.comparison')\n",
         "plan imports megatron_hdp.megatron.comparison"),
        ("plan/timeline/leak.py", "def f():\n    import torch\n", "pure layer: no torch"),
        ("data/leak.py", "from megatron.core import parallel_state\n", "import Megatron"),
        ("harness/leak.py", "def f():\n    import megatron.training\n", "harness imports megatron.training"),
        ("commands/leak.py", "import importlib\nM = importlib.import_module('megatron.core.parallel_state')\n",
         "commands imports megatron.core.parallel_state"),
        ("comm/leak.py", "from ..megatron import step\n", "comm imports megatron_hdp.megatron "),
        ("sim/leak.py", "from megatron_hdp import offload\n", "sim imports megatron_hdp.offload "),
        ("newlayer/leak.py", "x = 1\n", "not in MAY_IMPORT"),
        ("plan/cost/leak.py", "from megatron_hdp.plan.search.packing import best_fit\n",
         "plan.cost imports megatron_hdp.plan.search.packing"),
        ("plan/timeline/leak.py", "def f():\n    from megatron_hdp.plan import policies\n",
         "plan.timeline imports megatron_hdp.plan.policies"),
        ("plan/step_plan.py", "from megatron_hdp.plan.cost.model import CostModel\n",
         "plan.contract imports megatron_hdp.plan.cost.model"),
        ("plan/leak.py", "x = 1\n", "not placed in SUB_LAYERS['plan']"),
        ("megatron/comparison/leak.py", "from megatron_hdp.megatron.pretrain.wrappers import wrap_training_log\n",
         "megatron.comparison imports megatron_hdp.megatron.pretrain.wrappers"),
        ("megatron/layers/leak.py", "from megatron_hdp.megatron.core_api import step\n",
         "megatron.layers imports megatron_hdp.megatron.core_api"),
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


PURE_POSTTRAIN = ("megatron_hdp.posttrain", "megatron_hdp.posttrain.planning", "megatron_hdp.posttrain.weights")
"""posttrain/'s planning half: a framework's driver plans without torch or Megatron."""


def _pure_modules() -> list[str]:
    names = ["megatron_hdp.config", "megatron_hdp.run_logs", *PURE_POSTTRAIN]
    for layer in ("plan", "sim"):
        if (ROOT / layer).is_dir():
            names.append(f"megatron_hdp.{layer}")
            names += [m.name for m in pkgutil.walk_packages([str(ROOT / layer)], prefix=f"megatron_hdp.{layer}.")]
    return names


def test_pure_layers_import_without_torch_or_megatron():
    modules = _pure_modules()
    assert {"megatron_hdp.plan.step_plan", "megatron_hdp.plan.cost.model", "megatron_hdp.plan.policies.balance"} <= set(modules)
    result = subprocess.run([sys.executable, "-c", _BLOCKER, *modules], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_blocker_would_catch_a_violation():
    result = subprocess.run([sys.executable, "-c", _BLOCKER, "megatron_hdp.comm.launch", "torch"],
                            capture_output=True, text=True)
    assert result.returncode != 0 and "layer violation" in result.stderr


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at module level or inside a function), by file; a
    module's own parent packages are not edges (Python initialises them before it, whatever it imports)."""
    modules = {".".join(("megatron_hdp", *p.relative_to(root).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in modules.items():
        targets = set()
        for _, name in imported_names(path, root):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:  # a module's attribute: the module
                parts.pop()
            target = ".".join(parts)
            if len(parts) > 1 and not (module + ".").startswith(target + "."):  # a package's own parents run first
                targets.add(target)
        graph[module] = targets
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of `graph` (its modules in order, the first repeated at the end), or [] when it has none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_the_package_imports_have_no_cycle():
    """No module imports (even lazily) a module that imports it back, however long the loop: the layer
    spec and MLA once did (`layers.packed_seq` is the leaf both import now)."""
    assert import_cycle(module_graph()) == []


def test_a_planted_cycle_is_found(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.py").write_text("from megatron_hdp.data.b import x\n")
    (tmp_path / "data" / "b.py").write_text("def f():\n    from megatron_hdp.data import a\n")
    assert import_cycle(module_graph(tmp_path)) == ["megatron_hdp.data.a", "megatron_hdp.data.b", "megatron_hdp.data.a"]


MAX_INTEGRATION_MODULE_LINES = 450
MAX_TOP_LEVEL_MODULES = 8


def test_no_integration_module_is_long():
    """Every module of the Megatron layer fits in one reading (issue 40: <= 450 lines)."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "megatron").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_INTEGRATION_MODULE_LINES}
    assert long == {}


@pytest.mark.parametrize("package", ["plan", "megatron"])
def test_the_big_layers_are_sub_packages(package):
    """plan/ and megatron/ show their parts as sub-packages, with few modules left at their top."""
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    subs = [p for p in (ROOT / package).iterdir() if (p / "__init__.py").exists()]
    assert len(top) <= MAX_TOP_LEVEL_MODULES and len(subs) >= 3, (top, subs)
