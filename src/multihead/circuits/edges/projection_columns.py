"""Which columns of a layer's q/k/v projections each head reads, and gradients back through
them: a head's gradient at the norm's output for the cost of its own columns.

An attention layer computes its queries (keys, values) from the norm's output x (B, T, E)
through input projections P_j = x M_jᵀ + b_j (each (B, T, out_j); one fused projection or
three), then reshapes, rotates (RoPE) or normalises them per head into the tensor its kernel is
given, (B, slots, T, D) with slots its heads. Every step after the projections keeps heads
apart, so each output column of a projection feeds at most one slot: a cotangent on slot h
alone comes back to P_j nonzero on slot h's columns alone, and its gradient at x is those
columns of the cotangent at P_j times the same rows of M_j. Taking each head's share that
way costs, over all heads, one projection's backward; a cotangent per head taken through the
whole backward costs one per head.

:meth:`ProjectionColumns.find` reads the column → slot map off autograd's graph of one run
(cotangents on chosen slots sent back, once) and checks what the argument needs: every path
from the tensor back to x runs through the projections, and no column feeds two slots.

Shapes: B batch, T tokens, E the norm's width, D head dim, R chosen slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["ProjectionColumns", "walked"]


@dataclass(frozen=True)
class ProjectionColumns:
    """For one layer's q, k or v tensor: per input projection, the columns each slot reads
    (every slot as many) and the same rows of the projection's matrix; None for a projection
    the tensor does not read.

    Attributes:
        columns: per projection, (slots, width) int64, or None.
        rows: per projection, (slots, width, E): those rows of its matrix M (out, E), the
            projection read as x ↦ x Mᵀ + bias; or None.
    """

    columns: tuple[Tensor | None, ...]
    rows: tuple[Tensor | None, ...]
    # (projection, slots) -> where their columns are: the first of a run of them, or each
    _picked: dict[tuple[int, tuple[int, ...]], tuple[int | Tensor, torch.Size]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @classmethod
    def find(
        cls,
        tensors: list[Tensor],
        normed: Tensor,
        outputs: list[Tensor],
        matrices: list[Tensor],
    ) -> list[ProjectionColumns | None]:
        """The column maps of ``tensors`` (each (B, slots, T, D): a layer's q, k and v), read
        in this run's graph from ``normed`` (the norm's output) through ``outputs`` (the
        projections' outputs (B, T, out), each ``normed`` times the transpose of its matrix in
        ``matrices``, plus a bias).

        Sends back, for each tensor, one random cotangent on every slot and, per bit of a
        slot's number, one on the slots with that bit set and one on those without: which of
        them reach a column spell its slot. Every tensor's sends ride on the batch rows of one
        backward (send i on row i mod B; ⌈sends / B⌉ batched cotangents): nothing between a
        projection and the kernel mixes sequences. None for a tensor where a path from it to
        ``normed`` passes by the projections, a column is reached by two of its slots (a bit
        both set and unset) or its slots read unequally many columns of a projection (then
        each slot's cotangent goes through the whole backward)."""
        found: list[ProjectionColumns | None] = [None] * len(tensors)
        live = [i for i, t in enumerate(tensors) if outputs and not _reaches(t, normed, outputs)]
        if not live:
            return found
        device, batch = normed.device, tensors[live[0]].shape[0]
        plans: list[tuple[int, int, Tensor]] = []  # (tensor, its first send, its sends' slots)
        sends = 0
        for i in live:
            slots = tensors[i].shape[1]
            bits = max(1, math.ceil(math.log2(slots)))
            number = torch.arange(slots, device=device)
            has = ((number >> torch.arange(bits, device=device)[:, None]) & 1).bool()
            chosen = torch.ones(1 + 2 * bits, slots, dtype=torch.bool, device=device)
            chosen[1::2], chosen[2::2] = has, ~has  # (sends, slots): the slots each is on
            plans.append((i, sends, chosen))
            sends += len(chosen)
        rounds = -(-sends // batch)
        cotangents = []
        for i, first, chosen in plans:
            tensor = tensors[i]
            slots = tensor.shape[1]
            padded = torch.zeros(rounds * batch, slots, dtype=torch.bool, device=device)
            padded[first : first + len(chosen)] = chosen
            on = padded.view(rounds, batch, slots, 1, 1).to(tensor.dtype)
            # one random cotangent of a sequence's shape, on every batch row (each a send)
            base = torch.rand(tensor.shape[1:], dtype=tensor.dtype, device=device) + 0.5
            cotangents.append(base * on)
        grads = torch.autograd.grad(
            [tensors[i] for i in live], outputs, cotangents, retain_graph=True,
            is_grads_batched=True, allow_unused=True,
        )  # fmt: skip
        for i, first, chosen in plans:
            found[i] = cls._read(grads, matrices, chosen, first, tensors[i].shape[1])
        return found

    @classmethod
    def _read(
        cls,
        grads: tuple[Tensor | None, ...],
        matrices: list[Tensor],
        chosen: Tensor,
        first: int,
        slots: int,
    ) -> ProjectionColumns | None:
        """One tensor's column map from the sends :meth:`find` gave it (``chosen`` (sends,
        slots), from send ``first`` on) and the gradients they left at the projections'
        outputs (each (rounds, B, ..., out), or None)."""
        bits = (len(chosen) - 1) // 2
        weights = (1 << torch.arange(bits, device=chosen.device))[:, None]  # (bits, 1)
        columns: list[Tensor | None] = []
        rows: list[Tensor | None] = []
        for grad, matrix in zip(grads, matrices, strict=True):
            # (rounds, B, ..., out) -> (sends, out): whether each send reached each column
            reached = None
            if grad is not None:
                mine = grad.flatten(0, 1)[first : first + len(chosen)]
                reached = mine.flatten(1, -2).ne(0).any(1)
            if reached is None or not bool(reached[0].any()):
                columns.append(None)  # a projection this tensor does not read
                rows.append(None)
                continue
            with_bit, without = reached[1::2], reached[2::2]  # (bits, out)
            if bool((with_bit & without).any()):
                return None
            owner = torch.where(reached[0], (with_bit.long() * weights).sum(0), -1)
            counts = torch.bincount(owner[owner >= 0], minlength=slots)
            if bool((counts != counts[0]).any()) or len(counts) != slots:
                return None  # slots of unequal widths: not heads as projections lay them out
            # each slot's columns in order: a stable sort by owner, the unread ones first
            picked = owner.argsort(stable=True)[len(owner) - int(counts.sum()) :]
            picked = picked.view(slots, -1)  # (slots, width)
            columns.append(picked)
            rows.append(matrix.index_select(0, picked.flatten()).view(*picked.shape, -1))
        return cls(tuple(columns), tuple(rows))

    def backward(
        self, tensor: Tensor, outputs: list[Tensor], rounds: list[tuple[Tensor, list[int]]]
    ) -> Tensor:
        """(R, B, T, E): per round ``(cotangent, slots)``, the part of ``cotangent`` (on
        ``tensor``, (B, slots, T, D)) on each of its ``slots``, taken back to the norm's output
        of the run that made ``tensor`` and ``outputs`` (its projections' outputs, as for
        :meth:`find`); R counts the slots of all rounds, in order: :meth:`to_input` of
        :meth:`at_columns`."""
        slots = [s for _, round_slots in rounds for s in round_slots]
        joined = self.to_input(self.at_columns(tensor, outputs, rounds), slots)
        lead = outputs[self.used[0]].shape[:-1]  # (B, T)
        return joined.view(-1, *lead, joined.shape[-1])

    def overlaps(self, other: ProjectionColumns) -> bool:
        """Whether a column of a projection is read by a slot of this tensor and of ``other``
        (another tensor made from the same projections)."""
        for mine, theirs in zip(self.columns, other.columns, strict=True):
            if mine is not None and theirs is not None and bool(torch.isin(mine, theirs).any()):
                return True
        return False

    @property
    def used(self) -> list[int]:
        """The projections the tensor reads."""
        return [i for i, cols in enumerate(self.columns) if cols is not None]

    def at_columns(
        self, tensor: Tensor, outputs: list[Tensor], rounds: list[tuple[Tensor, list[int]]]
    ) -> list[Tensor | None]:
        """Per projection, (N, R, width) (N = B·T): per round ``(cotangent, slots)``, the
        gradient at the projection's output of the part of ``cotangent`` on each of its
        ``slots``, on that slot's own columns (None for a projection the tensor does not
        read). One backward of all rounds, batched."""
        used = self.used
        grads = torch.autograd.grad(
            tensor, [outputs[i] for i in used], torch.stack([c for c, _ in rounds]),
            retain_graph=True, is_grads_batched=True, allow_unused=True,
        )  # fmt: skip
        found: list[Tensor | None] = [None] * len(self.columns)
        for i, grad in zip(used, grads, strict=True):
            if grad is not None:
                parts = [self.gather(i, grad[k], slots) for k, (_, slots) in enumerate(rounds)]
                found[i] = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
        return found

    def gather(self, projection: int, values: Tensor, slots: list[int]) -> Tensor:
        """(N, R, width): the columns of each of ``slots`` in ``values`` (B, T, out), one of
        ``projection``'s outputs (or a tensor laid out like one)."""
        key = (projection, tuple(slots))
        if key not in self._picked:
            cols = self.columns[projection]
            assert cols is not None
            picked = cols.index_select(0, torch.tensor(slots, device=cols.device))  # (R, width)
            flat = picked.flatten()
            start = int(flat[0])
            run = torch.arange(start, start + len(flat), device=flat.device)
            # heads laid out one after another: a slice of the columns, no copy
            self._picked[key] = (start if torch.equal(flat, run) else flat, picked.shape)
        where, shape = self._picked[key]
        flat_values = values.flatten(0, -2)  # (N, out)
        if isinstance(where, int):
            return flat_values[:, where : where + shape.numel()].view(-1, *shape)
        return flat_values.index_select(1, where).view(-1, *shape)

    def to_input(
        self,
        at_columns: list[Tensor | None],
        slots: list[int],
        through: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor:
        """(R, N, E): gradients on the slots' columns (per projection (N, R, width), as
        :meth:`at_columns` gives them, for ``slots`` in order) at the projections' input: each
        slot's columns times the same rows of the matrices, summed over the projections.
        ``through`` maps the rows (R, width, E) first: a linear map of the input's last axis
        (a frozen norm's backward) taken to every row at once, not to every token."""
        total: Tensor | None = None
        for cols, rows, part in zip(self.columns, self.rows, at_columns, strict=True):
            if cols is None or rows is None or part is None:
                continue
            picked = rows.index_select(0, torch.tensor(slots, device=rows.device))
            picked = picked.to(part.dtype)
            if through is not None:
                picked = through(picked)
            product = torch.bmm(part.transpose(0, 1), picked)  # (R, N, width) @ (R, width, E)
            total = product if total is None else total + product
        assert total is not None, "a cotangent reached no projection"
        return total


def walked(starts: list[Tensor], cuts: list[Tensor]) -> dict[int, object]:
    """The nodes of autograd's graph that lead back from ``starts``, walking past none of
    ``cuts``' nodes (not included), by ``id`` (the nodes held: an id stays theirs)."""
    stop = {id(c.grad_fn): c.grad_fn for c in cuts if c.grad_fn is not None}
    seen: dict[int, object] = {}
    todo = [s.grad_fn for s in starts]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        todo.extend(nxt for nxt, _ in node.next_functions)
    return seen


def _reaches(start: Tensor, source: Tensor, cuts: list[Tensor]) -> bool:
    """Whether autograd's graph leads from ``start`` back to ``source`` other than through
    ``cuts`` (a leaf ``source``: no node to meet, so no cut can be shown to separate it)."""
    return source.grad_fn is None or id(source.grad_fn) in walked([start], cuts)
