"""The shared machinery of capture and head statistics: choose attention modules, heads and
query rows, and recompute those rows' weights from what an observer sees.

Shapes: B batch, H heads (H' the selected ones), T queries, R selected query rows, S keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import cast

import torch
from torch import Tensor, nn

from multihead import kernels
from multihead._checks import (
    check_choice,
    check_index,
    check_indices,
    check_optional_positive_int,
)
from multihead.heads import HeadName, is_head, parse_head
from multihead.mapping import attention_modules
from multihead.observers import AttentionCall, AttentionObserver, ObservableAttention, registered
from multihead.score_mods import SINK_WEIGHTS, modified_attention

__all__ = [
    "observe_rows",
    "row_values",
    "row_weights",
    "row_scores",
    "RowIndex",
    "Rows",
]

Rows = int | Sequence[int] | slice | range | None


def _device_of(site: ObservableAttention) -> torch.device | None:
    """Where a site's parameters live (None without any)."""
    return next((p.device for p in site.parameters()), None)


def _head_pairs(heads: object) -> list[tuple[int, int]] | None:
    """``heads`` as (layer, head) pairs when it names heads with their layers (``"L0H1"`` or
    ``(0, 1)`` items), else None (plain head indices, or None)."""
    if heads is None or isinstance(heads, (int, str, Tensor)) or not isinstance(heads, Sequence):
        return [parse_head("heads", heads)] if isinstance(heads, str) else None
    if not heads or not any(is_head(item) for item in heads):
        return None
    return [parse_head("heads item", item) for item in heads]


def row_values(rows: Rows, t: int) -> list[int]:
    """The query rows chosen by ``rows`` for a query length T, as ints in [0, T), in order."""
    return RowIndex(rows).values(t)


class RowIndex:
    """The query rows ``rows`` chooses (an int, ints, a slice, or None for all), for any query
    length.

    The chosen ints are checked once and copied to a device once (:meth:`to`, before a forward);
    a call then builds the (R,) index with device operations only, so that a forward never waits
    for the host.

    Raises:
        TypeError: ``rows`` of another kind, or a row that is not an int.
    """

    def __init__(self, rows: Rows) -> None:
        check_rows_type(rows)
        self.rows = rows
        self.items: list[int] | None = None  # the ints asked for (None: every row or a slice)
        if rows is not None and not isinstance(rows, slice):
            self.items = [rows] if isinstance(rows, int) else list(rows)
            for r in self.items:
                if not isinstance(r, int) or isinstance(r, bool):
                    raise TypeError(f"rows must be ints, got {r!r} ({type(r).__name__})")
        # the ints asked for lie in low..high: a query length T holds them when -T <= low and
        # high < T
        self.low = min(self.items or [0])
        self.high = max(self.items or [-1])
        self._on: dict[torch.device, Tensor] = {}  # device -> the ints asked for, (R,) int64
        # (T, device) -> the rows in [0, T), for rows counted from the end: made once per length
        self._resolved: dict[tuple[int, torch.device], Tensor] = {}
        self._first: dict[int, int] = {}  # T -> the smallest chosen row

    def values(self, t: int) -> list[int]:
        """The chosen rows of a query length T as ints in [0, T), in order.

        Raises:
            ValueError: a row out of range for T.
        """
        if self.items is None:
            every = range(t)
            return list(every[self.rows] if isinstance(self.rows, slice) else every)
        for r in self.items:
            if not -t <= r < t:
                raise ValueError(f"rows: row {r} is out of range for a query length of {t}")
        return [r % t for r in self.items]

    def to(self, device: torch.device) -> None:
        """Copy the chosen ints to ``device`` now (a host-to-device copy, outside any forward)."""
        if self.items is not None and device not in self._on:
            self._on[device] = torch.tensor(self.items, dtype=torch.long, device=device)

    def __call__(self, t: int, device: torch.device) -> Tensor:
        """(R,) int64 on ``device``: the chosen rows of a query length T, in [0, T)."""
        if self.items is None:
            every = torch.arange(t, device=device)
            return every if self.rows is None else every[self.rows]  # a slice: a view
        if not (-t <= self.low and self.high < t):
            self.values(t)  # raises, naming the row
        self.to(device)
        ids = self._on[device]
        if self.low >= 0:
            return ids
        key = (t, device)
        if key not in self._resolved:
            if len(self._resolved) > 8:
                self._resolved.clear()  # texts of many lengths: keep a few
            self._resolved[key] = ids % t  # negative rows count from the end
        return self._resolved[key]

    def first(self, t: int) -> int:
        """The smallest chosen row of a query length T, in [0, T) (T when none is chosen)."""
        if t not in self._first:
            if len(self._first) > 64:
                self._first.clear()
            if self.items is None:
                every = range(t)
                chosen = every[self.rows] if isinstance(self.rows, slice) else every
                self._first[t] = min(chosen, default=t)
            else:
                self._first[t] = min((r % t for r in self.items if -t <= r < t), default=t)
        return self._first[t]

    def count(self, t: int) -> int:
        """R, the number of rows chosen for a query length T."""
        if self.items is not None:
            return len(self.items)
        return len(range(t)[self.rows]) if isinstance(self.rows, slice) else t


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


