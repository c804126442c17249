"""The metrics of :class:`~multihead.observe.statistics.HeadStatistics` and their running sums.

Shapes: B sequences, T query positions, S = T keys (self-attention), H' heads, R query rows of
one chunk, L' layers (slots). Every metric is a mean over a set of queries of a sum of weights
(or, for the entropies, of a function of one query's row), so the sums are folded in a chunk of
query rows at a time and no head's (T, S) matrix is ever held. What a chunk needs beside the
weights (which queries each metric counts, which keys each reads, the chance levels) is made once
per chunk (:class:`QueryChunk`) and shared by the layers, so that each layer's weights are folded
in a handful of batched operations for every head, query and text at once.

The token-identity metrics (``induction``, ``duplicate_token``) need the token ids; the
metrics of Clark et al., "What Does BERT Look At?" (2019) (``to_cls``, ``to_sep``,
``to_punctuation``, ``sep_to_sep``, ``cls_entropy``) need to know which tokens are [CLS], [SEP]
and punctuation, which is read from the token strings. Without them those metrics are NaN; they
are NaN too when no query qualifies (no repeated token, no [SEP] query, ...).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "METRICS",
    "ID_METRICS",
    "ROLE_METRICS",
    "ROLES",
    "CHANCE",
    "CHANCE_METRICS",
    "BROAD",
    "BROAD_BELOW",
    "BROAD_ENTROPY",
    "OTHER",
    "token_roles",
    "StatsAccumulator",
    "QueryChunk",
]

# name -> what it measures; the metrics of HeadStatistics, in table order.
METRICS: dict[str, str] = {
    "entropy": "entropy of a query's weights, nats (mean over queries)",
    "identity": "weight on the query's own position",
    "previous_token": "weight on the position just before the query",
    "next_token": "weight on the position just after the query",
    "special": "weight on special tokens ([CLS], [SEP])",
    "first_token": (
        "weight on the text's first real token: a decoder's attention sink (texts whose first "
        "token is [CLS] are left out: to_cls measures it)"
    ),
    "induction": (
        "weight on the position right after an earlier occurrence of the query's token "
        "(queries whose token occurred before; needs token ids)"
    ),
    "duplicate_token": (
        "weight on earlier occurrences of the query's token (queries whose token occurred "
        "before; needs token ids)"
    ),
    "to_cls": "weight on [CLS] (needs tokens)",
    "to_sep": "weight on [SEP] (needs tokens)",
    "to_punctuation": "weight on punctuation tokens (needs tokens)",
    "sep_to_sep": "weight of [SEP] queries on [SEP] (needs tokens)",
    "cls_entropy": "entropy of [CLS]'s row, nats (needs tokens)",
}
ID_METRICS = ("induction", "duplicate_token")
ROLE_METRICS = ("to_cls", "to_sep", "to_punctuation", "sep_to_sep", "cls_entropy")

# role label -> the metric that measures it, for a head's dominant role (HeadStatistics.roles).
# Each is the weight a query puts on one kind of place, so they compare on one scale.
ROLES: dict[str, str] = {
    "self": "identity",
    "previous token": "previous_token",
    "next token": "next_token",
    "sink": "first_token",
    "[CLS]": "to_cls",
    "[SEP]": "to_sep",
    "punctuation": "to_punctuation",
    "induction": "induction",
    "duplicate token": "duplicate_token",
}
# A head none of whose role scores reaches BROAD_BELOW is "broad" (Clark et al.'s broad heads)
# when its entropy is at least BROAD_ENTROPY of what an even spread over the visible keys has:
# it spreads its weight. A head as sharp as a role's but on places no role names is "other".
BROAD = "broad"
OTHER = "other"
BROAD_BELOW = 0.3
BROAD_ENTROPY = 0.5

CLS_TOKENS = frozenset({"[CLS]", "<s>"})
SEP_TOKENS = frozenset({"[SEP]", "</s>"})


def _is_punctuation(token: str) -> bool:
    # WordPiece continuations ("##.") are punctuation too; "[CLS]" is not (letters inside).
    text = token.removeprefix("##")
    return bool(text) and all(unicodedata.category(c).startswith("P") for c in text)


def token_roles(
    tokens: Sequence[Sequence[str]],
    batch: int,
    length: int,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Bool masks (B, T) of the [CLS], [SEP] and punctuation tokens.

    Args:
        tokens: per sequence its tokens from position 0 (padding after them may be left out).
        batch, length: B and T.
        device: where to build the masks (one copy from the host).

    Raises:
        ValueError: not B sequences, or a sequence longer than T.
    """
    if len(tokens) != batch or any(len(seq) > length for seq in tokens):
        lengths = [len(seq) for seq in tokens]
        raise ValueError(
            f"tokens must hold B={batch} sequences of at most T={length} tokens, got lengths "
            f"{lengths[:8]}"
        )
    # built in Python and copied once: one write per token would be one copy each on a GPU
    kinds = [[[False] * length for _ in range(batch)] for _ in range(3)]
    for i, seq in enumerate(tokens):
        for j, tok in enumerate(seq):
            kinds[0][i][j] = tok in CLS_TOKENS
            kinds[1][i][j] = tok in SEP_TOKENS
            kinds[2][i][j] = _is_punctuation(tok)
    masks = torch.tensor(kinds, dtype=torch.bool, device=device)  # (3, B, T)
    return masks[0], masks[1], masks[2]


