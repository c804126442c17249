"""Counter-based random draws: the tasks' data as a pure function of (seed, stream, step, row).

Nothing here keeps state. A draw is a SplitMix64 hash of the numbers that name it, so any
process computes any row of any batch alone: a resumed run sees the batches an uninterrupted one
sees, and data-parallel ranks draw their shards of one global batch without talking. Every task
(:mod:`~multihead.training.tasks`, :mod:`~multihead.training.induction`) draws from here, and
holds out the same tenth: the inputs whose hash is a multiple of :data:`HELD_OUT_EVERY`.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "GOLDEN",
    "HELD_OUT_EVERY",
    "TRAIN_STREAM",
    "EVAL_STREAM",
    "SEED_STREAM",
    "mix",
    "key",
    "keys",
    "draws",
]

# The streams a draw comes from: training batches, held-out evaluation, and the seed torch's
# generator (dropout) is reset to before each step.
TRAIN_STREAM, EVAL_STREAM, SEED_STREAM = 0, 1, 2
HELD_OUT_EVERY = 10  # one input in ten is held out
GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # SplitMix64's increment, 2**64 / golden ratio


def mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 arrays (arithmetic wraps modulo 2**64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def key(*parts: int) -> np.uint64:
    """One well-mixed uint64 from a few non-negative ints."""
    return keys(*(np.array([p], dtype=np.uint64) for p in parts))[0]


def keys(*parts: np.ndarray) -> np.ndarray:
    """:func:`key` elementwise over equal-shape arrays of non-negative ints."""
    h = np.zeros(np.shape(parts[0]), dtype=np.uint64)
    for p in parts:
        h = mix(h ^ np.asarray(p).astype(np.uint64) + GOLDEN)
    return h


def draws(
    seed: int,
    stream: int,
    step: int,
    rows: np.ndarray,
    columns: int,
    attempt: np.ndarray | None = None,
) -> np.ndarray:
    """Uniform uint64 draws (n, columns), row i keyed by its global number ``rows[i]``.

    Args:
        seed, stream, step: which batch.
        rows: (n,) the rows' numbers in the global batch.
        columns: draws per row.
        attempt: (n,) redraw counters (a row drawn again gets other numbers); default 0.
    """
    salt = rows.astype(np.uint64) * GOLDEN
    if attempt is not None:
        salt = salt + attempt.astype(np.uint64)
    row_key = mix(key(seed, stream, step) ^ mix(salt))  # (n,)
    cols = np.arange(columns, dtype=np.uint64)
    return mix(row_key[:, None] + (cols[None, :] + np.uint64(1)) * GOLDEN)  # (n, columns)
