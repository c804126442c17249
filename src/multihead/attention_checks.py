"""The argument checks of :meth:`MultiHeadAttention.forward`, all run before any state (a
key/value cache) changes, and the one mask the kernel sees.

They take the module's sizes as plain values (E, kdim, vdim, H), never the module.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead import functional
from multihead._checks import check_mask, check_tensor
from multihead.packing import PackedBatch

__all__ = ["check_call", "check_packed_call", "combined_mask"]


def check_packed_call(
    x: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    mask: Tensor | None,
    key_mask: Tensor | None,
    need_weights: bool,
    cache: object,
    packing: PackedBatch,
    *,
    embed_dim: int,
    kdim: int,
    vdim: int,
) -> None:
    """``forward(x, packing=...)``: self-attention only, with nothing the packing replaces, on a
    module with the packed projection (kdim == vdim == embed_dim), and x the (N, E) tokens."""
    if not isinstance(packing, PackedBatch):
        raise TypeError(f"packing must be a PackedBatch or None, got {type(packing).__name__}")
    extra = {
        "key": key is not None,
        "value": value is not None,
        "mask": mask is not None,
        "key_mask": key_mask is not None,
        "need_weights": bool(need_weights),
        "cache": cache is not None,
    }
    given = [name for name, on in extra.items() if on]
    if given:
        raise ValueError(
            f"packing= is self-attention under the packing's own key mask: it cannot be "
            f"combined with {', '.join(given)} (for weights use multihead.capture, which "
            f"works on packed batches)"
        )
    if not kdim == vdim == embed_dim:
        raise ValueError(
            "packing= needs the packed self-attention projection: kdim == vdim == embed_dim "
            f"(got kdim={kdim}, vdim={vdim}, embed_dim={embed_dim})"
        )
    check_tensor("query", x, dims=2)
    if x.shape != (packing.num_tokens, embed_dim):
        raise ValueError(
            f"with packing=, query must be the packed tokens (N, E) = "
            f"({packing.num_tokens}, {embed_dim}), got {tuple(x.shape)}"
        )


def check_call(
    query: Tensor,
    key: Tensor | None,
    value: Tensor | None,
    key_mask: Tensor | None,
    *,
    embed_dim: int,
    kdim: int,
    vdim: int,
) -> None:
    """query (B, T, E) or (T, E); key (B, S, kdim) and value (B, S, vdim) alike; a bool key
    mask."""
    check_tensor("query", query, floating=True)
    if query.dim() not in (2, 3):
        raise ValueError(
            f"query must be 2-D (T, E) or 3-D (B, T, E), got {query.dim()}-D shape "
            f"{tuple(query.shape)}"
        )
    if query.shape[-1] != embed_dim:
        raise ValueError(
            f"query's last dimension must be embed_dim={embed_dim}, got shape {tuple(query.shape)}"
        )
    for name, t, width in (("key", key, kdim), ("value", value, vdim)):
        if t is None:
            continue
        check_tensor(name, t, floating=True)
        if t.dim() != query.dim():
            raise ValueError(
                f"{name} must be {query.dim()}-D like query {tuple(query.shape)}, got shape "
                f"{tuple(t.shape)}"
            )
        if t.shape[-1] != width:
            dim = "kdim" if name == "key" else "vdim"
            raise ValueError(
                f"{name}'s last dimension must be {dim}={width}, got shape {tuple(t.shape)}"
            )
        if query.dim() == 3 and t.shape[0] != query.shape[0]:
            raise ValueError(
                f"batch sizes disagree: query {tuple(query.shape)} and {name} {tuple(t.shape)}"
            )
    if value is not None and key is None:
        raise ValueError("value was given without key: pass key too (or neither)")
    if key is not None and value is not None and key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same length, got key {tuple(key.shape)} and "
            f"value {tuple(value.shape)}"
        )
    if key_mask is not None:
        if not isinstance(key_mask, Tensor):
            raise TypeError(
                f"key_mask must be a bool torch.Tensor or None, got {type(key_mask).__name__}"
            )
        if key_mask.dtype != torch.bool:
            raise TypeError(
                f"key_mask must be a bool tensor (True = a real token), got dtype "
                f"{key_mask.dtype}; for torch's key_padding_mask (True = padding) pass "
                f"~key_padding_mask"
            )


def combined_mask(
    mask: Tensor | None, key_mask: Tensor | None, b: int, h: int, t: int, s: int
) -> Tensor | None:
    """Check ``mask`` and ``key_mask`` against (B, H, T, S); combine them into one mask."""
    if key_mask is not None:
        if key_mask.shape != (b, s):
            raise ValueError(
                f"key_mask must have shape (B, S) = ({b}, {s}) (unbatched: ({s},)), got "
                f"{tuple(key_mask.shape)}"
            )
        key_mask = key_mask[:, None, None, :]  # (B, 1, 1, S)
    if isinstance(mask, Tensor) and mask.dim() == 3:
        mask = mask.unsqueeze(1)  # (B, T, S) -> (B, 1, T, S)
    if isinstance(mask, Tensor) and mask.dim() not in (2, 4):
        raise ValueError(
            f"mask must be (T, S), (B, T, S) or (B, H, T, S), got shape {tuple(mask.shape)}"
        )
    mask = check_mask("mask", mask, (b, h, t, s), "(B, H, T, S) =")
    return functional.combine_masks(mask, key_mask)
