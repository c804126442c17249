"""The shared machinery of capture and head statistics: choose attention modules, heads and
query rows, and recompute those rows' weights from what an observer sees.

Shapes: B batch, H heads (H' the selected ones), T queries, R selected query rows, S keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from multihead import functional
from multihead._checks import check_indices, check_optional_positive_int
from multihead.attention import AttentionCall, AttentionObserver, MultiHeadAttention
from multihead.observers import ObservableAttention

__all__ = ["attention_modules", "observe_rows", "resolve_rows", "row_weights", "Rows"]

Rows = int | Sequence[int] | slice | range | None


def attention_modules(model: nn.Module) -> list[tuple[str, ObservableAttention]]:
    """Every observable attention site in ``model``, in module order (= layer order).

    A site is a :class:`MultiHeadAttention`, or, in a Hugging Face transformers model, an
    attention module routed through transformers' ``AttentionInterface``
    (:func:`multihead.hf.attention_sites`: the model runs on ``attn_implementation="multihead"``
    while observers are registered). Both offer the same observer channel.

    Returns:
        ``(qualified_name, site)`` pairs; the model itself comes first if it is one.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if _holds_transformers(model):
        from multihead import hf  # only here: transformers is an optional extra

        return list(hf.attention_sites(model))
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MultiHeadAttention)]


def _holds_transformers(model: nn.Module) -> bool:
    """Whether a transformers model is inside (checked without importing transformers): a
    module whose class or a base of it comes from transformers (a user's own or remote-code
    ``PreTrainedModel`` subclass lives in another module)."""
    return any(
        c.__module__.startswith("transformers.") for m in model.modules() for c in type(m).__mro__
    )


def resolve_rows(rows: Rows, t: int, device: torch.device) -> Tensor:
    """The query rows (R,) int64 chosen by ``rows`` for a query length T."""
    if rows is None:
        return torch.arange(t, device=device)
    if isinstance(rows, slice):
        return torch.arange(t, device=device)[rows]
    items = [rows] if isinstance(rows, int) else list(rows)
    for r in items:
        if not isinstance(r, int) or isinstance(r, bool):
            raise TypeError(f"rows must be ints, got {r!r} ({type(r).__name__})")
        if not -t <= r < t:
            raise ValueError(f"rows: row {r} is out of range for a query length of {t}")
    return torch.tensor([r % t for r in items], dtype=torch.long, device=device)


def check_rows_type(rows: Rows) -> None:
    if rows is None or isinstance(rows, (slice, range)):
        return
    if isinstance(rows, int) and not isinstance(rows, bool):
        return
    if isinstance(rows, Sequence) and not isinstance(rows, (str, bytes)):
        return
    raise TypeError(
        f"rows must be None, an int, a sequence of ints or a slice, got {type(rows).__name__}"
    )


def slice_mask(mask: Tensor | None, heads: Tensor | None, rows: Tensor) -> Tensor | None:
    """The part of an attention mask (broadcastable to (B, H, T, S)) for chosen heads and rows."""
    if mask is None:
        return None
    if mask.dim() == 2:
        mask = mask[None, None]  # (T, S) -> (1, 1, T, S)
    elif mask.dim() == 3:
        mask = mask[None]  # (H, T, S) -> (1, H, T, S)
    if heads is not None and mask.shape[1] != 1:
        mask = mask.index_select(1, heads)  # (B, H', T, S)
    if mask.shape[2] != 1:
        mask = mask.index_select(2, rows)  # (B, H', R, S)
    return mask