def row_weights(
    call: AttentionCall,
    heads: Tensor | None,
    rows: Tensor,
    causal: Tensor | None,
    sink_weights: str | None = None,
) -> Tensor:
    """Attention weights (B, H', R, S) of one call, for the chosen heads and query rows.

    Recomputed from the call's per-head q, k and its mask by the core's formula
    (:func:`multihead.kernels.scaled_weights`, float32 at least), and nothing more: an observed
    layer adds only these few small kernels to the forward it watches (at long lengths a forward
    is bound by launching kernels, so each one counts). A row that may attend to no key gives
    zeros, as :func:`multihead.functional.attention` does.

    Args:
        call: what the attention module saw (see :class:`~multihead.attention.AttentionCall`).
        heads: (H',) int64 query heads, or None for all.
        rows: (R,) int64 query rows.
        causal: (R, S) bool, the call's causal mask restricted to ``rows``
            (:func:`multihead.kernels.causal_mask` with ``rows``), or None where the call is
            not causal or every chosen row sees every key (the caller knows the rows as ints
            and keeps the mask between calls). The core's own ``is_causal`` would align a
            (R, S) problem bottom-right, which is a different mask.
        sink_weights: for a call with sinks, ``"dropped"``, ``"column"`` (then S + 1 columns)
            or ``"plain"``; default the call's own (``call.mods.sink_weights``).

    A call with score modifications (``call.mods``: softcap, sinks, score_mod, block_mask)
    has its rows recomputed under them by :func:`multihead.score_mods.modified_attention`, at
    the same O(B · H' · R · S).
    """
    q, k, mask = call.q, call.k, call.mask
    if call.mods:
        _, weights = modified_attention(
            q,
            k,
            None,
            call.mods,
            mask=mask,
            is_causal=call.is_causal,
            scale=call.scale,
            rows=rows,
            heads=heads,
            need_weights=True,
            sink_weights=sink_weights,
        )
        assert weights is not None
        return weights
    h, hk = q.shape[1], k.shape[1]
    t, s = q.shape[2], k.shape[2]
    if heads is not None:
        q = q.index_select(1, heads)  # (B, H', T, D)
        # Query head h reads key/value head h // (H // Hk): pick each chosen head's own.
        k = k.index_select(1, torch.div(heads, h // hk, rounding_mode="floor"))  # (B, H', S, D)
    # else grouped heads keep their Hk key heads: scaled_weights shares each among its queries
    compute = torch.promote_types(q.dtype, torch.float32)
    q = q.index_select(2, rows).to(compute) * call.scale  # (B, H', R, D), a fresh tensor
    m = kernels.combine_masks(slice_mask(mask, heads, rows), causal)
    weights = kernels.scaled_weights(q, k.to(compute), m)  # (B, H', R, S)
    if mask is not None or (causal is not None and t > s):  # only then can a row be empty
        assert m is not None
        weights = weights.masked_fill_(~kernels.allowed(m).any(-1, keepdim=True), 0.0)
    return weights.to(call.q.dtype)


def row_scores(call: AttentionCall, rows: Tensor) -> Tensor:
    """The scores (B, H, R, S) of one call's query ``rows`` (R,) before the softmax: q kᵀ times
    the call's scale (softcapped where the call caps its scores), its mask added, and -inf at
    every key a row may not see (by the mask or causality). TransformerLens's
    ``hook_attn_scores``; computed and returned in float32 at least (a half-precision model's
    scores would lose the digits its softmax reads).

    Raises:
        ValueError: a call whose scores a ``score_mod`` or a block mask changes (FlexAttention's
            functions: the scores they make are not written out here).
    """
    mods = call.mods
    if mods.score_mod is not None or mods.block_mask is not None:
        raise ValueError(
            "attention scores of a call with a score_mod or a block mask are not computed "
            "(FlexAttention's functions change them inside the kernel): read its pattern"
        )
    q, k = call.q, call.k
    t, s = q.shape[2], k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    scores = kernels.scaled_scores(q.index_select(2, rows).to(compute) * call.scale, k.to(compute))
    scores = mods.capped(scores)
    causal = kernels.causal_mask(t, s, rows=rows) if call.is_causal else None
    m = kernels.combine_masks(slice_mask(call.mask, None, rows), causal)
    if m is not None:
        scores = kernels.add_mask(scores, m).masked_fill_(~kernels.allowed(m), float("-inf"))
    return scores


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
        allowed = kernels.allowed(m).any(1)  # (B|1, R|1, S|1)
    if call.is_causal:
        causal = kernels.causal_mask(t, s, rows=rows)  # (R, S)
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
    heads: int | Sequence[int] | Sequence[HeadName] | None,
    rows: Rows,
    chunk_size: int | None,
    consume: Consumer,
    sink_weights: str | None = None,
) -> Iterator[list[tuple[int, str, list[int] | None]]]:
    """Install observers on the chosen attention modules; yields (layer, name, heads) per slot.

    Each call of a chosen module hands its weights to ``consume`` chunk by chunk of query rows.
    The observers are removed on exit, even when the body raised. A module whose heads are split
    over ranks (``site.head_shard``, tensor parallelism) computes the chosen heads each rank
    holds there and gathers them: ``consume`` sees every chosen head, on every rank. A call with
    sinks reports its weights in ``sink_weights`` (default: each call's own convention).
    """
    check_optional_positive_int("chunk_size", chunk_size)
    if sink_weights is not None:
        check_choice("sink_weights", sink_weights, SINK_WEIGHTS)
    row_index = RowIndex(rows)
    found = attention_modules(model)
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}) contains no multihead.MultiHeadAttention module: "
            f"capture records only attention built from multihead's modules (or a transformers "
            f"model, through multihead.hf)"
        )
    slots: list[tuple[int, str, list[int] | None]] = []
    pairs = _head_pairs(heads)
    if pairs is not None:  # heads named with their layers ("L0H1" or (0, 1)): per layer
        if layers is not None:
            raise ValueError(
                f"layers must be None when heads name their layers ('L0H1' or (layer, head) "
                f"pairs), got layers={layers!r}"
            )
        by_layer: dict[int, list[int]] = {}
        for layer, head in pairs:
            layer = check_index(f"heads item L{layer}H{head}: layer", layer, len(found), "layers")
            name, mha = found[layer]
            head = check_index(f"heads item L{layer}H{head}: head", head, mha.num_heads, "heads")
            by_layer.setdefault(layer, [])
            if head not in by_layer[layer]:
                by_layer[layer].append(head)
        for layer in sorted(by_layer):
            slots.append((layer, found[layer][0], sorted(by_layer[layer])))
    else:
        layer_ids = check_indices("layers", layers, len(found), "attention layers")
        # a layer named twice is observed once
        chosen = list(range(len(found))) if layer_ids is None else list(dict.fromkeys(layer_ids))
        for layer in chosen:
            name, mha = found[layer]
            indices = cast("int | Sequence[int] | None", heads)  # no head named with its layer
            slots.append((layer, name, check_indices("heads", indices, mha.num_heads, "heads")))

    # the causal mask of the chosen rows, (R, S) bool, by (T, S, first row, device): shared by
    # the layers of a block, so a forward builds it once (chunks of rows: one a chunk)
    causal_masks: dict[tuple[int, int, int, torch.device], Tensor] = {}

    def make_observer(
        slot: int, site: ObservableAttention, head_list: list[int] | None
    ) -> AttentionObserver:
        # Under tensor parallelism each rank computes the chosen heads it holds (their positions
        # among its own) and the gather hands every rank all of them, in the order chosen.
        shard = site.head_shard
        gather = None if shard is None else shard.gatherer(head_list)
        own_heads = head_list if gather is None else gather.local
        # the head indices (H',) per device, made before the forward (on the module's device)
        # or at its first call on another: no host-to-device copy inside later forwards
        head_ids: dict[torch.device, Tensor] = {}

        def heads_on(device: torch.device) -> Tensor | None:
            if own_heads is None:
                return None
            if device not in head_ids:
                head_ids[device] = torch.tensor(own_heads, dtype=torch.long, device=device)
            return head_ids[device]

        def observer(call: AttentionCall, out: Tensor) -> None:
            q = call.q
            t = q.shape[2]
            if row_index.count(t) == 0:
                raise ValueError(f"rows selects no query row of a query length of {t}: {rows!r}")
            row_ids = row_index(t, q.device)
            chosen_heads = heads_on(q.device)
            step = chunk_size or len(row_ids)
            s = call.k.shape[2]
            with torch.no_grad():
                for start in range(0, len(row_ids), step):
                    chunk = row_ids[start : start + step]
                    causal = None
                    # the same for every layer of a forward: made once; none at all when every
                    # chosen row sees every key (the last row, say)
                    if call.is_causal and row_index.first(t) < t - 1:
                        key = (t, s, start, q.device)
                        if key not in causal_masks:
                            if any(k[:2] != (t, s) for k in causal_masks):
                                causal_masks.clear()  # one length at a time: texts vary
                            causal_masks[key] = kernels.causal_mask(t, s, rows=chunk)
                        causal = causal_masks[key]
                    w = row_weights(call, chosen_heads, chunk, causal, sink_weights)
                    if gather is not None:
                        w = gather(w, dim=1)  # (B, H', R, S): every chosen head, on every rank
                    consume(slot, chunk, w, t, call)

        device = _device_of(site)
        if device is not None:
            heads_on(device)
            row_index.to(device)
            if gather is not None:
                gather.to(device)
        return observer

    with registered(
        found[layer][1].register_observer(make_observer(slot, found[layer][1], head_list))
        for slot, (layer, _, head_list) in enumerate(slots)
    ):
        yield slots
