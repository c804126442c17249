"""A clean/corrupt pair for finding the induction circuit by patching.

    clean:   5 41 9 [17 3 60 22] 8 33 ... 50 [17 3 60 22] 12 ...
    corrupt: 5 41 9 [62 0 11 40] 8 33 ... 50 [17 3 60 22] 12 ...
                     s1 (resampled)           s2 (the repeat, unchanged)

On clean sequences an induction model predicts the repeat's tokens s2 + 1 … s2 + n - 1 from the
first occurrence; on corrupt ones the first occurrence is resampled (every token changed), so
nothing earlier says what comes next. Every sequence of the pair has the same layout (n, s1,
s2), one the training never drew (a held-out layout of
:class:`~multihead.training.induction.InductionTask`), so positions mean the same in every row
and a heads × positions map reads at a glance. The metric is the mean log-probability of the
correct token on the repeat.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from multihead._checks import check_non_negative_int, check_positive_int
from multihead.training.induction import MIN_SEGMENT, InductionTask, is_held_out

__all__ = ["InductionPair", "induction_pair"]


@dataclass(frozen=True)
class InductionPair:
    """Clean and corrupt induction sequences of one layout, and the positions they are scored at.

    Attributes:
        clean: (B, L) token ids with a segment of n tokens at s1 copied to s2.
        corrupt: (B, L) the same, the first occurrence (s1 … s1 + n - 1) resampled.
        repeated: (L,) bool, True at the repeat's predictable tokens s2 + 1 … s2 + n - 1.
        layout: (n, s1, s2).
    """

    clean: Tensor
    corrupt: Tensor
    repeated: Tensor
    layout: tuple[int, int, int]

    def metric(self, logits: Tensor) -> Tensor:
        """Per sequence (B,), the mean log-probability of the clean token at the repeated
        positions, from ``logits`` (B, L, V) (position t - 1 predicts token t)."""
        where = self.repeated.nonzero().squeeze(1).to(logits.device)  # (n - 1,)
        logp = logits[:, where - 1].float().log_softmax(-1)  # (B, n - 1, V)
        targets = self.clean.to(logits.device)[:, where]  # (B, n - 1)
        return logp.gather(-1, targets[..., None])[..., 0].mean(-1).to(logits.dtype)


def _layout(seq_len: int, max_segment: int) -> tuple[int, int, int]:
    # A tenth of the placements are held out, so the scan stops after ~10 on a long sequence.
    for n in range(max_segment, MIN_SEGMENT - 1, -1):
        for s2 in sorted(range(n, seq_len - n + 1), key=lambda s: (abs(2 * s - seq_len), s)):
            for s1 in range(s2 - n + 1):
                if is_held_out(n, s1, s2):
                    return n, s1, s2
    raise ValueError(f"seq_len {seq_len} has no held-out induction layout")  # pragma: no cover


def induction_pair(seq_len: int, batch: int = 64, *, seed: int = 0) -> InductionPair:
    """``batch`` clean/corrupt sequences of length ``seq_len`` sharing one held-out layout: the
    longest segment with a held-out placement, its copy starting as near the middle of the
    sequence as one allows (then its first occurrence as early as one allows).

    Raises:
        ValueError: a ``seq_len`` the induction task refuses, a ``batch`` that is not positive.
    """
    task = InductionTask(seq_len)
    check_positive_int("batch", batch)
    check_non_negative_int("seed", seed)
    n, s1, s2 = _layout(seq_len, task.max_segment)
    generator = torch.Generator().manual_seed(seed)
    v = task.vocab_size
    clean = torch.randint(v, (batch, seq_len), generator=generator)
    clean[:, s2 : s2 + n] = clean[:, s1 : s1 + n]
    corrupt = clean.clone()
    # a shift by 1 … V - 1 changes every token of the first occurrence
    shift = torch.randint(1, v, (batch, n), generator=generator)
    corrupt[:, s1 : s1 + n] = (clean[:, s1 : s1 + n] + shift) % v
    repeated = torch.zeros(seq_len, dtype=torch.bool)
    repeated[s2 + 1 : s2 + n] = True
    return InductionPair(clean, corrupt, repeated, (n, s1, s2))
