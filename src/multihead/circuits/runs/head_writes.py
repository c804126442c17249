"""Each head's write into the residual stream: its output through its slice of the output
projection, read as the model calls the projection (any linear layout, GPT-2's Conv1D
included). The cache's ``result``, the edge model and the weights' circuits read it.

Shapes: B batch, T tokens, H heads, Dv one head's output width, E the residual width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["head_writes", "projection_rows"]


def head_writes(projection: nn.Module, z: Tensor) -> Tensor:
    """(B, T, H, E): each head's output z (B, T, H, Dv) through ``projection`` (the module an
    attention gives its heads' outputs flattened, (B, T, H·Dv) -> (B, T, E)), less the bias.

    The projection is read as the model calls it (any linear layout, GPT-2's Conv1D included),
    whichever way costs fewer rows through it: once per head on that head alone (H · B · T
    rows), or once on the H·Dv unit vectors, whose outputs less its output on zero are the rows
    A (H·Dv, E) of x ↦ x A + bias, head h writing z_h times its Dv rows (when Dv < B · T)."""
    b, t, h, dv = z.shape
    if dv >= b * t:
        bias = projection(torch.zeros_like(z.flatten(2)[:, :1]))  # (B, 1, E)
        heads = []
        for head in range(h):
            alone = torch.zeros_like(z)
            alone[:, :, head] = z[:, :, head]
            heads.append(projection(alone.flatten(2)) - bias)
        return torch.stack(heads, dim=2)
    rows = projection_rows(projection, z.flatten(2))  # (H·Dv, E)
    return torch.einsum("bthd,hde->bthe", z, rows.view(h, dv, -1))


def projection_rows(projection: nn.Module, like: Tensor) -> Tensor:
    """A (W, out): a per-token linear module read as x ↦ x A + bias, as the model calls it
    (nn.Linear's weight transposed, GPT-2's Conv1D's as it is): its outputs on the W unit
    vectors less its output on zero. ``like`` (..., W) is an input it was given (width, dtype,
    device)."""
    width = like.shape[-1]
    eye = torch.eye(width, dtype=like.dtype, device=like.device)[None]  # (1, W, W)
    return (projection(eye) - projection(torch.zeros_like(eye[:, :1])))[0]
