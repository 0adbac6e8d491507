"""Set-up the harness tests share: the benchmarks' scripts imported as modules."""

import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def benchmark_script(monkeypatch):
    """`benchmark_script(name)`: benchmarks/<name>.py as a module, with benchmarks/ on `sys.path` for the
    test's duration, as when it runs as a script (the scripts import their helpers, `output`, `repeats`,
    by bare name)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module
