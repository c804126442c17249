"""The attention math, once: the readable formula and block attention with its log-sum-exp.

Shapes: B batch, H query heads, Hk key/value heads (H a multiple of Hk), T queries, S keys,
D head dim, Dv value head dim.

- :func:`math_attention` is the formula the tutorials teach, softmax(q kᵀ · scale + mask) · v,
  written to be read; it is the only place attention weights are made.
- :func:`block_attention` (section below) computes one block of keys with the log-sum-exp of its
  scores, :func:`merge_block` folds blocks together, and :func:`block_attention_backward` gives
  a block's gradients: ring attention is built from these three.

This is the only module that uses private torch APIs, each for one stated reason and each with a
public fallback that gives the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["math_attention", "softmax_"]


def softmax_(scores: Tensor) -> Tensor:
    """Softmax over the last dimension, in place when no autograd graph is recorded.

    At long sequence lengths a fresh (T, S) buffer per step costs more (allocation, page faults)
    than its arithmetic, so outside autograd the probabilities overwrite the scores.

    Args:
        scores: (..., T, S), floating point.

    Returns:
        The softmax probabilities, (..., T, S): ``scores`` itself when written in place.
    """
    if torch.is_grad_enabled() and scores.requires_grad:
        return torch.softmax(scores, dim=-1)
    try:
        # Private: aten's softmax with out= is torch.softmax's own fused kernel writing in place;
        # torch has no public in-place softmax.
        return torch._softmax(scores, -1, False, out=scores)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - another torch
        return torch.softmax(scores, dim=-1)


def _add_mask(scores: Tensor, mask: Tensor) -> Tensor:
    """scores (..., T, S) with ``mask`` applied: -inf where a bool mask is False, a float mask
    added. In place when no graph is recorded (see :func:`softmax_`)."""
    in_place = not (torch.is_grad_enabled() and scores.requires_grad)
    if mask.dtype == torch.bool:
        if in_place:
            return scores.masked_fill_(~mask, float("-inf"))
        return scores.masked_fill(~mask, float("-inf"))
    if in_place and not mask.requires_grad:
        return scores.add_(mask.to(scores.dtype))
    return scores + mask.to(scores.dtype)


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + mask) · v, spelled out.

    Scores and softmax run in float32 at least, so half-precision inputs keep an exact softmax.
    The caller has checked the arguments and made sure no row is fully masked (see
    :func:`multihead.functional.attention`).

    Args:
        q: (..., H, T, D). k: (..., Hk, S, D). v: (..., Hk, S, Dv); query head h reads key/value
            head h // (H // Hk).
        mask: None, bool (True = may attend) or float (added to the scores), broadcastable to
            (..., H, T, S).
        scale: the factor on the scores.
        dropout_p: dropout on the weights (applied when > 0).

    Returns:
        ``(out, weights)``: out (..., H, T, Dv) and the softmax weights (..., H, T, S) before
        dropout, both in q's dtype.
    """
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k = k.repeat_interleave(group, dim=-3)  # (..., H, S, D)
        v = v.repeat_interleave(group, dim=-3)  # (..., H, S, Dv)
    compute = torch.promote_types(q.dtype, torch.float32)
    # The scale goes on q, a (T, D) pass, rather than on the (T, S) scores.
    scores = torch.matmul(q.to(compute) * scale, k.to(compute).transpose(-2, -1))  # (..., H, T, S)
    if mask is not None:
        scores = _add_mask(scores, mask)
    weights = softmax_(scores)  # (..., H, T, S)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    # (..., H, T, S) x (..., H, S, Dv) -> (..., H, T, Dv)
    out = torch.matmul(dropped, v.to(compute))
    return out.to(q.dtype), weights.to(q.dtype)
