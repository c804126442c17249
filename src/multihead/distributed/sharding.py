"""How a sequence is cut across the ranks of a ring, and which of its pieces meet.

Layouts (how the global sequence of length T is cut, ``world`` ranks):

- ``"contiguous"``: rank r holds positions [r·T/world, (r+1)·T/world). Simple, and any
  sequence-parallel code already uses it. With ``is_causal`` the work is unbalanced: rank r has
  r + 1 chunks of keys to attend to (the ones after it are skipped), so the last rank does about
  twice the average work and the others wait for it.
- ``"zigzag"``: the sequence is cut into 2·world chunks and rank r holds chunks r and
  2·world − 1 − r (one early, one late). With ``is_causal`` every rank then does the same work at
  every step of the ring: half of a full chunk-by-chunk product. The price: the local sequence is
  not contiguous (positional encodings and the un-sharding must follow the layout, see
  :func:`shard_sequence` / :func:`unshard_sequence`) and each step issues up to three smaller
  kernel calls instead of one. Without ``is_causal`` both layouts do the same work.

:func:`plan_blocks` turns two ranks' chunk ids into the blocks of queries and keys that meet.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from multihead._checks import (
    check_choice,
    check_index,
    check_positive_int,
    check_tensor,
    describe,
    is_int,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "shard_sequence",
    "unshard_sequence",
    "check_layout",
    "chunk_ids",
    "Block",
    "plan_blocks",
]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def check_layout(layout: Any) -> str:
    """``layout`` must be one of :data:`LAYOUTS`."""
    return check_choice("layout", layout, LAYOUTS)


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices a rank holds, in local order (chunks of T/world or T/(2·world))."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def shard_sequence(
    x: Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """Cut a rank's part out of a whole sequence.

    Args:
        x: a tensor holding the whole sequence along ``dim``, e.g. (B, H, T, D) for heads (the
            default ``dim=-2``) or (B, T, E) with ``dim=1``.
        rank: this rank, 0 <= rank < world.
        world: the number of ranks.
        layout: ``"contiguous"`` (rank r gets positions [r·T/world, (r+1)·T/world)) or
            ``"zigzag"`` (rank r gets chunks r and 2·world − 1 − r of 2·world chunks, glued).
        dim: the sequence dimension.

    Returns:
        The rank's part, T/world long along ``dim`` (a view for ``"contiguous"``, a copy for
        ``"zigzag"``).

    Raises:
        TypeError: x is not a tensor.
        ValueError: an unknown layout, a rank outside [0, world), a dim x does not have, or a
            length that does not divide into world (``"zigzag"``: 2·world) equal chunks.

    Example:
        >>> x = torch.arange(8).view(1, 1, 8, 1)
        >>> shard_sequence(x, 0, 2, "zigzag").flatten().tolist()
        [0, 1, 6, 7]
    """
    check_tensor("x", x)
    check_layout(layout)
    check_positive_int("world", world)
    if not is_int(rank) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, world) = [0, {world}), got {describe(rank)}")
    check_index("dim", dim, x.dim(), "dimensions")
    pieces = world if layout == "contiguous" else 2 * world
    length = x.shape[dim]
    if length % pieces != 0:
        raise ValueError(
            f"x's length along dim {dim} ({length}) must divide into {pieces} equal chunks for "
            f"layout={layout!r} with world={world}"
        )
    size = length // pieces
    parts = [x.narrow(dim, i * size, size) for i in chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_sequence(chunks: Sequence[Tensor], layout: str = "contiguous", dim: int = -2) -> Tensor:
    """Glue the ranks' parts (in rank order) back into the whole sequence.

    The inverse of :func:`shard_sequence`: ``unshard_sequence([shard_sequence(x, r, w, layout)
    for r in range(w)], layout)`` equals ``x``.

    Args:
        chunks: one tensor per rank, rank 0 first, all the same length along ``dim``.
        layout: ``"contiguous"`` or ``"zigzag"``, as they were cut.
        dim: the sequence dimension.

    Returns:
        The whole sequence, world·(chunk length) long along ``dim``.

    Raises:
        TypeError: a chunk that is not a tensor.
        ValueError: an unknown layout, no chunks, a dim the chunks do not have, chunks of
            different lengths, or (``"zigzag"``) an odd chunk length.
    """
    check_layout(layout)
    if len(chunks) == 0:
        raise ValueError("chunks must hold one tensor per rank, got none")
    for i, chunk in enumerate(chunks):
        check_tensor(f"chunks[{i}]", chunk)
        check_index("dim", dim, chunk.dim(), "dimensions")
    lengths = [c.shape[dim] for c in chunks]
    if len(set(lengths)) != 1:
        raise ValueError(f"chunks must all have the same length along dim {dim}, got {lengths}")
    if layout == "contiguous":
        return torch.cat(list(chunks), dim=dim)
    if lengths[0] % 2 != 0:
        raise ValueError(
            f"zigzag chunks hold two equal halves, so their length along dim {dim} must be even, "
            f"got {lengths[0]}"
        )
    half = lengths[0] // 2
    early = [c.narrow(dim, 0, half) for c in chunks]  # chunks 0 .. world-1
    late = [c.narrow(dim, half, half) for c in reversed(chunks)]  # chunks world .. 2·world-1
    return torch.cat(early + late, dim=dim)


# -- which pieces meet ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """Queries in sub-chunks [q0, q1) attend to keys in sub-chunks [k0, k1); ``causal`` on the
    diagonal (a square block, where top-left and bottom-right causal alignment coincide)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@functools.cache
def plan_blocks(q_ids: tuple[int, ...], k_ids: tuple[int, ...], causal: bool) -> tuple[Block, ...]:
    """The blocks to compute when queries of chunks ``q_ids`` meet keys of chunks ``k_ids``.

    With ``causal``, global query chunk a sees key chunk b fully when b < a, causally when b == a,
    and not at all when b > a (skipped: no compute). Neighbouring sub-chunks with the same
    treatment merge into one block, so each case is as few kernel calls as possible.
    """
    runs: list[Block] = []
    for i, a in enumerate(q_ids):
        full = [j for j, b in enumerate(k_ids) if not causal or b < a]
        # contiguous runs of fully visible key sub-chunks
        start = None
        for j in range(len(k_ids) + 1):
            inside = j in full
            if inside and start is None:
                start = j
            if not inside and start is not None:
                runs.append(Block(i, i + 1, start, j, False))
                start = None
        runs += [Block(i, i + 1, j, j + 1, True) for j, b in enumerate(k_ids) if causal and b == a]
    merged: list[Block] = []
    for blk in runs:
        last = merged[-1] if merged else None
        if (
            last is not None
            and not blk.causal
            and not last.causal
            and (last.k0, last.k1) == (blk.k0, blk.k1)
            and last.q1 == blk.q0
        ):
            merged[-1] = Block(last.q0, blk.q1, blk.k0, blk.k1, False)
        else:
            merged.append(blk)
    return tuple(merged)
