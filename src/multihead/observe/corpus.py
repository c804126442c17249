"""Head statistics over a corpus: many texts in token batches, each text weighing the same.

:func:`statistics_over_batches` runs :func:`~multihead.observe.statistics.head_statistics`' forward
on each batch (chunked as always: no head's (T, T) matrix is held) and averages each metric over
the texts. The batches come from above, already tokenized (any object with ``input_ids``,
``attention_mask`` and, optionally, ``token_type_ids``, ``special_mask`` and ``tokens``, such as a
:class:`~multihead.text.tokenization.TokenBatch`): this package reads no text.
:func:`multihead.text.corpus_statistics` is the loop over texts. With ``split`` (a
:class:`~multihead.distributed.DataParallelGroup`) each rank passes the batches of its own texts
and every rank gets the statistics of all of them.

Shapes: N texts, L' layers, H' heads, T a batch's padded length.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.mapping import attention_modules
from multihead.memory_budget import FLOAT32_BYTES
from multihead.observe.head_metrics import CHANCE, CHANCE_METRICS, METRICS
from multihead.observe.head_summary import HeadStatistics, split_chance
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
    a chunk's weights (B, H', chunk_size, T) float32 and their working copies, every chunk's
    earlier-occurrence keys (B, T, T) (kept for the layers that follow) and the per-text sums
    (checks ``layers`` and ``heads`` as :func:`chosen_size` does)."""
    check_positive_int("chunk_size", chunk_size)
    num_layers, num_heads = chosen_size(model, layers, heads)

    def batch_bytes(b: int, t: int) -> int:
        rows = min(chunk_size, t)  # a chunk's weights, ~4 working copies, its (B, R, S) masks
        per_token = 4 * num_heads * rows + 8 * rows + t + 2 * num_layers * num_heads
        return FLOAT32_BYTES * b * t * per_token  # the last: float64 sums per key (L', B, H', T)

    return batch_bytes


