"""Model directories multihead makes once and keeps: :func:`cached_directory`, the one cache.

A GGUF file converted by transformers, the all-mpnet-base-v2 files put together from the parts
its PyPI packages ship: each is a directory made from some source files, slow to make, read
like any model directory once made. The cache keeps each in one entry:

    $MULTIHEAD_CACHE_DIR  (default $XDG_CACHE_HOME/multihead, else ~/.cache/multihead)
        <kind>/
            <name>-<key>/   the files, and source.json (written last: complete)

``<key>`` is a digest of the source's identity (its files' resolved paths, sizes and
modification times, and the maker's version): a changed source makes the entry again.
``source.json`` lists each file's size and SHA-256; an entry whose files are missing, cut or
changed is removed with one warning and made again. An entry is written under a hidden name and
renamed into place when whole, so a reader sees a complete entry or none, and two processes
making the same entry at once both succeed. Setting ``MULTIHEAD_CACHE_DIR`` to an empty string
turns the cache off: each load makes its directory in a temporary folder, removed after the
load. A cache that cannot be written is skipped with a warning. A new entry of a source removes
the entries of its earlier versions (the same ``source["file"]``); delete an entry (or the
folder) to free its space.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from multihead._files import fsync_dir, json_bytes, write_synced

__all__ = ["CACHE_ENV", "cache_root", "cached_directory"]

CACHE_ENV = "MULTIHEAD_CACHE_DIR"
_SOURCE = "source.json"


def cache_root() -> Path | None:
    """multihead's cache folder (see the module docstring); None when ``MULTIHEAD_CACHE_DIR`` is
    set to an empty string (no cache)."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return Path(value).expanduser() if value else None
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "multihead"


@contextlib.contextmanager
def cached_directory(
    kind: str,
    name: str,
    source: dict[str, Any],
    make: Callable[[Path], None],
    *,
    given: str,
    made: str,
    making: str,
) -> Iterator[Path]:
    """The directory ``make(folder)`` fills, for the block: a cache entry, made now if missing;
    without a cache, a temporary directory removed on exit.

    Args:
        kind: the cache's sub-folder (``"gguf"``, ``"mpnet"``).
        name: the entry's readable name (a digest of ``source`` follows it).
        source: the source's identity, JSON (it keys the entry and is kept in source.json;
            ``source["file"]`` names the source whose earlier entries a new one replaces).
        make: fills an empty folder with the model directory's files.
        given: the model as the user gave it, for warnings.
        made: what the entry is, for warnings (``"converted"``: "its converted copy ...").
        making: what ``make`` does, for warnings (``"converting the GGUF file"``).

    Raises:
        whatever ``make`` raises (an entry is only kept when it returned).
    """
    root = cache_root()
    identity = json.dumps(source, sort_keys=True)
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    entry = None if root is None else root / kind / f"{name}-{key}"
    if entry is not None and (entry / _SOURCE).is_file():
        damage = _damage(entry)
        if damage is None:
            yield entry
            return
        warnings.warn(
            f"model {given!r}: its {made} copy {str(entry)!r} is damaged ({damage}): "
            f"{making} again",
            UserWarning,
            stacklevel=3,
        )
        shutil.rmtree(entry, ignore_errors=True)
    if entry is not None:
        try:
            made_entry = _made_into(entry, source, make)
        except _Unwritable as e:
            warnings.warn(
                f"model {given!r}: the cache {str(entry.parent)!r} cannot be written "
                f"({e.reason}): {making} in a temporary directory, again on every load "
                f"(set {CACHE_ENV} to a writable folder)",
                UserWarning,
                stacklevel=3,
            )
        else:
            yield made_entry
            return
    with tempfile.TemporaryDirectory(prefix=f"multihead-{kind}-") as tmp:
        make(Path(tmp))
        yield Path(tmp)


class _Unwritable(Exception):
    """The cache's own writing failed (not ``make``): the load goes on without it."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.reason = error.strerror or str(error)


def _made_into(entry: Path, source: dict[str, Any], make: Callable[[Path], None]) -> Path:
    """Make into a hidden sibling of ``entry`` and rename it into place when whole.

    Raises:
        _Unwritable: the cache's folder, the hidden entry, its sync, source.json or the rename
            failed; whatever ``make`` raises, as it is.
    """
    tmp = entry.with_name(f".{entry.name}.{secrets.token_hex(8)}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise _Unwritable(e) from e
    try:
        make(tmp)
        try:
            return _kept(tmp, entry, source)
        except OSError as e:
            raise _Unwritable(e) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _kept(tmp: Path, entry: Path, source: dict[str, Any]) -> Path:
    """The made folder ``tmp`` synced, listed in its source.json and renamed to ``entry``."""
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    for path in files:  # writers do not sync: a crash must not leave an entry with empty
        with path.open("rb+") as f:  # files behind its source.json
            os.fsync(f.fileno())
    # every file's size and digest (by its path in the entry): a damaged entry is found,
    # not loaded
    kept = dict(source)
    kept["files"] = {
        path.relative_to(tmp).as_posix(): {"size": path.stat().st_size, "sha256": _digest(path)}
        for path in files
    }
    write_synced(tmp / _SOURCE, json_bytes(kept))
    fsync_dir(tmp)
    try:
        tmp.rename(entry)
    except OSError:
        if not (entry / _SOURCE).is_file():  # not another process's complete entry
            raise
    fsync_dir(entry.parent)
    _remove_stale(entry, source.get("file"))
    return entry


def _digest(path: Path) -> str:
    """The SHA-256 of a file, read 16 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _damage(entry: Path) -> str | None:
    """What is wrong with a complete-looking entry (a file missing, cut or changed against the
    sizes and digests its source.json lists; an entry that lists none), or None."""
    try:
        source = json.loads((entry / _SOURCE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{_SOURCE} cannot be read"
    files = source.get("files") if isinstance(source, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{_SOURCE} lists no files (an earlier multihead's entry)"
    for name, expected in files.items():
        path = entry / name
        if not isinstance(expected, dict) or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected.get("size"):
            return f"{name} is {path.stat().st_size} bytes, {expected.get('size')} were written"
        if _digest(path) != expected.get("sha256"):
            return f"{name} changed since it was written (its checksum differs)"
    return None


def _remove_stale(entry: Path, file: object) -> None:
    """Remove the entries of earlier versions of the same source (a reinstalled package): only
    the newest is ever read again."""
    if file is None:
        return
    for other in entry.parent.iterdir():
        if other == entry or other.name.startswith("."):
            continue
        try:
            source = json.loads((other / _SOURCE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict) and source.get("file") == file:
            shutil.rmtree(other, ignore_errors=True)