def _check_mask(name: str, m: Tensor | None, batch: int, length: int) -> None:
    if m is None:
        return
    if not isinstance(m, Tensor) or m.dtype != torch.bool:
        raise TypeError(f"{name} must be a bool tensor (B, T) or None, got {m!r:.80}")
    if tuple(m.shape) != (batch, length):
        raise ValueError(
            f"{name} must have shape (B, T) = ({batch}, {length}), got {tuple(m.shape)}"
        )


# metric -> (the per-query value it averages, the queries it averages over). Values: a query's
# entropy; its weight on keys marked per text (special tokens; [CLS], [SEP] and punctuation, from
# the tokens), on its own, the previous and the next position, and on keys marked per query (the
# position after an earlier occurrence of its token, and those occurrences: from the token ids).
# Queries: "all" real queries, or those the metric applies to. The weight on [CLS], [SEP] or
# punctuation is unknown, not 0, for a text that has none (GPT-2 has no [CLS]).
_SOURCES: dict[str, tuple[str, str]] = {
    "entropy": ("entropy", "all"),
    "identity": ("self", "all"),
    "previous_token": ("previous", "prev"),
    "next_token": ("next", "next"),
    "special": ("special", "all"),
    "first_token": ("first", "has_first"),
    "induction": ("after", "repeat"),
    "duplicate_token": ("earlier", "repeat"),
    "to_cls": ("cls", "has_cls"),
    "to_sep": ("sep", "has_sep"),
    "to_punctuation": ("punctuation", "has_punctuation"),
    "sep_to_sep": ("sep", "sep"),
    "cls_entropy": ("entropy", "cls"),
}
_QUERY_KINDS = (
    "all",
    "has_first",
    "prev",
    "next",
    "repeat",
    "has_cls",
    "has_sep",
    "has_punctuation",
    "sep",
    "cls",
)
# The score of the same metric for a head that spreads its weight evenly over the keys each
# query can see (its chance level), kept as CHANCE + metric: a causal model's first query sees
# itself alone, so identity 1 there says nothing about the head. The entropy's is log(keys seen).
CHANCE = "chance_"
CHANCE_METRICS = ("entropy", *ROLES.values())
# Metrics that are NaN, not 0, when no query they apply to was seen.
_OPTIONAL = (*ID_METRICS, *ROLE_METRICS, "first_token")


def _base(name: str) -> str:
    return name.removeprefix(CHANCE)


