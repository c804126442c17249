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
:mod:`multihead.explanation.result`, exported here as :class:`Explanation`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from multihead._checks import check_index, check_indices, describe, is_int
from multihead.circuits.decompose.qk_attribution import qk_attribution
from multihead.explanation.focus import (
    LayerFocus,
    choose_focus,
    layer_focus,
    named_word,
    word_groups,
    word_text,
)
from multihead.explanation.head_effects import (
    ablated_weights,
    check_heads,
    every_head,
    importance_measure,
)
from multihead.explanation.head_effects import importance as head_effect_importance
from multihead.explanation.result import Explanation
from multihead.heads import HeadName, parse_head
from multihead.memory_budget import (
    DEFAULT_MEMORY_LIMIT,
    FLOAT32_BYTES,
    check_memory_limit,
    format_bytes,
)
from multihead.observe.head_summary import HeadStatistics
from multihead.pretrained.text_loader import load_text_model
from multihead.text.model import TextModel
from multihead.text.tokenization import TokenBatch, TruncationWarning, check_text

__all__ = [
    "explain",
    "DEFAULT_TEXT",
    "DEFAULT_FOCUS",
    "explain_peak_bytes",
]

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
DEFAULT_FOCUS = "it"

# The peak, in copies of the (L, H, T, T) float32 weights: the captured layers beside their
# stack, then the weights beside the page's or the pictures' working copies; one more for the
# ablated run's weights.
_PEAK_COPIES = 3


def explain_peak_bytes(num_layers: int, num_heads: int, num_tokens: int, *, ablate: bool) -> int:
    """What :func:`explain` holds at its peak for T tokens, estimated from the shapes alone.

    ``(3 + ablate) · 4 · L · H · T²`` bytes: every head's weights (L, H, T, T) in float32, held
    once (twice with ``ablate``), plus up to two working copies while they are captured and
    while the page and pictures are made from them (:meth:`Explanation.save`). The model, its
    activations and the importance runs (one (T, E) forward at a time) are not counted: they
    grow with T, not T².
    """
    copies = _PEAK_COPIES + (1 if ablate else 0)
    return copies * FLOAT32_BYTES * num_layers * num_heads * num_tokens**2


