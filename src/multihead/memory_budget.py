"""The memory budget: what a run that keeps attention weights may hold, checked before it
allocates.

Attention weights grow with the square of the text: every head's (T, T) map of float32 is
4·T² bytes, so ``explain`` on 9,000 tokens of a 16-layer, 32-head model would hold
16·32·9000²·4 B ≈ 166 GB. The functions that keep weights (:func:`multihead.explain`, the corpus
loops of :mod:`multihead.text.corpus`, sized by :mod:`multihead.observe.corpus` and
:mod:`multihead.observe.head_distance`) estimate their peak from the shapes alone, compare it with
``memory_limit`` (default :data:`DEFAULT_MEMORY_LIMIT`, a fixed 4 GiB that a caller raises
explicitly) and cut the text or refuse *before* allocating, never half-way through.
"""

from __future__ import annotations

from typing import Any

from multihead._checks import describe, is_int

__all__ = ["DEFAULT_MEMORY_LIMIT", "check_memory_limit", "format_bytes", "FLOAT32_BYTES"]

# A fixed default rather than a share of the free memory: the same text gives the same result
# on every machine, and a larger run is one explicit argument away.
DEFAULT_MEMORY_LIMIT = 4 * 2**30
FLOAT32_BYTES = 4


def check_memory_limit(name: str, value: Any) -> int:
    """A memory limit in bytes: a positive int."""
    if not is_int(value) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {describe(value)}")
    return int(value)


def format_bytes(n: float) -> str:
    """``n`` bytes for a message: "512 B", "3.2 MiB", "166.3 GiB"."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
