"""Which global heads one process's attention calls hold, when a module's heads are split over
ranks (tensor parallelism), and the collective that puts chosen heads back together.

Under tensor parallelism each rank of a group computes a contiguous, equal slice of a module's
query heads: rank r of W holds heads ``[r·H/W, (r+1)·H/W)``, its attention call sees only those
(q (B, H/W, T, D), the per-head output (B, T, H/W, Dv)), and the output projection sums the
ranks' parts. :class:`HeadShard` describes that slice; :class:`HeadGather` gathers what each rank
computed for the chosen heads it holds into the chosen heads in the order asked, on every rank.

Every rank of the group runs every forward together, so every observer runs on every rank at the
same point: a gather inside an observer is a collective all ranks reach.

Shapes: H heads over all ranks, H/W heads a rank holds, H' chosen heads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from multihead._checks import check_indices

__all__ = ["HeadGather", "HeadShard", "every_head", "held_heads"]


@dataclass(frozen=True)
class HeadShard:
    """The slice of a module's query heads that this process holds.

    Attributes:
        num_heads: H, the module's query heads over all ranks.
        rank: this process's rank in ``group``.
        world_size: W, the ranks in ``group``; H is a multiple of W.
        group: the ``torch.distributed`` process group the heads are split over (None: the
            default group).
    """

    num_heads: int
    rank: int
    world_size: int
    group: Any = None

    def __post_init__(self) -> None:
        if self.world_size <= 0 or self.num_heads % self.world_size:
            raise ValueError(
                f"{self.num_heads} heads cannot be split evenly over {self.world_size} ranks"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")

    @property
    def per_rank(self) -> int:
        """H/W, the heads each rank holds."""
        return self.num_heads // self.world_size

    @property
    def heads(self) -> range:
        """The global query heads this rank holds, in the order its calls see them."""
        return self.heads_of(self.rank)

    def heads_of(self, rank: int) -> range:
        """The global query heads ``rank`` holds."""
        return range(rank * self.per_rank, (rank + 1) * self.per_rank)

    def owner(self, head: int) -> int:
        """The rank (in ``group``) holding global head ``head`` (in [0, H))."""
        return head // self.per_rank

    def describe(self) -> str:
        """E.g. "heads 2-3 of 4 (rank 1 of 2)", for error messages."""
        heads = self.heads
        return (
            f"heads {heads.start}-{heads.stop - 1} of {self.num_heads} (rank {self.rank} of "
            f"{self.world_size})"
        )

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the ranks of ``group``, on every rank (in place, and returned)."""
        dist.all_reduce(x, group=self.group)
        return x

    def gatherer(self, heads: Sequence[int] | None) -> HeadGather:
        """A :class:`HeadGather` for the chosen global ``heads`` (None: every head)."""
        return HeadGather(self, heads)


def held_heads(num_heads: int, shard: HeadShard | None) -> range:
    """The global heads an attention call holds, in the order it sees them: all ``num_heads``
    without a shard, else the shard's (e.g. ``site.num_heads, site.head_shard``)."""
    return range(num_heads) if shard is None else shard.heads


def every_head(x: Tensor, dim: int, shard: HeadShard | None) -> Tensor:
    """``x``, holding a call's heads along ``dim`` (e.g. a per-head score (T, H/W) with
    ``dim=1``), with every head of the module there, in order: ``x`` itself without a shard,
    else gathered from every rank (a collective every rank of the shard's group reaches)."""
    return x if shard is None else shard.gatherer(None)(x, dim)


class HeadGather:
    """Put chosen heads, each computed on the rank that holds it, together on every rank.

    Each rank computes the chosen heads it holds (:attr:`local`: their positions among its own
    heads, in the order chosen) and calls the gather with them along a dimension; every rank gets
    all the chosen heads in the order chosen. Ranks holding fewer chosen heads than others send
    zeros in their place (all_gather moves equal sizes), which the gather drops.

    Args:
        shard: the module's :class:`HeadShard`.
        heads: the chosen global heads, in [0, H), in the order wanted (None: all, in order).
    """

    def __init__(self, shard: HeadShard, heads: Sequence[int] | None) -> None:
        checked = check_indices("heads", heads, shard.num_heads, "heads")
        chosen = list(range(shard.num_heads)) if checked is None else checked
        # per rank, the positions (in chosen) of the chosen heads it holds
        positions: list[list[int]] = [[] for _ in range(shard.world_size)]
        for j, head in enumerate(chosen):
            positions[shard.owner(head)].append(j)
        self.shard = shard
        self.width = max(len(p) for p in positions)  # what each rank sends along the dim
        mine = [chosen[j] - shard.heads.start for j in positions[shard.rank]]
        # None: the rank's own heads, all in order (the caller computes them without indexing)
        self.local: list[int] | None = None if mine == list(range(shard.per_rank)) else mine
        slot = {j: r * self.width + i for r, ps in enumerate(positions) for i, j in enumerate(ps)}
        order = [slot[j] for j in range(len(chosen))]
        # None: the ranks' parts concatenated are already the chosen heads in order
        self._order = None if order == list(range(shard.world_size * self.width)) else order
        self._index: dict[torch.device, Tensor] = {}  # device -> _order, (W·width,) int64
        self._local_index: dict[torch.device, Tensor] = {}  # device -> local, (len(local),)

    def to(self, device: torch.device) -> None:
        """Copy the gather's indices to ``device`` now (outside any forward: no host-to-device
        copy inside one)."""
        if self._order is not None and device not in self._index:
            self._index[device] = torch.tensor(self._order, dtype=torch.long, device=device)
        if self.local is not None and device not in self._local_index:
            self._local_index[device] = torch.tensor(self.local, dtype=torch.long, device=device)

    def take(self, x: Tensor, dim: int) -> Tensor:
        """The chosen heads on every rank, from ``x`` holding all of this rank's heads (H/W)
        along ``dim`` (e.g. the per-head output (B, T, H/W, Dv) with ``dim=2``)."""
        if self.local is not None:
            self.to(x.device)
            x = x.index_select(dim, self._local_index[x.device])
        return self(x, dim)

    def __call__(self, x: Tensor, dim: int) -> Tensor:
        """The chosen heads on every rank.

        Args:
            x: this rank's chosen heads along ``dim`` (``len(local)`` of them, or all H/W it
                holds when :attr:`local` is None), e.g. weights (B, ., R, S) with ``dim=1``.
            dim: the head dimension.

        Returns:
            ``x`` with the H' chosen heads along ``dim``, in the order chosen; the same on every
            rank. Not differentiable (a collective under ``torch.no_grad`` use).
        """
        dim = dim % x.dim()
        if x.shape[dim] < self.width:  # this rank holds fewer chosen heads than another
            pad = list(x.shape)
            pad[dim] = self.width - x.shape[dim]
            x = torch.cat([x, x.new_zeros(pad)], dim=dim)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.shard.world_size)]
        dist.all_gather(parts, x, group=self.shard.group)
        out = torch.cat(parts, dim=dim)
        if self._order is None:
            return out
        self.to(x.device)
        return out.index_select(dim, self._index[x.device])
