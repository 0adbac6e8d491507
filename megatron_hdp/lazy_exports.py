"""`lazy_exports`: a package's public names, each read from its module on first use (PEP 562), so that
importing the package imports none of those modules (torch and Megatron stay unimported until needed)."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[list[str], Callable[[str], Any]]:
    """(`__all__`, `__getattr__`) of `package` for `exports` (public name -> the module it is read from)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name]), name)

    return sorted(exports), __getattr__
