"""A GGUF file's header, read and checked before anything is built: :func:`read_gguf_header`.

GGUF (llama.cpp's format) holds a model's configuration as metadata keys
(``llama.block_count``, ``llama.embedding_length``, ...) and its tensors as named, typed blocks
(``token_embd.weight``, ``blk.0.attn_q.weight``, ...), often quantised. transformers rebuilds a
config from the keys and dequantises the tensors to float; before it does, the keys are checked
against the tensors the file holds, and every tensor's data against the file's length, so that a
file that is not GGUF, is cut short, or promises sizes its tensors don't have (a block count of
10**9) is refused in one line instead of failing in the allocator or deep inside transformers.

The header is read with the ``gguf`` package's reader (the ``gguf`` extra), which maps the file
and reads nothing of the tensors' data.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multihead._files import check_regular_file

__all__ = ["GGUFHeader", "read_gguf_header", "GGUF_EXTRA"]

GGUF_EXTRA = "pip install 'multihead[gguf]'"
_MAGIC = b"GGUF"
# Beyond any model's context: a bigger context_length is a corrupt header, not a model.
_MAX_CONTEXT = 1 << 24
_LAYER = re.compile(r"blk\.(\d+)\.")
# The metadata's bounds, checked before the reader parses it (it builds numpy views of every
# value: a 1.6 MB file declaring a 1.5-million-element array cost it 20 s and 1 GB): the most
# entries, array elements (a tokenizer's 262,144 tokens fit) and bytes of one string.
_MAX_ENTRIES = 65_536
_MAX_ELEMENTS = 1 << 20
_MAX_STRING = 1 << 24
# GGUF's value types: fixed sizes in bytes; 8 is a string, 9 an array
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about its model, checked against its tensors.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` ("llama", "qwen2", "gpt2", ...).
        name: ``general.name``, or the file's stem when absent.
        layers: the transformer blocks (``{arch}.block_count``, = the ``blk.N`` tensors' layers).
        width: the residual width (``{arch}.embedding_length``).
        heads, kv_heads: query heads and key/value heads per layer.
        vocab: the embedding's rows (= the tokenizer's tokens when the file lists them).
        context: ``{arch}.context_length``, or None.
        tensors: how many tensors the file holds.
        float32_bytes: the size of every tensor dequantised to float32.
    """

    path: Path
    architecture: str
    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    vocab: int
    context: int | None
    tensors: int
    float32_bytes: int


