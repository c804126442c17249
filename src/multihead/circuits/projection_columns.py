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
    """For one layer's q, k or v tensor: per input projection, the slot each output column
    feeds (-1: none; None for a projection it does not read), and the projection's matrix.

    Attributes:
        owners: per projection, (out,) int64, or None.
        matrices: per projection, (out, E): the projection read as x ↦ x Mᵀ + bias.
    """

    owners: tuple[Tensor | None, ...]
    matrices: tuple[Tensor, ...]

    @classmethod
    def find(
        cls, tensor: Tensor, normed: Tensor, outputs: list[Tensor], matrices: list[Tensor]
    ) -> ProjectionColumns | None:
        """The column map of ``tensor`` (B, slots, T, D), read in this run's graph from
        ``normed`` (the norm's output) through ``outputs`` (the projections' outputs (B, T,
        out), each ``normed`` times the transpose of its matrix in ``matrices``, plus a bias).

        Sends back one random cotangent on every slot and, per bit of a slot's number, one on
        the slots with that bit set and one on those without: which of them reach a column
        spell its slot. None where a path from ``tensor`` to ``normed`` passes by the
        projections, or a column is reached by two slots (a bit both set and unset)."""
        if not outputs or _reaches(tensor, normed, outputs):
            return None
        slots = tensor.shape[1]
        bits = max(1, math.ceil(math.log2(slots)))
        base = torch.rand(tensor.shape, dtype=tensor.dtype, device=tensor.device) + 0.5
        number = torch.arange(slots, device=tensor.device)
        sends = [base]
        for bit in range(bits):
            has = ((number >> bit) & 1).bool().view(1, slots, 1, 1)
            sends += [base * has, base * ~has]
        grads = torch.autograd.grad(
            tensor, outputs, torch.stack(sends), retain_graph=True, is_grads_batched=True,
            allow_unused=True,
        )  # fmt: skip
        owners: list[Tensor | None] = []
        weights = (1 << torch.arange(bits, device=tensor.device))[:, None]  # (bits, 1)
        for grad in grads:
            if grad is None:
                owners.append(None)
                continue
            reached = grad.flatten(1, -2).ne(0).any(1)  # (1 + 2·bits, out)
            with_bit, without = reached[1::2], reached[2::2]  # (bits, out)
            if bool((with_bit & without).any()):
                return None
            owner = (with_bit.long() * weights).sum(0)
            owners.append(torch.where(reached[0], owner, -1))
        return cls(tuple(owners), tuple(matrices))

    def backward(
        self, tensor: Tensor, outputs: list[Tensor], rounds: list[tuple[Tensor, list[int]]]
    ) -> Tensor:
        """(R, B, T, E): per round ``(cotangent, slots)``, the part of ``cotangent`` (on
        ``tensor``, (B, slots, T, D)) on each of its ``slots``, taken back to the norm's output
        of the run that made ``tensor`` and ``outputs`` (its projections' outputs, as for
        :meth:`find`); R counts the slots of all rounds, in order. One backward of all rounds
        (batched) to the projections' outputs, then each slot's columns times their rows of
        the matrices."""
        used = [i for i, owner in enumerate(self.owners) if owner is not None]
        grads = torch.autograd.grad(
            tensor, [outputs[i] for i in used], torch.stack([c for c, _ in rounds]),
            retain_graph=True, is_grads_batched=True, allow_unused=True,
        )  # fmt: skip
        parts = []
        for k, (_, slots) in enumerate(rounds):
            total: Tensor | None = None
            for i, grad in zip(used, grads, strict=True):
                owner = self.owners[i]
                if grad is not None and owner is not None:
                    matrix = self.matrices[i].to(grad.dtype)
                    part = _slot_products(grad[k].flatten(0, -2), owner, slots, matrix)
                    total = part if total is None else total + part
            assert total is not None, "a cotangent reached no projection"
            parts.append(total)
        lead = outputs[used[0]].shape[:-1]  # (B, T)
        return torch.cat(parts).view(-1, *lead, parts[0].shape[-1])


def _slot_products(grad: Tensor, owner: Tensor, slots: list[int], matrix: Tensor) -> Tensor:
    """(R, N, E): for each of ``slots`` (R,), ``grad`` (N, out) on the columns ``owner``
    (out,) gives that slot, times those rows of ``matrix`` (out, E): a slice of each where a
    slot's columns are one run of them (a head's, as projections lay them out), else picked."""
    parts = []
    for slot in slots:
        cols = (owner == slot).nonzero()[:, 0]
        first, last = (int(cols[0]), int(cols[-1])) if len(cols) else (0, -1)
        if last - first + 1 == len(cols):
            parts.append(grad[:, first : last + 1] @ matrix[first : last + 1])
        else:
            parts.append(grad[:, cols] @ matrix[cols])
    return torch.stack(parts)


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
