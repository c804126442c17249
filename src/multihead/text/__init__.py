"""Text in, vectors and head summaries out, for any model: the text floor.

:class:`TextModel` (``model.py``) holds a pure model (multihead's BERT or a transformers model) with
its tokenizer and pooling (``mean_pool``, ``last_token_pool``): one ``tokenize``
(:mod:`multihead.text.tokenization`: display tokens as written, one word rule), ``encode``,
``sentence_embedding``. :func:`corpus_statistics` and :func:`head_distances` (``corpus.py``) are
the loops over texts, on ``text_batches`` of texts ``check_texts`` checked;
:mod:`multihead.observe` below reads only token batches. Load a TextModel from local files with
:func:`multihead.pretrained.load_text_model` (or :func:`multihead.pretrained.minilm`).
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "TextModel": "multihead.text.model",
    "mean_pool": "multihead.text.model",
    "last_token_pool": "multihead.text.model",
    "corpus_statistics": "multihead.text.corpus",
    "head_distances": "multihead.text.corpus",
    "text_batches": "multihead.text.corpus",
    "check_texts": "multihead.text.corpus",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
