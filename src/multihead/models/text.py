"""Deprecated: the tokenizer's functions moved to :mod:`multihead.tokenization` (kept one release).

``BertBatch`` is :class:`multihead.tokenization.TokenBatch`; ``tokenize``, ``prepare_tokenizer``,
``check_token_ids``, ``check_text`` and ``TruncationWarning`` keep their names there.
``mean_pool`` is :func:`multihead.text.model.mean_pool` and ``encode(model, texts)`` is
``TextModel.encode(texts)``: both above the models, so not re-exported here.
"""

from __future__ import annotations

import warnings
from typing import Any

from multihead import tokenization

_MOVED = {
    "BertBatch": "TokenBatch",
    "TruncationWarning": "TruncationWarning",
    "check_text": "check_text",
    "check_token_ids": "check_token_ids",
    "prepare_tokenizer": "prepare_tokenizer",
    "tokenize": "tokenize",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(
            f"multihead.models.text.{name} is deprecated: it is "
            f"multihead.tokenization.{_MOVED[name]}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(tokenization, _MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
