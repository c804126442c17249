"""multihead: multi-head attention that is correct, fast and visible.

Core (always imported): :mod:`multihead.functional` (``attention()``, the math once) and
:class:`MultiHeadAttention`. Everything else loads on first use, so ``import multihead`` costs
torch and nothing more; parts that need an extra say which one to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from multihead import functional
from multihead._lazy import lazy_getattr
from multihead.attention import MultiHeadAttention

__version__ = "0.1.0"

# public name -> the module that defines it (imported lazily, on first access)
_LAZY: dict[str, str] = {
    "FeedForward": "multihead.layer_parts",
    "TransformerEncoderLayer": "multihead.layers",
    "TransformerEncoder": "multihead.layers",
    "TransformerDecoderLayer": "multihead.layers",
    "SinusoidalPositionalEncoding": "multihead.positions",
    "LearnedPositionalEmbedding": "multihead.positions",
    "KVCache": "multihead.cache",
    "PackedBatch": "multihead.packing",
    "capture": "multihead.observe.recorder",
    "head_statistics": "multihead.observe.statistics",
    "corpus_statistics": "multihead.text.corpus",
    "head_distances": "multihead.text.corpus",
    "intervene": "multihead.observe.steering",
    "record_heads": "multihead.observe.steering",
    "head_importance": "multihead.observe.importance",
    "patch_heads": "multihead.observe.patching",
    "attribution_patching": "multihead.observe.attribution",
    "path_patching": "multihead.observe.paths",
    "logit_attribution": "multihead.observe.direct_logit_attribution",
    "LogitAttribution": "multihead.observe.direct_logit_attribution",
    "explain": "multihead.explanation",
    "TextModel": "multihead.text.model",
    "load_text_model": "multihead.pretrained.text_loader",
    "minilm": "multihead.pretrained.text_loader",
}
_SUBMODULES = (
    "models",
    "pretrained",
    "distributed",
    "observe",
    "text",
    "viz",
    "training",
    "cli",
    "hf",
)

__all__ = ["MultiHeadAttention", "functional", "__version__", *_LAZY, *_SUBMODULES]


_lazy_name = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"multihead.{name}")
    return _lazy_name(name)


def __dir__() -> list[str]:
    return sorted(__all__)
