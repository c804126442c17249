"""Text in, token ids out, for any tokenizer: :class:`TokenBatch` and the one :func:`tokenize`.

A ``tokenizers.Tokenizer`` (the library under every fast Hugging Face tokenizer) splits a text
into pieces: WordPiece ("token", "##ization", lower-cased), byte-level BPE ("Ġthe"),
SentencePiece ("▁the"). People read words. :func:`tokenize` gives every family the same view:

- **display tokens** are the text each piece covers, as written ("Hello", not BERT's "hello";
  "the", not "Ġthe"), found from the tokenizer's character offsets; special tokens keep the
  tokenizer's own strings ("[CLS]", "<s>"); a piece of whitespace alone reads "␣" (a newline
  "⏎"); the byte pieces of one character are numbered ("東1/3", "東2/3", "東3/3");
- **words** follow one rule, read from the text itself (:func:`word_spans`), never from the
  tokenizer's pre-tokenizer (which may see one "word" in a whole sentence): a word is a run of
  characters between whitespace, each punctuation character (Unicode category P) a word of
  its own. Each piece belongs to the word its first character falls in.

This module knows no model: :class:`multihead.text.TextModel` holds a tokenizer and a model and
calls :func:`tokenize`. The tokenizer is imported only when one is prepared, so importing this
module costs nothing beyond torch.

Shapes: B texts, T tokens (the longest text's; shorter texts are padded on the right).
"""

from __future__ import annotations

import json
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead._checks import describe
from multihead._files import few

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "TokenBatch",
    "TruncationWarning",
    "check_text",
    "check_token_ids",
    "prepare_tokenizer",
    "tokenize",
    "word_spans",
]

# How whitespace-only pieces are shown (a label of blanks reads as nothing).
_BLANKS = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})
# Word-boundary markers of SentencePiece ("▁") and byte-level BPE ("Ġ", a space); a newline
# ("Ċ") is whitespace of its own, shown through _BLANKS.
_MARKERS = "▁Ġ"


class TruncationWarning(UserWarning):
    """A text was longer than the model takes, and only its start was read."""


