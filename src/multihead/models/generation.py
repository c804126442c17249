"""The pieces of token-by-token continuation, on tensors: where each prompt's positions start
(left-padded prompts) and how the next token is picked (greedy, sampled, top-k).

The loop itself is :meth:`TransformerLM.generate <multihead.models.TransformerLM.generate>`.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["prompt_positions", "pick"]


def prompt_positions(ids: Tensor, key_mask: Tensor | None) -> Tensor:
    """Per-row positions (B, T) of the prompts: 0 at each row's first real token."""
    b, t = ids.shape
    if key_mask is None:
        return torch.arange(t, device=ids.device).expand(b, t)
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
        raise TypeError("key_mask must be a bool tensor (True = a real token)")
    if key_mask.shape != ids.shape:
        raise ValueError(
            f"key_mask must have the shape of ids (B, T) = {tuple(ids.shape)}, got "
            f"{tuple(key_mask.shape)}"
        )
    if not bool(key_mask[:, -1].all()) or bool((key_mask[:, :-1] & ~key_mask[:, 1:]).any()):
        raise ValueError(
            "key_mask must describe left padding (each row False... then True..., ending in "
            "a real token): generation appends after the last position"
        )
    return (key_mask.long().cumsum(-1) - 1).clamp(min=0)


def pick(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """The next token (B,) from the last position's logits (B, V)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
