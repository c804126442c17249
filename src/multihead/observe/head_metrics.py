"""The metrics of :class:`~multihead.observe.statistics.HeadStatistics` and their running sums.

Shapes: B sequences, T query positions, S = T keys (self-attention), H' heads, R query rows of
one chunk, L' layers (slots). Every metric is a mean over a set of queries of a sum of weights
(or, for the entropies, of a function of one query's row), so the sums are folded in a chunk of
query rows at a time and no head's (T, S) matrix is ever held.

The token-identity metrics (``induction``, ``duplicate_token``) need the token ids; the
metrics of Clark et al., "What Does BERT Look At?" (2019) (``to_cls``, ``to_sep``,
``to_punctuation``, ``sep_to_sep``, ``cls_entropy``) need to know which tokens are [CLS], [SEP]
and punctuation, which is read from the token strings. Without them those metrics are NaN; they
are NaN too when no query qualifies (no repeated token, no [SEP] query, ...).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "METRICS",
    "ID_METRICS",
    "ROLE_METRICS",
    "ROLES",
    "CHANCE",
    "BROAD",
    "BROAD_BELOW",
    "token_roles",
    "StatsAccumulator",
]

# name -> what it measures; the metrics of HeadStatistics, in table order.
METRICS: dict[str, str] = {
    "entropy": "entropy of a query's weights, nats (mean over queries)",
    "identity": "weight on the query's own position",
    "previous_token": "weight on the position just before the query",
    "next_token": "weight on the position just after the query",
    "special": "weight on special tokens ([CLS], [SEP])",
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
    "[CLS]": "to_cls",
    "[SEP]": "to_sep",
    "punctuation": "to_punctuation",
    "induction": "induction",
    "duplicate token": "duplicate_token",
}
# A head none of whose role scores reaches this spreads its weight: Clark et al.'s "broad" heads.
BROAD = "broad"
BROAD_BELOW = 0.3

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


# metric -> the queries it averages over (default "all": every real query). The weight on
# [CLS], [SEP] or punctuation is unknown, not 0, for a text that has none (GPT-2 has no [CLS]).
_COUNT_OF = {
    "previous_token": "prev",
    "next_token": "next",
    "induction": "repeat",
    "duplicate_token": "repeat",
    "to_cls": "has_cls",
    "to_sep": "has_sep",
    "to_punctuation": "has_punctuation",
    "sep_to_sep": "sep",
    "cls_entropy": "cls",
}
# The score of the same metric for a head that spreads its weight evenly over the keys each
# query can see (its chance level), kept as CHANCE + metric: a causal model's first query sees
# itself alone, so identity 1 there says nothing about the head.
CHANCE = "chance_"


def _base(name: str) -> str:
    return name.removeprefix(CHANCE)


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
        self.roles: dict[str, Tensor] | None = None
        if tokens is not None:
            cls, sep, punct = token_roles(tokens, batch, length, device)
            self.roles = {
                "cls": cls & self.valid,
                "sep": sep & self.valid,
                "punctuation": punct & self.valid,
            }
        self.shape = (batch, length)
        # Kept per sequence, so that a corpus can weight each text equally (per_sequence_means).
        z = torch.zeros(num_slots, batch, num_heads, dtype=torch.float64, device=device)
        self.seq_sums = {name: z.clone() for name in METRICS}  # (L', B, H')
        for name in ROLES.values():  # chance levels: the same for every head, kept per head
            self.seq_sums[CHANCE + name] = z.clone()
        # The queries each metric averages over, (B,) (counted once: every slot sees the same
        # rows).
        self.seq_counts = {
            name: torch.zeros(batch, dtype=torch.float64, device=device)
            for name in (*{"all", *_COUNT_OF.values()},)
        }
        # (slot, B, H, S): summed weight each key receives from real queries
        self.received = torch.zeros(
            num_slots, batch, num_heads, length, dtype=torch.float64, device=device
        )
        self.slot_counts = torch.zeros(num_slots, dtype=torch.float64, device=device)

    def add(self, slot: int, rows: Tensor, w: Tensor, t: int, visible: Tensor) -> None:
        """Fold in weights (B, H', R, S) of query rows ``rows`` (R,) of a (T, S) problem, whose
        queries may attend to the keys ``visible`` (B or 1, R, S) bool (for the chance levels)."""
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

        def mass(keys: Tensor) -> Tensor:
            """Weight (B, H', R) on keys marked by (B, S) or per query by (B, R, S)."""
            k = keys.to(w.dtype)
            return (w * (k[:, None, None, :] if k.dim() == 2 else k[:, None])).sum(-1)

        entropy = -torch.special.xlogy(w, w).sum(-1)  # (B, H, R)
        own = rows.view(1, 1, r, 1).expand(b, h, r, 1)
        # previous/next: only queries that have a real neighbour there count
        prev_pos, next_pos = rows - 1, rows + 1
        has_prev = (prev_pos >= 0)[None, :] & valid_k[:, prev_pos.clamp(min=0)].bool()  # (B, R)
        has_next = (next_pos < s)[None, :] & valid_k[:, next_pos.clamp(max=s - 1)].bool()
        prev_q, next_q = vq * has_prev.to(w.dtype), vq * has_next.to(w.dtype)  # (B, R)
        # (per-query values (B, H', R), the queries (B, R) they are averaged over)
        scores: dict[str, tuple[Tensor, Tensor]] = {
            "entropy": (entropy, vq),
            "special": (mass(self.special), vq),
            "identity": (w.gather(-1, own).squeeze(-1), vq),
            "previous_token": (w.gather(-1, (own - 1).clamp(min=0)).squeeze(-1), prev_q),
            "next_token": (w.gather(-1, (own + 1).clamp(max=s - 1)).squeeze(-1), next_q),
        }
        counts = {"all": vq, "prev": prev_q, "next": next_q}
        # a head reading evenly the real keys each query may see is the chance level
        seen = visible.to(w.device) & self.valid[:, None, :]  # (B, R, S)
        even = seen.to(w.dtype) / seen.sum(-1, keepdim=True).clamp(min=1).to(w.dtype)
        chance_w = even[:, None]  # (B, 1, R, S)
        ar = torch.arange(r, device=w.device)
        chance: dict[str, Tensor] = {
            "identity": chance_w[..., ar, rows],
            "previous_token": chance_w[..., ar, (rows - 1).clamp(min=0)],
            "next_token": chance_w[..., ar, (rows + 1).clamp(max=s - 1)],
        }  # (B, 1, R) each
        if self.ids is not None:
            keys = torch.arange(s, device=w.device)
            earlier = self.ids[:, None, :] == self.ids[:, rows, None]  # (B, R, S): same token
            earlier &= (keys[None, :] < rows[:, None])[None] & self.valid[:, None, :]
            # the position right after each earlier occurrence (at most the query itself)
            after = F.pad(earlier[..., :-1], (1, 0))  # (B, R, S)
            repeat_q = vq * earlier.any(-1).to(w.dtype)  # (B, R): the token occurred before
            scores["induction"] = (mass(after), repeat_q)
            scores["duplicate_token"] = (mass(earlier), repeat_q)
            chance["induction"] = (chance_w * after[:, None]).sum(-1)
            chance["duplicate_token"] = (chance_w * earlier[:, None]).sum(-1)
            counts["repeat"] = repeat_q
        if self.roles is not None:
            cls_q = self.roles["cls"][:, rows].to(w.dtype)  # (B, R)
            sep_q = self.roles["sep"][:, rows].to(w.dtype)
            to_sep = mass(self.roles["sep"])
            for kind in ("cls", "sep", "punctuation"):
                metric, keys_of = f"to_{kind}", self.roles[kind]  # (B, S)
                has = vq * keys_of.any(1, keepdim=True).to(w.dtype)  # (B, R): texts with one
                scores[metric] = (to_sep if kind == "sep" else mass(keys_of), has)
                chance[metric] = (chance_w * keys_of[:, None, None, :]).sum(-1)
                counts[f"has_{kind}"] = has
            scores["sep_to_sep"] = (to_sep, sep_q)
            scores["cls_entropy"] = (entropy, cls_q)
            counts["sep"], counts["cls"] = sep_q, cls_q
        for name, values in chance.items():
            scores[CHANCE + name] = (values.expand(b, h, r), scores[name][1])
        for name, (values, queries) in scores.items():
            self.seq_sums[name][slot] += (values * queries[:, None, :]).sum(dim=2)
        if slot == 0:
            for name, queries in counts.items():
                self.seq_counts[name] += queries.sum(1)
        self.received[slot] += (w * vq[:, None, :, None]).sum(2)  # (B, H, S)
        self.slot_counts[slot] += vq.sum()

    @property
    def counts(self) -> dict[str, Tensor]:
        """The number of queries each kind of metric averages over, () float64, whole batch."""
        return {name: c.sum() for name, c in self.seq_counts.items()}

    def _known(self, name: str) -> bool:
        name = _base(name)
        return (name not in ID_METRICS or self.ids is not None) and (
            name not in ROLE_METRICS or self.roles is not None
        )

    def means(self) -> dict[str, Tensor]:
        """Each metric (L', H') float32 on the CPU, a mean over the batch's queries (a longer
        sequence weighs more); NaN where its inputs or queries are missing."""
        counts = self.counts
        out = {}
        for name, per_seq in self.seq_sums.items():
            total = per_seq.sum(1)  # (L', H')
            count = counts[_COUNT_OF.get(_base(name), "all")]
            mean = total / count.clamp(min=1)
            if not self._known(name):
                mean = torch.full_like(mean, float("nan"))
            elif _base(name) in (*ID_METRICS, *ROLE_METRICS):
                mean = mean.masked_fill(count == 0, float("nan"))  # no query it applies to
            out[name] = mean.float().cpu()  # every table on the CPU, whatever the default device
        return out

    def per_sequence_means(self) -> dict[str, Tensor]:
        """Each metric per sequence, (B, L', H') float64 on the CPU: the mean over that
        sequence's own queries; NaN where its inputs are unknown or the sequence has no query
        the metric applies to (no repeated token, no [SEP] query, ...), and for the queries-free
        metrics of a sequence without real tokens."""
        out = {}
        for name, per_seq in self.seq_sums.items():
            count = self.seq_counts[_COUNT_OF.get(_base(name), "all")]  # (B,)
            mean = per_seq / count.clamp(min=1)[None, :, None]  # (L', B, H')
            mean = mean.masked_fill((count == 0)[None, :, None], float("nan"))
            if not self._known(name):
                mean = torch.full_like(mean, float("nan"))
            out[name] = mean.transpose(0, 1).cpu()
        return out

    def most_attended(self) -> tuple[Tensor, Tensor]:
        """Per sequence, the key each head reads most: positions and weights (B, L', H')."""
        # Mean weight each key receives per sequence; padding keys can't be "most attended".
        per_seq = self.valid.sum(1).to(torch.float64).clamp(min=1)  # (B,)
        received = self.received / per_seq[None, :, None, None]  # (L', B, H, S)
        received = received.masked_fill(~self.valid[None, :, None, :], -1.0)
        top_weight, top_pos = received.max(dim=-1)  # (L', B, H)
        return top_pos.transpose(0, 1).cpu(), top_weight.clamp(min=0).transpose(0, 1).float().cpu()
