"""A deliberately naive float64 reference for attention: loops over heads, no broadcasting tricks.

Written independently of multihead.functional so that the two can check each other.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor


def reference_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ·scale + mask)·v in float64 for q (B, H, T, D), k/v (B, Hk, S, D).

    Fully masked rows give zero output and zero weights. Returns (out, weights) in float64, on the
    inputs' device; computed on the CPU whatever that device.
    """
    device = q.device
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if mask is not None:
        mask = mask.cpu().expand(b, h, t, s)
    out = torch.zeros(b, h, t, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(b, h, t, s, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // hk)
            for i in range(t):
                scores = torch.tensor(
                    [float(q[bi, hi, i] @ k[bi, kv, j]) * scale for j in range(s)],
                    dtype=torch.float64,
                )
                allowed = torch.ones(s, dtype=torch.bool)
                if is_causal:
                    allowed &= torch.arange(s) <= i + (s - t)
                if mask is not None:
                    m = mask[bi, hi, i]
                    if m.dtype == torch.bool:
                        allowed &= m
                    else:
                        scores = scores + m.double()
                        allowed &= m != float("-inf")
                if not allowed.any():
                    continue
                scores = scores.masked_fill(~allowed, float("-inf"))
                p = torch.exp(scores - scores.max())
                p = p / p.sum()
                weights[bi, hi, i] = p
                out[bi, hi, i] = p @ v[bi, kv]
    return out.to(device), weights.to(device)


def bert_attentions(
    model: Any, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None
) -> list[Tensor]:
    """Every layer's attention weights (B, H, T, T) of a multihead BertModel, each from its
    attention module's own ``need_weights=True`` (where weights are born), the padded
    computation stepped through layer by layer; independent of ``multihead.capture``."""
    key_mask = attention_mask.bool()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    with torch.no_grad():
        x = model.embeddings(input_ids, token_type_ids, positions)  # (B, T, E)
        weights = []
        for layer in model.encoder.layers:
            _, w = layer.self_attn(x, key_mask=key_mask, need_weights=True)
            weights.append(w)
            x = layer(x, key_mask=key_mask)
    return weights
