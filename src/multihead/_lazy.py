"""Lazy public names (name -> defining module, imported on first use), and names that moved."""

from __future__ import annotations

import importlib
import warnings
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


def moved_getattr(module: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``module`` serving names that moved to another module.

    ``moved[name]`` is the name's new module. The old path keeps working for one release, with a
    ``DeprecationWarning`` that names the new one.
    """

    def __getattr__(name: str) -> Any:
        if name in moved:
            warnings.warn(
                f"{module}.{name} moved to {moved[name]}.{name}: import it from there (the old "
                f"path goes in the next release)",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
