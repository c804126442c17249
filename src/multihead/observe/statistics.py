"""Head statistics: what each head does, summarised in one forward pass.

:func:`head_statistics` summarises each head (entropy, identity, previous/next-token scores,
mass on special tokens, induction and duplicate-token scores, Clark et al.'s [CLS]/[SEP]/
punctuation measures, most-attended token), computing the weights a chunk of query rows at a
time inside the forward so that no head's full (T, S) matrix is ever held. The metrics and their
running sums live in :mod:`multihead.observe.head_metrics`.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int
from multihead.observe.head_metrics import (
    BROAD,
    BROAD_BELOW,
    ID_METRICS,
    METRICS,
    ROLES,
    StatsAccumulator,
)
from multihead.observe.rows import attention_modules, observe_rows

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["head_statistics", "HeadStatistics", "METRICS"]

# metric -> table column ("-" where a metric is unknown for the inputs)
_COLUMNS = {
    "entropy": "entropy",
    "identity": "self",
    "previous_token": "prev",
    "next_token": "next",
    "special": "special",
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
      of punctuation characters;
    - ``sep_to_sep``: over [SEP] queries, the weight on [SEP];
    - ``cls_entropy``: the entropy of [CLS]'s row, in nats.

    Attributes:
        layers: the layer indices (L') the rows of each table refer to.
        heads: the head indices (H').
        entropy, identity, previous_token, next_token, special, induction, duplicate_token,
            to_cls, to_sep, to_punctuation, sep_to_sep, cls_entropy: (L', H') float32 (the
            names of :data:`METRICS`).
        most_attended: (B, L', H') int64, per sequence the key position with the largest mean
            weight.
        most_attended_weight: (B, L', H') that mean weight.
        num_queries: the number of (real) queries averaged over.
        tokens: the tokens of each sequence, when known, to label positions.
    """

    layers: list[int]
    heads: list[int]
    entropy: Tensor
    identity: Tensor
    previous_token: Tensor
    next_token: Tensor
    special: Tensor
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
        """
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
        for slot, w in enumerate(per_layer):
            for start in range(0, t, step):
                rows = torch.arange(start, min(start + step, t), device=w.device)
                acc.add(slot, rows, w[:, :, start : start + step], t)
        return _result(
            acc,
            list(layers) if layers is not None else list(range(len(per_layer))),
            list(heads) if heads is not None else list(range(h)),
            tokens,
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
        ROLES` label whose metric is largest ("self", "previous token", "next token", "[CLS]",
        "[SEP]", "punctuation", "induction", "duplicate token"), or "broad" when none reaches
        ``BROAD_BELOW`` (0.3: the head spreads its weight). Unknown (NaN) metrics don't compete.
        """
        scores = torch.stack([getattr(self, m) for m in ROLES.values()])  # (R, L', H')
        best, which = scores.nan_to_num(nan=-1.0).max(dim=0)
        labels = list(ROLES)
        return [
            [
                labels[int(k)] if float(v) >= BROAD_BELOW else BROAD
                for v, k in zip(vr, kr, strict=True)
            ]
            for vr, kr in zip(best, which, strict=True)
        ]

    def to_dict(self, batch_index: int = 0) -> dict[str, Any]:
        """Plain lists (JSON-ready): metrics (L', H') and, for one sequence, the most-attended."""
        out: dict[str, Any] = {"layers": self.layers, "heads": self.heads}
        for name in METRICS:  # NaN (unknown) as None: JSON has no NaN
            out[name] = [
                [None if x != x else round(float(x), 4) for x in row.tolist()]
                for row in getattr(self, name)
            ]
        out["role"] = self.roles()
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
    return _result(acc, chosen, head_ids, tokens)


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
    need them per sequence, as :func:`multihead.observe.corpus.corpus_statistics` does).

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
    with observe_rows(
        model,
        layers=layers,
        heads=heads,
        rows=None,
        chunk_size=chunk_size,
        consume=acc.add,
    ):
        with torch.no_grad():
            run()
    if not bool(acc.slot_counts.gt(0).all()) and bool(acc.valid.any()):
        raise ValueError("some chosen attention layers were not called by the model's forward")
    return acc, chosen, head_ids if head_ids is not None else list(range(h)), tokens


def _result(
    acc: StatsAccumulator, layers: list[int], heads: list[int], tokens: list[list[str]] | None
) -> HeadStatistics:
    top_pos, top_weight = acc.most_attended()
    return HeadStatistics(
        layers=layers,
        heads=heads,
        **acc.means(),
        most_attended=top_pos,
        most_attended_weight=top_weight,
        num_queries=int(acc.counts["all"].item()),
        tokens=tokens,
    )