def check_text(name: str, value: Any) -> str:
    """``value`` must be a str that is valid Unicode (encodable as UTF-8).

    Python keeps bytes that are not UTF-8 (from ``sys.argv``, ``os.listdir``, ...) as lone
    surrogates ("\\udcff"); the tokenizer and every file writer reject them later, less clearly.
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"{name} must be valid Unicode text, got {describe(value)} with an undecodable "
            f"character at position {e.start} (bytes that are not UTF-8?)"
        ) from None
    return value


@dataclass
class TokenBatch:
    """Tokenised texts, padded on the right to the batch's longest (see :func:`tokenize`).

    Attributes:
        input_ids: (B, T) int64.
        attention_mask: (B, T) int64, 1 = a real token (Hugging Face's convention).
        token_type_ids: (B, T) int64.
        tokens: per text, its display tokens (the text each covers; special tokens as the
            tokenizer names them), padding excluded.
        special_mask: (B, T) bool, True at special tokens ([CLS], [SEP], <s>) and padding.
        truncated: whether each text was cut at the model's ``max_seq_length``.
        offsets: per text, per token, the (start, end) characters it covers in the text,
            whitespace excluded; (0, 0) for special tokens added around the text, (s, s) for
            a piece of whitespace alone.
        word_ids: per text, per token, the index of its word (:func:`word_spans`); None for
            special tokens and whitespace.
    """

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor
    tokens: list[list[str]]
    special_mask: Tensor
    truncated: list[bool]
    offsets: list[list[tuple[int, int]]]
    word_ids: list[list[int | None]]

    def to(self, device: torch.device | str) -> TokenBatch:
        """The same batch with its tensors on ``device``."""
        return TokenBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.token_type_ids.to(device),
            self.tokens,
            self.special_mask.to(device),
            self.truncated,
            self.offsets,
            self.word_ids,
        )


def check_token_ids(tokenizer: Any, vocab_size: int) -> None:
    """Every id ``tokenizer`` (a ``tokenizers.Tokenizer``) can give, added tokens included, must
    have a row in the model's token embedding (``vocab_size`` rows): a text holding any other
    token would fail inside the embedding, whatever the text a load probes with.

    Raises:
        ValueError: the tokens beyond the embedding (a few, then how many more).
    """
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    emitted = [*((i, token) for token, i in vocab.items()), *_emitted_ids(tokenizer)]
    beyond = sorted({(i, token) for i, token in emitted if i >= vocab_size})
    if beyond:
        raise ValueError(
            f"the tokenizer has ids up to {beyond[-1][0]}, beyond the {vocab_size} rows of the "
            f"model's token embedding (vocab_size): "
            f"{few([f'{token!r} ({i})' for i, token in beyond])} cannot be embedded; use the "
            f"tokenizer saved with these weights"
        )


def _emitted_ids(tokenizer: Any) -> list[tuple[int, str]]:
    """The ids a tokenizer emits beside its vocabulary: its post-processor's special tokens
    (a template's ``ids``, BERT/RoBERTa processing's ``cls`` and ``sep``) and its padding id,
    as ``(id, what)``, read from its JSON."""
    try:
        spec = json.loads(tokenizer.to_str())
    except (AttributeError, TypeError, ValueError):
        return []
    found: list[tuple[int, str]] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "ids" and isinstance(value, list):
                    found.extend((i, where) for i in value if isinstance(i, int))
                elif key in ("cls", "sep") and isinstance(value, list) and len(value) == 2:
                    if isinstance(value[1], int):
                        found.append((value[1], f"{where} {value[0]}"))
                else:
                    walk(value, f"{where} {key}" if key != "special_tokens" else where)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    walk(spec.get("post_processor"), "post-processor")
    padding = spec.get("padding")
    if isinstance(padding, dict) and isinstance(padding.get("pad_id"), int):
        found.append((padding["pad_id"], "padding"))
    return found


def prepare_tokenizer(tokenizer: Any, *, pad_id: int, vocab_size: int | None = None) -> Tokenizer:
    """A copy of ``tokenizer`` that pads on the right to the batch's longest text and does not
    truncate.

    Files such as MiniLM's pad every text to a fixed 128 and truncate at 128; :func:`tokenize`
    sets the truncation the model wants on each call instead. The caller's object is untouched.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        pad_id: the padding id when the file names none.
        vocab_size: the rows of the model's token embedding, when known: every id of the
            tokenizer must have one (:func:`check_token_ids`).

    Raises:
        TypeError: ``tokenizer`` is not a ``tokenizers.Tokenizer``.
        ValueError: ids beyond ``vocab_size``.
    """
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    if vocab_size is not None:
        check_token_ids(tokenizer, vocab_size)
    tok = Tokenizer.from_str(tokenizer.to_str())
    shipped = tok.padding or {}
    padding_id = shipped.get("pad_id", pad_id)
    if vocab_size is not None and not 0 <= padding_id < vocab_size:
        raise ValueError(
            f"the padding id {padding_id} has no row in the model's token embedding "
            f"({vocab_size} rows): padded batches could not be embedded; give the model's "
            f"pad_token_id or a tokenizer that pads with one of its ids"
        )
    tok.no_padding()
    tok.no_truncation()
    tok.enable_padding(
        direction="right",
        pad_id=padding_id,
        pad_type_id=shipped.get("pad_type_id", 0),
        pad_token=shipped.get("pad_token", "[PAD]"),
    )
    return tok


def word_spans(text: str) -> list[tuple[int, int]]:
    """The words of ``text`` as (start, end) character spans, in order: runs of characters
    between whitespace, each punctuation character (Unicode category P) a word of its own.

    The one word rule of multihead: :func:`tokenize`'s ``word_ids`` and the focus words of
    :func:`multihead.explain` both follow it. BERT's pre-tokenizer also splits symbols such as
    "$" and "+" and every CJK character; those stay inside their word here.
    """
    spans: list[tuple[int, int]] = []
    start: int | None = None
    for i, ch in enumerate(text):
        if ch.isspace() or unicodedata.category(ch).startswith("P"):
            if start is not None:
                spans.append((start, i))
                start = None
            if not ch.isspace():
                spans.append((i, i + 1))
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(text)))
    return spans


def tokenize(
    tokenizer: Tokenizer,
    texts: str | Sequence[str],
    *,
    max_seq_length: int,
    device: torch.device | str = "cpu",
    stacklevel: int = 2,
) -> TokenBatch:
    """Tokenise texts, padded to the longest, truncated at ``max_seq_length`` tokens.

    Args:
        tokenizer: a tokenizer from :func:`prepare_tokenizer` (pads, does not truncate).
        texts: one text or a sequence of B texts.
        max_seq_length: the most tokens per text, special tokens included.
        device: where the batch's tensors go.
        stacklevel: passed to :func:`warnings.warn`, so the warning names the caller's line.

    Returns:
        A :class:`TokenBatch` of B texts, each (B, T): display tokens, trimmed offsets and word
        ids as the module docstring says.

    Raises:
        ValueError: ``texts`` is empty or holds text that is not valid Unicode.
        TypeError: ``texts`` holds something other than strings.

    Warns:
        TruncationWarning: when a text is longer than ``max_seq_length`` tokens and is cut.
    """
    items = [texts] if isinstance(texts, str) else list(texts)
    if not items:
        raise ValueError("texts must hold at least one text, got none")
    for i, text in enumerate(items):
        check_text(f"texts[{i}]", text)
    tokenizer.enable_truncation(max_length=max_seq_length)
    encodings = tokenizer.encode_batch(items)
    truncated = [len(e.overflowing) > 0 for e in encodings]
    # Not every tokenizers release fills ``overflowing`` (0.23.2 leaves it empty): a text that
    # fills the limit without it is encoded once more with one token of room, to tell.
    full = [
        i
        for i, e in enumerate(encodings)
        if not truncated[i] and sum(e.attention_mask) == max_seq_length
    ]
    if full:
        tokenizer.enable_truncation(max_length=max_seq_length + 1)
        roomier = tokenizer.encode_batch([items[i] for i in full])
        tokenizer.enable_truncation(max_length=max_seq_length)
        for i, e in zip(full, roomier, strict=True):
            truncated[i] = sum(e.attention_mask) > max_seq_length
    if any(truncated):
        which = [i for i, cut in enumerate(truncated) if cut]
        warnings.warn(
            f"{len(which)} of {len(items)} texts are longer than max_seq_length="
            f"{max_seq_length} tokens and were truncated (texts {which[:10]})",
            TruncationWarning,
            stacklevel=stacklevel,
        )
    input_ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)  # (B, T)
    attention_mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64)
    token_type_ids = torch.tensor([e.type_ids for e in encodings], dtype=torch.int64)
    special = torch.tensor([e.special_tokens_mask for e in encodings], dtype=torch.bool)
    special |= attention_mask == 0
    tokens, offsets, word_ids = [], [], []
    for text, e, n in zip(items, encodings, attention_mask.sum(1).tolist(), strict=True):
        shown, spans, words = _read(text, e.tokens[:n], e.offsets[:n], e.special_tokens_mask[:n])
        tokens.append(shown)
        offsets.append(spans)
        word_ids.append(words)
    return TokenBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        token_type_ids=token_type_ids.to(device),
        tokens=tokens,
        special_mask=special.to(device),
        truncated=truncated,
        offsets=offsets,
        word_ids=word_ids,
    )


def _read(
    text: str, pieces: list[str], offsets: list[tuple[int, int]], special: list[int]
) -> tuple[list[str], list[tuple[int, int]], list[int | None]]:
    """One text's display tokens, whitespace-trimmed offsets and word ids (the module's rules)."""
    word_at: list[int | None] = [None] * len(text)
    for w, (s, e) in enumerate(word_spans(text)):
        word_at[s:e] = [w] * (e - s)
    tokens: list[str] = []
    spans: list[tuple[int, int]] = []
    words: list[int | None] = []
    for piece, (s, e), is_special in zip(pieces, offsets, special, strict=True):
        if is_special:
            tokens.append(piece)
            spans.append((s, e))
            words.append(None)
            continue
        # A piece that is only a word-boundary marker ("▁", "Ġ") is whitespace, whatever
        # characters its offsets point at (SentencePiece maps a prepended "▁" onto the first
        # letter).
        marker_only = not piece.strip(_MARKERS + " ")
        start, end = (s, s) if marker_only else _trim(text, s, e)
        if marker_only:
            shown = "␣"
        else:
            shown = text[start:end] or (text[s:e] or " ").translate(_BLANKS)
        tokens.append(shown)
        spans.append((start, end))
        words.append(word_at[start] if end > start else None)
    _number_byte_pieces(tokens, spans)
    return tokens, spans, words


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    """(start, end) without the whitespace at either end; (end, end) for whitespace alone, so
    that a word's text never starts with the space its first piece carries."""
    piece = text[start:end]
    core = piece.strip()
    if not core:
        return end, end
    s = start + piece.index(core)
    return s, s + len(core)


def _number_byte_pieces(tokens: list[str], spans: list[tuple[int, int]]) -> None:
    """Label in place the pieces of a character that byte-level BPE split ("東" as three
    bytes, each piece spanning the whole character): "東1/3", "東2/3", "東3/3", so that a
    picture does not show one character three times over."""
    i = 0
    while i < len(tokens):
        j = i
        while j + 1 < len(tokens) and spans[j + 1] == spans[i] and spans[i][1] > spans[i][0]:
            j += 1
        if j > i:
            for k in range(i, j + 1):
                tokens[k] = f"{tokens[k]}{k - i + 1}/{j - i + 1}"
        i = j + 1
