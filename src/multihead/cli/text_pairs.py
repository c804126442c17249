"""The texts ``multihead patch --model`` compares: one clean/corrupt pair from the flags, many
from ``--pairs FILE``, or a named model's built-in pair.

``--pairs FILE`` holds one pair a line as a JSON object (JSON lines)::

    {"clean": "When Mary and John went to the store, John gave a drink to",
     "corrupt": "When Mary and John went to the store, Mary gave a drink to",
     "answer": " Mary", "wrong": " John"}

(each object on one line; blank lines skipped). ``clean``, ``corrupt`` and ``answer`` are
strings, ``wrong`` a string or absent (then the metric is the answer's log-probability), the
same for every line; no other key. JSON keeps the leading space of " Mary", which a
tab-separated file would make easy to lose. Errors are one line naming the file and the line.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from multihead.cli.common import CLIError, printable
from multihead.memory_budget import format_bytes

__all__ = [
    "TextPair", "read_pairs", "chosen_pairs", "built_in_note", "BUILT_IN_PAIRS", "MAX_PAIRS",
    "MAX_PAIRS_BYTES",
]  # fmt: skip

# Far above the pairs an experiment averages over (Wang et al. use a few hundred), far below
# what a batch of stacked patched runs could hold.
MAX_PAIRS = 4096
MAX_PAIRS_BYTES = 16 * 2**20
_KEYS = ("clean", "corrupt", "answer", "wrong")


@dataclass(frozen=True)
class TextPair:
    """One clean/corrupt pair and the tokens the metric reads.

    Attributes:
        clean, corrupt: the texts (as many tokens each).
        answer: the token the clean text should predict next.
        wrong: the token the corrupt text predicts (the metric is then the logit difference),
            or None (the answer's log-probability).
        source: where it was given, for messages ("--clean", or "--pairs 'f.jsonl' line 3").
    """

    clean: str
    corrupt: str
    answer: str
    wrong: str | None
    source: str = ""

    def flag(self, key: str) -> str:
        """How a message names ``key`` ("clean", "answer", ...) of this pair: the flag
        ("--answer") for a pair from the flags, else the file's line and the key."""
        return f"{self.source}: {key}" if self.source else f"--{key}"


def read_pairs(path: str) -> list[TextPair]:
    """The pairs of a JSON-lines file (see the module docstring), each checked.

    Raises:
        CLIError: the file is missing, unreadable, over :data:`MAX_PAIRS_BYTES` or
            :data:`MAX_PAIRS` pairs, holds none, or a line that is not a JSON object of the
            keys (naming the line); lines that disagree on ``wrong``.
    """
    shown = repr(printable(path))
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_PAIRS_BYTES + 1)
    except FileNotFoundError:
        raise CLIError(f"--pairs {shown}: no such file") from None
    except IsADirectoryError:
        raise CLIError(f"--pairs {shown} is a directory, expected a file of pairs") from None
    except OSError as e:
        raise CLIError(f"--pairs {shown} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_PAIRS_BYTES:
        raise CLIError(f"--pairs {shown} holds more than {format_bytes(MAX_PAIRS_BYTES)}")
    pairs: list[TextPair] = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"--pairs {shown} line {number}"
        pairs.append(_pair(line, where))
        if len(pairs) > MAX_PAIRS:
            raise CLIError(f"--pairs {shown} holds more than {MAX_PAIRS} pairs")
    if not pairs:
        raise CLIError(
            f'--pairs {shown} holds no pair (one JSON object a line: {{"clean": ..., '
            f'"corrupt": ..., "answer": ..., "wrong": ...}})'
        )
    given = [p.wrong is not None for p in pairs]
    if any(given) and not all(given):
        odd = pairs[given.index(not given[0])]
        raise CLIError(
            f"{odd.source} {'gives' if odd.wrong is not None else 'lacks'} 'wrong', unlike the "
            f"first pair: give it on every line or on none (one metric for all pairs)"
        )
    return pairs


def _pair(line: bytes, where: str) -> TextPair:
    """One line's pair, or a CLIError naming ``where``."""
    try:
        item = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CLIError(f"{where} is not UTF-8 text (byte {e.start + 1})") from None
    except ValueError as e:
        raise CLIError(f"{where} is not a JSON object: {e}") from None
    if not isinstance(item, dict):
        raise CLIError(
            f"{where} must be a JSON object with clean, corrupt, answer (and wrong), got "
            f"{type(item).__name__}"
        )
    unknown = sorted(set(item) - set(_KEYS))
    if unknown:
        raise CLIError(f"{where}: unknown key {unknown[0]!r}, expected {', '.join(_KEYS)}")
    for key in _KEYS:
        value = item.get(key)
        if value is None and key == "wrong":
            continue
        if not isinstance(value, str):
            got = "nothing" if key not in item else type(value).__name__
            raise CLIError(f"{where}: {key!r} must be a string, got {got}")
    return TextPair(item["clean"], item["corrupt"], item["answer"], item.get("wrong"), where)


# The pair a command runs on ``--model NAME`` without texts, keyed by the name as given (the
# models the loader knows by name): Wang et al.'s indirect-object identification (IOI), the
# second name (the subject, S) repeated in clean and swapped for the first in corrupt.
BUILT_IN_PAIRS: dict[str, TextPair] = {
    "smollm2": TextPair(
        clean="When Mary and John went to the store, John gave a drink to",
        corrupt="When Mary and John went to the store, Mary gave a drink to",
        answer=" Mary",
        wrong=" John",
    ),
}


def chosen_pairs(args: argparse.Namespace) -> list[TextPair] | None:
    """The pairs a ``--model`` run compares: ``--pairs FILE``, the flags' one pair, or the
    model's built-in pair (:data:`BUILT_IN_PAIRS`); None for ``--checkpoint`` (which reads
    its texts from the flags) and a model without texts or a built-in pair.

    Raises:
        CLIError: some of ``--clean``, ``--corrupt`` and ``--answer`` without the others;
            ``--pairs`` with ``--checkpoint`` or beside the single pair's flags; a pairs
            file :func:`read_pairs` refuses.
    """
    texts = (args.clean, args.corrupt, args.answer)
    if any(t is not None for t in (*texts, args.wrong)) and any(t is None for t in texts):
        raise CLIError("--clean, --corrupt and --answer go together: give all three")
    if args.pairs is not None:
        if args.checkpoint:
            raise CLIError(
                "--pairs takes texts for a --model's tokenizer: give --model DIR, or "
                "--clean, --corrupt and --answer with --checkpoint"
            )
        if any(t is not None for t in (*texts, args.wrong)):
            raise CLIError("--pairs replaces --clean, --corrupt, --answer and --wrong: give one")
        return read_pairs(args.pairs)
    if args.checkpoint:
        return None
    if args.clean is not None:
        return [TextPair(args.clean, args.corrupt, args.answer, args.wrong)]
    built_in = BUILT_IN_PAIRS.get(args.model)
    return None if built_in is None else [built_in]


def built_in_note(args: argparse.Namespace, pairs: list[TextPair] | None) -> str | None:
    """The line a command prints when ``pairs`` is ``--model NAME``'s built-in pair (the
    user gave no texts), else None."""
    if not pairs or pairs[0] is not BUILT_IN_PAIRS.get(args.model):
        return None
    pair = pairs[0]
    return (
        f"note: --model {printable(args.model)} without texts: its built-in pair, clean "
        f"{pair.clean!r}, corrupt {pair.corrupt!r}, answer {pair.answer!r}, wrong "
        f"{pair.wrong!r}"
    )
