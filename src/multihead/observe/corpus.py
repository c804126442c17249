"""Head statistics over a corpus: many texts, batched, each text weighing the same.

:func:`corpus_statistics` tokenizes the texts ``batch_size`` at a time with the model's own
``tokenize``, runs :func:`~multihead.observe.statistics.head_statistics`' forward on each batch
(chunked as always: no head's (T, T) matrix is held), and averages each metric over the texts.
It needs only ``model.tokenize(texts) -> BertBatch`` (``input_ids``, ``attention_mask``,
``token_type_ids``, ``tokens``, ``special_mask``) and observable attention layers, so it serves
:class:`~multihead.models.bert.BertModel` and a wrapped Hugging Face model alike.

Shapes: N texts, L' layers, H' heads, T a batch's padded length.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int, describe
from multihead.memory_budget import (
    DEFAULT_MEMORY_LIMIT,
    FLOAT32_BYTES,
    check_memory_limit,
    format_bytes,
)
from multihead.models.text import TruncationWarning, check_text
from multihead.observe.head_summary import HeadStatistics, split_chance
from multihead.observe.rows import attention_modules
from multihead.observe.statistics import accumulate_statistics

__all__ = [
    "corpus_statistics",
    "check_texts",
    "text_batches",
    "chosen_size",
    "BatchBytes",
    "Progress",
]


def check_texts(name: str, texts: Any) -> list[str]:
    """``texts`` must be a non-empty sequence of non-empty, valid Unicode strings.

    Returns:
        The texts as a list.

    Raises:
        TypeError: not a sequence (a single str counts as not one), or an item not a str.
        ValueError: no texts, or a text that is empty, blank or not valid Unicode (bytes that
            are not UTF-8); the message names the text's index (0-based) and line (1-based).
    """
    if isinstance(texts, (str, bytes, bytearray)) or not isinstance(texts, Sequence):
        raise TypeError(f"{name} must be a sequence of str (one text each), got {describe(texts)}")
    items = list(texts)
    if not items:
        raise ValueError(f"{name} must hold at least one text, got none")
    for i, text in enumerate(items):
        where = f"{name}[{i}] (line {i + 1})"
        if not isinstance(text, str):
            raise TypeError(f"{where} must be a str, got {type(text).__name__}")
        check_text(where, text)
        if not text.strip():
            raise ValueError(f"{where} must be a non-empty text, got {text!r}")
    return items


BatchBytes = Callable[[int, int], int]
"""What a batch of B texts padded to T tokens will hold, in bytes: ``batch_bytes(B, T)``."""
Progress = Callable[[int, int], None]
"""Told ``(texts done, texts in all)`` after each batch."""


def text_batches(
    model: nn.Module,
    texts: Sequence[str],
    batch_size: int,
    *,
    batch_bytes: BatchBytes | None = None,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
) -> Iterator[Any]:
    """``model.tokenize`` of ``batch_size`` texts at a time, in order (the last batch smaller).

    With ``batch_bytes``, every text is tokenized once first (tokenization only) to learn its
    length, and a batch holds fewer texts where long ones would take more than
    ``memory_limit``: the result does not change, only how many texts share a forward. A text
    that alone would take more is refused before the first batch is made.

    Raises:
        ValueError: a text with no word the tokenizer keeps (only zero-width or control
            characters: the statistics would be those of [CLS] and [SEP] alone), or a text too
            long for ``memory_limit``; the message names its line (1-based).

    Warns:
        TruncationWarning: once, at the end, when texts were truncated: the tokenizer's own warning
            would name a text by its place in its batch, this one names its line in the corpus
            (when the batch says which texts were truncated, as ``BertBatch.truncated`` does).
    """
    tokenize = getattr(model, "tokenize", None)
    if not callable(tokenize):
        raise TypeError(
            f"model must have a tokenize(texts) method returning a tokenized batch, got "
            f"{type(model).__name__}"
        )
    limit = check_memory_limit("memory_limit", memory_limit)
    if batch_bytes is None:
        plan = [(s, min(s + batch_size, len(texts))) for s in range(0, len(texts), batch_size)]
    else:
        plan = _plan(tokenize, texts, batch_size, batch_bytes, limit)
    truncated: list[int] = []  # 1-based lines
    for start, stop in plan:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = tokenize(list(texts[start:stop]))
        _check_words(batch, texts, start)
        flags = getattr(batch, "truncated", None)
        for w in caught:
            if flags is None or not issubclass(w.category, TruncationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        if flags is not None and caught:
            truncated += [start + i + 1 for i, cut in enumerate(flags) if cut]
        yield batch
    if truncated:
        warnings.warn(
            f"{len(truncated)} of {len(texts)} texts are longer than the model takes and were "
            f"truncated (lines {truncated[:10]}{', ...' if len(truncated) > 10 else ''})",
            TruncationWarning,
            stacklevel=2,
        )


def _check_words(batch: Any, texts: Sequence[str], start: int) -> None:
    """Refuse a text of ``batch`` (texts from ``start``) whose tokens are all special."""
    for i, ids in enumerate(getattr(batch, "word_ids", None) or []):
        if all(w is None for w in ids):
            n = start + i
            raise ValueError(
                f"texts[{n}] (line {n + 1}) holds no word the tokenizer keeps, got "
                f"{texts[n][:40]!r} (only zero-width or control characters?): its statistics "
                f"would be those of {' '.join(batch.tokens[i]) or 'no token'} alone"
            )


def _plan(
    tokenize: Callable[[list[str]], Any],
    texts: Sequence[str],
    batch_size: int,
    batch_bytes: BatchBytes,
    limit: int,
) -> list[tuple[int, int]]:
    """(start, stop) of each batch: consecutive texts, at most ``batch_size``, fitting ``limit``."""
    lengths: list[int] = []
    for start in range(0, len(texts), batch_size):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)  # said once, by the real pass
            batch = tokenize(list(texts[start : start + batch_size]))
        _check_words(batch, texts, start)
        lengths += [int(n) for n in batch.attention_mask.sum(1).tolist()]
    plan = []
    start = 0
    while start < len(texts):
        stop, longest = start, 0
        while stop < len(texts) and stop - start < batch_size:
            if batch_bytes(stop - start + 1, max(longest, lengths[stop])) > limit:
                break
            longest = max(longest, lengths[stop])
            stop += 1
        if stop == start:
            raise ValueError(
                f"texts[{start}] (line {start + 1}) is {lengths[start]} tokens long: its "
                f"attention weights would take {format_bytes(batch_bytes(1, lengths[start]))}, "
                f"over memory_limit={format_bytes(limit)}; split the text or raise the limit"
            )
        plan.append((start, stop))
        start = stop
    return plan


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


def corpus_statistics(
    model: nn.Module,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    progress: Progress | None = None,
) -> HeadStatistics:
    """What each head does over many texts: each metric is the mean over texts of that text's
    :func:`~multihead.observe.statistics.head_statistics` value.

    Exactly what is averaged: for a text n and a metric m, ``head_statistics(model,
    model.tokenize([text_n]))``'s m is a mean over that text's own queries (its real tokens, or
    the subset m applies to: tokens with a previous token, repeated tokens, [SEP], ...). The
    result is the plain mean of those per-text values over the texts, each text weighing the
    same whatever its length. A text whose value is NaN (no query m applies to: no repeated
    token for ``induction``; or m unknown) is left out of m's mean; m is NaN only when it is NaN
    for every text. Padding never counts: a batch's padding tokens are neither queries nor keys.

    Args:
        model: a model with ``tokenize(texts) -> BertBatch`` (``BertModel``, a wrapped Hugging
            Face model) whose attention layers are observable.
        texts: N non-empty texts.
        batch_size: texts per forward pass (memory grows with it; the result does not change).
        layers, heads: which to summarise (as for :func:`~multihead.observe.capture`).
        chunk_size: query rows per step inside each forward.
        memory_limit: bytes one batch may hold (estimated from its shapes: a chunk's weights
            (B, H', chunk_size, T) float32 and their working copies, and the per-text sums);
            batches of long texts hold fewer texts (see :func:`text_batches`).
        progress: told ``(texts done, texts in all)`` after each batch.

    Returns:
        A :class:`HeadStatistics` whose metrics are (L', H') means over the texts;
        ``most_attended``/``most_attended_weight`` are (N, L', H'), per text as for one batch
        (positions index each text's tokens); ``num_queries`` counts every real token of the
        corpus; ``tokens`` holds each text's tokens.

    Raises:
        TypeError, ValueError: bad ``texts`` (naming the line: also a text with no word the
            tokenizer keeps, or one too long for ``memory_limit``), ``batch_size``, indices.
    """
    items = check_texts("texts", texts)
    check_positive_int("batch_size", batch_size)
    check_positive_int("chunk_size", chunk_size)
    num_layers, num_heads = chosen_size(model, layers, heads)

    def batch_bytes(b: int, t: int) -> int:
        rows = min(chunk_size, t)  # a chunk's weights, ~4 working copies, its (B, R, S) masks
        per_token = 4 * num_heads * rows + 8 * rows + 2 * num_layers * num_heads
        return FLOAT32_BYTES * b * t * per_token  # the last: float64 sums per key (L', B, H', T)

    done = 0
    sums: dict[str, Tensor] = {}  # metric -> (L', H') float64 sum over texts where known
    known: dict[str, Tensor] = {}  # metric -> (L', H') how many texts were summed
    top_pos: list[Tensor] = []
    top_weight: list[Tensor] = []
    tokens: list[list[str]] = []
    num_queries = 0
    chosen: list[int] = []
    head_ids: list[int] = []
    for batch in text_batches(
        model, items, batch_size, batch_bytes=batch_bytes, memory_limit=memory_limit
    ):
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
        done += int(batch.input_ids.shape[0])
        if progress is not None:
            progress(done, len(items))
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
