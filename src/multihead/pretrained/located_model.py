"""Where a model's files are: :func:`located_model`, for every loader of text models.

A name or path given for a model (``--model``, ``load_text_model(dir_or_name)``) is, in this
order: an existing directory (a Hugging Face style one, or one holding a GGUF file and no
``config.json``), an existing ``.gguf`` file, the named models ``"smollm2"``
(:mod:`~multihead.pretrained.smollm2`) and ``"mpnet"`` (:mod:`~multihead.pretrained.mpnet`),
or a name in the local Hugging Face cache (never downloaded). A GGUF file's directory is its
conversion (:mod:`~multihead.pretrained.gguf_cache`).
"""

from __future__ import annotations

import contextlib
import os
import string
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multihead._checks import describe
from multihead._files import check_regular_file
from multihead.pretrained.gguf_cache import find_gguf_file, gguf_directory
from multihead.pretrained.mpnet import MPNET, mpnet_directory
from multihead.pretrained.smollm2 import SMOLLM2, smollm2_file

__all__ = ["located_model"]

# The files of a model directory that are read whole
_SMALL_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "sentence_bert_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _looks_like_path(given: str) -> bool:
    # Hub names are "name" or "owner/name"; anything else can only be a path.
    return (
        given.startswith((".", "/", "~"))
        or given.count("/") > 1
        or os.sep in given.replace("/", "")
        or bool(set(given) - set(string.ascii_letters + string.digits + "-_./"))
    )


@contextlib.contextmanager
def located_model(
    dir_or_name: Any, cache_dir: str | None = None
) -> Iterator[tuple[str, Path, str]]:
    """(the name or path as given, the directory, the model's name) of a local model directory,
    a GGUF file (or a directory holding one and no ``config.json``), a named model
    (``"smollm2"``, ``"mpnet"``) or a name in the local Hugging Face cache (never downloaded),
    for the block: a GGUF file's directory is its conversion (:func:`gguf_directory`: cached, or
    temporary and removed on exit).

    Raises:
        TypeError: not a str or path. FileNotFoundError: none of these. NotADirectoryError: a
        file that is not ``.gguf``. ValueError: a GGUF file refused
        (:func:`~multihead.pretrained.gguf_header.read_gguf_header`). ImportError: a name, and
        transformers is not installed; a GGUF file, and the ``gguf`` extra is not; ``"smollm2"``
        or ``"mpnet"``, and its packages are not.
    """
    if not isinstance(dir_or_name, (str, os.PathLike)):
        raise TypeError(
            f"model must be a directory, a .gguf file or a model name, got {describe(dir_or_name)}"
        )
    given = os.fspath(dir_or_name)
    if not given:
        raise ValueError("model must be a directory, a .gguf file or a model name, got ''")
    path = Path(given).expanduser()
    try:
        exists = path.exists()
    except OSError as e:  # a name too long, ...
        raise ValueError(f"model path {given!r} cannot be used: {e.strerror or e}") from None
    gguf: Path | None = None
    if exists:
        if not path.is_dir():
            if path.suffix.lower() != ".gguf":
                raise NotADirectoryError(
                    f"model must be a directory, a .gguf file or a model name, got {given!r} "
                    f"(not a directory)"
                )
            gguf = path
        else:
            gguf = find_gguf_file(path, given)
        # the name goes into titles, pages and reports: bytes that are not UTF-8 escaped
        name = path.resolve().name.encode("utf-8", "backslashreplace").decode("utf-8")
        if gguf is not None and gguf == path:
            name = name[: -len(path.suffix)]
        if gguf is None:
            _check_small_files(path)
            yield given, path, name
            return
    elif given == SMOLLM2:
        gguf, name = smollm2_file(), SMOLLM2
    elif given == MPNET:
        with mpnet_directory(given) as directory:
            _check_small_files(directory)
            yield given, directory, "all-mpnet-base-v2"
        return
    if gguf is not None:
        with gguf_directory(gguf, given) as directory:
            _check_small_files(directory)
            yield given, directory, name
        return
    if _looks_like_path(given):
        raise FileNotFoundError(f"model directory {given!r} does not exist")
    try:
        from multihead.hf.loading import from_cache
    except ImportError as e:
        raise ImportError(
            f"model {given!r} is not a directory, and finding a model name in the Hugging Face "
            f"cache needs transformers: {e}"
        ) from e
    directory = from_cache(given, cache_dir)
    _check_small_files(directory)
    yield given, directory, given


def _check_small_files(directory: Path) -> None:
    """The files a load reads whole are regular files (never /dev/zero or a pipe)."""
    for small in _SMALL_FILES:
        check_regular_file(directory / small)
