"""Lazy public names (name -> defining module, imported on first use), and names that moved."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package`` that imports ``names[name]`` on first access.

    The value is cached in the package's namespace, so the import happens once.
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            module = importlib.import_module(package)
            value = getattr(importlib.import_module(names[name]), name)
            setattr(module, name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
