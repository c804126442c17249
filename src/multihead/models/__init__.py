"""Models built from multihead's layers: a BERT encoder (``bert``), a small causal LM (``lm``)."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "BertModel": "multihead.models.bert",
    "BertConfig": "multihead.models.bert",
    "TransformerLM": "multihead.models.lm",
    "LMConfig": "multihead.models.lm",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'multihead.models' has no attribute {name!r}")