def _tokens_that_fit(num_layers: int, num_heads: int, limit: int, *, ablate: bool) -> int:
    """The most tokens whose :func:`explain_peak_bytes` stays within ``limit``."""
    t = math.isqrt(limit // explain_peak_bytes(num_layers, num_heads, 1, ablate=ablate))
    while explain_peak_bytes(num_layers, num_heads, t + 1, ablate=ablate) <= limit:
        t += 1  # isqrt of the floored quotient may fall one short
    return t


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
    memory_limit: int = DEFAULT_MEMORY_LIMIT,
    qk: HeadName | None = None,
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
        model: a :class:`~multihead.text.TextModel` (multihead's BERT or any Hugging Face text
            model, e.g. from :func:`multihead.pretrained.load_text_model`); default
            all-MiniLM-L6-v2 (``load_text_model()``, loaded once per process).
        layers: the layers (0-based) the pictures and ``top_words`` cover; default all.
        heads: the heads they cover; default all.
        ablate: (layer, head) pairs to zero in a second run: :attr:`Explanation.ablation` and
            :attr:`Explanation.ablated_top_words` show what changes without them.
        importance: also score every head by how far zeroing it moves what the model puts out
            (:attr:`Explanation.importance`; one extra forward per head): for a causal
            language model with its head (``load_text_model(..., head="lm")``), the KL
            divergence of the next-token distribution at the focus; else the cosine distance
            of the sentence embedding (:mod:`multihead.explanation.head_effects`).
        memory_limit: bytes the weights may take at their peak (:func:`explain_peak_bytes`,
            from L, H and the text's T; default 4 GiB). A text longer than fits is cut to the
            tokens that fit, with a warning, before anything is captured.
        qk: a head, ``"L1H3"`` or ``(1, 3)``: also split its score of the key it attends to
            most from the focus token into (query-side, key-side) component pairs
            (:func:`multihead.qk_attribution`; a causal LM's text model only):
            :attr:`Explanation.qk`, shown on the page beside the head view.

    Returns:
        An :class:`Explanation`: every layer's and head's weights (L, H, T, T), head statistics,
        per covered layer the focus token's top words.

    Raises:
        ValueError: empty text, text that is not valid Unicode, or text with no word the
            tokenizer keeps (only zero-width or control characters); a focus word not in the
            text (the message lists the tokens) or cut off by truncation; a ``memory_limit``
            too small for a single word; focus and focus_index both
            given; a layer/head/token index out of range.
        TypeError: an argument of the wrong type (a ``model`` that is not a TextModel).

    Warns:
        TruncationWarning: (a UserWarning) the text is longer than the model takes, or than
            ``memory_limit`` allows; the message says where it was cut and why.
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
    model = load_text_model() if model is None else _check_model(model)
    causal = model.causal
    n_layers, n_heads = model.num_layers, model.num_heads
    layer_list = check_indices("layers", layers, n_layers, "layers") or list(range(n_layers))
    head_list = check_indices("heads", heads, n_heads, "heads") or list(range(n_heads))
    ablate_list = None if ablate is None else check_heads("ablate", ablate, n_layers, n_heads)
    if not isinstance(importance, bool):
        raise TypeError(f"importance must be a bool, got {describe(importance)}")
    if focus_index is not None and not is_int(focus_index):
        raise TypeError(f"focus_index must be an int or None, got {describe(focus_index)}")
    memory_limit = check_memory_limit("memory_limit", memory_limit)
    qk_head = None
    if qk is not None:
        raw = parse_head("qk", qk)
        qk_layer = check_index(f"qk {qk!r}: layer", raw[0], n_layers, "layers")
        qk_head = (qk_layer, check_index(f"qk {qk!r}: head", raw[1], n_heads, "heads"))

    with warnings.catch_warnings():
        # Said below in explain's own words, with where the text was cut.
        warnings.simplefilter("ignore", TruncationWarning)
        batch = model.tokenize(text)
    if all(w is None for w in batch.word_ids[0]):
        raise ValueError(
            f"text must hold at least one word the tokenizer keeps, got {text[:40]!r}: only "
            f"{' '.join(batch.tokens[0])} (zero-width or control characters are dropped)"
        )
    cut_at = model.max_seq_length
    over_budget = None  # (tokens, peak bytes) when the memory limit cuts the text
    fits = _tokens_that_fit(n_layers, n_heads, memory_limit, ablate=ablate_list is not None)
    if len(batch.tokens[0]) > fits:
        over_budget = (
            len(batch.tokens[0]),
            explain_peak_bytes(
                n_layers, n_heads, len(batch.tokens[0]), ablate=ablate_list is not None
            ),
        )
        batch, cut_at = _first_tokens(model, text, batch, fits, memory_limit), fits
    tokens = batch.tokens[0]
    t = len(tokens)
    offsets = [(int(o[0]), int(o[1])) for o in batch.offsets[0]]
    word_ids = list(batch.word_ids[0])
    special = [bool(x) for x in batch.special_mask[0, :t].tolist()]
    # A decoder parks the attention it has nowhere else to put on its first token (the
    # attention sink): set apart from the words, as [CLS] and [SEP] are, unless it is special
    # already (a BOS token).
    sink = 0 if causal and not special[0] else None
    apart = [is_special or i == sink for i, is_special in enumerate(special)]
    truncated = bool(batch.truncated[0]) or over_budget is not None
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
        max_tokens=cut_at,
    )
    if over_budget is not None:
        warnings.warn(
            f"the text's {over_budget[0]} tokens would hold {format_bytes(over_budget[1])} of "
            f"attention weights ({n_layers} layers × {n_heads} heads × T² × 4 bytes, with "
            f"working copies), over memory_limit={format_bytes(memory_limit)}: only its first "
            f"{t} tokens were read, up to {text[-40:]!r}; raise the limit to read more",
            TruncationWarning,
            stacklevel=2,
        )
    elif truncated:
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

    groups = word_groups(word_ids, apart)
    own = next((g for g in word_groups(word_ids, special) if focus_at in g), [focus_at])

    def tops(weights: Tensor) -> list[LayerFocus]:
        return [
            layer_focus(weights, layer, head_list, focus_at, text, tokens, offsets, groups, apart)
            for layer in layer_list
        ]

    ablation = None if ablate_list is None else ablated_weights(model, batch, ablate_list)
    split = None
    if qk_head is not None:  # the key the head attends to most from the focus
        key = int(weights[qk_head[0], qk_head[1], focus_at].argmax())
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        split = qk_attribution(
            model, inputs, layer=qk_head[0], head=qk_head[1], query=focus_at, key=key
        )
    return Explanation(
        text=text,
        tokens=tokens,
        weights=weights,
        statistics=statistics,
        focus_index=focus_at,
        focus_token=tokens[focus_at],
        # the word as the user named it, else the tokens' word
        focus_word=(focus is not None and named_word(text, focus, focus_at, offsets))
        or word_text(text, tokens, offsets, own),
        layers=layer_list,
        heads=head_list,
        top_words=tops(weights),
        special=special,
        sink=sink,
        word_ids=word_ids,
        model_name=model.name,
        truncated=truncated,
        importance=head_effect_importance(model, batch, focus_at) if importance else None,
        importance_measure=importance_measure(model) if importance else None,
        ablation=ablation,
        ablated_top_words=None if ablation is None else tops(ablation.weights),
        causal=causal,
        qk=split,
    )


def _check_model(model: Any) -> TextModel:
    if isinstance(model, TextModel):
        return model
    raise TypeError(
        f"model must be a multihead.text.TextModel (a model with its tokenizer: load one with "
        f"multihead.pretrained.load_text_model(directory), or wrap one with "
        f"TextModel(model, tokenizer)), got {type(model).__name__}"
    )


def _first_tokens(
    model: TextModel, text: str, batch: TokenBatch, fits: int, limit: int
) -> TokenBatch:
    """``text`` tokenized again, cut after its first words so that at most ``fits`` tokens
    remain, the special tokens included (the tokenizer's own truncation, at a smaller length)."""
    word_ids = list(batch.word_ids[0])
    offsets = [(int(s), int(e)) for s, e in batch.offsets[0]]
    words = [i for i, w in enumerate(word_ids) if w is not None]
    # the special tokens after the last word ([SEP]) stay when the text is cut
    trailing = len(word_ids) - 1 - words[-1]
    keep = fits - trailing
    while True:
        kept = [i for i in words if i < keep]
        if not kept:
            raise ValueError(
                f"memory_limit={format_bytes(limit)} leaves room for {fits} tokens, too few for "
                f"one word of the text: raise it"
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncationWarning)
            cut = model.tokenize(text[: offsets[kept[-1]][1]])
        if len(cut.tokens[0]) <= fits:
            return cut
        # a prefix may tokenize into more pieces at its edge: cut that many tokens more
        keep -= len(cut.tokens[0]) - fits
