"""Any Hugging Face model: see and steer its heads through transformers' attention interface.

transformers (>= 5.15) routes the attention of most model families through one function table,
``transformers.AttentionInterface``. Importing this module registers the implementation
``"multihead"`` there (with transformers' sdpa mask function under the same name, so padding
reaches it), so that::

    import multihead.hf
    model = AutoModel.from_pretrained(path, attn_implementation="multihead")

runs every routed attention call through :func:`multihead.functional.attention` (the fused path;
the result equals ``attn_implementation="sdpa"``), and returns per-head weights equal to
``"eager"``'s with ``output_attentions=True``.

The function receives exactly what the observer channel needs: the per-head q (B, H, T, D),
k (B, Hk, S, D), v, the mask, and it returns the per-head output (B, T, H, Dv) that the module
then sends through its output projection. Each routed attention module gets an
:class:`AttentionSite` (its observers), so :func:`multihead.capture`, ``head_statistics``,
``intervene``, ``record_heads`` and ``head_importance`` accept a ``PreTrainedModel`` directly,
with layers = the routed attention modules in module order. While any observer is registered
the model runs on ``"multihead"``; its previous implementation comes back when the last one is
removed.

Attention-logit softcapping (``softcap``: Gemma-2, ...) and attention sinks (``s_aux`` /
``sinks``: GPT-OSS, ...) go to the core function's ``softcap=`` and ``sinks=``: the forward,
``output_attentions`` (with sinks in the family's own convention,
:func:`multihead.hf.forward.sink_weights_of`) and every observer see what ``"eager"`` computes.

Refused, with an error naming the model family and the feature (never a different result): a
keyword argument carrying data that sdpa would ignore but eager may honour, sinks of a shape the
core does not take, paged caches (``NotImplementedError``); and observing a family whose
attention is not routed through the interface, computed partly outside it, or made of several
calls per layer (``ValueError``).

This package is the bridge only. :mod:`multihead.hf.loading` reads a model from local files for
:func:`multihead.pretrained.load_text_model`, which wraps it with its tokenizer as a
:class:`multihead.text.TextModel` (``multihead explain --model``); ``HFTextModel`` and ``load_hf``,
which lived here before, are that class and that function.
"""

from __future__ import annotations

from multihead.hf.families import transformers_map

# importing forward registers "multihead" and its mask function in transformers
from multihead.hf.forward import NAME, attention_forward, mask_function
from multihead.hf.sites import AttentionSite, attention_sites, routed, uses_transformers

__all__ = [
    "NAME",
    "AttentionSite",
    "attention_forward",
    "attention_sites",
    "mask_function",
    "routed",
    "transformers_map",
    "uses_transformers",
]

# Names that moved to the text floor (hf/ is the bridge only; an alias here would be an arrow up)
_MOVED = {
    "load_hf": "multihead.load_text_model(dir_or_name, backend='transformers')",
    "HFTextModel": "multihead.TextModel (multihead.text)",
}


def __getattr__(name: str) -> object:
    if name in _MOVED:
        raise AttributeError(f"multihead.hf.{name} has moved to the text floor: use {_MOVED[name]}")
    raise AttributeError(f"module 'multihead.hf' has no attribute {name!r}")
