"""Head statistics: what each head does, summarised in one forward pass.

:func:`head_statistics` summarises each head (entropy, identity, previous/next-token scores,
mass on special tokens, most-attended token), computing the weights a chunk of query rows at a
time inside the forward so that no head's full (T, S) matrix is ever held.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_positive_int
from multihead.observe.rows import attention_modules, observe_rows

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["head_statistics", "HeadStatistics", "METRICS"]

# name -> what it measures; the metrics of HeadStatistics, in table order.
METRICS: dict[str, str] = {
    "entropy": "entropy of a query's weights, nats (mean over queries)",
    "identity": "weight on the query's own position",
    "previous_token": "weight on the position just before the query",
    "next_token": "weight on the position just after the query",
    "special": "weight on special tokens ([CLS], [SEP])",
}


@dataclass
class HeadStatistics:
    """What each head does, averaged over the real (non-padding) query tokens.

    Every score is a mean over queries of the weight a query puts somewhere, so it lies in [0, 1]:
    a pure identity head has ``identity`` 1, a head that always reads the token before has
    ``previous_token`` 1 (the first token, which has none, is left out of that mean; likewise the
    last for ``next_token``). ``entropy`` is in nats: 0 for a head that reads one key, log(S) for a
    uniform one.

    Attributes:
        layers: the layer indices (L') the rows of each table refer to.
        heads: the head indices (H').
        entropy, identity, previous_token, next_token, special: (L', H') float32.
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
        chunk_size: int | None = None,
    ) -> HeadStatistics:
        """Statistics of weights already computed.

        Args:
            weights: (L, B, H, T, T) or a sequence of L tensors (B, H, T, T) (self-attention).
            valid_mask: (B, T) bool, True at real tokens; padding queries are left out.
            special_mask: (B, T) bool, True at special tokens ([CLS], [SEP]).
            layers, heads: the indices to label rows and columns with (default 0..L-1, 0..H-1).
            tokens: per sequence, to label positions in the table.
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
        acc = _StatsAccumulator(len(per_layer), h, b, t, first.device, valid_mask, special_mask)
        step = chunk_size or t
        for slot, w in enumerate(per_layer):
            for start in range(0, t, step):
                rows = torch.arange(start, min(start + step, t), device=w.device)
                acc.add(slot, rows, w[:, :, start : start + step], t)
        return acc.result(
            list(layers) if layers is not None else list(range(len(per_layer))),
            list(heads) if heads is not None else list(range(h)),
            tokens,
        )

    def top(self, metric: str, k: int = 3) -> list[tuple[int, int, float]]:
        """The k heads scoring highest on ``metric``, as (layer, head, score)."""
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
        values: Tensor = getattr(self, metric)
        order = values.flatten().argsort(descending=True)[:k]
        n = values.shape[1]
        return [
            (self.layers[int(i) // n], self.heads[int(i) % n], float(values.flatten()[i]))
            for i in order
        ]

    def to_dict(self, batch_index: int = 0) -> dict[str, Any]:
        """Plain lists (JSON-ready): metrics (L', H') and, for one sequence, the most-attended."""
        out: dict[str, Any] = {"layers": self.layers, "heads": self.heads}
        for name in METRICS:
            out[name] = [[round(float(x), 4) for x in row] for row in getattr(self, name)]
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
        for col in ("layer", "head", "entropy", "identity", "prev", "next", "special", "top"):
            table.add_column(col, justify="left" if col == "top" else "right")
        rows = [(i, j) for i in range(len(self.layers)) for j in range(len(self.heads))]
        if sort_by is not None:
            if sort_by not in METRICS:
                raise ValueError(f"sort_by must be one of {', '.join(METRICS)}, got {sort_by!r}")
            values = getattr(self, sort_by)
            rows.sort(key=lambda ij: -float(values[ij]))
        toks = self.tokens[batch_index] if self.tokens is not None else None
        for i, j in rows:
            pos = int(self.most_attended[batch_index, i, j])
            label = toks[pos] if toks is not None and pos < len(toks) else f"#{pos}"
            table.add_row(
                str(self.layers[i]),
                str(self.heads[j]),
                f"{float(self.entropy[i, j]):.2f}",
                f"{float(self.identity[i, j]):.2f}",
                f"{float(self.previous_token[i, j]):.2f}",
                f"{float(self.next_token[i, j]):.2f}",
                f"{float(self.special[i, j]):.2f}",
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
        Console(file=buffer, width=100, color_system=None).print(self.table())
        return buffer.getvalue()


class _StatsAccumulator:
    """Running sums of the head statistics, fed one chunk of query rows at a time."""

    def __init__(
        self,
        num_slots: int,
        num_heads: int,
        batch: int,
        length: int,
        device: torch.device,
        valid_mask: Tensor | None,
        special_mask: Tensor | None,
    ) -> None:
        for name, m in (("valid_mask", valid_mask), ("special_mask", special_mask)):
            if m is None:
                continue
            if not isinstance(m, Tensor) or m.dtype != torch.bool:
                raise TypeError(f"{name} must be a bool tensor (B, T) or None, got {m!r:.80}")
            if tuple(m.shape) != (batch, length):
                raise ValueError(
                    f"{name} must have shape (B, T) = ({batch}, {length}), got {tuple(m.shape)}"
                )
        self.valid = (
            valid_mask.to(device)
            if valid_mask is not None
            else torch.ones(batch, length, dtype=torch.bool, device=device)
        )  # (B, T)
        special = special_mask.to(device) if special_mask is not None else None
        self.special = (
            special & self.valid if special is not None else torch.zeros_like(self.valid)
        )  # (B, S)
        self.shape = (batch, length)
        z = torch.zeros(num_slots, num_heads, dtype=torch.float64, device=device)
        self.sums = {name: z.clone() for name in METRICS}
        self.prev_count = torch.zeros((), dtype=torch.float64, device=device)
        self.next_count = torch.zeros((), dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.float64, device=device)
        # (slot, B, H, S): summed weight each key receives from real queries
        self.received = torch.zeros(
            num_slots, batch, num_heads, length, dtype=torch.float64, device=device
        )
        self.slot_counts = torch.zeros(num_slots, dtype=torch.float64, device=device)

    def add(self, slot: int, rows: Tensor, w: Tensor, t: int) -> None:
        """Fold in weights (B, H', R, S) of query rows ``rows`` (R,) of a (T, S) problem."""
        b, h, r, s = w.shape
        if (b, t) != self.shape or s != t:
            raise ValueError(
                f"head statistics need self-attention over the (B, T) = {self.shape} tokens they "
                f"were given, got weights for B={b}, T={t}, S={s}; choose self-attention layers "
                f"with layers="
            )
        # float32 per chunk (float64 would double the chunk's memory); sums accumulate in float64
        w = w.to(torch.promote_types(w.dtype, torch.float32))
        vq = self.valid[:, rows].to(w.dtype)  # (B, R)
        valid_k = self.valid.to(w.dtype)  # (B, S)
        per_query = {
            "entropy": -torch.special.xlogy(w, w).sum(-1),  # (B, H, R)
            "special": (w * self.special[:, None, None, :].to(w.dtype)).sum(-1),
        }
        own = rows.view(1, 1, r, 1).expand(b, h, r, 1)
        per_query["identity"] = w.gather(-1, own).squeeze(-1)
        # previous/next: only queries that have a real neighbour there count
        prev_pos, next_pos = rows - 1, rows + 1
        has_prev = (prev_pos >= 0)[None, :] & valid_k[:, prev_pos.clamp(min=0)].bool()  # (B, R)
        has_next = (next_pos < s)[None, :] & valid_k[:, next_pos.clamp(max=s - 1)].bool()
        per_query["previous_token"] = w.gather(-1, (own - 1).clamp(min=0)).squeeze(-1)
        per_query["next_token"] = w.gather(-1, (own + 1).clamp(max=s - 1)).squeeze(-1)
        prev_w = vq * has_prev.to(w.dtype)  # (B, R)
        next_w = vq * has_next.to(w.dtype)
        weights_of = {"previous_token": prev_w, "next_token": next_w}
        for name, values in per_query.items():
            qw = weights_of.get(name, vq)
            self.sums[name][slot] += (values * qw[:, None, :]).sum(dim=(0, 2))
        if slot == 0:
            self.count += vq.sum()
            self.prev_count += prev_w.sum()
            self.next_count += next_w.sum()
        self.received[slot] += (w * vq[:, None, :, None]).sum(2)  # (B, H, S)
        self.slot_counts[slot] += vq.sum()

    def result(
        self, layers: list[int], heads: list[int], tokens: list[list[str]] | None
    ) -> HeadStatistics:
        def mean(name: str, count: Tensor) -> Tensor:
            return (self.sums[name] / count.clamp(min=1)).float().cpu()

        # Mean weight each key receives per sequence; padding keys can't be "most attended".
        per_seq = self.valid.sum(1).to(torch.float64).clamp(min=1)  # (B,)
        received = self.received / per_seq[None, :, None, None]  # (L', B, H, S)
        received = received.masked_fill(~self.valid[None, :, None, :], -1.0)
        top_weight, top_pos = received.max(dim=-1)  # (L', B, H)
        return HeadStatistics(
            layers=layers,
            heads=heads,
            entropy=mean("entropy", self.count),
            identity=mean("identity", self.count),
            previous_token=mean("previous_token", self.prev_count),
            next_token=mean("next_token", self.next_count),
            special=mean("special", self.count),
            most_attended=top_pos.transpose(0, 1).cpu(),
            most_attended_weight=top_weight.clamp(min=0).transpose(0, 1).float().cpu(),
            num_queries=int(self.count.item()),
            tokens=tokens,
        )


def head_statistics(
    model: nn.Module,
    inputs: Any,
    *,
    valid_mask: Tensor | None = None,
    special_mask: Tensor | None = None,
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
        layers, heads: which to summarise (as for :func:`capture`).
        chunk_size: query rows per step.
        **forward_kwargs: passed to the model when ``inputs`` is a tensor.

    Returns:
        A :class:`HeadStatistics` over the chosen layers and heads.
    """
    check_positive_int("chunk_size", chunk_size)
    tokens: list[list[str]] | None = None
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
        tokens = getattr(inputs, "tokens", None)

        def run() -> None:
            model(ids, **kwargs)

        b, t = ids.shape
    elif isinstance(inputs, Tensor):
        if valid_mask is None and forward_kwargs.get("key_mask") is not None:
            valid_mask = forward_kwargs["key_mask"]

        def run() -> None:
            model(inputs, **forward_kwargs)

        b, t = inputs.shape[0], inputs.shape[1]
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
    acc = _StatsAccumulator(len(chosen), h, b, t, device, valid_mask, special_mask)
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
    return acc.result(chosen, head_ids if head_ids is not None else list(range(h)), tokens)
