"""GGUF files as model directories, converted once: :func:`gguf_directory` and the cache it keeps.

A GGUF file is checked (:func:`~multihead.pretrained.gguf_header.read_gguf_header`), converted
by transformers to an ordinary directory (float32 ``model.safetensors``, ``config.json``,
``tokenizer.json``: :func:`multihead.hf.gguf_conversion.convert_gguf`), and that directory is
loaded like any other, with the same checks. Converting dequantises every tensor, which takes
tens of seconds even for a small model, so the directory is kept in multihead's cache and the
next load of the same file reads it in a second or two:

    $MULTIHEAD_CACHE_DIR  (default $XDG_CACHE_HOME/multihead, else ~/.cache/multihead)
        gguf/
            SmolLM2-135M-Instruct.Q4_1-<key>/   config.json, model.safetensors, tokenizer.json,
                                                ..., source.json (written last: complete)

``<key>`` is a digest of the file's resolved path, size and modification time and of the
converter (transformers' version): a changed file or a new transformers converts again.
``source.json`` lists each converted file's size and SHA-256; an entry whose files are missing,
cut or changed is removed with one warning and the file converted again. An entry
is written under a hidden name and renamed into place when whole, so a reader sees a complete
entry or none, and two processes converting the same file at once both succeed. Setting
``MULTIHEAD_CACHE_DIR`` to an empty string turns the cache off: each load converts into a
temporary directory, removed after the load. A cache that cannot be written is skipped with a
warning. A new conversion of a file removes the entries of its earlier versions; delete an entry
(or the folder) to free its space.
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

from multihead._files import fsync_dir, json_bytes, write_synced
from multihead.pretrained.gguf_header import read_gguf_header

__all__ = ["CACHE_ENV", "cache_root", "gguf_directory", "find_gguf_file"]

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


def find_gguf_file(directory: Path, given: str) -> Path | None:
    """The one ``.gguf`` file of a directory without ``config.json`` (a GGUF model's
    directory); None when the directory has a ``config.json`` or no ``.gguf`` file.

    Raises:
        ValueError: several ``.gguf`` files (which one is meant?).
    """
    if (directory / "config.json").exists():
        return None
    files = sorted(p for p in directory.glob("*.gguf") if p.is_file())
    if len(files) > 1:
        names = ", ".join(p.name for p in files[:4]) + (", ..." if len(files) > 4 else "")
        raise ValueError(
            f"model {given!r} holds {len(files)} GGUF files ({names}): give the file itself"
        )
    return files[0] if files else None


@contextlib.contextmanager
def gguf_directory(file: Path, given: str) -> Iterator[Path]:
    """The directory of ``file`` converted (see the module docstring), for the block: a cache
    entry, made now if missing; without a cache, a temporary directory removed on exit.

    Raises:
        ValueError: a file that is not GGUF, is truncated or whose header disagrees with its
            tensors (:func:`~multihead.pretrained.gguf_header.read_gguf_header`); a file
            transformers cannot convert.
        ImportError: the ``gguf`` extra is not installed.
    """
    file = file.resolve()
    root = cache_root()
    entry = None if root is None else _entry(root, file)
    if entry is not None and (entry / _SOURCE).is_file():
        damage = _damage(entry)
        if damage is None:
            yield entry
            return
        warnings.warn(
            f"model {given!r}: its converted copy {str(entry)!r} is damaged ({damage}): "
            f"converting the GGUF file again",
            UserWarning,
            stacklevel=3,
        )
        shutil.rmtree(entry, ignore_errors=True)
    header = read_gguf_header(file, given)  # checked before transformers builds anything
    try:
        from multihead.hf.gguf_conversion import convert_gguf
    except ImportError as e:  # transformers missing or too old: the message names both
        raise ImportError(f"model {given!r} is converted by transformers: {e}") from e
    if entry is not None:
        try:
            yield _converted_into_cache(file, entry, given, convert_gguf, header.name)
            return
        except OSError as e:
            warnings.warn(
                f"model {given!r}: the conversion cache {str(entry.parent)!r} cannot be written "
                f"({e.strerror or e}): converting in a temporary directory, again on every load "
                f"(set {CACHE_ENV} to a writable folder)",
                UserWarning,
                stacklevel=3,
            )
    with tempfile.TemporaryDirectory(prefix="multihead-gguf-") as tmp:
        convert_gguf(file, Path(tmp), given)
        yield Path(tmp)


def _entry(root: Path, file: Path) -> Path:
    from multihead.hf.gguf_conversion import CONVERTER

    stat = file.stat()
    identity = json.dumps([str(file), stat.st_size, stat.st_mtime_ns, CONVERTER])
    key = hashlib.sha256(identity.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return root / "gguf" / f"{file.stem}-{key}"


def _converted_into_cache(
    file: Path, entry: Path, given: str, convert: Callable[[Path, Path, str], None], name: str
) -> Path:
    """Convert into a hidden sibling of ``entry`` and rename it into place when whole."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f".{entry.name}.{secrets.token_hex(8)}.tmp")
    tmp.mkdir()
    try:
        convert(file, tmp, given)
        for path in tmp.iterdir():  # save_pretrained does not sync: a crash must not leave
            with path.open("rb+") as f:  # an entry with empty files behind its source.json
                os.fsync(f.fileno())
        stat = file.stat()
        source: dict[str, object] = {
            "file": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "name": name,
        }  # fmt: skip
        # every converted file's size and digest: a damaged entry is found, not loaded
        source["files"] = {
            path.name: {"size": path.stat().st_size, "sha256": _digest(path)}
            for path in sorted(tmp.iterdir())
            if path.is_file()
        }
        write_synced(tmp / _SOURCE, json_bytes(source))
        fsync_dir(tmp)
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / _SOURCE).is_file():  # not another process's complete entry
                raise
        fsync_dir(entry.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale(entry, str(file))
    return entry


def _digest(path: Path) -> str:
    """The SHA-256 of a file, read 16 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _damage(entry: Path) -> str | None:
    """What is wrong with a complete-looking entry (a converted file missing, cut or changed
    against the sizes and digests its source.json lists; an entry that lists none), or None."""
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


def _remove_stale(entry: Path, file: str) -> None:
    """Remove the entries of earlier versions of the same file (a reinstalled package): each
    conversion takes four times the file's size, and only the newest is ever read again."""
    for other in entry.parent.iterdir():
        if other == entry or other.name.startswith("."):
            continue
        try:
            source = json.loads((other / _SOURCE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict) and source.get("file") == file:
            shutil.rmtree(other, ignore_errors=True)
