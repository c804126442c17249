"""Synthetic sequence tasks, framed as continuation so one causal model trains and generates.

Every example is ``prompt answer <eos>`` with a fixed length per task:

    copy     3 1 2 =        → 3 1 2 <eos>
    reverse  3 1 2 =        → 2 1 3 <eos>
    sort     3 1 2 =        → 1 2 3 <eos>
    add      4 7 + 0 5 =    → 0 5 2 <eos>        (47 + 05 = 052: the sum has L + 1 digits)

The loss is taken on the answer tokens only (the prompt is random and can't be predicted).

Data is a pure function of ``(seed, stream, step, row)``: each row of each batch is drawn from its
own counter-based random numbers (:mod:`~multihead.training.draws`), so

- a run resumed at step s sees exactly the batches an uninterrupted run sees (nothing to save);
- in data-parallel training rank r draws rows [r·b, (r+1)·b) of the global batch itself, keyed by
  those row numbers, and the union of the ranks' shards is the single process's global batch.

A fixed tenth of all inputs (chosen by a hash of the input digits) is held out: training never
draws them, evaluation draws only them, so exact-match accuracy is measured on unseen inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from multihead._checks import check_choice, check_non_negative_int, check_positive_int
from multihead.training.draws import EVAL_STREAM, GOLDEN, HELD_OUT_EVERY, TRAIN_STREAM, draws, mix
from multihead.training.induction import InductionTask

__all__ = [
    "VOCAB",
    "PAD",
    "EOS",
    "EQUALS",
    "PLUS",
    "TASKS",
    "ALL_TASKS",
    "Task",
    "TaskLike",
    "get_task",
]

# One vocabulary for every task: the ten digits, the two operators, padding and end-of-sequence.
VOCAB: tuple[str, ...] = (
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
    "+",
    "=",
    "<pad>",
    "<eos>",
)
PLUS, EQUALS, PAD, EOS = 10, 11, 12, 13
TASKS: tuple[str, ...] = ("copy", "reverse", "sort", "add")
# With the induction task (multihead.training.induction), which has its own vocabulary.
ALL_TASKS: tuple[str, ...] = (*TASKS, "induction")

_ADD_MAX_DIGITS = 17  # two 17-digit operands still sum below 2**63


class TaskLike(Protocol):
    """What the training loop needs of a task: :class:`Task` or
    :class:`~multihead.training.induction.InductionTask`."""

    @property
    def name(self) -> str: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...  # the loss is taken on the tokens after the prompt
    @property
    def total_len(self) -> int: ...
    def batch(self, seed: int, step: int, rows: range | Sequence[int]) -> Tensor: ...
    def held_out(self, seed: int, n: int, *, start: int = 0) -> Tensor: ...
    def to_dict(self) -> dict[str, object]: ...
    def label(self, token: int) -> str: ...
    def decode(self, ids: Sequence[int] | Tensor, *, stop_at_eos: bool = True) -> str: ...


@dataclass(frozen=True)
class Task:
    """One synthetic task at one input length.

    Args:
        name: ``"copy"``, ``"reverse"``, ``"sort"`` or ``"add"``.
        seq_len: L, the number of input digits (for ``add``: digits of each operand).

    Attributes:
        prompt_len: tokens in a prompt, ``=`` included.
        answer_len: tokens in an answer, ``<eos>`` included.
        total_len: prompt_len + answer_len, the length of one example.
    """

    name: str
    seq_len: int

    def __post_init__(self) -> None:
        check_choice("task", self.name, TASKS)
        check_positive_int("seq_len", self.seq_len)
        if self.name == "add" and self.seq_len > _ADD_MAX_DIGITS:
            raise ValueError(
                f"seq_len must be at most {_ADD_MAX_DIGITS} for the add task (its sums are int64), "
                f"got {self.seq_len}"
            )

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    @staticmethod
    def label(token: int) -> str:
        """A short label of a token id for figures."""
        return VOCAB[token].replace("<eos>", "eos")

    @property
    def input_digits(self) -> int:
        return 2 * self.seq_len if self.name == "add" else self.seq_len

    @property
    def prompt_len(self) -> int:
        return self.input_digits + (2 if self.name == "add" else 1)

    @property
    def answer_len(self) -> int:
        return self.seq_len + (2 if self.name == "add" else 1)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.answer_len

    @property
    def held_out_size(self) -> int:
        """About how many distinct inputs are held out: a tenth of the 10^digits inputs (a hash
        chooses them). An evaluation drawing more only draws them again."""
        # A seq_len read from a hand-edited file may be huge: never raise 10 to it.
        digits = min(self.input_digits, 30)
        return 10**digits // HELD_OUT_EVERY

    @property
    def prompt_tokens(self) -> tuple[str, ...]:
        """The tokens a prompt of this task may contain."""
        return (*VOCAB[:10], "+", "=") if self.name == "add" else (*VOCAB[:10], "=")

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "seq_len": self.seq_len, "vocab": list(VOCAB)}

    # -- data -----------------------------------------------------------------------------------

    def _digits(
        self, seed: int, stream: int, step: int, rows: np.ndarray, attempt: np.ndarray
    ) -> np.ndarray:
        """Input digits (n, input_digits) for the given global row numbers."""
        u = draws(seed, stream, step, rows, self.input_digits, attempt)  # (n, digits)
        return ((u >> np.uint64(32)) % np.uint64(10)).astype(np.int64)

    def _held_out(self, digits: np.ndarray) -> np.ndarray:
        """Whether each input (n, input_digits) belongs to the held-out tenth."""
        h = np.zeros(digits.shape[0], dtype=np.uint64)
        salt = np.arange(digits.shape[1], dtype=np.uint64) * GOLDEN  # array ops wrap silently
        for j in range(digits.shape[1]):
            h = mix(h ^ (digits[:, j].astype(np.uint64) + salt[j]))
        return (h % np.uint64(HELD_OUT_EVERY)) == 0

    def _inputs(
        self, seed: int, stream: int, step: int, rows: np.ndarray, held_out: bool
    ) -> np.ndarray:
        """Draw inputs, redrawing (with the next attempt number) rows on the wrong side."""
        attempt = np.zeros(len(rows), dtype=np.int64)
        digits = self._digits(seed, stream, step, rows, attempt)
        wrong = self._held_out(digits) != held_out
        while wrong.any():
            attempt[wrong] += 1
            digits[wrong] = self._digits(seed, stream, step, rows[wrong], attempt[wrong])
            wrong = self._held_out(digits) != held_out
        return digits

    def answers(self, digits: np.ndarray) -> np.ndarray:
        """The answer digits (n, answer_len - 1) for inputs (n, input_digits)."""
        if self.name == "copy":
            return digits.copy()
        if self.name == "reverse":
            return digits[:, ::-1].copy()
        if self.name == "sort":
            return np.sort(digits, axis=1)
        # add: two L-digit operands, most significant digit first, sum on L + 1 digits
        weights = 10 ** np.arange(self.seq_len - 1, -1, -1, dtype=np.int64)
        a = digits[:, : self.seq_len] @ weights
        b = digits[:, self.seq_len :] @ weights
        total = a + b
        out = np.empty((len(digits), self.seq_len + 1), dtype=np.int64)
        for j in range(self.seq_len, -1, -1):
            out[:, j] = total % 10
            total //= 10
        return out

    def examples(self, digits: np.ndarray) -> Tensor:
        """Whole examples (n, total_len) as token ids: prompt, answer, <eos>."""
        n = len(digits)
        answer = self.answers(digits)
        eq = np.full((n, 1), EQUALS)
        eos = np.full((n, 1), EOS)
        if self.name == "add":
            plus = np.full((n, 1), PLUS)
            prompt = np.concatenate(
                [digits[:, : self.seq_len], plus, digits[:, self.seq_len :], eq], 1
            )
        else:
            prompt = np.concatenate([digits, eq], axis=1)
        return torch.from_numpy(np.concatenate([prompt, answer, eos], axis=1))

    def batch(self, seed: int, step: int, rows: range | Sequence[int]) -> Tensor:
        """Training examples (len(rows), total_len) for the given rows of step ``step``'s batch.

        A pure function of its arguments: any process computes the same rows.
        """
        r = np.asarray(rows, dtype=np.int64)
        return self.examples(self._inputs(seed, TRAIN_STREAM, step, r, held_out=False))

    def held_out(self, seed: int, n: int, *, start: int = 0) -> Tensor:
        """Held-out examples ``start .. start + n - 1`` (n, total_len): inputs training never draws.

        Each row is keyed by its number, so chunks drawn separately are the whole set.
        """
        check_non_negative_int("start", start)
        rows = np.arange(start, start + n)
        return self.examples(self._inputs(seed, EVAL_STREAM, 0, rows, held_out=True))

    # -- text -----------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of a space-separated prompt such as ``"5 2 9 1 ="``.

        Raises:
            ValueError: a token outside this task's prompt vocabulary, or an empty prompt.
        """
        tokens = text.split()
        if not tokens:
            raise ValueError("the prompt is empty: give space-separated tokens such as '3 1 2 ='")
        allowed = self.prompt_tokens
        bad = [t for t in tokens if t not in allowed]
        if bad:
            raise ValueError(
                f"prompt token {bad[0]!r} is not in the {self.name} task's vocabulary "
                f"({' '.join(allowed)}); separate tokens with spaces"
            )
        return [VOCAB.index(t) for t in tokens]

    def example_prompt(self) -> str:
        """A well-formed prompt of this task, for messages (``"5 2 9 1 ="`` for sort, L=4)."""
        digits = [str((5 + 7 * i) % 10) for i in range(self.input_digits)]
        if self.name == "add":
            digits.insert(self.seq_len, "+")
        return " ".join([*digits, "="])

    def parse_prompt(self, text: str) -> list[int]:
        """Token ids of one prompt the model was trained on: L digits then ``=`` (for ``add``:
        L digits, ``+``, L digits, ``=``).

        Raises:
            ValueError: a token outside the vocabulary, or a prompt of another shape; the
                message shows the shape this task expects.
        """
        ids = self.encode(text)
        shape = (
            f"{self.seq_len} digits, '+', {self.seq_len} digits and '='"
            if self.name == "add"
            else f"{self.seq_len} digits and '='"
        )
        expected = [EQUALS if i == self.prompt_len - 1 else None for i in range(self.prompt_len)]
        if self.name == "add":
            expected[self.seq_len] = PLUS
        fits = len(ids) == len(expected) and all(
            (i < 10) if want is None else (i == want) for i, want in zip(ids, expected, strict=True)
        )
        if not fits:
            raise ValueError(
                f"prompt {text!r} does not fit the model: it was trained on {self.name} prompts of "
                f"{shape}, such as {self.example_prompt()!r}"
            )
        return ids

    @staticmethod
    def decode(ids: Sequence[int] | Tensor, *, stop_at_eos: bool = True) -> str:
        """Space-separated tokens, ending before ``<eos>`` when ``stop_at_eos``."""
        out = []
        for i in ids.tolist() if isinstance(ids, Tensor) else ids:
            if stop_at_eos and i == EOS:
                break
            out.append(VOCAB[int(i)])
        return " ".join(out)


def get_task(name: str, seq_len: int) -> TaskLike:
    """The task ``name`` (one of :data:`ALL_TASKS`) at length ``seq_len`` (validates both)."""
    if name == "induction":
        return InductionTask(seq_len)
    check_choice("task", name, ALL_TASKS)
    return Task(name, seq_len)
