"""The trained induction model's heads by their attention patterns (no circuit method): each
layer-0 head's share on the previous token, each layer-1 head's on the token after the first
occurrence of the current one."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import multihead


def head_patterns(model: Any, pair: Any) -> tuple[Tensor, Tensor]:
    """(previous (H,), induction (H,)): layer 0's mean weight on the previous token over every
    position, layer 1's mean weight on the induction target over the repeat."""
    n, s1, s2 = pair.layout
    t = pair.clean.shape[1]
    with multihead.capture(model) as rec:
        model(pair.clean)
    first, second = rec.weights[0], rec.weights[1]  # (B, H, T, T)
    positions = torch.arange(1, t)
    previous = first[:, :, positions, positions - 1].mean((0, 2))
    repeat = torch.arange(s2, s2 + n - 1)
    induction = second[:, :, repeat, repeat - s2 + s1 + 1].mean((0, 2))
    return previous, induction
