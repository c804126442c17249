"""Models built from multihead's layers: a BERT encoder (``bert``, its text path in ``text``) and a
small causal LM (``lm``). Nothing here reads checkpoints of other libraries: that is
:mod:`multihead.pretrained`, above this package."""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "BertModel": "multihead.models.bert",
    "BertConfig": "multihead.models.bert_config",
    "BertBatch": "multihead.models.text",
    "TransformerLM": "multihead.models.lm",
    "LMConfig": "multihead.models.lm_config",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
