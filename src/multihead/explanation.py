"""``multihead.explain``: what does a word attend to, in every layer and head of a real model?

The library entry point that the CLI (``multihead explain``) and notebooks share::

    >>> from multihead import explain
    >>> ex = explain("The animal didn't cross the street because it was too tired.", focus="it")
    ... # doctest: +SKIP
    >>> ex.top_words[-1].words[0].word  # doctest: +SKIP
    'animal'
    >>> ex.save("attention/")  # doctest: +SKIP

In a notebook, the returned :class:`Explanation` shows the interactive page inline.

This module computes it (the focus token, the weights, head statistics, importance and
ablation); the dataclass with its pictures, page and files is
:mod:`multihead.explanation_result`, exported here as :class:`Explanation`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from multihead._checks import check_indices, describe, is_int
from multihead.explain_model import DEFAULT_MODEL_NAME, check_model, default_model, model_name
from multihead.explanation_result import Explanation
from multihead.focus import (
    AttendedWord,
    LayerFocus,
    choose_focus,
    layer_focus,
    named_word,
    word_groups,
    word_text,
)
from multihead.head_effects import ablated_weights, check_heads, every_head
from multihead.head_effects import importance as head_effect_importance
from multihead.models.text import TruncationWarning, check_text
from multihead.observe.statistics import HeadStatistics

if TYPE_CHECKING:
    from multihead.explain_model import TextModel

__all__ = [
    "explain",
    "Explanation",
    "LayerFocus",
    "AttendedWord",
    "DEFAULT_TEXT",
    "DEFAULT_FOCUS",
]

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
DEFAULT_FOCUS = "it"


def explain(
    text: str | None = None,
    *,
    focus: str | None = None,
    focus_index: int | None = None,
    model: TextModel | None = None,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    ablate: Sequence[tuple[int, int]] | None = None,
    importance: bool = True,
) -> Explanation:
    """Run a text through a model and gather its attention around one focus token.

    Args:
        text: the text; default the seeds' "The animal didn't cross the street because it was
            too tired." (with focus "it"). Longer than the model takes: truncated, with a warning.
        focus: a word: matched case-insensitively, its first occurrence, and its first token when
            the tokenizer splits it. Default: "it" for the default text, else the first word;
            for a causal (decoder) model the last word's last token, which sees every token.
        focus_index: a token position instead (0 is [CLS] in BERT); negative counts from the
            end.
        model: a :class:`~multihead.models.bert.BertModel` with a tokenizer, or an
            :class:`~multihead.hf.text.HFTextModel` (any Hugging Face text model, e.g. from
            :func:`multihead.hf.text.load_hf`); default :func:`multihead.pretrained.minilm`.
        layers: the layers (0-based) the pictures and ``top_words`` cover; default all.
        heads: the heads they cover; default all.
        ablate: (layer, head) pairs to zero in a second run: :attr:`Explanation.ablation` and
            :attr:`Explanation.ablated_top_words` show what changes without them.
        importance: also score every head by how far zeroing it moves the sentence embedding
            (:attr:`Explanation.importance`; one extra forward per head).

    Returns:
        An :class:`Explanation`: every layer's and head's weights (L, H, T, T), head statistics,
        per covered layer the focus token's top words.

    Raises:
        ValueError: empty text or text that is not valid Unicode; a focus word not in the text
            (the message lists the tokens) or cut off by truncation; focus and focus_index both
            given; a layer/head/token index out of range; a model without a tokenizer.
        TypeError: an argument of the wrong type.

    Warns:
        TruncationWarning: (a UserWarning) the text is longer than the model takes; the message
            says where it was cut.
    """
    if text is None:
        text = DEFAULT_TEXT
        if focus is None and focus_index is None:
            focus = DEFAULT_FOCUS
    check_text("text", text)
    if not text.strip():
        raise ValueError("text must hold at least one word, got an empty text")
    if focus is not None:
        check_text("focus", focus)
    if focus is not None and focus_index is not None:
        raise ValueError(
            f"give focus or focus_index, not both (got focus={focus!r}, focus_index={focus_index})"
        )
    name = None
    if model is None:
        model, name = default_model(), DEFAULT_MODEL_NAME
    model = check_model(model)
    causal = bool(getattr(model, "causal", False))
    config = model.config
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    layer_list = check_indices("layers", layers, n_layers, "layers") or list(range(n_layers))
    head_list = check_indices("heads", heads, n_heads, "heads") or list(range(n_heads))
    ablate_list = None if ablate is None else check_heads("ablate", ablate, n_layers, n_heads)
    if not isinstance(importance, bool):
        raise TypeError(f"importance must be a bool, got {describe(importance)}")
    if focus_index is not None and not is_int(focus_index):
        raise TypeError(f"focus_index must be an int or None, got {describe(focus_index)}")

    with warnings.catch_warnings():
        # Said below in explain's own words, with where the text was cut.
        warnings.simplefilter("ignore", TruncationWarning)
        batch = model.tokenize(text)
    tokens = batch.tokens[0]
    t = len(tokens)
    offsets = [(int(o[0]), int(o[1])) for o in batch.offsets[0]]
    word_ids = list(batch.word_ids[0])
    special = [bool(x) for x in batch.special_mask[0, :t].tolist()]
    truncated = bool(batch.truncated[0])
    full_text = text
    if truncated:
        last = max(
            (e for (s, e), w in zip(offsets, word_ids, strict=True) if w is not None), default=0
        )
        text = text[:last]

    focus_at = choose_focus(
        text,
        tokens,
        offsets,
        word_ids,
        special,
        focus=focus,
        focus_index=focus_index,
        causal=causal,
        cut_from=full_text if truncated else None,
        max_tokens=model.max_seq_length,
    )
    if truncated:
        warnings.warn(
            f"the text is longer than the model takes (max_seq_length={model.max_seq_length} "
            f"tokens) and was truncated: only its start was read, up to {text[-40:]!r}",
            TruncationWarning,
            stacklevel=2,
        )

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batch = batch.to(device)
    weights, _ = every_head(model, batch)  # (L, H, T, T)
    statistics = HeadStatistics.from_weights(
        [weights.unsqueeze(0)[:, i] for i in range(weights.shape[0])],  # L × (1, H, T, T)
        special_mask=torch.tensor([special]),  # (1, T)
        tokens=[tokens],
        token_ids=batch.input_ids.cpu(),  # (1, T): induction and duplicate-token scores
        causal=causal,
    )

    groups = word_groups(word_ids, special)
    own = next((g for g in groups if focus_at in g), [focus_at])

    def tops(weights: Tensor) -> list[LayerFocus]:
        return [
            layer_focus(weights, layer, head_list, focus_at, text, tokens, offsets, groups, special)
            for layer in layer_list
        ]

    ablation = None if ablate_list is None else ablated_weights(model, batch, ablate_list)
    return Explanation(
        text=text,
        tokens=tokens,
        weights=weights,
        statistics=statistics,
        focus_index=focus_at,
        focus_token=tokens[focus_at],
        # the word as the user named it, else the tokens' word
        focus_word=(focus is not None and named_word(text, focus, focus_at, offsets, word_ids))
        or word_text(text, tokens, offsets, own),
        layers=layer_list,
        heads=head_list,
        top_words=tops(weights),
        special=special,
        word_ids=word_ids,
        model_name=name or model_name(model),
        truncated=truncated,
        importance=head_effect_importance(model, batch) if importance else None,
        ablation=ablation,
        ablated_top_words=None if ablation is None else tops(ablation.weights),
        causal=causal,
    )
