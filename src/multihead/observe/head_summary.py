"""HeadStatistics: what each head does, one (L', H') table per metric, and how to read it.

:class:`HeadStatistics` holds the means that :func:`~multihead.observe.statistics.head_statistics`
computes (or that :meth:`HeadStatistics.from_weights` computes from weights already at hand) and
reads them: the best heads for a metric (``top``), each head's role (``roles``), plain lists
(``to_dict``) and a rich table (``table``, ``str``). The metrics and their running sums live in
:mod:`multihead.observe.head_metrics`.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead.observe.head_metrics import (
    BROAD,
    BROAD_BELOW,
    BROAD_ENTROPY,
    CHANCE,
    ID_METRICS,
    METRICS,
    OTHER,
    ROLES,
    StatsAccumulator,
)

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["HeadStatistics", "split_chance"]


def split_chance(means: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """An accumulator's means split into the metrics and their chance levels (keys without the
    ``CHANCE`` prefix)."""
    metrics = {k: v for k, v in means.items() if not k.startswith(CHANCE)}
    chance = {k.removeprefix(CHANCE): v for k, v in means.items() if k.startswith(CHANCE)}
    return metrics, chance


# metric -> table column ("-" where a metric is unknown for the inputs)
_COLUMNS = {
    "entropy": "entropy",
    "identity": "self",
    "previous_token": "prev",
    "next_token": "next",
    "special": "special",
    "first_token": "first",
    "induction": "induct",
    "duplicate_token": "dup",
    "to_cls": "[CLS]",
    "to_sep": "[SEP]",
    "to_punctuation": "punct",
    "sep_to_sep": "sep>sep",
    "cls_entropy": "cls ent",
}


@dataclass
class HeadStatistics:
    """What each head does, averaged over the real (non-padding) query tokens.

    Every score is a mean over queries of the weight a query puts somewhere, so it lies in [0, 1]:
    a pure identity head has ``identity`` 1, a head that always reads the token before has
    ``previous_token`` 1 (the first token, which has none, is left out of that mean; likewise the
    last for ``next_token``). ``entropy`` is in nats: 0 for a head that reads one key, log(S) for a
    uniform one.

    ``first_token`` is the weight on each text's first real token, where a decoder parks the
    attention it has nowhere else to put (the attention sink: Xiao et al., "Efficient Streaming
    Language Models with Attention Sinks", 2023); texts whose first token is [CLS] are left out
    (``to_cls`` measures it), so it is NaN for BERT given its tokens.

    Token-identity metrics (need the token ids; NaN when they are unknown, e.g. when the model
    was run on embeddings, or when no query's token occurred earlier):

    - ``induction``: over queries whose token occurred earlier, the weight on the positions
      right after those earlier occurrences. A perfect induction head (… A B … A → B) scores 1,
      a previous-token head about 0.
    - ``duplicate_token``: over the same queries, the weight on the earlier occurrences.

    Clark et al., "What Does BERT Look At?" (2019), over real queries unless said otherwise
    (need the tokens, to tell [CLS], [SEP] and punctuation; NaN when unknown or, for the last
    two, when the batch holds no such query):

    - ``to_cls``, ``to_sep``, ``to_punctuation``: the weight on [CLS], on [SEP], on tokens made
      of punctuation characters, over the queries of texts that have such a token (a model
      without [CLS], as GPT-2, leaves ``to_cls`` NaN rather than 0);
    - ``sep_to_sep``: over [SEP] queries, the weight on [SEP];
    - ``cls_entropy``: the entropy of [CLS]'s row, in nats.

    Attributes:
        layers: the layer indices (L') the rows of each table refer to.
        heads: the head indices (H').
        entropy, identity, previous_token, next_token, special, first_token, induction,
            duplicate_token, to_cls, to_sep, to_punctuation, sep_to_sep, cls_entropy: (L', H')
            float32 (the names of :data:`METRICS`).
        most_attended: (B, L', H') int64, per sequence the key position with the largest mean
            weight.
        most_attended_weight: (B, L', H') that mean weight.
        num_queries: the number of (real) queries averaged over.
        tokens: the tokens of each sequence, when known, to label positions.
        chance: per role metric (the values of :data:`~multihead.observe.head_metrics.ROLES`)
            and for ``entropy``, (L', H') the score a head would get by spreading its weight
            evenly over the keys each query can see: 1/T-sized for a bidirectional model, far
            more for a causal model's early queries (the first sees only itself); the entropy's
            is the mean of log(keys seen). :meth:`roles` measures heads against it.
    """

    layers: list[int]
    heads: list[int]
    entropy: Tensor
    identity: Tensor
    previous_token: Tensor
    next_token: Tensor
    special: Tensor
    first_token: Tensor
    induction: Tensor
    duplicate_token: Tensor
    to_cls: Tensor
    to_sep: Tensor
    to_punctuation: Tensor
    sep_to_sep: Tensor
    cls_entropy: Tensor
    most_attended: Tensor
    most_attended_weight: Tensor
    num_queries: int
    tokens: list[list[str]] | None = None
    chance: dict[str, Tensor] | None = None

    @classmethod
    def from_weights(
        cls,
        weights: Tensor | Sequence[Tensor],
        *,
        valid_mask: Tensor | None = None,
        special_mask: Tensor | None = None,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        tokens: list[list[str]] | None = None,
        token_ids: Tensor | None = None,
        chunk_size: int | None = None,
        causal: bool = False,
    ) -> HeadStatistics:
        """Statistics of weights already computed.

        Args:
            weights: (L, B, H, T, T) or a sequence of L tensors (B, H, T, T) (self-attention).
            valid_mask: (B, T) bool, True at real tokens; padding queries are left out.
            special_mask: (B, T) bool, True at special tokens ([CLS], [SEP]).
            layers, heads: the indices to label rows and columns with (default 0..L-1, 0..H-1).
            tokens: per sequence, to label positions in the table and to find [CLS], [SEP] and
                punctuation (Clark et al.'s metrics are NaN without them).
            token_ids: (B, T) integer ids, for ``induction`` and ``duplicate_token`` (NaN
                without them).
            chunk_size: rows per step (bounds temporaries).
            causal: the weights are a causal model's (query i may see keys 0..i): for the chance
                levels (:attr:`chance`), which count the keys each query may see.
        """
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
        if isinstance(weights, Tensor):
            if weights.dim() != 5:
                raise ValueError(
                    f"weights must be (L, B, H, T, T) or a sequence of (B, H, T, T), got shape "
                    f"{tuple(weights.shape)}"
                )
            per_layer = list(weights.unbind(0))
        else:
            per_layer = list(weights)
        if not per_layer:
            raise ValueError("weights must hold at least one layer, got none")
        first = per_layer[0]
        for w in per_layer:
            if w.dim() != 4 or w.shape != first.shape or w.shape[-1] != w.shape[-2]:
                raise ValueError(
                    f"each layer's weights must be (B, H, T, T) with one shape for all layers, "
                    f"got {tuple(w.shape)} (first {tuple(first.shape)})"
                )
        b, h, t, _ = first.shape
        acc = StatsAccumulator(
            len(per_layer), h, b, t, first.device, valid_mask, special_mask, token_ids, tokens
        )
        step = chunk_size or t
        keys = torch.arange(t, device=first.device)
        dtype = functools.reduce(torch.promote_types, [w.dtype for w in per_layer], torch.float32)
        for start in range(0, t, step):
            rows = torch.arange(start, min(start + step, t), device=first.device)
            # every (real) key, or with causal the keys up to the query: (1, R, S)
            visible = (keys <= rows[:, None] if causal else keys >= 0).expand(len(rows), t)
            chunk = acc.chunk(rows, visible[None], dtype)  # the same for every layer
            for slot, w in enumerate(per_layer):
                acc.add_chunk(slot, w[:, :, start : start + step], t, chunk)
        return cls.from_accumulator(
            acc,
            list(layers) if layers is not None else list(range(len(per_layer))),
            list(heads) if heads is not None else list(range(h)),
            tokens,
        )

    @classmethod
    def from_accumulator(
        cls,
        acc: StatsAccumulator,
        layers: list[int],
        heads: list[int],
        tokens: list[list[str]] | None,
    ) -> HeadStatistics:
        """The statistics of an accumulator's running sums (its means over every query)."""
        top_pos, top_weight = acc.most_attended()
        metrics, chance = split_chance(acc.means())
        return cls(
            layers=layers,
            heads=heads,
            **metrics,
            most_attended=top_pos,
            most_attended_weight=top_weight,
            num_queries=int(acc.counts["all"].item()),
            tokens=tokens,
            chance=chance,
        )

    def top(self, metric: str, k: int = 3) -> list[tuple[int, int, float]]:
        """The k heads scoring highest on ``metric``, as (layer, head, score).

        Heads whose score is NaN come last.

        Raises:
            ValueError: an unknown metric, or one unknown for these inputs (all NaN: e.g.
                ``induction`` of a model run without token ids).
        """
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
        values: Tensor = getattr(self, metric)
        if bool(values.isnan().all()):
            need = "token ids" if metric in ID_METRICS else "tokens"
            raise ValueError(
                f"metric {metric!r} is NaN for every head: it needs the inputs' {need} "
                f"(and a query it applies to)"
            )
        order = values.flatten().nan_to_num(nan=-float("inf")).argsort(descending=True)[:k]
        n = values.shape[1]
        return [
            (self.layers[int(i) // n], self.heads[int(i) % n], float(values.flatten()[i]))
            for i in order
        ]

    def roles(self) -> list[list[str]]:
        """Each head's dominant role, (L', H') labels: the :data:`~multihead.observe.head_metrics.
        ROLES` label whose metric is largest above chance ("self", "previous token", "next
        token", "sink" (the first token), "[CLS]", "[SEP]", "punctuation", "induction",
        "duplicate token") when it reaches ``BROAD_BELOW`` (0.3); else "broad" when the head's
        entropy is at least ``BROAD_ENTROPY`` (half) of what an even spread over the keys each
        query can see has (the head spreads its weight), and "other" when it is sharper (it
        reads places no role names). Unknown (NaN) metrics don't compete.

        Above chance: a score s whose chance level is c (:attr:`chance`) counts as
        (s - c) / (1 - c), the share of the weight the even spread would not put there, so
        that a head reading every visible key alike is "broad" in a causal model too (its first
        queries see one or two keys). Without :attr:`chance`, the scores as they are, and every
        head no role reaches is "broad".
        """
        scores = torch.stack([self.above_chance(m) for m in ROLES.values()])  # (R, L', H')
        best, which = scores.nan_to_num(nan=-1.0).max(dim=0)
        spread = self.spread()
        labels = list(ROLES)
        return [
            [
                labels[int(k)]
                if float(v) >= BROAD_BELOW
                else (OTHER if float(e) < BROAD_ENTROPY else BROAD)
                for v, k, e in zip(vr, kr, er, strict=True)
            ]
            for vr, kr, er in zip(best, which, spread, strict=True)
        ]

    def spread(self) -> Tensor:
        """(L', H') the entropy as a share of the even spread's (its chance level: the mean of
        log(keys seen) over the queries): 1 for a head reading every visible key alike, 0 for
        one reading one key; 1 where the chance level is unknown or 0 (every query sees one
        key)."""
        c = self.chance.get("entropy") if self.chance is not None else None
        if c is None:
            return torch.ones_like(self.entropy)
        ratio = self.entropy / c.clamp(min=1e-6)
        return torch.where(c > 1e-6, ratio, torch.ones_like(ratio)).nan_to_num(nan=1.0)

    def above_chance(self, metric: str) -> Tensor:
        """(L', H') ``metric`` measured above its chance level: (s - c) / (1 - c) (see
        :meth:`roles`); the score itself where the chance level is unknown."""
        score: Tensor = getattr(self, metric)
        if self.chance is None or metric not in self.chance:
            return score
        c = self.chance[metric]
        return (score - c) / (1 - c).clamp(min=1e-6)

    def to_dict(self, batch_index: int = 0) -> dict[str, Any]:
        """Plain lists (JSON-ready): metrics (L', H') and, for one sequence, the most-attended."""
        out: dict[str, Any] = {"layers": self.layers, "heads": self.heads}
        for name in METRICS:  # NaN (unknown) as None: JSON has no NaN
            out[name] = [
                [None if x != x else round(float(x), 4) for x in row.tolist()]
                for row in getattr(self, name)
            ]
        out["role"] = self.roles()
        if self.chance is not None:  # what roles() measured the scores against
            out["chance"] = {
                name: [[None if x != x else round(float(x), 4) for x in row] for row in value]
                for name, value in self.chance.items()
            }
        out["most_attended"] = self.most_attended[batch_index].tolist()
        out["most_attended_weight"] = [
            [round(float(x), 4) for x in row] for row in self.most_attended_weight[batch_index]
        ]
        out["num_queries"] = self.num_queries
        return out

    def table(self, *, batch_index: int = 0, sort_by: str | None = None) -> Table:
        """A rich Table, one row per (layer, head).

        Needs rich: ``pip install 'multihead[viz]'``.
        """
        try:
            from rich.table import Table
        except ImportError as e:
            raise ImportError(
                "HeadStatistics.table needs rich: pip install 'multihead[viz]'"
            ) from e
        table = Table(title="Head statistics (mean over queries; entropy in nats)")
        for col in ("layer", "head", *_COLUMNS.values(), "role", "top"):
            table.add_column(col, justify="left" if col in ("role", "top") else "right")
        rows = [(i, j) for i in range(len(self.layers)) for j in range(len(self.heads))]
        if sort_by is not None:
            if sort_by not in METRICS:
                raise ValueError(f"sort_by must be one of {', '.join(METRICS)}, got {sort_by!r}")
            values = getattr(self, sort_by).nan_to_num(nan=-float("inf"))
            rows.sort(key=lambda ij: -float(values[ij]))
        toks = self.tokens[batch_index] if self.tokens is not None else None
        roles = self.roles()
        for i, j in rows:
            pos = int(self.most_attended[batch_index, i, j])
            label = toks[pos] if toks is not None and pos < len(toks) else f"#{pos}"
            cells = [getattr(self, m)[i, j] for m in _COLUMNS]
            table.add_row(
                str(self.layers[i]),
                str(self.heads[j]),
                *("-" if v != v else f"{float(v):.2f}" for v in cells),
                roles[i][j],
                f"{label} ({float(self.most_attended_weight[batch_index, i, j]):.2f})",
            )
        return table

    def __rich__(self) -> Table:
        return self.table()

    def __str__(self) -> str:
        try:
            from rich.console import Console
        except ImportError:
            return repr(self)
        buffer = io.StringIO()
        Console(file=buffer, width=170, color_system=None).print(self.table())
        return buffer.getvalue()
