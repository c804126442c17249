"""The files a model lives in: safetensors read header first (checksummed when the file carries a
SHA-256), JSON, atomic writes, and the checks that compare what a config promises with what a
file holds.

Every loader (:meth:`TransformerLM.load <multihead.models.TransformerLM.load>`, training
checkpoints, :func:`~multihead.pretrained.load_bert`, the Hugging Face loader) reads a
safetensors header first — names, dtypes and shapes, no tensor data — and compares it with its
config before anything the size of the model is allocated or built: whatever a config says, the
memory a load takes is bounded by the file's size, and a disagreement is one short line.

The safetensors layout: 8 bytes (little-endian) giving the header's length n, n bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``), then
the tensors' bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from multihead._checks import is_int

__all__ = [
    "HEADER_LIMIT",
    "TensorInfo",
    "Header",
    "read_header",
    "read_tensors",
    "checksummed_safetensors",
    "sha256",
    "json_bytes",
    "write_synced",
    "fsync_dir",
    "atomic_write",
    "read_json",
    "read_torch_weights",
    "few",
    "tensor_problems",
    "layer_counts",
]

# safetensors' own limit on the header's length; a larger claim is damage, not a model.
HEADER_LIMIT = 100_000_000
# safetensors' dtype names -> (torch's name, bits per element).
_DTYPES: dict[str, tuple[str, int]] = {
    "BOOL": ("bool", 8),
    "U8": ("uint8", 8),
    "I8": ("int8", 8),
    "F8_E4M3": ("float8_e4m3fn", 8),
    "F8_E5M2": ("float8_e5m2", 8),
    "F8_E8M0": ("float8_e8m0fnu", 8),
    "I16": ("int16", 16),
    "U16": ("uint16", 16),
    "F16": ("float16", 16),
    "BF16": ("bfloat16", 16),
    "I32": ("int32", 32),
    "U32": ("uint32", 32),
    "F32": ("float32", 32),
    "I64": ("int64", 64),
    "U64": ("uint64", 64),
    "F64": ("float64", 64),
    "C64": ("complex64", 64),
}
# The segment before a layer's index in weight names: GPT-2's "h.3.", BERT's "layer.3.",
# Llama's "layers.3.", T5's "block.3.", multihead's "blocks.3.".
_LAYER = re.compile(r"(?:^|\.)(layers|layer|h|block|blocks)\.(\d+)\.")


class TensorInfo(NamedTuple):
    """A tensor's shape and dtype (torch's name, e.g. ``"float32"``), as a header gives them."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: Tensor) -> TensorInfo:
        return cls(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


@dataclass(frozen=True)
class Header:
    """What a safetensors header says: each tensor's shape and dtype, and the metadata.

    Attributes:
        tensors: name -> :class:`TensorInfo`, in the file's order.
        metadata: the ``__metadata__`` strings (empty when the file has none).
        entries: the header's tensor entries as stored (dtype names, shapes, offsets).
        data_start: where the tensors' bytes begin in the file.
    """

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    entries: dict[str, Any]
    data_start: int


def _unreadable(path: Path, reason: str) -> ValueError:
    return ValueError(
        f"{str(path)!r} could not be read as safetensors (truncated or corrupt?): {reason}"
    )


def _parse_header(raw: bytes, data_size: int, data_start: int) -> Header:
    """The header from its JSON bytes; ValueError (the reason alone) when it is malformed."""
    try:
        parsed = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its header is not JSON ({e})") from None
    if not isinstance(parsed, dict):
        raise ValueError("its header is not a JSON object")
    metadata = parsed.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("its __metadata__ is not an object of strings")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in parsed.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        if (
            not isinstance(dtype, str)
            or not isinstance(shape, list)
            or not all(is_int(d) and d >= 0 for d in shape)
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_size
        ):
            raise ValueError(f"the entry of tensor {name!r} is malformed or points past the end")
        torch_name, bits = _DTYPES.get(dtype, (dtype, 0))
        # Python ints: a shape of absurd sizes cannot overflow here, it just fails to match.
        if bits and math.prod(shape) * bits != (offsets[1] - offsets[0]) * 8:
            raise ValueError(
                f"tensor {name!r} holds {offsets[1] - offsets[0]} bytes, not the "
                f"{math.prod(shape) * bits // 8} of a {dtype} tensor of shape {tuple(shape)}"
            )
        tensors[name] = TensorInfo(tuple(shape), torch_name)
    return Header(tensors, dict(metadata), parsed, data_start)


def read_header(path: str | os.PathLike[str]) -> Header:
    """The header of a safetensors file, every entry checked against the file's size; no tensor
    data is read.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a truncated or corrupt file (names it): a header longer than the file (or
            than safetensors' 100 MB limit), not JSON, or entries whose bytes don't fit.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise _unreadable(path, f"{size} bytes, shorter than the 8-byte header size")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, HEADER_LIMIT):
            raise _unreadable(
                path, f"the header claims {n} bytes, the file has {size - 8} after its size"
            )
        raw = f.read(n)
    try:
        return _parse_header(raw, size - 8 - n, 8 + n)
    except ValueError as e:
        raise _unreadable(path, str(e)) from None


def _safetensors() -> Any:
    try:
        import safetensors
        import safetensors.torch
    except ImportError as e:
        raise ImportError(
            "reading and writing model files needs the 'safetensors' package: "
            "pip install 'multihead[pretrained]'"
        ) from e
    return safetensors


def _digest(entries: Mapping[str, Any], chunks: Iterable[bytes]) -> str:
    """SHA-256 of a safetensors file's tensor entries (names, dtypes, shapes, offsets) and data."""
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    for chunk in chunks:
        digest.update(chunk)
    return digest.hexdigest()


def read_tensors(
    path: str | os.PathLike[str],
    names: Iterable[str] | None = None,
    *,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """Tensors of a safetensors file, read straight onto ``device``; when the file's metadata
    holds a ``sha256`` (as :func:`checksummed_safetensors` writes), it is verified first.

    Args:
        path: the file.
        names: the tensors to read; default all.
        device: where they go; default CPU.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a truncated or corrupt file, or one that fails its checksum (names it).
        ImportError: safetensors is not installed.
    """
    path = Path(path)
    header = read_header(path)
    expected = header.metadata.get("sha256")
    if expected is not None:
        with open(path, "rb") as f:
            f.seek(header.data_start)
            found = _digest(header.entries, iter(lambda: f.read(1 << 20), b""))
        if found != expected:
            raise ValueError(
                f"{str(path)!r} is corrupt: its tensors do not match the checksum stored with them"
            )
    wanted = list(header.tensors if names is None else names)
    st = _safetensors()
    where = torch.device(device or "cpu")
    # safetensors names the CPU "cpu" only: torch's "cpu:0" is the same device
    target = "cpu" if where.type == "cpu" else str(where)
    try:
        with st.safe_open(str(path), framework="pt", device=target) as f:
            return {name: f.get_tensor(name) for name in wanted}
    except Exception as e:  # the header was fine, so the data is damaged
        raise _unreadable(path, " ".join(str(e).split())) from None


def checksummed_safetensors(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    """``tensors`` as safetensors bytes whose metadata also holds their SHA-256 (``sha256``).

    The checksum covers the tensor entries and the data, so a flipped bit anywhere but in the
    metadata is found when :func:`read_tensors` reads the file back.
    """
    st = _safetensors().torch
    blob: bytes = st.save(dict(tensors), metadata=dict(metadata))
    n = int.from_bytes(blob[:8], "little")
    header = _parse_header(blob[8 : 8 + n], len(blob) - 8 - n, 8 + n)
    # The metadata lives in the header only: adding the checksum leaves entries and data as is.
    checksum = _digest(header.entries, [blob[8 + n :]])
    out: bytes = st.save(dict(tensors), metadata={**metadata, "sha256": checksum})
    return out


def sha256(data: bytes) -> str:
    """The SHA-256 of ``data`` (hex), as a file that vouches for another records it."""
    return hashlib.sha256(data).hexdigest()


def json_bytes(data: Any, *, indent: int | None = 2) -> bytes:
    """``data`` as a JSON file's bytes (UTF-8, ending in a newline); encode before writing, so
    that data which is not JSON fails (TypeError) before anything is written."""
    return (json.dumps(data, indent=indent) + "\n").encode()


def write_synced(path: Path, data: bytes) -> None:
    """Create the file ``path`` (it must not exist: FileExistsError) with ``data``, fsynced: on
    disk when this returns. Not atomic by itself: :func:`atomic_write` (one file), or a
    directory renamed into place (training checkpoints)."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, a rename) durable; not possible on every OS."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half:
    written aside under a fresh hidden name (:func:`write_synced`), then renamed over ``path``.
    The file gets the permissions any new file gets (the umask)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# A JSON file a loader reads whole (config.json, state.json, ...): larger is not one of them.
MAX_JSON_BYTES = 64 << 20


def check_regular_file(path: str | os.PathLike[str]) -> None:
    """Refuse a path that exists but is not a regular file (a device such as /dev/zero, a
    named pipe, a directory), also through a symbolic link: reading one would never end, or
    wait for a writer, before anything could be checked.

    Raises:
        ValueError: names the path and what it is.
    """
    path = Path(path)
    if os.path.lexists(path) and not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file (a device or a pipe?)"
        raise ValueError(f"{str(path)!r} is {what}: a model's files must be regular files")


def read_json(path: str | os.PathLike[str], *, limit: int = MAX_JSON_BYTES) -> Any:
    """The parsed content of a JSON file of at most ``limit`` bytes.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, larger than ``limit``, not UTF-8 or not valid JSON
            (names the file).
    """
    path = Path(path)
    check_regular_file(path)
    with open(path, "rb") as f:
        data = f.read(limit + 1)  # bounded whatever the file claims to be
    if len(data) > limit:
        raise ValueError(f"{str(path)!r} is larger than {limit} bytes: not a JSON file to read")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{str(path)!r} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON ({e})") from None


def read_torch_weights(path: str | os.PathLike[str], what: str) -> Any:
    """What a ``torch.save`` file of another project holds (``what`` names it in errors), read
    with ``torch.load(..., weights_only=True)``: tensors, numbers, strings, lists and dicts, and
    never the pickled code a plain ``torch.load`` would run. multihead writes safetensors; this
    reads the ``.pt`` files other projects publish (a Jacobian lens, a tuned lens).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, or a file ``weights_only`` refuses (it holds other
            objects) or cannot read (damaged): one line naming the path.
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{str(path)!r} is missing")
    check_regular_file(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, a zip or pickle error of a damaged file
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        # torch's refusal spans many lines; the one naming what it refused is the reason
        reason = next((line for line in lines if line.startswith("WeightsUnpickler error")), None)
        reason = reason or (lines[0] if lines else type(e).__name__)
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise ValueError(
            f"{str(path)!r} is not {what} that torch.load(weights_only=True) reads "
            f"(tensors, numbers, strings, lists and dicts only): {reason}"
        ) from None


def few(items: Sequence[str], limit: int = 4, *, sep: str = ", ") -> str:
    """``"a, b, c, d and 12 more"``: a list that stays one short line whatever its length."""
    if len(items) <= limit:
        return sep.join(items)
    # "a, b and 3 more", but "a; b; and 3 more" where the items hold commas themselves
    return f"{sep.join(items[:limit])}{' ' if sep == ', ' else sep}and {len(items) - limit} more"


def tensor_problems(
    expected: Mapping[str, TensorInfo],
    found: Mapping[str, TensorInfo],
    *,
    needs: str = "the model needs",
    extra: bool = True,
) -> list[str]:
    """What keeps ``found`` from being ``expected``: missing and (with ``extra``) unexpected
    names, shapes and dtypes that differ; each kind summarised in one short phrase.

    Returns:
        Phrases such as ``"missing blocks.2.norm1.weight, ... and 11 more"`` or
        ``"head.weight has shape (14, 32), the model needs (14, 48)"``; empty when they agree.
    """
    problems = []
    missing = sorted(set(expected) - set(found))
    if missing:
        problems.append(f"missing {few(missing)}")
    unexpected = sorted(set(found) - set(expected)) if extra else []
    if unexpected:
        problems.append(f"unexpected {few(unexpected)}")
    differ = []
    for name in sorted(set(expected) & set(found)):
        want, got = expected[name], found[name]
        if want.shape != got.shape:
            differ.append(f"{name} has shape {got.shape}, {needs} {want.shape}")
        elif want.dtype != got.dtype:
            differ.append(f"{name} has dtype {got.dtype}, {needs} {want.dtype}")
    if differ:
        problems.append("; ".join(differ[:3]))
        if len(differ) > 3:
            problems.append(f"and {len(differ) - 3} more tensors of another shape or dtype")
    return problems


def layer_counts(names: Iterable[str]) -> dict[str, int]:
    """The layer stacks in weight names: stack prefix -> number of distinct layer indices.

    A stack is the first ``layers.N.`` / ``layer.N.`` / ``h.N.`` / ``block.N.`` / ``blocks.N.``
    in a name (``transformer.h``, ``encoder.layer``, T5's ``encoder.block`` and
    ``decoder.block``); deeper numbers (T5's ``block.0.layer.1``, experts) are parts of a layer.
    An index followed directly by another (``blocks.0.3.``: groups of layers) is no stack.
    """
    stacks: dict[str, set[int]] = {}
    nested: set[str] = set()
    for name in names:
        m = _LAYER.search(name)
        if m is None:
            continue
        prefix = name[: m.end(1)]
        if re.match(r"\d+\.", name[m.end() :]):
            nested.add(prefix)
        stacks.setdefault(prefix, set()).add(int(m.group(2)))
    return {prefix: len(indices) for prefix, indices in stacks.items() if prefix not in nested}
