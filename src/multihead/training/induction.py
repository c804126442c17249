"""The induction task: random tokens in which a segment is copied to a later place.

    5 41 9 [17 3 60 22] 8 33 ... 50 [17 3 60 22] 12 ...      (a segment of n tokens, copied)
           s1                       s2

Every next token is scored. Most are random, the segment's first occurrence included (its
tokens s1 + 1 … s1 + n - 1: loss ≈ log V); the same tokens of the copy (s2 + 1 … s2 + n - 1)
can be read off the earlier occurrence by an
induction head (Olsson et al., "In-context Learning and Induction Heads", 2022): a head that,
at a token A, attends to the position right after an earlier A and copies what it finds there.
A two-layer attention-only model learns one in a sudden "phase change"; one layer can't (the
head needs a previous-token head in an earlier layer to know what came before each position).

The layout varies: n ∈ [4, min(12, 3/8 · L)], s1 random, s2 ≥ s1 + n random. With one fixed
layout ("N tokens, then the same N") both a 1- and a 2-layer model cheat by attending a fixed
distance back; with n above 3/8 of the length the one-layer control learns the layout by
position. A fixed tenth of the layouts (by a hash of (n, s1, s2)) is held out: training never
draws them, :meth:`InductionTask.probe_batch` only them.

Data is a pure function of (seed, stream, step, row), like the other tasks' (see
:mod:`multihead.training.draws`), so a resumed run sees the batches an uninterrupted one sees.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from multihead._checks import check_non_negative_int, check_positive_int
from multihead.observe.statistics import head_statistics
from multihead.training.draws import EVAL_STREAM, HELD_OUT_EVERY, TRAIN_STREAM, draws, key

__all__ = ["InductionTask", "InductionBatch", "InductionProbe", "probe_induction"]

VOCAB_SIZE = 64
MIN_SEGMENT, MAX_SEGMENT = 4, 12


@functools.lru_cache(maxsize=8)
def _layouts(seq_len: int, max_segment: int, held_out: bool) -> dict[int, list[tuple[int, int]]]:
    # Computed once per length: hashing every layout costs tens of milliseconds.
    out: dict[int, list[tuple[int, int]]] = {}
    for n in range(MIN_SEGMENT, max_segment + 1):
        out[n] = [
            (s1, s2)
            for s1 in range(seq_len - 2 * n + 1)
            for s2 in range(s1 + n, seq_len - n + 1)
            if (int(key(n, s1, s2)) % HELD_OUT_EVERY == 0) == held_out
        ]
    return {n: pairs for n, pairs in out.items() if pairs}


@dataclass(frozen=True)
class InductionBatch:
    """Sequences and where their tokens are predictable.

    Attributes:
        ids: (B, L) token ids.
        repeated: (B, L) bool, True at the copy's tokens after its first (s2 + 1 … s2 + n - 1):
            predictable from the earlier occurrence.
        first: (B, L) bool, True at the same tokens of the segment's first occurrence
            (s1 + 1 … s1 + n - 1): random, so their loss stays near log V.
    """

    ids: Tensor
    repeated: Tensor
    first: Tensor


@dataclass(frozen=True)
class InductionTask:
    """Random tokens with one copied segment, at sequence length ``seq_len`` (L).

    Args:
        seq_len: L, tokens per sequence; at least 11 (a segment of 4 is at most 3/8 of it).

    Attributes:
        name: ``"induction"``.
        vocab_size: V = 64.
        prompt_len: 1: every token after the first is scored.
        total_len: L.
    """

    seq_len: int
    name: str = field(default="induction", init=False)

    def __post_init__(self) -> None:
        check_positive_int("seq_len", self.seq_len)
        if self.max_segment < MIN_SEGMENT:
            raise ValueError(
                f"seq_len must be at least 11 for the induction task (it copies segments of "
                f"{MIN_SEGMENT} to 3/8 of the length), got {self.seq_len}"
            )

    @property
    def max_segment(self) -> int:
        return min(MAX_SEGMENT, 3 * self.seq_len // 8)

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def prompt_len(self) -> int:
        return 1

    @property
    def total_len(self) -> int:
        return self.seq_len

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "seq_len": self.seq_len, "vocab_size": VOCAB_SIZE}

    @staticmethod
    def label(token: int) -> str:
        return str(token)

    @staticmethod
    def decode(ids: Sequence[int] | Tensor, *, stop_at_eos: bool = True) -> str:
        return " ".join(str(int(i)) for i in (ids.tolist() if isinstance(ids, Tensor) else ids))

    # -- data -----------------------------------------------------------------------------------

    def layouts(self, *, held_out: bool) -> dict[int, list[tuple[int, int]]]:
        """Per segment length n, the (s1, s2) of one side of the held-out split."""
        return _layouts(self.seq_len, self.max_segment, held_out)

    def sample(
        self, seed: int, stream: int, step: int, rows: np.ndarray, *, held_out: bool
    ) -> InductionBatch:
        """The sequences of the given global row numbers, with their masks."""
        layouts = self.layouts(held_out=held_out)
        lengths = sorted(layouts)
        ids = np.empty((len(rows), self.seq_len), dtype=np.int64)
        repeated = np.zeros((len(rows), self.seq_len), dtype=bool)
        first = np.zeros((len(rows), self.seq_len), dtype=bool)
        # L token draws and two layout draws per row, each row keyed by its global number.
        u = draws(seed, stream, step, rows, self.seq_len + 2) >> np.uint64(32)  # (b, L + 2)
        ids[:] = (u[:, : self.seq_len] % np.uint64(VOCAB_SIZE)).astype(np.int64)
        for i in range(len(rows)):
            n = lengths[int(u[i, -2]) % len(lengths)]  # n uniform, then a layout of that n
            s1, s2 = layouts[n][int(u[i, -1]) % len(layouts[n])]
            ids[i, s2 : s2 + n] = ids[i, s1 : s1 + n]
            # The same n - 1 positions of both occurrences: only the copy's are predictable.
            first[i, s1 + 1 : s1 + n] = True
            repeated[i, s2 + 1 : s2 + n] = True
        return InductionBatch(
            torch.from_numpy(ids), torch.from_numpy(repeated), torch.from_numpy(first)
        )

    def batch(self, seed: int, step: int, rows: range | Sequence[int]) -> Tensor:
        """Training sequences (len(rows), L) of step ``step``'s batch (a pure function)."""
        r = np.asarray(rows, dtype=np.int64)
        return self.sample(seed, TRAIN_STREAM, step, r, held_out=False).ids

    def held_out(self, seed: int, n: int, *, start: int = 0) -> Tensor:
        """Held-out sequences ``start .. start + n - 1`` (n, L), of layouts training never draws."""
        return self.probe_batch(seed, n, start=start).ids

    def probe_batch(self, seed: int, n: int, *, start: int = 0) -> InductionBatch:
        """Held-out sequences with their masks (see :class:`InductionBatch`)."""
        check_non_negative_int("start", start)
        rows = np.arange(start, start + n)
        return self.sample(seed, EVAL_STREAM, 0, rows, held_out=True)


