"""Token-by-token continuation for :class:`~multihead.models.TransformerLM` (greedy, sampled,
top-k, left-padded prompts, with or without a :class:`~multihead.cache.KVCache`).

:meth:`TransformerLM.generate <multihead.models.TransformerLM.generate>` delegates here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead._checks import (
    check_finite_float,
    check_index,
    check_non_negative_int,
    check_optional_positive_int,
)

if TYPE_CHECKING:
    from multihead.models.lm import TransformerLM

__all__ = ["generate"]


@torch.no_grad()
def generate(
    model: TransformerLM,
    ids: Tensor,
    max_new_tokens: int,
    *,
    use_cache: bool = True,
    temperature: float = 0.0,
    top_k: int | None = None,
    key_mask: Tensor | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """See :meth:`TransformerLM.generate <multihead.models.TransformerLM.generate>`."""
    config = model.config
    model.check_ids(ids)
    b, t = ids.shape
    check_non_negative_int("max_new_tokens", max_new_tokens)
    if t == 0:
        raise ValueError("ids must hold at least one prompt token, got shape (B, 0)")
    if t + max_new_tokens > config.max_len:
        raise ValueError(
            f"the prompt ({t} tokens) plus max_new_tokens ({max_new_tokens}) is longer than "
            f"the model's max_len={config.max_len}"
        )
    check_finite_float("temperature", temperature, minimum=0.0)  # NaN or inf: refused
    check_optional_positive_int("top_k", top_k)
    if eos_id is not None:
        check_index("eos_id", eos_id, config.vocab_size, "token ids")
        if eos_id < 0:
            raise ValueError(f"eos_id must be in [0, {config.vocab_size}), got {eos_id}")
    positions = prompt_positions(ids, key_mask)

    was_training = model.training
    model.eval()
    try:
        out = ids
        cache = model.make_cache(b, t + max_new_tokens) if use_cache else None
        done = torch.zeros(b, dtype=torch.bool, device=ids.device)
        step_ids, step_pos = ids, positions
        for _ in range(max_new_tokens):
            if cache is None:  # recompute the whole sequence
                step_ids, step_pos = out, positions
            logits = model(step_ids, key_mask=key_mask, positions=step_pos, cache=cache)
            token = pick(logits[:, -1], temperature, top_k, generator)  # (B,)
            if eos_id is not None:
                token = token.masked_fill(done, eos_id)
                done = done | (token == eos_id)
            out = torch.cat([out, token[:, None]], dim=1)
            # The new token is position last + 1 of its row, and a real token.
            step_ids, step_pos = token[:, None], positions[:, -1:] + 1
            positions = torch.cat([positions, step_pos], dim=1)
            if key_mask is not None:
                key_mask = F.pad(key_mask, (0, 1), value=True)
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return out


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
