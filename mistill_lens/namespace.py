"""Wings as namespaces: ``mistill_lens.lens.sweep`` and the like resolve on first use, so a notebook
reaches any module through ``import mistill_lens as ml`` without importing the heavy ones up front."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path
from typing import Any, Callable


def lazy_submodules(package: str, package_file: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for `package` that imports its submodule ``name`` when asked."""
    folder = Path(package_file).parent

    def __getattr__(name: str) -> Any:
        if (folder / f"{name}.py").is_file() or (folder / name / "__init__.py").is_file():
            return import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
