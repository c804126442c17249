"""Models built from multihead's layers: a BERT encoder (``bert``), a small causal LM (``lm``)."""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "BertModel": "multihead.models.bert",
    "BertConfig": "multihead.models.bert",
    "TransformerLM": "multihead.models.lm",
    "LMConfig": "multihead.models.lm",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
