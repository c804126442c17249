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
draws them, :meth:`InductionTask.probe_batch` only them. A layout is drawn in time independent of
L (n and a placement uniformly, drawn again while on the wrong side of the split), never by
listing the O(L²) placements.

Data is a pure function of (seed, stream, step, row), like the other tasks' (see
:mod:`multihead.training.draws`), so a resumed run sees the batches an uninterrupted one sees.
"""

from __future__ import annotations

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
from multihead.training.draws import EVAL_STREAM, HELD_OUT_EVERY, TRAIN_STREAM, draws, key, keys

__all__ = [
    "InductionTask",
    "InductionBatch",
    "InductionProbe",
    "is_held_out",
    "probe_induction",
]

VOCAB_SIZE = 64
MIN_SEGMENT, MAX_SEGMENT = 4, 12
MIN_SEQ_LEN = 11  # the shortest L whose 3/8 holds a segment of MIN_SEGMENT


# Redraws a row may take before the task gives up. An attempt lands on the held-out side with
# chance ≥ 0.04 at every length from 11 on (about 0.1 at long ones; tests/test_induction.py
# counts the short ones), so 10_000 attempts fail with chance below 1e-100.
MAX_ATTEMPTS = 10_000


def is_held_out(n: int, s1: int, s2: int) -> bool:
    """Whether the layout (segment length ``n``, first start ``s1``, copy start ``s2``) is in
    the held-out tenth: training never draws it, :meth:`InductionTask.probe_batch` only such."""
    return int(key(n, s1, s2)) % HELD_OUT_EVERY == 0


def _placement(index: int, n: int, seq_len: int) -> tuple[int, int]:
    """The ``index``-th of the m(m + 1)/2 placements (s1, s2) of a segment of ``n`` tokens,
    m = L - 2n + 1, s2 ≥ s1 + n, s2 + n ≤ L; O(1), so drawing one never lists them all."""
    m = seq_len - 2 * n + 1
    r = m * (m + 1) // 2 - 1 - index  # counted from the last row of the triangle
    t = (math.isqrt(8 * r + 1) - 1) // 2  # row t holds t + 1 placements: s1 = m - 1 - t
    s1 = m - 1 - t
    return s1, s1 + n + (r - t * (t + 1) // 2)


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
                f"seq_len must be at least {MIN_SEQ_LEN} for the induction task (it copies "
                f"segments of {MIN_SEGMENT} to 3/8 of the length), got {self.seq_len}"
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

    def sample(
        self, seed: int, stream: int, step: int, rows: np.ndarray, *, held_out: bool
    ) -> InductionBatch:
        """The sequences of the given global row numbers, with their masks."""
        ids = np.empty((len(rows), self.seq_len), dtype=np.int64)
        repeated = np.zeros((len(rows), self.seq_len), dtype=bool)
        first = np.zeros((len(rows), self.seq_len), dtype=bool)
        # L token draws per row, each row keyed by its global number.
        u = draws(seed, stream, step, rows, self.seq_len) >> np.uint64(32)  # (b, L)
        ids[:] = (u % np.uint64(VOCAB_SIZE)).astype(np.int64)
        for i, (n, s1, s2) in enumerate(self._draw_layouts(seed, stream, step, rows, held_out)):
            ids[i, s2 : s2 + n] = ids[i, s1 : s1 + n]
            # The same n - 1 positions of both occurrences: only the copy's are predictable.
            first[i, s1 + 1 : s1 + n] = True
            repeated[i, s2 + 1 : s2 + n] = True
        return InductionBatch(
            torch.from_numpy(ids), torch.from_numpy(repeated), torch.from_numpy(first)
        )

    def _draw_layouts(
        self, seed: int, stream: int, step: int, rows: np.ndarray, held_out: bool
    ) -> list[tuple[int, int, int]]:
        """(n, s1, s2) per row: n uniform, then a placement uniform, both drawn again (attempt
        1, 2, …, keyed by the row) for the rows whose layout is on the other side of the split."""
        layouts = np.zeros((len(rows), 3), dtype=np.int64)  # (b, 3): n, s1, s2
        pending = np.arange(len(rows))
        for attempt in range(1, MAX_ATTEMPTS + 1):
            u = draws(seed, stream, step, rows[pending], 2, np.full(len(pending), attempt))
            n = MIN_SEGMENT + u[:, 0] % np.uint64(self.max_segment - MIN_SEGMENT + 1)
            m = np.uint64(self.seq_len + 1) - np.uint64(2) * n  # (p,) placements of s1
            index = u[:, 1] % (m * (m + np.uint64(1)) // np.uint64(2))
            for j, (nj, ij) in enumerate(zip(n.tolist(), index.tolist(), strict=True)):
                layouts[pending[j]] = (nj, *_placement(ij, nj, self.seq_len))
            drawn = layouts[pending]
            wrong = (keys(*drawn.T) % np.uint64(HELD_OUT_EVERY) == 0) != held_out
            pending = pending[wrong]
            if not len(pending):
                return [(int(n), int(s1), int(s2)) for n, s1, s2 in layouts]
        raise RuntimeError(  # pragma: no cover - a chance below 1e-100 (see MAX_ATTEMPTS)
            f"no {'held-out' if held_out else 'training'} induction layout drawn"
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
