"""Models built from multihead's layers, pure modules (ids in, hidden states or logits out): a BERT
encoder (``BertModel``, configured by a ``BertConfig``) and a small causal LM (``TransformerLM``,
an ``LMConfig``). Nothing here reads text or checkpoints of other libraries: that is
:mod:`multihead.text` and :mod:`multihead.pretrained`, above this package."""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "BertModel": "multihead.models.bert",
    "BertConfig": "multihead.models.bert_config",
    "TransformerLM": "multihead.models.lm",
    "LMConfig": "multihead.models.lm_config",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)
