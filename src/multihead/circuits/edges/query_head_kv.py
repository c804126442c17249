"""The gradients of a grouped-query attention's keys and values as each query head reads them,
without repeating the keys and values per query head: edge attribution's key and value
receivers per query head (:mod:`~multihead.circuits.edges.receiver_gradients`, ``kv="query_head"``).

A key/value head is read by the G query heads of its group; the gradient of the metric at its
keys (values) is the sum of G parts, one per query head, and each part is the gradient through
that query head's attention alone. Group member j is the query heads j, G + j, 2G + j, … (one
of each group).

Shapes: B batch, T queries, S keys, H query heads, Hk key/value heads (G = H / Hk), D head dim,
Dv value dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead.kernels import allowed, causal_mask, combine_masks, scaled_weights
from multihead.observers import AttentionCall
from multihead.score_mods import modified_attention

__all__ = ["plain_kv_grads", "query_head_kv_grads"]


def query_head_kv_grads(
    call: AttentionCall, qkv: tuple[Tensor, Tensor, Tensor], out_grad: Tensor
) -> dict[str, list[Tensor]]:
    """Per group member j, the gradients (B, Hk, S, D) of the keys and values as query heads
    j, G + j, 2G + j, … (one of each group) read them: their attention recomputed from the
    recorded q, k, v with the gradient at their outputs (B, T, H, Dv); keys and values stay
    grouped. A call with score modifications (softcap, sinks, a score_mod or block mask) is
    recomputed under them (:func:`~multihead.score_mods.modified_attention`), one member at a
    time; a plain one by the softmax's backward written out, every member at once
    (:func:`plain_kv_grads`)."""
    q, k, v = (t.detach() for t in qkv)
    d_out = out_grad.detach().transpose(1, 2)  # (B, H, T, Dv)
    if not call.mods:
        mask = call.mask
        if call.is_causal:
            mask = combine_masks(mask, causal_mask(q.shape[2], k.shape[2], device=q.device))
        return plain_kv_grads(q, k, v, mask, call.scale, d_out)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    out = {"k": [], "v": []}  # type: dict[str, list[Tensor]]
    for member in range(group):
        with torch.enable_grad():
            keys, values = k.clone().requires_grad_(), v.clone().requires_grad_()
            chosen = torch.arange(member, heads, group, device=q.device)
            o, _ = modified_attention(
                q, keys, values, call.mods, mask=call.mask, is_causal=call.is_causal,
                scale=call.scale, heads=chosen,
            )  # fmt: skip
            assert o is not None
            cotangent = d_out[:, member::group].to(o.dtype)
            dk, dv = torch.autograd.grad(o, (keys, values), cotangent)
        out["k"].append(dk)
        out["v"].append(dv)
    return out


def plain_kv_grads(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, d_out: Tensor
) -> dict[str, list[Tensor]]:
    """:func:`query_head_kv_grads` of plain attention softmax(q kᵀ · scale + mask) v:
    with P (T, S) a query head's weights and dO (T, Dv) the gradient at its output,
    dV = Pᵀ dO and dK = scale · (P ⊙ (dP - rowsum(P ⊙ dP)))ᵀ q, dP = dO Vᵀ, for all query
    heads in one batch, each group's keys and values read as they are (no copy per query
    head); a row that sees no key has zero weights (the attention gives it zeros).

    Shapes: q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, Dv), d_out (B, H, T, Dv); query
    head h reads key/value head h // G."""
    batch, heads, t, _ = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    group = heads // kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    with torch.no_grad():
        qs, ks, vs = (x.to(compute) for x in (q, k, v))
        weights = scaled_weights(qs * scale, ks, mask)  # (B, H, T, S)
        if mask is not None:
            weights = weights.masked_fill(~allowed(mask).any(-1, keepdim=True), 0.0)
        p = weights.reshape(batch, kv_heads, group, t, s)  # query head kv·G + g
        do = d_out.to(compute).reshape(batch, kv_heads, group, t, -1)
        dv = p.transpose(-1, -2) @ do  # (B, Hk, G, S, Dv)
        dp = do.reshape(batch, kv_heads, group * t, -1) @ vs.transpose(-1, -2)
        dp = dp.view(batch, kv_heads, group, t, s)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dk = (ds.transpose(-1, -2) @ qs.reshape(batch, kv_heads, group, t, -1)).mul_(scale)
    return {
        "k": [dk[:, :, g].to(k.dtype) for g in range(group)],
        "v": [dv[:, :, g].to(v.dtype) for g in range(group)],
    }
