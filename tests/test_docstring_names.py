"""Docstrings name what exists: every ``multihead.…`` a docstring names resolves, and each
package's docstring names every public name it exports.

A docstring is read with ``ast`` (module, class and function docstrings of every module under
``src/multihead``); a dotted name ``multihead.a.b.c`` resolves when its longest importable
module prefix imports and the rest are attributes of it (a lazy package name resolves through
the package's ``__getattr__``, as a user's ``multihead.patch`` does). A name that moved or went
away leaves a docstring pointing at nothing; this test names each such place (file:line).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import multihead

SRC = Path(multihead.__file__).resolve().parent
DOTTED = re.compile(r"(?<![\w.])multihead(?:\.[A-Za-z_]\w*)+")


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring in the file."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None and node.body:
                found.append((node.body[0].lineno, doc))
    return found


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        try:
            obj: object = importlib.import_module(name)
        except ModuleNotFoundError as e:  # an optional extra (triton): the module exists
            if e.name is None or e.name.startswith("multihead"):
                raise
            return True
        for attr in parts[k:]:
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                return False
        return True
    return False


def test_every_dotted_name_in_a_docstring_resolves() -> None:
    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for line, doc in _docstrings(path):
            for match in DOTTED.finditer(doc):
                name = match.group(0).rstrip(".")
                if not _resolves(name):
                    missing.append(f"{path.relative_to(SRC.parent)}:{line}: {name}")
    assert not missing, "docstrings name what does not exist:\n" + "\n".join(sorted(set(missing)))


PACKAGES = [
    "multihead.circuits",
    "multihead.observe",
    "multihead.text",
    "multihead.viz",
    "multihead.models",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_docstring_names_every_name_it_exports(package: str) -> None:
    module = importlib.import_module(package)
    doc = module.__doc__ or ""
    unnamed = [n for n in module.__all__ if not re.search(rf"(?<![\w.]){re.escape(n)}\b", doc)]
    assert not unnamed, f"{package}'s docstring does not name {unnamed}"


def test_the_check_finds_a_stale_name() -> None:
    """The resolver is not vacuous: a removed name and a moved module do not resolve."""
    assert _resolves("multihead.circuits.patching.patch_heads.patch_heads")
    assert _resolves("multihead.patch")
    assert not _resolves("multihead.no_such_name")
    assert not _resolves("multihead.sites.ModelMap")
