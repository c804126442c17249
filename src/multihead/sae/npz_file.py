"""A NumPy ``.npz`` file read header first, never unpickled: :func:`npz_shapes`, then
:func:`read_npz`.

An ``.npz`` is a zip of ``.npy`` files, each a magic string, a header (a Python literal: dtype,
order, shape) and the array's bytes. :func:`npz_shapes` reads each member's header alone and
checks that its bytes are what the zip says the member holds, so a loader compares the shapes
with what it expects before a single array is read; :func:`read_npz` then reads them with
``numpy.load(..., allow_pickle=False)``. An object array (a pickle) is refused by its header.
"""

from __future__ import annotations

import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from multihead._files import TensorInfo, check_regular_file

__all__ = ["npz_shapes", "read_npz"]

# a compressed member may claim at most this many times its compressed bytes (a zip bomb
# claims millions); np.savez stores, np.savez_compressed deflates floats by far less
MAX_RATIO = 64


def _refused(path: Path, reason: str) -> ValueError:
    return ValueError(f"{str(path)!r} could not be read as an .npz of arrays: {reason}")


def npz_shapes(path: str | os.PathLike[str]) -> dict[str, TensorInfo]:
    """Each array's shape and dtype, from its ``.npy`` header alone; nothing else is read.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a zip of ``.npy`` files, a member holding objects (a pickle), of a
            dtype that is not a number, or whose bytes disagree with its header (one line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing")
    check_regular_file(path)
    shapes: dict[str, TensorInfo] = {}
    try:
        with zipfile.ZipFile(path) as archive:
            # a zip bomb is bounded as a whole: one constant array may compress 400x, a whole
            # SAE's weights do not
            claimed = sum(info.file_size for info in archive.infolist())
            if claimed > MAX_RATIO * path.stat().st_size + (64 << 20):
                raise _refused(
                    path,
                    f"its members claim {claimed} bytes from a {path.stat().st_size}-byte "
                    f"archive (more than {MAX_RATIO}x)",
                )
            for info in archive.infolist():
                if not info.filename.endswith(".npy"):
                    raise _refused(path, f"member {info.filename!r} is not an .npy array")
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    read = (
                        np.lib.format.read_array_header_1_0
                        if version == (1, 0)
                        else np.lib.format.read_array_header_2_0
                    )
                    shape, _, dtype = read(member)
                    header_end = member.tell()
                name = info.filename.removesuffix(".npy")
                if dtype.hasobject or dtype.kind not in "fiub":
                    raise _refused(
                        path,
                        f"array {name!r} has dtype {dtype} (objects are pickles, never read): "
                        "numbers only",
                    )
                size = math.prod(shape) * dtype.itemsize
                if header_end + size != info.file_size:
                    raise _refused(
                        path,
                        f"array {name!r} of shape {tuple(shape)} and dtype {dtype} needs "
                        f"{size} bytes, the member holds {info.file_size - header_end}",
                    )
                shapes[name] = TensorInfo(tuple(int(d) for d in shape), str(dtype))
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        if isinstance(e, ValueError) and str(e).startswith(repr(str(path))):
            raise
        raise _refused(path, " ".join(str(e).split()) or type(e).__name__) from None
    return shapes


def read_npz(path: str | os.PathLike[str], names: list[str]) -> dict[str, Tensor]:
    """The arrays ``names`` of an ``.npz`` (its shapes checked by :func:`npz_shapes` first) as
    CPU tensors, read with ``allow_pickle=False``.

    Raises:
        ValueError: a damaged file (one line).
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: torch.from_numpy(np.ascontiguousarray(data[name])) for name in names}
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError) as e:
        raise _refused(path, " ".join(str(e).split()) or type(e).__name__) from None