def statistics_over_batches(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    chunk_size: int = 128,
    split: DataParallelGroup | None = None,
    positions: Sequence[int] | None = None,
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
            forward each; at least one (over all ranks, with ``split``).
        layers, heads: which to summarise (as for :func:`~multihead.observe.capture`).
        chunk_size: query rows per step inside each forward.
        split: the ranks the texts were shared out over
            (:class:`~multihead.distributed.DataParallelGroup`): each rank passes the batches
            of its own texts, every rank calls this, and every rank gets the statistics of all
            of them (the sums meet in one all-reduce). None: these batches are all.
        positions: each text's place in the corpus, in the order the batches hold them
            (``most_attended`` and ``tokens`` are in corpus order); with ``split``, this rank's
            texts', all ranks' together 0..N-1 once each. Default: the order they come in (rank
            after rank with ``split``).

    Returns:
        A :class:`HeadStatistics` whose metrics are (L', H') means over the texts;
        ``most_attended``/``most_attended_weight`` are (N, L', H'), per text as for one batch
        (positions index each text's tokens); ``num_queries`` counts every real token;
        ``tokens`` holds each text's tokens when the batches carry them.

    Raises:
        ValueError: no batch; indices out of range; ``positions`` not one place per text, or
            (over all ranks) not each place once. With ``split``, an error on any rank is
            raised on every rank.
    """
    check_positive_int("chunk_size", chunk_size)
    split = DataParallelGroup.single() if split is None else split
    part: _Part | None = None
    error: Exception | None = None
    places: list[int] | None = None
    try:
        part = _statistics_part(model, batches, layers, heads, chunk_size)
        if positions is not None and len(positions) != part.count:
            raise ValueError(
                f"positions must give one place per text of the batches ({part.count}), got "
                f"{len(positions)}"
            )
        places = None if positions is None else [int(p) for p in positions]
    except Exception as e:  # every rank must hear of it before the all-reduce
        error = e
    # what is not a sum travels in the one all-gather that tells every rank of any error
    reports = split.gather((part, places), error)
    assert part is not None
    parts: list[_Part] = [report[0] for report in reports]
    counts = [p.count for p in parts]
    if not sum(counts):
        raise ValueError("batches must hold at least one batch, got none")
    first = next(p for p in parts if p.count)
    chosen, head_ids = first.layers, first.heads
    order = _corpus_order([report[1] for report in reports], counts)
    n = sum(counts)
    # one all-reduce: the sums over each rank's texts (fixed names: a rank may have none)
    names = [*METRICS, *(CHANCE + m for m in CHANCE_METRICS)]
    table = torch.zeros(2 * len(names), len(chosen), len(head_ids), dtype=torch.float64)
    if part.count:
        table[: len(names)] = torch.stack([part.sums[k] for k in names])
        table[len(names) :] = torch.stack([part.known[k] for k in names]).double()
    totals = split.sum(torch.cat([table.flatten(), table.new_tensor([part.num_queries])]))
    table = totals[:-1].view(table.shape)
    sums, known = table[: len(names)], table[len(names) :]
    means, chance = split_chance(
        {
            name: (sums[i] / known[i].clamp(min=1)).masked_fill(known[i] == 0, math.nan).float()
            for i, name in enumerate(names)
        }
    )
    top_pos = torch.zeros(n, len(chosen), len(head_ids), dtype=torch.long)
    top_weight = torch.zeros(n, len(chosen), len(head_ids))
    tokens: list[list[str]] = [[] for _ in range(n)]
    for rank_part, places in zip(parts, order, strict=True):
        if rank_part.count:
            where = torch.tensor(places, dtype=torch.long)
            top_pos[where] = rank_part.top_pos
            top_weight[where] = rank_part.top_weight
        for place, text_tokens in zip(places, rank_part.tokens, strict=True):
            tokens[place] = text_tokens
    return HeadStatistics(
        layers=chosen,
        heads=head_ids,
        chance=chance,
        **means,
        most_attended=top_pos,
        most_attended_weight=top_weight,
        num_queries=int(totals[-1]),
        tokens=tokens if any(tokens) else None,
    )


@dataclass
class _Part:
    """One rank's share of the corpus statistics: sums over its texts."""

    sums: dict[str, Tensor]  # metric -> (L', H') float64 sum over texts where known
    known: dict[str, Tensor]  # metric -> (L', H') how many texts were summed
    top_pos: Tensor  # (n, L', H') per text
    top_weight: Tensor
    tokens: list[list[str]]
    num_queries: int
    layers: list[int]
    heads: list[int]

    @property
    def count(self) -> int:
        return int(self.top_pos.shape[0])


def _statistics_part(
    model: nn.Module,
    batches: Iterable[Any],
    layers: int | Sequence[int] | None,
    heads: int | Sequence[int] | None,
    chunk_size: int,
) -> _Part:
    """The sums of :func:`statistics_over_batches` over these batches (none: empty sums)."""
    sums: dict[str, Tensor] = {}
    known: dict[str, Tensor] = {}
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
        per_text = acc.per_sequence_means()  # metric -> (B, L', H')
        values = torch.stack(list(per_text.values()))  # (M, B, L', H')
        seen = ~values.isnan()
        batch_sums, batch_known = values.nan_to_num(nan=0.0).sum(1), seen.sum(1)
        for i, name in enumerate(per_text):
            sums[name] = sums.get(name, 0) + batch_sums[i]
            known[name] = known.get(name, 0) + batch_known[i]
        pos, weight = acc.most_attended()
        top_pos.append(pos)
        top_weight.append(weight)
        tokens.extend(batch_tokens or [[] for _ in range(pos.shape[0])])
        num_queries += int(acc.counts["all"].item())
    if not top_pos:
        return _Part({}, {}, torch.zeros(0, dtype=torch.long), torch.zeros(0), [], 0, [], [])
    return _Part(
        sums, known, torch.cat(top_pos), torch.cat(top_weight), tokens, num_queries, chosen,
        head_ids,
    )  # fmt: skip


def _corpus_order(places: list[list[int] | None], counts: list[int]) -> list[list[int]]:
    """Per rank, the corpus place of each of its texts: as given, or rank after rank.

    Raises:
        ValueError: places given by some ranks only, or not each of 0..N-1 once.
    """
    if all(p is None for p in places):
        starts = [sum(counts[:r]) for r in range(len(counts))]
        return [list(range(s, s + c)) for s, c in zip(starts, counts, strict=True)]
    if any(p is None for p in places):
        raise ValueError("positions must be given by every rank or by none")
    given = [p for p in places if p is not None]
    flat = sorted(i for p in given for i in p)
    if flat != list(range(len(flat))):
        raise ValueError(
            f"positions must name each text's place in the corpus once, 0..{len(flat) - 1}, "
            f"got {flat[:10]}{' ...' if len(flat) > 10 else ''}"
        )
    return given