def row_weights(call: AttentionCall, heads: Tensor | None, rows: Tensor) -> Tensor:
    """Attention weights (B, H', R, S) of one call, for the chosen heads and query rows.

    Recomputed from the call's per-head q, k and its mask by the core's formula.

    Args:
        call: what the attention module saw (see :class:`~multihead.attention.AttentionCall`).
        heads: (H',) int64 query heads, or None for all.
        rows: (R,) int64 query rows.
    """
    q, k, v, mask = call.q, call.k, call.v, call.mask
    h, hk = q.shape[1], k.shape[1]
    t, s = q.shape[2], k.shape[2]
    if heads is not None:
        q = q.index_select(1, heads)  # (B, H', T, D)
        # Query head h reads key/value head h // (H // Hk): pick each chosen head's own.
        kv_heads = torch.div(heads, h // hk, rounding_mode="floor")
        k = k.index_select(1, kv_heads)  # (B, H', S, D)
        v = v.index_select(1, kv_heads)  # (B, H', S, Dv)
    q = q.index_select(2, rows)  # (B, H', R, D)
    m = slice_mask(mask, heads, rows)
    if call.is_causal:
        # The causal mask of the full (T, S) problem, restricted to the chosen rows: the core's
        # own is_causal would align a (R, S) problem bottom-right, which is a different mask.
        # Built for the chosen rows only (query i sees keys j <= i + S - T): never (T, S).
        causal = torch.arange(s, device=q.device) <= (rows + (s - t))[:, None]  # (R, S)
        m = functional.combine_masks(m, causal)
    _, weights = functional.attention(
        q, k, v, mask=m, scale=call.scale, need_weights=True, backend="math"
    )
    return weights  # (B, H', R, S)


def visible_keys(call: AttentionCall, rows: Tensor) -> Tensor:
    """(B or 1, R, S) bool: the keys each chosen query row may attend to, by the call's mask
    and causality (a key allowed to any head counts)."""
    t, s = call.q.shape[2], call.k.shape[2]
    allowed: Tensor | None = None
    mask = call.mask
    if mask is not None:
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, H|1, T|1, S|1)
        if m.shape[2] != 1:
            m = m.index_select(2, rows)
        allowed = (m if m.dtype == torch.bool else m != float("-inf")).any(1)  # (B|1, R|1, S|1)
    if call.is_causal:
        causal = torch.arange(s, device=rows.device) <= (rows + (s - t))[:, None]  # (R, S)
        allowed = causal[None] if allowed is None else allowed & causal
    if allowed is None:
        return torch.ones(1, len(rows), s, dtype=torch.bool, device=rows.device)
    return allowed.expand(allowed.shape[0], len(rows), s)


# consumer(slot, rows (R,), weights (B, H', R, S), T, call) for one chunk of one attention call
# (the call for what a consumer may need beyond the weights, e.g. visible_keys; capture needs
# nothing more, so nothing more is computed for it)
Consumer = Callable[[int, Tensor, Tensor, int, AttentionCall], None]


@contextlib.contextmanager
def observe_rows(
    model: nn.Module,
    *,
    layers: int | Sequence[int] | None,
    heads: int | Sequence[int] | None,
    rows: Rows,
    chunk_size: int | None,
    consume: Consumer,
) -> Iterator[list[tuple[int, str, list[int] | None]]]:
    """Install observers on the chosen attention modules; yields (layer, name, heads) per slot.

    Each call of a chosen module hands its weights to ``consume`` chunk by chunk of query rows.
    The observers are removed on exit, even when the body raised.
    """
    check_optional_positive_int("chunk_size", chunk_size)
    check_rows_type(rows)
    found = attention_modules(model)
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}) contains no multihead.MultiHeadAttention module: "
            f"capture records only attention built from multihead's modules (or a transformers "
            f"model, through multihead.hf)"
        )
    layer_ids = check_indices("layers", layers, len(found), "attention layers")
    # a layer named twice is observed once
    chosen = list(range(len(found))) if layer_ids is None else list(dict.fromkeys(layer_ids))
    slots: list[tuple[int, str, list[int] | None]] = []
    for layer in chosen:
        name, mha = found[layer]
        slots.append((layer, name, check_indices("heads", heads, mha.num_heads, "heads")))

    def make_observer(slot: int, head_list: list[int] | None) -> AttentionObserver:
        def observer(call: AttentionCall, out: Tensor) -> None:
            q = call.q
            t = q.shape[2]
            row_ids = resolve_rows(rows, t, q.device)
            if len(row_ids) == 0:
                raise ValueError(f"rows selects no query row of a query length of {t}: {rows!r}")
            head_ids = (
                None
                if head_list is None
                else torch.tensor(head_list, dtype=torch.long, device=q.device)
            )
            step = chunk_size or len(row_ids)
            with torch.no_grad():
                for start in range(0, len(row_ids), step):
                    chunk = row_ids[start : start + step]
                    w = row_weights(call, head_ids, chunk)
                    consume(slot, chunk, w, t, call)

        return observer

    handles = []
    try:
        for slot, (layer, _, head_list) in enumerate(slots):
            handles.append(found[layer][1].register_observer(make_observer(slot, head_list)))
        yield slots
    finally:
        for handle in handles:
            handle.remove()
