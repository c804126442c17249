"""Head statistics over a corpus: many texts in token batches, each text weighing the same.

:func:`statistics_over_batches` runs :func:`~multihead.observe.statistics.head_statistics`' forward
on each batch (chunked as always: no head's (T, T) matrix is held) and averages each metric over
the texts. The batches come from above, already tokenized (any object with ``input_ids``,
``attention_mask`` and, optionally, ``token_type_ids``, ``special_mask`` and ``tokens``, such as a
:class:`~multihead.tokenization.TokenBatch`): this package reads no text.
:func:`multihead.text.corpus_statistics` is the loop over texts.

Shapes: N texts, L' layers, H' heads, T a batch's padded length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int
from multihead.memory_budget import FLOAT32_BYTES
from multihead.observe.head_summary import HeadStatistics, split_chance
from multihead.observe.rows import attention_modules
from multihead.observe.statistics import accumulate_statistics

__all__ = ["statistics_over_batches", "statistics_batch_bytes", "chosen_size", "BatchBytes"]

BatchBytes = Callable[[int, int], int]
"""What a batch of B texts padded to T tokens will hold, in bytes: ``batch_bytes(B, T)``."""


def chosen_size(
    model: nn.Module, layers: int | Sequence[int] | None, heads: int | Sequence[int] | None
) -> tuple[int, int]:
    """(L', H'): how many attention layers and heads ``layers`` and ``heads`` choose (checked
    as :func:`~multihead.observe.capture` checks them; (0, 0) for a model with none)."""
    found = attention_modules(model)
    if not found:
        return 0, 0
    chosen = check_indices("layers", layers, len(found), "attention layers")
    chosen = list(dict.fromkeys(chosen)) if chosen is not None else list(range(len(found)))
    counts = [found[i][1].num_heads for i in chosen]
    picked = check_indices("heads", heads, min(counts), "heads")
    return len(chosen), len(picked) if picked is not None else max(counts)


def statistics_batch_bytes(
    model: nn.Module,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
) -> BatchBytes:
    """What :func:`statistics_over_batches` holds for a batch of B texts padded to T tokens:
    a chunk's weights (B, H', chunk_size, T) float32 and their working copies, and the per-text
    sums (checks ``layers`` and ``heads`` as :func:`chosen_size` does)."""
    check_positive_int("chunk_size", chunk_size)
    num_layers, num_heads = chosen_size(model, layers, heads)

    def batch_bytes(b: int, t: int) -> int:
        rows = min(chunk_size, t)  # a chunk's weights, ~4 working copies, its (B, R, S) masks
        per_token = 4 * num_heads * rows + 8 * rows + 2 * num_layers * num_heads
        return FLOAT32_BYTES * b * t * per_token  # the last: float64 sums per key (L', B, H', T)

    return batch_bytes


def statistics_over_batches(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
) -> HeadStatistics:
    """What each head does over many texts: each metric is the mean over texts of that text's
    :func:`~multihead.observe.statistics.head_statistics` value.

    Exactly what is averaged: for a text n and a metric m, ``head_statistics(model, batch of
    text n alone)``'s m is a mean over that text's own queries (its real tokens, or the subset m
    applies to: tokens with a previous token, repeated tokens, [SEP], ...). The result is the
    plain mean of those per-text values over the texts, each text weighing the same whatever its
    length or batch. A text whose value is NaN (no query m applies to: no repeated token for
    ``induction``; or m unknown) is left out of m's mean; m is NaN only when it is NaN for every
    text. Padding never counts: a batch's padding tokens are neither queries nor keys.

    Args:
        model: a module whose attention layers are observable.
        batches: tokenized batches (``input_ids`` (B, T), ``attention_mask`` (B, T), ...), one
            forward each; at least one.
        layers, heads: which to summarise (as for :func:`~multihead.observe.capture`).
        chunk_size: query rows per step inside each forward.

    Returns:
        A :class:`HeadStatistics` whose metrics are (L', H') means over the texts;
        ``most_attended``/``most_attended_weight`` are (N, L', H'), per text as for one batch
        (positions index each text's tokens); ``num_queries`` counts every real token;
        ``tokens`` holds each text's tokens when the batches carry them.

    Raises:
        ValueError: no batch; indices out of range.
    """
    check_positive_int("chunk_size", chunk_size)
    sums: dict[str, Tensor] = {}  # metric -> (L', H') float64 sum over texts where known
    known: dict[str, Tensor] = {}  # metric -> (L', H') how many texts were summed
    top_pos: list[Tensor] = []
    top_weight: list[Tensor] = []
    tokens: list[list[str]] = []
    num_queries = 0
    chosen: list[int] = []
    head_ids: list[int] = []
    for batch in batches:
        acc, chosen, head_ids, batch_tokens = accumulate_statistics(
            model, batch, layers=layers, heads=heads, chunk_size=chunk_size
        )
        for name, per_text in acc.per_sequence_means().items():  # (B, L', H')
            seen = ~per_text.isnan()
            sums[name] = sums.get(name, 0) + per_text.nan_to_num(nan=0.0).sum(0)
            known[name] = known.get(name, 0) + seen.sum(0)
        pos, weight = acc.most_attended()
        top_pos.append(pos)
        top_weight.append(weight)
        tokens.extend(batch_tokens or [[] for _ in range(pos.shape[0])])
        num_queries += int(acc.counts["all"].item())
    if not top_pos:
        raise ValueError("batches must hold at least one batch, got none")
    means, chance = split_chance(
        {
            name: (sums[name] / known[name].clamp(min=1))
            .masked_fill(known[name] == 0, math.nan)
            .float()
            for name in sums
        }
    )
    return HeadStatistics(
        layers=chosen,
        heads=head_ids,
        chance=chance,
        **means,
        most_attended=torch.cat(top_pos),
        most_attended_weight=torch.cat(top_weight),
        num_queries=num_queries,
        tokens=tokens if any(tokens) else None,
    )
