"""DESIGN.md's layer rule, checked by importing: plan/ and sim/ load with torch and megatron blocked."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import megatron_hdp

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
    root = Path(megatron_hdp.__file__).parent
    names = ["megatron_hdp.config"]
    for layer in ("plan", "sim"):
        if (root / layer).is_dir():
            names.append(f"megatron_hdp.{layer}")
            names += [f"megatron_hdp.{layer}.{m.name}" for m in pkgutil.iter_modules([str(root / layer)])]
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