@dataclass(frozen=True)
class InductionProbe:
    """What the model does on held-out induction sequences at one step.

    Attributes:
        step: optimizer steps done.
        first_loss: mean cross-entropy on the segment's first occurrence (s1 + 1 … s1 + n - 1:
            random tokens, ≈ log V).
        repeated_loss: mean cross-entropy on the same tokens of the copy (s2 + 1 … s2 + n - 1).
        scores: per layer, per head, the induction score (see
            :class:`~multihead.observe.HeadStatistics`): 1 for a perfect induction head.
    """

    step: int
    first_loss: float
    repeated_loss: float
    scores: list[list[float]]

    def best(self, layer: int | None = None) -> tuple[int, int, float]:
        """(layer, head, score) of the highest-scoring head, of one layer if given."""
        cands = [
            (li, hi, s)
            for li, row in enumerate(self.scores)
            for hi, s in enumerate(row)
            if (layer is None or li == layer) and not math.isnan(s)
        ]
        return max(cands, key=lambda c: c[2]) if cands else (-1, -1, math.nan)

    def to_list(self) -> list[object]:
        return [self.step, self.first_loss, self.repeated_loss, self.scores]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> InductionProbe:
        step, first, repeated, scores = data
        return cls(
            int(step), float(first), float(repeated), [[float(x) for x in r] for r in scores]
        )


@torch.no_grad()
def probe_induction(model: torch.nn.Module, batch: InductionBatch, step: int) -> InductionProbe:
    """The losses on first and repeated tokens and every head's induction score on ``batch``.

    The model is run in eval mode (and put back as it was); the scores are computed a chunk
    of query rows at a time (:func:`~multihead.observe.head_statistics`).
    """
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        ids = batch.ids.to(device)
        logits = model(ids[:, :-1])  # (B, L-1, V): position t predicts token t+1
        losses = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none").cpu()
        stats = head_statistics(model, ids)
    finally:
        model.train(was_training)
    return InductionProbe(
        step=step,
        first_loss=float(losses[batch.first[:, 1:]].mean()),
        repeated_loss=float(losses[batch.repeated[:, 1:]].mean()),
        scores=[[round(float(s), 4) for s in row] for row in stats.induction],
    )
