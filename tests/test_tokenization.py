"""The text floor's tokenize: which texts were cut at max_seq_length, on any tokenizers release."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

pytest.importorskip("tokenizers", reason="the pretrained extra brings tokenizers")

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from multihead.text.tokenization import TruncationWarning, prepare_tokenizer, tokenize  # noqa: E402

VOCAB = {"[PAD]": 0, "[UNK]": 1, "a": 2, "b": 3, "c": 4}


def _tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return prepare_tokenizer(tok, pad_id=0)


class _NoOverflow:
    """A tokenizer whose encodings report no overflow, as tokenizers 0.23.2's do."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok

    def enable_truncation(self, **kwargs: Any) -> None:
        self.tok.enable_truncation(**kwargs)

    def encode_batch(self, texts: list[str]) -> list[Any]:
        return [_Encoding(e) for e in self.tok.encode_batch(texts)]


class _Encoding:
    def __init__(self, e: Any) -> None:
        self.e = e
        self.overflowing: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.e, name)


@pytest.mark.parametrize("report", ["overflowing", "no overflowing"])
def test_only_texts_longer_than_the_limit_count_as_truncated(report: str) -> None:
    tok: Any = _tokenizer() if report == "overflowing" else _NoOverflow(_tokenizer())
    texts = ["a b c", "a b", "a b c a", "c"]  # 3 tokens: exactly the limit; 4: one too many
    with pytest.warns(TruncationWarning, match=r"1 of 4 texts .* \(texts \[2\]\)"):
        batch = tokenize(tok, texts, max_seq_length=3)
    assert batch.truncated == [False, False, True, False]
    assert batch.input_ids.tolist() == [[2, 3, 4], [2, 3, 0], [2, 3, 4], [4, 0, 0]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a text that fills the limit exactly is not cut
        assert tokenize(tok, ["a b c"], max_seq_length=3).truncated == [False]