def read_gguf_header(path: str | Path, given: str | None = None) -> GGUFHeader:
    """Read and check a GGUF file's header (metadata and tensor table, not the tensors' data).

    Args:
        path: the ``.gguf`` file.
        given: the name or path the caller gave, for messages (default ``path``).

    Returns:
        The :class:`GGUFHeader`.

    Raises:
        ValueError: not a regular file; not GGUF (its first bytes are not ``GGUF``); a header
            the reader cannot parse; a tensor whose data lies past the file's end (a truncated
            file); metadata missing or disagreeing with the tensors (layers, width, heads,
            vocabulary, an absurd context length). One line each, naming the file.
        ImportError: the ``gguf`` package is not installed (named with its extra).
    """
    path = Path(path)
    label = f"model {given or str(path)!r}"
    check_regular_file(path)
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise ValueError(
            f"{label}: {str(path)!r} is not a GGUF file (it starts with {magic!r}, expected "
            f"{_MAGIC!r})"
        )
    try:
        import gguf
    except ImportError as e:
        raise ImportError(
            f"{label}: reading a GGUF file needs the 'gguf' package: {GGUF_EXTRA}"
        ) from e
    size = path.stat().st_size
    _check_metadata(path, label, size)
    try:
        reader = gguf.GGUFReader(path)
    except MemoryError:
        raise
    except Exception as e:  # numpy's reshape/view errors on a cut header, struct errors, ...
        raise ValueError(
            f"{label}: {str(path)!r} is not a readable GGUF file (truncated or corrupt?): "
            f"{type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    return _checked(reader, path, label, size)


def _check_metadata(path: Path, label: str, size: int) -> None:
    """Walk the header's key/value entries, reading only lengths and skipping values, and
    refuse, in one line, counts past the bounds above or the file's end (before the reader
    allocates for them)."""

    def refuse(what: str) -> ValueError:
        return ValueError(f"{label}: {str(path)!r} has a corrupt GGUF header: {what}")

    with path.open("rb") as f:

        def number(width: int) -> int:
            raw = f.read(width)
            if len(raw) != width:
                raise refuse("it ends inside its metadata")
            return int.from_bytes(raw, "little")

        def skip(n: int) -> None:
            if f.tell() + n > size:
                raise refuse("a value runs past the end of the file")
            f.seek(n, 1)

        def string(what: str) -> None:
            n = number(8)
            if n > _MAX_STRING:
                raise refuse(f"{what} declares a string of {n:,} bytes (at most {_MAX_STRING:,})")
            skip(n)

        def value(kind: int, where: str) -> None:
            if kind in _FIXED:
                skip(_FIXED[kind])
            elif kind == _STRING:
                string(where)
            elif kind == _ARRAY:
                inner, count = number(4), number(8)
                if count > _MAX_ELEMENTS:
                    raise refuse(
                        f"{where} declares an array of {count:,} elements (at most "
                        f"{_MAX_ELEMENTS:,})"
                    )
                if inner in _FIXED:
                    skip(count * _FIXED[inner])
                elif inner == _STRING:
                    for _ in range(count):
                        string(where)
                else:
                    raise refuse(f"{where} is an array of value type {inner}")
            else:
                raise refuse(f"{where} has value type {kind}, which GGUF does not define")

        f.seek(4)  # past the magic
        version = number(4)
        if version < 2:
            return  # version 1 counted in 32 bits: left to the reader
        number(8)  # the tensors: the reader's table, checked against the file afterwards
        entries = number(8)
        if entries > _MAX_ENTRIES:
            raise refuse(f"it declares {entries:,} metadata entries (at most {_MAX_ENTRIES:,})")
        for i in range(entries):
            length = number(8)
            if length > _MAX_STRING:
                raise refuse(f"metadata key {i} declares {length:,} bytes")
            key = f.read(length).decode("utf-8", "replace")
            value(number(4), f"metadata {key!r}")


def _field(reader: Any, key: str) -> Any:
    """A metadata value (a str, a number, or a list), or None when the file has no such key."""
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a field of a type the reader cannot decode: absent for our checks
        return None


def _checked(reader: Any, path: Path, label: str, size: int) -> GGUFHeader:
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise ValueError(
                f"{label}: {str(path)!r} is truncated: tensor {t.name!r} ends at byte {end}, the "
                f"file has {size}"
            )
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"{label}: {str(path)!r} names no general.architecture")

    def count(key: str, required: bool = True) -> int | None:
        value = _field(reader, f"{arch}.{key}")
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"{label}: {str(path)!r}: {arch}.{key} must be a positive int, got {value!r}"
            )
        return value

    layers, width = count("block_count"), count("embedding_length")
    heads = count("attention.head_count")
    assert layers is not None and width is not None and heads is not None
    kv_heads = count("attention.head_count_kv", required=False) or heads
    context = count("context_length", required=False)
    stored = {int(m.group(1)) for m in map(_LAYER.match, tensors) if m}
    if len(stored) != layers or max(stored, default=-1) != layers - 1:
        raise ValueError(
            f"{label}: {str(path)!r}: {arch}.block_count is {layers}, but the file holds the "
            f"tensors of {len(stored)} layers (blk.N)"
        )
    embedding = tensors.get("token_embd.weight")
    if embedding is None or len(embedding.shape) != 2:
        raise ValueError(f"{label}: {str(path)!r} holds no 2-d token_embd.weight")
    # GGUF lists a tensor's sizes innermost first: the embedding is (width, vocab)
    rows, embedded = int(embedding.shape[1]), int(embedding.shape[0])
    if embedded != width:
        raise ValueError(
            f"{label}: {str(path)!r}: {arch}.embedding_length is {width}, but token_embd.weight "
            f"is {embedded} wide"
        )
    if heads > width or kv_heads > heads or heads % kv_heads:
        raise ValueError(
            f"{label}: {str(path)!r}: {heads} query heads and {kv_heads} key/value heads do not "
            f"fit a width of {width} (key/value heads must divide the query heads)"
        )
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != rows:
        raise ValueError(
            f"{label}: {str(path)!r}: the tokenizer lists {len(tokens.data)} tokens, but "
            f"token_embd.weight has {rows} rows"
        )
    positions = tensors.get("position_embd.weight")
    if context is not None and (
        context > _MAX_CONTEXT or (positions is not None and int(positions.shape[-1]) != context)
    ):
        raise ValueError(
            f"{label}: {str(path)!r}: {arch}.context_length {context} is absurd or disagrees "
            f"with position_embd.weight"
        )
    # every width the header gives (feed_forward_length, attention.key_length, ...) is the size
    # of some tensor: one past the largest would be built at random, at any cost
    largest = max((int(d) for t in reader.tensors for d in t.shape), default=0)
    for key in reader.fields:
        if not key.startswith(f"{arch}.") or not key.endswith("_length") or "context" in key:
            continue
        value = _field(reader, key)
        values = value if isinstance(value, list) else [value]
        ints = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
        if ints and max(ints) > largest:
            raise ValueError(
                f"{label}: {str(path)!r}: {key} is {max(ints):,}, more than any size of the "
                f"file's tensors (at most {largest:,})"
            )
    for key in ("attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon"):
        eps = _field(reader, f"{arch}.{key}")
        number = isinstance(eps, (int, float)) and not isinstance(eps, bool)
        if eps is not None and (not number or not math.isfinite(eps) or eps < 0):
            raise ValueError(
                f"{label}: {str(path)!r}: {arch}.{key} is {eps!r}: expected a finite number >= 0 "
                f"(a norm's epsilon, such as 1e-05)"
            )
    name = _field(reader, "general.name")
    return GGUFHeader(
        path=path,
        architecture=arch,
        name=name if isinstance(name, str) and name else path.stem,
        layers=layers,
        width=width,
        heads=heads,
        kv_heads=kv_heads,
        vocab=rows,
        context=context,
        tensors=len(tensors),
        float32_bytes=4 * sum(int(t.n_elements) for t in reader.tensors),
    )
