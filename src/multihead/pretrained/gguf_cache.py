"""GGUF files as model directories, converted once: :func:`gguf_directory`.

A GGUF file is checked (:func:`~multihead.pretrained.gguf_header.read_gguf_header`), converted
by transformers to an ordinary directory (float32 ``model.safetensors``, ``config.json``,
``tokenizer.json``: :func:`multihead.hf.gguf_conversion.convert_gguf`), and that directory is
loaded like any other, with the same checks. Converting dequantises every tensor, which takes
tens of seconds even for a small model, so the directory is kept in multihead's cache
(:mod:`~multihead.pretrained.cached_directory`: ``$MULTIHEAD_CACHE_DIR/gguf/<file>-<key>/``)
and the next load of the same file reads it in a second or two. The entry is keyed by the
file's resolved path, size and modification time and by the converter (transformers'
version): a changed file or a new transformers converts again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from multihead.pretrained.cached_directory import cached_directory
from multihead.pretrained.gguf_header import read_gguf_header

__all__ = ["gguf_directory", "find_gguf_file"]


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
    try:
        from multihead.hf.gguf_conversion import CONVERTER, convert_gguf
    except ImportError as e:  # transformers missing or too old: the message names both
        raise ImportError(f"model {given!r} is converted by transformers: {e}") from e

    def convert(folder: Path) -> None:
        read_gguf_header(file, given)  # checked before transformers builds anything
        convert_gguf(file, folder, given)

    stat = file.stat()
    source = {
        "file": str(file), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
        "converter": CONVERTER,
    }  # fmt: skip
    with cached_directory(
        "gguf", file.stem, source, convert, given=given, made="converted",
        making="converting the GGUF file",
    ) as directory:  # fmt: skip
        yield directory