@dataclass(frozen=True)
class QueryChunk:
    """What a chunk of R query rows brings whichever layer's weights are folded in: which
    queries each metric averages over, the keys each value reads, the chance levels.

    Built once per chunk by :meth:`StatsAccumulator.chunk` and shared by every layer whose calls
    see the same keys (the same mask and causality), so that a layer's weights cost a handful of
    batched operations (:meth:`StatsAccumulator.add_chunk`).

    Attributes:
        dtype: the dtype of the weights it is folded with (float32 at least).
        index: (1, 1, R, 3) int64, each query's own, previous and next position (clamped).
        key_masks: (B, S, K) the keys marked per text, as values (special, the first token,
            [CLS], [SEP], punctuation).
        earlier: (B, R, S) the keys marked per query, as values: the earlier occurrences of the
            query's token (the position after each is ``induction``'s), or None without token
            ids.
        queries: (B, 1, R, M) per metric the queries it averages over (1 or 0).
        chance: (B, M_c) float64, the chance level's sums per chance metric.
        counts: (B, Q) float64, the queries of each kind.
        real: (B, 1, 1, R) the real queries (1 or 0).
        num_real: () float64, how many.
    """

    dtype: torch.dtype
    index: Tensor
    key_masks: Tensor
    earlier: Tensor | None
    queries: Tensor
    chance: Tensor
    counts: Tensor
    real: Tensor
    num_real: Tensor


