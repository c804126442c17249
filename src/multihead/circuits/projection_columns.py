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
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["ProjectionColumns"]


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

    @classmethod
    def find(
        cls, tensor: Tensor, normed: Tensor, outputs: list[Tensor], matrices: list[Tensor]
    ) -> ProjectionColumns | None:
        """The column map of ``tensor`` (B, slots, T, D), read in this run's graph from
        ``normed`` (the norm's output) through ``outputs`` (the projections' outputs (B, T,
        out), each ``normed`` times the transpose of its matrix in ``matrices``, plus a bias).

        Sends back one random cotangent on every slot and, per bit of a slot's number, one on
        the slots with that bit set and one on those without: which of them reach a column
        spell its slot. The sends ride on the batch rows (send i on row i mod B; ⌈sends / B⌉
        batched cotangents): nothing between a projection and the kernel mixes sequences.
        None where a path from ``tensor`` to ``normed`` passes by the projections, a column is
        reached by two slots (a bit both set and unset) or slots read unequally many columns
        of a projection (then each slot's cotangent goes through the whole backward)."""
        if not outputs or _reaches(tensor, normed, outputs):
            return None
        batch, slots = tensor.shape[0], tensor.shape[1]
        bits = max(1, math.ceil(math.log2(slots)))
        number = torch.arange(slots, device=tensor.device)
        has = ((number >> torch.arange(bits, device=tensor.device)[:, None]) & 1).bool()
        chosen = torch.ones(1 + 2 * bits, slots, dtype=torch.bool, device=tensor.device)
        chosen[1::2], chosen[2::2] = has, ~has  # (sends, slots): the slots each send is on
        rounds = -(-len(chosen) // batch)
        padded = torch.zeros(rounds * batch, slots, dtype=torch.bool, device=tensor.device)
        padded[: len(chosen)] = chosen
        on = padded.view(rounds, batch, slots, 1, 1).to(tensor.dtype)
        # one random cotangent of a sequence's shape, on every batch row (each its own send)
        base = torch.rand(tensor.shape[1:], dtype=tensor.dtype, device=tensor.device) + 0.5
        grads = torch.autograd.grad(
            tensor, outputs, base * on, retain_graph=True, is_grads_batched=True,
            allow_unused=True,
        )  # fmt: skip
        columns: list[Tensor | None] = []
        rows: list[Tensor | None] = []
        weights = (1 << torch.arange(bits, device=tensor.device))[:, None]  # (bits, 1)
        for grad, matrix in zip(grads, matrices, strict=True):
            if grad is None:
                columns.append(None)
                rows.append(None)
                continue
            # (rounds, B, ..., out) -> (sends, out): whether each send reached each column
            reached = grad.flatten(2, -2).ne(0).any(2).flatten(0, 1)[: len(chosen)]
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
        :meth:`find`); R counts the slots of all rounds, in order. One backward of all rounds
        (batched) to the projections' outputs, then each slot's columns times their rows of
        the matrices."""
        used = [i for i, cols in enumerate(self.columns) if cols is not None]
        grads = torch.autograd.grad(
            tensor, [outputs[i] for i in used], torch.stack([c for c, _ in rounds]),
            retain_graph=True, is_grads_batched=True, allow_unused=True,
        )  # fmt: skip
        parts = []
        for k, (_, slots) in enumerate(rounds):
            total: Tensor | None = None
            for i, grad in zip(used, grads, strict=True):
                cols, rows = self.columns[i], self.rows[i]
                if grad is not None and cols is not None and rows is not None:
                    # (R, N, width) @ (R, width, E): each slot's columns times its rows
                    index = torch.tensor(slots, device=cols.device)
                    picked = cols.index_select(0, index)  # (R, width)
                    g = grad[k].flatten(0, -2).index_select(1, picked.flatten())
                    g = g.view(g.shape[0], *picked.shape).transpose(0, 1)
                    part = torch.bmm(g, rows.index_select(0, index).to(g.dtype))
                    total = part if total is None else total + part
            assert total is not None, "a cotangent reached no projection"
            parts.append(total)
        lead = outputs[used[0]].shape[:-1]  # (B, T)
        joined = parts[0] if len(parts) == 1 else torch.cat(parts)
        return joined.view(-1, *lead, joined.shape[-1])


def _reaches(start: Tensor, source: Tensor, cuts: list[Tensor]) -> bool:
    """Whether autograd's graph leads from ``start`` back to ``source`` other than through
    ``cuts`` (their nodes are not walked past)."""
    stop = {id(c.grad_fn) for c in cuts if c.grad_fn is not None}
    target = source.grad_fn
    if target is None:
        return True  # a leaf: no node to meet, so no cut can be shown to separate it
    seen: set[int] = set()
    todo = [start.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        if node is target:
            return True
        seen.add(id(node))
        todo.extend(nxt for nxt, _ in node.next_functions)
    return False
