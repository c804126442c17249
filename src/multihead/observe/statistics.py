"""Head statistics: what each head does, summarised in one forward pass.

:func:`head_statistics` runs the model once and summarises each head (entropy, identity,
previous/next-token scores, mass on special tokens, induction and duplicate-token scores, Clark
et al.'s [CLS]/[SEP]/punctuation measures, most-attended token), computing the weights a chunk of
query rows at a time inside the forward so that no head's full (T, S) matrix is ever held. The
result, :class:`HeadStatistics`, and its reading (top, roles, table) live in
:mod:`multihead.observe.head_summary`; the metrics and their running sums in
:mod:`multihead.observe.head_metrics`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int
from multihead.mapping import attention_modules
from multihead.observe.head_metrics import QueryChunk, StatsAccumulator
from multihead.observe.head_summary import HeadStatistics
from multihead.observe.rows import observe_rows, visible_keys
from multihead.observers import AttentionCall

__all__ = ["head_statistics"]


def head_statistics(
    model: nn.Module,
    inputs: Any,
    *,
    valid_mask: Tensor | None = None,
    special_mask: Tensor | None = None,
    token_ids: Tensor | None = None,
    tokens: list[list[str]] | None = None,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
    **forward_kwargs: Any,
) -> HeadStatistics:
    """Run ``model`` once and summarise what each head does (see :class:`HeadStatistics`).

    The weights are recomputed ``chunk_size`` query rows at a time inside the forward pass and
    folded into running sums, so no head's full (T, T) matrix is ever held: memory is
    O(B · H · chunk_size · T) on top of the model's own.

    Args:
        model: a model built from MultiHeadAttention (self-attention layers).
        inputs: a tokenized batch (anything with ``input_ids``, ``attention_mask`` and
            optionally ``token_type_ids``, ``special_mask``, ``tokens``, like
            ``BertModel.tokenize``'s), run as ``model(input_ids, attention_mask=...,
            token_type_ids=...)``; or a tensor, run as ``model(inputs, **forward_kwargs)``.
        valid_mask: (B, T) bool, True at real tokens; default from the batch's attention_mask,
            else from ``key_mask`` in forward_kwargs, else all tokens.
        special_mask: (B, T) bool, True at [CLS]/[SEP]; default from the batch.
        token_ids: (B, T) integer ids for ``induction`` and ``duplicate_token``; default the
            batch's ``input_ids``, or ``inputs`` itself when it is an integer tensor. When they
            are unknown (``inputs`` is a float tensor of embeddings and no ``token_ids`` given),
            those two metrics are NaN.
        tokens: per sequence its tokens, for Clark et al.'s [CLS]/[SEP]/punctuation metrics;
            default the batch's ``tokens``. Unknown: those metrics are NaN.
        layers, heads: which to summarise (as for :func:`capture`).
        chunk_size: query rows per step.
        **forward_kwargs: passed to the model when ``inputs`` is a tensor.

    Under tensor parallelism (a transformers model loaded with a ``tp_plan``; every rank calls
    this together) each rank computes its heads' weights, gathered chunk by chunk, and every
    rank gets the statistics of every chosen head (global head numbers).

    Returns:
        A :class:`HeadStatistics` over the chosen layers and heads.
    """
    acc, chosen, head_ids, tokens = accumulate_statistics(
        model,
        inputs,
        valid_mask=valid_mask,
        special_mask=special_mask,
        token_ids=token_ids,
        tokens=tokens,
        layers=layers,
        heads=heads,
        chunk_size=chunk_size,
        **forward_kwargs,
    )
    return HeadStatistics.from_accumulator(acc, chosen, head_ids, tokens)


def accumulate_statistics(
    model: nn.Module,
    inputs: Any,
    *,
    valid_mask: Tensor | None = None,
    special_mask: Tensor | None = None,
    token_ids: Tensor | None = None,
    tokens: list[list[str]] | None = None,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
    **forward_kwargs: Any,
) -> tuple[StatsAccumulator, list[int], list[int], list[list[str]] | None]:
    """:func:`head_statistics`' forward pass, returning its running sums (for callers that
    need them per sequence, as :func:`multihead.observe.corpus.statistics_over_batches` does).

    Returns:
        (the accumulator, the layer indices, the head indices, the tokens used).
    """
    check_positive_int("chunk_size", chunk_size)
    if hasattr(inputs, "input_ids"):
        ids = inputs.input_ids
        attention_mask = getattr(inputs, "attention_mask", None)
        kwargs: dict[str, Any] = {"attention_mask": attention_mask}
        if getattr(inputs, "token_type_ids", None) is not None:
            kwargs["token_type_ids"] = inputs.token_type_ids
        if valid_mask is None and attention_mask is not None:
            valid_mask = attention_mask.bool()
        if special_mask is None and getattr(inputs, "special_mask", None) is not None:
            special_mask = inputs.special_mask.bool()
        if tokens is None:
            tokens = getattr(inputs, "tokens", None)
        if token_ids is None:
            token_ids = ids

        def run() -> None:
            model(ids, **kwargs)

        b, t = ids.shape
    elif isinstance(inputs, Tensor):
        if valid_mask is None and forward_kwargs.get("key_mask") is not None:
            valid_mask = forward_kwargs["key_mask"]

        def run() -> None:
            model(inputs, **forward_kwargs)

        b, t = inputs.shape[0], inputs.shape[1]
        if token_ids is None and inputs.dim() == 2 and not inputs.is_floating_point():
            token_ids = inputs
    else:
        raise TypeError(
            f"inputs must be a tensor or a tokenized batch with input_ids, got "
            f"{type(inputs).__name__}"
        )
    if valid_mask is not None and special_mask is not None:
        special_mask = special_mask & valid_mask

    found = attention_modules(model)
    layer_ids = check_indices("layers", layers, len(found), "attention layers") if found else None
    chosen = list(dict.fromkeys(layer_ids)) if layer_ids is not None else list(range(len(found)))
    num_heads = {found[i][1].num_heads for i in chosen}
    head_ids = check_indices("heads", heads, min(num_heads), "heads") if num_heads else None
    if head_ids is None and len(num_heads) > 1:
        raise ValueError(
            f"the chosen layers have different head counts {sorted(num_heads)}: pass heads= "
            f"or layers= to pick comparable ones"
        )
    h = len(head_ids) if head_ids is not None else (num_heads.pop() if num_heads else 0)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    acc = StatsAccumulator(
        len(chosen), h, b, t, device, valid_mask, special_mask, token_ids, tokens
    )
    chunks = _SharedChunks(acc)
    with observe_rows(
        model,
        layers=layers,
        heads=heads,
        rows=None,
        chunk_size=chunk_size,
        # a sink's column (a call whose own convention is "column") is no key's: left out
        consume=lambda slot, rows, w, t, call: acc.add_chunk(
            slot, w[..., : call.k.shape[2]], t, chunks(call, rows, w)
        ),
    ):
        with torch.no_grad():
            run()
    if not bool(acc.slot_counts.gt(0).all()) and bool(acc.valid.any()):
        raise ValueError("some chosen attention layers were not called by the model's forward")
    return acc, chosen, head_ids if head_ids is not None else list(range(h)), tokens


class _SharedChunks:
    """The :class:`QueryChunk` of each chunk of query rows, made once per forward and shared by
    the layers whose calls see the same keys (the same mask object, causality and lengths: every
    layer of most models), so that each layer's weights cost only their own fold.

    A call hands its chunks over in order, so a chunk is known by its place in its call; the
    signature it was made under is held (the mask by reference), so no later call can match a
    signature it does not share.
    """

    def __init__(self, acc: StatsAccumulator) -> None:
        self.acc = acc
        self.call: AttentionCall | None = None  # the call whose chunks arrive now
        self.index = 0  # the chunk's place in it
        self.signature: tuple[Any, ...] | None = None
        self.chunks: list[QueryChunk] = []

    def __call__(self, call: AttentionCall, rows: Tensor, w: Tensor) -> QueryChunk:
        dtype = torch.promote_types(w.dtype, torch.float32)
        if call is not self.call:
            self.call, self.index = call, 0
            signature = (call.mask, call.is_causal, call.q.shape[2], call.k.shape[2], dtype)
            if self.signature is None or not _same(signature, self.signature):
                self.signature, self.chunks = signature, []
        else:
            self.index += 1
        if self.index == len(self.chunks):
            self.chunks.append(self.acc.chunk(rows, visible_keys(call, rows), dtype))
        return self.chunks[self.index]


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Signatures equal, the masks (first) by identity."""
    return a[0] is b[0] and a[1:] == b[1:]
