"""Text in, tensors out, for BERT encoders: tokenised batches and sentence embeddings.

:class:`~multihead.models.bert.BertModel` keeps the public names (``tokenize``, ``encode``,
``mean_pool``, ``tokenizer``) and delegates here. Nothing in this module knows the model's layers:
``encode`` only needs something that maps ``(input_ids, attention_mask, token_type_ids)`` to a
``last_hidden_state`` (B, T, E) and can ``tokenize``.

The tokenizer is a ``tokenizers.Tokenizer`` (the ``pretrained`` extra); it is imported only when
one is set, so importing this module costs nothing beyond torch.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead._checks import check_positive_int, describe
from multihead._files import few

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from multihead.models.bert import BertModel

__all__ = [
    "BertBatch",
    "TruncationWarning",
    "check_text",
    "check_token_ids",
    "prepare_tokenizer",
    "tokenize",
    "mean_pool",
    "encode",
]


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
class BertBatch:
    """Tokenised text, padded to the batch's longest sequence (see :func:`tokenize`).

    Attributes:
        input_ids: (B, T) int64.
        attention_mask: (B, T) int64, 1 = a real token (Hugging Face's convention).
        token_type_ids: (B, T) int64.
        tokens: each text's tokens, [CLS] and [SEP] included, padding excluded.
        special_mask: (B, T) bool, True at special tokens ([CLS], [SEP], [PAD]).
        truncated: whether each text was cut at ``max_seq_length``.
        offsets: per text, per token (as ``tokens``), the (start, end) characters in the text;
            (0, 0) for special tokens.
        word_ids: per text, per token, the index of the word it belongs to; None for specials.
    """

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor
    tokens: list[list[str]]
    special_mask: Tensor
    truncated: list[bool]
    offsets: list[list[tuple[int, int]]]
    word_ids: list[list[int | None]]

    def to(self, device: torch.device | str) -> BertBatch:
        """The same batch with its tensors on ``device``."""
        return BertBatch(
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
    beyond = sorted((i, token) for token, i in vocab.items() if i >= vocab_size)
    if beyond:
        raise ValueError(
            f"the tokenizer has ids up to {beyond[-1][0]}, beyond the {vocab_size} rows of the "
            f"model's token embedding (vocab_size): "
            f"{few([f'{token!r} ({i})' for i, token in beyond])} cannot be embedded; use the "
            f"tokenizer saved with these weights"
        )


def prepare_tokenizer(tokenizer: Any, *, pad_id: int, vocab_size: int | None = None) -> Tokenizer:
    """A copy of ``tokenizer`` that pads to the batch's longest text and does not truncate.

    Files such as MiniLM's pad every text to a fixed 128 and truncate at 128; :func:`tokenize`
    sets the truncation the model wants on each call instead. The caller's object is untouched.

    Args:
        tokenizer: a ``tokenizers.Tokenizer``.
        pad_id: the [PAD] id when the file names none (the model's ``pad_token_id``).
        vocab_size: the rows of the model's token embedding, when known: every id of the
            tokenizer must have one (:func:`check_token_ids`).

    Raises:
        TypeError: ``tokenizer`` is not a ``tokenizers.Tokenizer``.
        ValueError: ids beyond ``vocab_size``.
    """
    from tokenizers import Tokenizer

    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(
            f"tokenizer must be a tokenizers.Tokenizer or None, got {type(tokenizer).__name__}"
        )
    if vocab_size is not None:
        check_token_ids(tokenizer, vocab_size)
    tok = Tokenizer.from_str(tokenizer.to_str())
    shipped = tok.padding or {}
    tok.no_padding()
    tok.no_truncation()
    tok.enable_padding(
        direction="right",
        pad_id=shipped.get("pad_id", pad_id),
        pad_type_id=shipped.get("pad_type_id", 0),
        pad_token=shipped.get("pad_token", "[PAD]"),
    )
    return tok


def tokenize(
    tokenizer: Tokenizer,
    texts: str | Sequence[str],
    *,
    max_seq_length: int,
    device: torch.device | str = "cpu",
    stacklevel: int = 2,
) -> BertBatch:
    """Tokenise texts, padded to the longest, truncated at ``max_seq_length`` tokens.

    Args:
        tokenizer: a tokenizer from :func:`prepare_tokenizer` (pads, does not truncate).
        texts: one text or a sequence of B texts.
        max_seq_length: the most tokens per text, [CLS] and [SEP] included.
        device: where the batch's tensors go.
        stacklevel: passed to :func:`warnings.warn`, so the warning names the caller's line.

    Returns:
        A :class:`BertBatch` of B texts, each (B, T).

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
    lengths = attention_mask.sum(1).tolist()
    return BertBatch(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask.to(device),
        token_type_ids=token_type_ids.to(device),
        tokens=[e.tokens[:n] for e, n in zip(encodings, lengths, strict=True)],
        special_mask=special.to(device),
        truncated=truncated,
        offsets=[list(e.offsets[:n]) for e, n in zip(encodings, lengths, strict=True)],
        word_ids=[list(e.word_ids[:n]) for e, n in zip(encodings, lengths, strict=True)],
    )


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean over real tokens, L2-normalised, as sentence-transformers' Pooling + Normalize.

    Args:
        hidden: (B, T, E).
        attention_mask: (B, T) int or bool, 1 = a real token.

    Returns:
        (B, E), each row of unit length.
    """
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    summed = (hidden * mask).sum(1)  # (B, E)
    counts = mask.sum(1).clamp(min=1e-9)  # (B, 1)
    return F.normalize(summed / counts, p=2, dim=1)


def encode(model: BertModel, sentences: str | Sequence[str], *, batch_size: int = 32) -> Tensor:
    """Sentence embeddings: mean over real tokens, L2-normalised (sentence-transformers').

    Texts are sorted by length and run ``batch_size`` at a time (little padding), in eval mode
    without gradients; the result is in the input order.

    Args:
        model: the encoder (it tokenises, and its forward returns ``last_hidden_state``).
        sentences: one text or a sequence of N texts.
        batch_size: texts per forward.

    Returns:
        (N, E) on the model's device ((1, E) for a single text).

    Warns:
        TruncationWarning: when a text is longer than ``max_seq_length`` tokens and is cut.
    """
    items = [sentences] if isinstance(sentences, str) else list(sentences)
    for i, text in enumerate(items):
        check_text(f"sentences[{i}]", text)
    check_positive_int("batch_size", batch_size)
    ref = model.embeddings.word.weight
    out = torch.empty(len(items), model.config.hidden_size, device=ref.device, dtype=ref.dtype)
    # Longest first, so each batch pads little.
    order = sorted(range(len(items)), key=lambda i: -len(items[i]))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                batch = model.tokenize([items[i] for i in idx])
                hidden = model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
                out[idx] = mean_pool(hidden.last_hidden_state, batch.attention_mask)
    finally:
        model.train(was_training)
    return out
