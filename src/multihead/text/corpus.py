"""Over a corpus: texts in, batches of tokens to the observe functions, a summary of every head.

:func:`corpus_statistics` and :func:`head_distances` check the texts, tokenize them with the
:class:`~multihead.text.model.TextModel`'s own ``tokenize`` (:func:`text_batches`: batches that fit
a memory limit, truncations said once, naming the texts' lines) and hand the batches to
:func:`multihead.observe.corpus.statistics_over_batches` and
:func:`multihead.observe.head_distance.head_distances_over_batches`, which read no text.

Under ``torch.distributed`` (``torchrun``) every rank plans the same batches, runs every
``world``-th of them and hands its own to the observe functions with the
:class:`~multihead.distributed.DataParallelGroup`, which combine the ranks' sums: each text runs
on one rank, every rank gets the whole corpus' result.

Shapes: N texts, L' layers, H' heads, T a batch's padded length.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from multihead._checks import check_positive_int, describe
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.memory_budget import DEFAULT_MEMORY_LIMIT, check_memory_limit, format_bytes
from multihead.observe.corpus import BatchBytes, statistics_batch_bytes, statistics_over_batches
from multihead.observe.head_distance import (
    HeadMap,
    distances_batch_bytes,
    head_distances_over_batches,
)
from multihead.observe.head_summary import HeadStatistics
from multihead.text.model import TextModel
from multihead.text.tokenization import TokenBatch, TruncationWarning, check_text

__all__ = [
    "corpus_statistics",
    "head_distances",
    "check_texts",
    "text_batches",
    "Progress",
]

Progress = Callable[[int, int], None]
"""Told ``(texts done, texts in all)`` after each batch."""


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


def _check_model(model: Any) -> TextModel:
    if not isinstance(model, TextModel):
        raise TypeError(
            f"model must be a multihead.text.TextModel (load one with "
            f"multihead.pretrained.load_text_model), got {type(model).__name__}"
        )
    return model


def text_batches(
    model: TextModel,
    texts: Sequence[str],
    batch_size: int,
    *,
    batch_bytes: BatchBytes | None = None,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    progress: Progress | None = None,
) -> Iterator[TokenBatch]:
    """``model.tokenize`` of ``batch_size`` texts at a time, in order (the last batch smaller).

    With ``batch_bytes``, every text is tokenized once first (tokenization only) to learn its
    length, and a batch holds fewer texts where long ones would take more than
    ``memory_limit``: the result does not change, only how many texts share a forward. A text
    that alone would take more is refused before the first batch is made. ``progress`` is told
    ``(texts done, texts in all)`` when the consumer asks for the next batch.

    Raises:
        ValueError: a text with no word the tokenizer keeps (only zero-width or control
            characters: the statistics would be those of the special tokens alone), or a text
            too long for ``memory_limit``; the message names its line (1-based).

    Warns:
        TruncationWarning: once, at the end, when texts were truncated, naming their lines in
            the corpus (the tokenizer's own warning would name a text by its place in its
            batch).
    """
    plan = _plan(model, texts, batch_size, batch_bytes, memory_limit)
    yield from _batches(model, texts, plan, plan.spans, progress)


@dataclass
class _Plan:
    """Which consecutive texts share each forward, and which texts the model truncates (known
    when every text was tokenized first: with a memory limit to plan for)."""

    spans: list[tuple[int, int]]  # (start, stop) of each batch
    truncated: list[int] | None  # 1-based lines; None: not known before the batches run


def _plan(
    model: TextModel,
    texts: Sequence[str],
    batch_size: int,
    batch_bytes: BatchBytes | None,
    memory_limit: int,
) -> _Plan:
    """The batches: ``batch_size`` consecutive texts, or with ``batch_bytes`` at most that many
    fitting ``memory_limit`` (every text tokenized first, checked, its length learned). The same
    on every rank: a text it refuses is refused by every rank before any forward."""
    limit = check_memory_limit("memory_limit", memory_limit)
    if batch_bytes is None:
        spans = [(s, min(s + batch_size, len(texts))) for s in range(0, len(texts), batch_size)]
        return _Plan(spans, None)
    lengths: list[int] = []
    truncated: list[int] = []
    for start in range(0, len(texts), batch_size):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)  # said once, after the batches
            batch = model.tokenize(list(texts[start : start + batch_size]))
        _check_words(batch, texts, start)
        lengths += [int(n) for n in batch.attention_mask.sum(1).tolist()]
        truncated += [start + i + 1 for i, cut in enumerate(batch.truncated) if cut]
    spans = []
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
        spans.append((start, stop))
        start = stop
    return _Plan(spans, truncated)


def _batches(
    model: TextModel,
    texts: Sequence[str],
    plan: _Plan,
    spans: Sequence[tuple[int, int]],
    progress: Progress | None,
) -> Iterator[TokenBatch]:
    """The batches of ``spans`` (those of ``plan`` this rank runs), tokenized, in order;
    ``progress`` told ``(texts done, texts in spans)``; then the one truncation warning, naming
    every truncated text of the plan (known beforehand), or of these batches."""
    total = sum(stop - start for start, stop in spans)
    done = 0
    truncated: list[int] = []  # 1-based lines
    for start, stop in spans:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batch = model.tokenize(list(texts[start:stop]))
        _check_words(batch, texts, start)
        for w in caught:
            if not issubclass(w.category, TruncationWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        truncated += [start + i + 1 for i, cut in enumerate(batch.truncated) if cut]
        yield batch
        done += stop - start
        if progress is not None:
            progress(done, total)
    if plan.truncated is not None:
        truncated = plan.truncated
    if truncated:
        warnings.warn(
            f"{len(truncated)} of {len(texts)} texts are longer than the model takes and were "
            f"truncated (lines {truncated[:10]}{', ...' if len(truncated) > 10 else ''})",
            TruncationWarning,
            stacklevel=2,
        )


def _check_words(batch: TokenBatch, texts: Sequence[str], start: int) -> None:
    """Refuse a text of ``batch`` (texts from ``start``) whose tokens are all special."""
    for i, ids in enumerate(batch.word_ids):
        if all(w is None for w in ids):
            n = start + i
            raise ValueError(
                f"texts[{n}] (line {n + 1}) holds no word the tokenizer keeps, got "
                f"{texts[n][:40]!r} (only zero-width or control characters?): its statistics "
                f"would be those of {' '.join(batch.tokens[i]) or 'no token'} alone"
            )


def corpus_statistics(
    model: TextModel,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    progress: Progress | None = None,
    group: Any = None,
) -> HeadStatistics:
    """What each head does over many texts: each metric is the mean over texts of that text's
    :func:`~multihead.observe.statistics.head_statistics` value
    (:func:`~multihead.observe.corpus.statistics_over_batches` says exactly what is averaged).

    Data parallel: under ``torch.distributed`` (as under ``torchrun``; or over ``group``) every
    rank calls this with the same texts, runs every ``world``-th batch of them (each text on
    one rank), and gets the statistics one process would (see
    :class:`~multihead.distributed.DataParallelGroup`: a model sharded over the ranks runs
    every batch on every rank instead).

    Args:
        model: a :class:`~multihead.text.model.TextModel`.
        texts: N non-empty texts.
        batch_size: texts per forward pass (memory grows with it; the result does not change).
        layers, heads: which to summarise (as for :func:`~multihead.observe.capture`).
        chunk_size: query rows per step inside each forward.
        memory_limit: bytes one batch may hold (estimated from its shapes:
            :func:`~multihead.observe.corpus.statistics_batch_bytes`); batches of long texts
            hold fewer texts (see :func:`text_batches`).
        progress: told ``(texts done, texts in all)`` after each batch (under data parallelism,
            this rank's texts).
        group: the ``torch.distributed`` process group to share the texts over; default every
            rank when ``torch.distributed`` is initialised, else this process alone.

    Returns:
        A :class:`~multihead.observe.HeadStatistics` whose metrics are (L', H') means over the
        texts; ``most_attended``/``most_attended_weight`` are (N, L', H'), per text;
        ``num_queries`` counts every real token of the corpus; ``tokens`` holds each text's
        tokens.

    Raises:
        TypeError, ValueError: ``model`` not a TextModel; bad ``texts`` (naming the line: also a
            text with no word the tokenizer keeps, or one too long for ``memory_limit``),
            ``batch_size``, ``chunk_size``, indices; under data parallelism on every rank.
    """
    model = _check_model(model)
    items = check_texts("texts", texts)
    check_positive_int("batch_size", batch_size)
    split = DataParallelGroup.of(group, model)
    batch_bytes = statistics_batch_bytes(model, layers, heads, chunk_size)
    plan = _plan(model, items, batch_size, batch_bytes, memory_limit)
    spans = split.share(plan.spans)
    return statistics_over_batches(
        model,
        _batches(model, items, plan, spans, progress),
        layers=layers,
        heads=heads,
        chunk_size=chunk_size,
        split=split,
        positions=[i for start, stop in spans for i in range(start, stop)],
    )


def head_distances(
    model: TextModel,
    texts: Sequence[str],
    *,
    batch_size: int = 32,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    progress: Progress | None = None,
    group: Any = None,
) -> HeadMap:
    """The mean Jensen–Shannon distance between every pair of heads over a corpus, and its map
    (:func:`~multihead.observe.head_distance.head_distances_over_batches`).

    Data parallel as :func:`corpus_statistics`: under ``torch.distributed`` (or over ``group``)
    each rank runs every ``world``-th batch and every rank gets the map of the whole corpus.

    Args:
        model: a :class:`~multihead.text.model.TextModel`.
        texts: the corpus, non-empty texts.
        batch_size: texts per forward pass (the result does not depend on it).
        layers, heads: which heads to compare (as for ``capture``).
        memory_limit: bytes one batch may hold: its weights (L', B, H', T, T) float32 and the
            real queries' copy of them (:func:`~multihead.observe.head_distance.
            distances_batch_bytes`); batches of long texts hold fewer texts.
        progress: told ``(texts done, texts in all)`` after each batch (under data parallelism,
            this rank's texts).
        group: the ``torch.distributed`` process group to share the texts over; default every
            rank when ``torch.distributed`` is initialised, else this process alone.

    Returns:
        A :class:`~multihead.observe.head_distance.HeadMap`.

    Raises:
        TypeError, ValueError: ``model`` not a TextModel; bad ``texts`` (naming the line: also a
            text with no word the tokenizer keeps, or one too long for ``memory_limit`` on its
            own), ``batch_size``, indices; under data parallelism on every rank.
    """
    model = _check_model(model)
    items = check_texts("texts", texts)
    check_positive_int("batch_size", batch_size)
    split = DataParallelGroup.of(group, model)
    batch_bytes = distances_batch_bytes(model, layers, heads)
    plan = _plan(model, items, batch_size, batch_bytes, memory_limit)
    batches = _batches(model, items, plan, split.share(plan.spans), progress)
    return head_distances_over_batches(model, batches, layers=layers, heads=heads, split=split)
