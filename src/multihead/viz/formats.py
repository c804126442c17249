"""The file formats multihead draws attention in, and the checks on where the files go.

Both run before anything is written: a bad format list or an output directory that cannot take
the files fails with one message and leaves the disk as it was. Nothing heavy is imported here,
so the CLI can check its flags before it loads a model.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from multihead._checks import describe

__all__ = ["FORMATS", "FIGURE_FORMATS", "check_formats", "check_output_dir"]

# Every format: the pictures (matplotlib) and the interactive page.
FORMATS: tuple[str, ...] = ("png", "svg", "html")
# The ones matplotlib draws; "html" is the page.
FIGURE_FORMATS: tuple[str, ...] = tuple(f for f in FORMATS if f != "html")


def check_formats(name: str, value: str | Sequence[str]) -> list[str]:
    """A list of formats: a comma-separated string ("png,svg") or a sequence of names.

    Names are matched case-insensitively, surrounding spaces ignored; repeats count once.

    Returns:
        The formats, lower case, in the order given.

    Raises:
        TypeError: ``value`` is neither a str nor a sequence of str.
        ValueError: an unknown format, or none at all.
    """
    if isinstance(value, str):
        items: list[Any] = value.split(",")
    elif isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        items = list(value)
    else:
        raise TypeError(f"{name} must be a str or a sequence of str, got {describe(value)}")
    bad = [describe(f) for f in items if not isinstance(f, str)]
    if bad:
        raise TypeError(f"{name} must name formats as str, got {bad[0]}")
    formats = [f.strip().lower() for f in items if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"{name} must be some of {', '.join(FORMATS)}, got {describe(value)}")
    return list(dict.fromkeys(formats))


def check_output_dir(name: str, value: Any, files: Iterable[str] = ()) -> Path:
    """A directory that can be created (if needed) and can take ``files``; nothing is created.

    Args:
        name: the argument's name, for the messages.
        value: the directory, a str or a path.
        files: file names that will be written into it; each must not be a directory already,
            nor a file that cannot be overwritten.

    Returns:
        ``value`` as a Path.

    Raises:
        TypeError: ``value`` is not a str or a path.
        ValueError: ``value`` is empty, is a file, lies under a file, or one of ``files`` is
            taken by a directory.
        PermissionError: the directory (or the nearest one that exists) is not writable, or one
            of ``files`` exists and is not writable.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or a path, got {type(value).__name__}")
    if not os.fspath(value):  # Path("") would quietly be the current directory
        raise ValueError(f"{name} must name a directory, got ''")
    directory = Path(value)
    shown = repr(str(directory))
    kind = _kind(name, directory)
    if kind == "file":
        raise ValueError(f"{name} {shown} is a file, not a directory")
    existing = directory
    while kind is None and existing != existing.parent:
        existing = existing.parent
        kind = _kind(name, existing)
    if kind == "file":
        raise ValueError(f"{name} {shown} cannot be created: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(
            f"{name} {shown} is not writable: no permission to write in {str(existing)!r}"
        )
    for file in files:
        target = directory / file
        kind = _kind(name, target)
        if kind == "dir":
            raise ValueError(
                f"{name} {shown} holds a directory named {file!r} where a file goes: "
                f"move it or choose another {name}"
            )
        if kind == "file" and not os.access(target, os.W_OK):
            raise PermissionError(f"{name}: {str(target)!r} exists and is not writable")
    return directory


def _kind(name: str, path: Path) -> str | None:
    """ "dir", "file" (anything else that exists) or None (nothing there)."""
    try:
        return "dir" if path.is_dir() else "file" if path.exists() else None
    except OSError as e:  # a name too long, a loop of links, a directory we may not enter
        error = PermissionError if isinstance(e, PermissionError) else ValueError
        raise error(f"{name} {str(path)!r} cannot be used: {e.strerror or e}") from None