class StatsAccumulator:
    """Running sums of the head statistics, fed one chunk of query rows at a time.

    Args:
        num_slots, num_heads: L' and H'.
        batch, length: B and T.
        device: where the sums live.
        valid_mask: (B, T) bool, True at real tokens (default all).
        special_mask: (B, T) bool, True at [CLS]/[SEP].
        token_ids: (B, T) integer ids, for ``induction`` and ``duplicate_token`` (NaN without).
        tokens: per sequence its tokens, for the [CLS]/[SEP]/punctuation metrics (NaN without).
    """

    def __init__(
        self,
        num_slots: int,
        num_heads: int,
        batch: int,
        length: int,
        device: torch.device,
        valid_mask: Tensor | None,
        special_mask: Tensor | None,
        token_ids: Tensor | None = None,
        tokens: Sequence[Sequence[str]] | None = None,
    ) -> None:
        _check_mask("valid_mask", valid_mask, batch, length)
        _check_mask("special_mask", special_mask, batch, length)
        if token_ids is not None and (
            not isinstance(token_ids, Tensor)
            or token_ids.is_floating_point()
            or token_ids.is_complex()
            or tuple(token_ids.shape) != (batch, length)
        ):
            got = (
                f"{token_ids.dtype} of shape {tuple(token_ids.shape)}"
                if isinstance(token_ids, Tensor)
                else type(token_ids).__name__
            )
            raise ValueError(
                f"token_ids must be an integer tensor (B, T) = ({batch}, {length}), got {got}"
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
        self.ids = token_ids.to(device) if token_ids is not None else None  # (B, T)
        # each text's first real token (B, S): where a decoder parks its attention
        self.first = self.valid & (self.valid.cumsum(1) == 1)
        self.roles: dict[str, Tensor] | None = None
        if tokens is not None:
            cls, sep, punct = token_roles(tokens, batch, length, device)
            self.roles = {
                "cls": cls & self.valid,
                "sep": sep & self.valid,
                "punctuation": punct & self.valid,
            }
        self.shape = (batch, length)
        # The columns a chunk's values come in (QueryChunk, add_chunk) and the query kinds.
        self._values = ["entropy", "special", "first"]
        self._values += ["cls", "sep", "punctuation"] if self.roles is not None else []
        self._values += ["self", "previous", "next"]
        self._values += ["after", "earlier"] if self.ids is not None else []
        self._kinds = [k for k in _QUERY_KINDS if self._needs(k)]
        # The metrics these inputs can tell, and their chance levels (the rest are NaN).
        self.metrics = [m for m in METRICS if self._known(m)]
        self.chance_metrics = [m for m in CHANCE_METRICS if self._known(m)]
        columns = [self._values.index(_SOURCES[m][0]) for m in self.metrics]
        self._value_columns = torch.tensor(columns, dtype=torch.long, device=device)
        self._metric_kinds = torch.tensor(
            [self._kinds.index(_SOURCES[m][1]) for m in self.metrics], device=device
        )
        self._chance_columns = torch.tensor(
            [self._values.index(_SOURCES[m][0]) for m in self.chance_metrics],
            dtype=torch.long,
            device=device,
        )
        self._chance_kinds = torch.tensor(
            [self._kinds.index(_SOURCES[m][1]) for m in self.chance_metrics], device=device
        )

        # Kept per sequence, so that a corpus can weight each text equally (per_sequence_means).
        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        self.seq_sums = zeros(num_slots, batch, num_heads, len(self.metrics))
        # chance levels: the same for every head
        self.chance_sums = zeros(num_slots, batch, len(self.chance_metrics))
        # (B, kinds): the queries of each kind (counted once: every slot sees the same rows)
        self.seq_counts = zeros(batch, len(self._kinds))
        # (slot, B, H, S): summed weight each key receives from real queries
        self.received = zeros(num_slots, batch, num_heads, length)
        self.slot_counts = zeros(num_slots)

    def _needs(self, kind: str) -> bool:
        if kind == "repeat":
            return self.ids is not None
        return kind in ("all", "has_first", "prev", "next") or self.roles is not None

    def chunk(self, rows: Tensor, visible: Tensor, dtype: torch.dtype) -> QueryChunk:
        """What query rows ``rows`` (R,) of the (T, S) problem bring to every layer whose
        queries may attend to the keys ``visible`` (B or 1, R, S) bool, for weights of
        ``dtype`` (float32 at least)."""
        b, s = self.shape
        r = rows.shape[0]
        valid = self.valid
        vq = valid[:, rows].to(dtype)  # (B, R)
        prev_pos, next_pos = rows - 1, rows + 1
        prev_at, next_at = prev_pos.clamp(min=0), next_pos.clamp(max=s - 1)
        # previous/next: only queries that have a real neighbour there count
        has_prev = (prev_pos >= 0)[None, :] & valid[:, prev_at]  # (B, R)
        has_next = (next_pos < s)[None, :] & valid[:, next_at]
        kinds = {"all": vq, "prev": vq * has_prev.to(dtype), "next": vq * has_next.to(dtype)}
        # the first token's weight: texts whose first token is not [CLS] (to_cls measures it)
        cls_first = (
            (self.roles["cls"] & self.first).any(1, keepdim=True)
            if self.roles is not None
            else torch.zeros(b, 1, dtype=torch.bool, device=valid.device)
        )  # (B, 1)
        kinds["has_first"] = vq * (~cls_first).to(dtype)
        keys = [self.special, self.first]  # (B, S) each
        earlier_keys = None
        if self.ids is not None:
            positions = torch.arange(s, device=rows.device)
            earlier = self.ids[:, None, :] == self.ids[:, rows, None]  # (B, R, S): same token
            earlier &= (positions[None, :] < rows[:, None])[None] & valid[:, None, :]
            # the position right after each earlier occurrence (at most the query itself)
            after = F.pad(earlier[..., :-1], (1, 0))  # (B, R, S)
            earlier_keys = earlier.to(dtype)
            kinds["repeat"] = vq * earlier.any(-1).to(dtype)  # the token occurred before
        if self.roles is not None:
            for kind in ("cls", "sep", "punctuation"):
                keys.append(self.roles[kind])
                # texts with such a token
                kinds[f"has_{kind}"] = vq * self.roles[kind].any(1, keepdim=True).to(dtype)
            kinds["sep"] = self.roles["sep"][:, rows].to(dtype)
            kinds["cls"] = self.roles["cls"][:, rows].to(dtype)
        key_masks = torch.stack(keys, -1).to(dtype)  # (B, S, K)
        queries = torch.stack([kinds[k] for k in self._kinds], -1)  # (B, R, Q)
        index = torch.stack([rows, prev_at, next_at], -1).view(1, 1, r, 3)
        # a head reading evenly the real keys each query may see is the chance level
        seen = visible.to(rows.device) & valid[:, None, :]  # (B, R, S)
        n_seen = seen.sum(-1, keepdim=True).clamp(min=1).to(dtype)  # (B, R, 1)
        even = seen.to(dtype) / n_seen
        # its entropy is log(keys seen); then the values of the even spread, column by column
        parts = [
            n_seen.log(),
            torch.bmm(even, key_masks),
            even.gather(-1, index[0].expand(b, r, 3)),
        ]
        if earlier_keys is not None:
            parts += [(even * after).sum(-1, keepdim=True), (even * earlier).sum(-1, keepdim=True)]
        chance_values = torch.cat(parts, -1)  # (B, R, values)
        chance = chance_values.index_select(-1, self._chance_columns)
        chance = chance * queries.index_select(-1, self._chance_kinds)  # (B, R, M_c)
        return QueryChunk(
            dtype=dtype,
            index=index,
            key_masks=key_masks,
            earlier=earlier_keys,
            queries=queries.index_select(-1, self._metric_kinds)[:, None],  # (B, 1, R, M)
            chance=chance.sum(1, dtype=torch.float64),
            counts=queries.sum(1, dtype=torch.float64),
            real=vq[:, None, None, :],
            num_real=vq.sum(dtype=torch.float64),
        )

    def add(self, slot: int, rows: Tensor, w: Tensor, t: int, visible: Tensor) -> None:
        """Fold in weights (B, H', R, S) of query rows ``rows`` (R,) of a (T, S) problem, whose
        queries may attend to the keys ``visible`` (B or 1, R, S) bool (for the chance levels)."""
        dtype = torch.promote_types(w.dtype, torch.float32)
        self.add_chunk(slot, w, t, self.chunk(rows, visible, dtype))

    def add_chunk(self, slot: int, w: Tensor, t: int, chunk: QueryChunk) -> None:
        """Fold in weights (B, H', R, S) of the query rows ``chunk`` was made for
        (:meth:`chunk`) of a (T, S) problem."""
        b, h, r, s = w.shape
        if (b, t) != self.shape or s != t:
            raise ValueError(
                f"head statistics need self-attention over the (B, T) = {self.shape} tokens they "
                f"were given, got weights for B={b}, T={t}, S={s}; choose self-attention layers "
                f"with layers="
            )
        # float32 per chunk (float64 would double the chunk's memory); sums accumulate in float64
        w = w.to(chunk.dtype)
        # w·log w, as xlogy (0 at w = 0) but on the vectorised log: the log of the smallest
        # normal number instead of -inf (a weight below it adds less than 1e-36)
        log_w = w.clamp_min(torch.finfo(w.dtype).tiny).log_()
        entropy = (w * log_w).sum(-1, keepdim=True).neg_()  # (B, H, R, 1)
        on_keys = torch.bmm(w.reshape(b, h * r, s), chunk.key_masks).view(b, h, r, -1)
        parts = [entropy, on_keys, w.gather(-1, chunk.index.expand(b, h, r, 3))]
        if chunk.earlier is not None:
            earlier = chunk.earlier[:, None]  # (B, 1, R, S)
            # the key after an earlier occurrence: key s + 1 where s is one
            after = (w[..., 1:] * earlier[..., :-1]).sum(-1, keepdim=True)
            parts += [after, (w * earlier).sum(-1, keepdim=True)]
        values = torch.cat(parts, -1).index_select(-1, self._value_columns)  # (B, H, R, M)
        self.seq_sums[slot] += (values * chunk.queries).sum(2)  # (B, H, M)
        self.chance_sums[slot] += chunk.chance
        if slot == 0:
            self.seq_counts += chunk.counts
        self.received[slot] += torch.matmul(chunk.real, w).squeeze(2)  # (B, H, S)
        self.slot_counts[slot] += chunk.num_real

    @property
    def counts(self) -> dict[str, Tensor]:
        """The number of queries each kind of metric averages over, () float64, whole batch."""
        totals = self.seq_counts.sum(0)
        zero = totals.new_zeros(())
        return {k: totals[self._kinds.index(k)] if k in self._kinds else zero for k in _QUERY_KINDS}

    def _known(self, name: str) -> bool:
        name = _base(name)
        return (name not in ID_METRICS or self.ids is not None) and (
            name not in ROLE_METRICS or self.roles is not None
        )

    def _per_sequence(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Sums and query counts per sequence: (L', B, H', M), (B, M), (L', B, M_c), (B, M_c)."""
        kinds = self._metric_kinds
        return (
            self.seq_sums,
            self.seq_counts.index_select(1, kinds),
            self.chance_sums,
            self.seq_counts.index_select(1, self._chance_kinds),
        )

    def _named(self, metrics: Tensor, chance: Tensor, nan: Tensor) -> dict[str, Tensor]:
        """Per metric (then per chance level, as CHANCE + metric) its slice of ``metrics`` (...,
        M) or ``chance`` (..., M_c), or ``nan`` for a metric these inputs cannot tell."""
        out = {}
        for name in METRICS:
            known = name in self.metrics
            out[name] = metrics[..., self.metrics.index(name)] if known else nan
        for name in CHANCE_METRICS:
            known = name in self.chance_metrics
            out[CHANCE + name] = chance[..., self.chance_metrics.index(name)] if known else nan
        return out

    def means(self) -> dict[str, Tensor]:
        """Each metric (L', H') float32 on the CPU, a mean over the batch's queries (a longer
        sequence weighs more); NaN where its inputs or queries are missing."""
        sums, counts, chance_sums, chance_counts = self._per_sequence()
        slots, _, heads, _ = sums.shape
        # no query it applies to: NaN, for the metrics that need token ids or tokens
        optional = torch.tensor([m in _OPTIONAL for m in self.metrics], device=sums.device)
        optional_chance = torch.tensor(
            [m in _OPTIONAL for m in self.chance_metrics], device=sums.device
        )
        count = counts.sum(0)  # (M,)
        metrics = sums.sum(1) / count.clamp(min=1)  # (L', H', M)
        metrics = metrics.masked_fill(optional & (count == 0), float("nan"))
        count = chance_counts.sum(0)
        chance = chance_sums.sum(1) / count.clamp(min=1)  # (L', M_c)
        chance = chance.masked_fill(optional_chance & (count == 0), float("nan"))
        chance = chance[:, None, :].expand(slots, heads, chance.shape[-1])
        # every table on the CPU, whatever the default device
        metrics, chance = metrics.float().cpu(), chance.float().cpu()
        nan = torch.full((slots, heads), float("nan"))
        return self._named(metrics, chance, nan)

    def per_sequence_means(self) -> dict[str, Tensor]:
        """Each metric per sequence, (B, L', H') float64 on the CPU: the mean over that
        sequence's own queries; NaN where its inputs are unknown or the sequence has no query
        the metric applies to (no repeated token, no [SEP] query, ...), and for the queries-free
        metrics of a sequence without real tokens."""
        sums, counts, chance_sums, chance_counts = self._per_sequence()
        slots, b, heads, _ = sums.shape
        metrics = sums / counts.clamp(min=1)[None, :, None, :]  # (L', B, H', M)
        metrics = metrics.masked_fill((counts == 0)[None, :, None, :], float("nan"))
        chance = chance_sums / chance_counts.clamp(min=1)[None]  # (L', B, M_c)
        chance = chance.masked_fill((chance_counts == 0)[None], float("nan"))
        chance = chance[:, :, None, :].expand(slots, b, heads, chance.shape[-1])
        metrics, chance = metrics.transpose(0, 1).cpu(), chance.transpose(0, 1).cpu()
        nan = torch.full((b, slots, heads), float("nan"), dtype=torch.float64)
        return self._named(metrics, chance, nan)

    def most_attended(self) -> tuple[Tensor, Tensor]:
        """Per sequence, the key each head reads most: positions and weights (B, L', H')."""
        # Mean weight each key receives per sequence; padding keys can't be "most attended".
        per_seq = self.valid.sum(1).to(torch.float64).clamp(min=1)  # (B,)
        received = self.received / per_seq[None, :, None, None]  # (L', B, H, S)
        received = received.masked_fill(~self.valid[None, :, None, :], -1.0)
        top_weight, top_pos = received.max(dim=-1)  # (L', B, H)
        return top_pos.transpose(0, 1).cpu(), top_weight.clamp(min=0).transpose(0, 1).float().cpu()
