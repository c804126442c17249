"""Words and tokens: which token a focus word names, which tokens make up each word, and which
words a token attends to most.

Used by :func:`multihead.explain`. A tokenizer splits text into pieces ("didn't" -> didn ' t,
"Tokenization" -> Token ization); people name words. These helpers map between the two with
the tokens' character offsets and word ids (:mod:`multihead.text.tokenization`: its one word
rule), never by re-tokenising. A name may also cover several words written without a space
between them ("didn't", "well-known", "city."): :func:`focus_spans`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from multihead._checks import check_index
from multihead.text.tokenization import word_spans

__all__ = [
    "AttendedWord",
    "LayerFocus",
    "choose_focus",
    "default_focus",
    "find_focus",
    "focus_spans",
    "named_word",
    "layer_focus",
    "word_groups",
    "word_text",
]

# Shown in the error for a word that is not in the text, before "…".
_SHOWN_TOKENS = 80


@dataclass(frozen=True)
class AttendedWord:
    """A word the focus token attends to, in one layer.

    Attributes:
        word: the word as written in the text.
        tokens: its token positions (a word the tokenizer splits has several).
        weight: the attention the focus token pays it: summed over its tokens, mean over heads.
        head: the head that pays it the most attention.
        head_weight: that head's attention to it (summed over its tokens).
        is_focus: whether it is the focus word itself.
    """

    word: str
    tokens: tuple[int, ...]
    weight: float
    head: int
    head_weight: float
    is_focus: bool = False


@dataclass(frozen=True)
class LayerFocus:
    """Where the focus token looks in one layer.

    Attributes:
        layer: the layer (0-based).
        words: the words it attends to most (mean over the chosen heads), strongest first.
        special: attention on each special token ([CLS], [SEP]), mean over heads, reported apart
            because they soak up most of the mass in many heads.
    """

    layer: int
    words: list[AttendedWord]
    special: dict[str, float]


def focus_spans(text: str, max_length: int | None = None) -> list[tuple[int, int]]:
    """What a focus word may name, as (start, end) character spans in text order: each word of
    :func:`multihead.text.tokenization.word_spans` and each run of consecutive words with no
    whitespace between them ("didn't" is didn, ', t and the runs "didn'", "'t", "didn't");
    only those of at most ``max_length`` characters when given."""
    words = word_spans(text)
    longest = len(text) if max_length is None else max_length
    spans = []
    for i, (start, end) in enumerate(words):
        if end - start <= longest:
            spans.append((start, end))
        for next_start, next_end in words[i + 1 :]:
            if next_start != end or next_end - start > longest:  # whitespace, or too long
                break
            end = next_end
            spans.append((start, end))
    return sorted(spans)


def named_word(text: str, focus: str, at: int, offsets: list[tuple[int, int]]) -> str | None:
    """The word ``focus`` as written in ``text`` at the focus token ``at`` ("well-known" where
    the tokens split it into "well", "-", "known"), or None when no candidate there
    (:func:`focus_spans`) matches it."""
    target = focus.strip().casefold()
    start, end = offsets[at]
    for s, e in focus_spans(text, len(target)):
        if s < max(end, start + 1) and e > start and text[s:e].casefold() == target:
            return text[s:e]
    return None


def find_focus(
    text: str,
    focus: str,
    tokens: list[str],
    offsets: list[tuple[int, int]],
    word_ids: list[int | None],
    *,
    cut_from: str | None = None,
    max_tokens: int | None = None,
) -> int:
    """The position of the first token of the first word matching ``focus`` case-insensitively.

    Args:
        text: the text the tokens cover (the part the model read).
        focus: the word to find.
        tokens, offsets, word_ids: per token, as
            :class:`~multihead.text.tokenization.TokenBatch` has them for ``text``.
        cut_from: when the text was truncated, the whole text before the cut, to tell a word
            that was cut off from one that was never there.
        max_tokens: where it was truncated, in tokens (for the message).

    Raises:
        ValueError: ``focus`` is empty, is not in the text (the message lists the tokens), or
            only occurs after the truncation point.
    """
    target = focus.strip().casefold()
    if not target:
        raise ValueError("focus must be a word of the text, got an empty string")
    for start, end in focus_spans(text, len(target)):
        if text[start:end].casefold() != target:
            continue
        real = [i for i, (s, e) in enumerate(offsets) if word_ids[i] is not None and e > s]
        inside = [i for i in real if offsets[i][0] >= start and offsets[i][1] <= end]
        # else a token that runs past the word's edge ("city." as one piece, "n't" in "didn't")
        overlapping = [i for i in real if offsets[i][0] < end and offsets[i][1] > start]
        if inside or overlapping:
            return (inside or overlapping)[0]
    if cut_from is not None and any(
        cut_from[s:e].casefold() == target for s, e in focus_spans(cut_from, len(target))
    ):
        raise ValueError(
            f"focus word {focus!r} was cut off by truncation at {max_tokens} tokens: the model "
            f"reads the text only up to {text[-40:]!r}; shorten the text or focus on an earlier "
            f"word"
        )
    shown = " ".join(tokens[:_SHOWN_TOKENS]) + (" …" if len(tokens) > _SHOWN_TOKENS else "")
    raise ValueError(f"focus word {focus!r} is not in the text; its tokens are: {shown}")


def word_groups(word_ids: list[int | None], special: list[bool]) -> list[list[int]]:
    """Token positions grouped by word (consecutive tokens of one word id); specials apart."""
    groups: list[list[int]] = []
    last: int | None = None
    for i, word in enumerate(word_ids):
        if special[i] or word is None:
            last = None
            continue
        if groups and word == last:
            groups[-1].append(i)
        else:
            groups.append([i])
        last = word
    return groups


def word_text(
    text: str, tokens: list[str], offsets: list[tuple[int, int]], group: list[int]
) -> str:
    """The word that the tokens ``group`` make, as written in ``text`` (joined tokens when the
    offsets point nowhere, as for special tokens)."""
    start, end = offsets[group[0]][0], offsets[group[-1]][1]
    return text[start:end] if end > start else "".join(tokens[i] for i in group)


def layer_focus(
    weights: Tensor,
    layer: int,
    heads: list[int],
    focus: int,
    text: str,
    tokens: list[str],
    offsets: list[tuple[int, int]],
    groups: list[list[int]],
    special: list[bool],
    top: int = 3,
) -> LayerFocus:
    """Where the token ``focus`` looks in one layer: the ``top`` words, mean over ``heads``.

    Args:
        weights: (L, H, T, T) attention weights of one text.
        layer: the layer.
        heads: the heads to average over (and to name the strongest of).
        focus: the query token's position.
        text, tokens, offsets: the text, its T tokens and their character offsets.
        groups: token positions grouped by word (:func:`word_groups`).
        special: per token, whether it is a special token ([CLS], [SEP]).
    """
    rows = weights[layer, heads, focus]  # (H', T)
    mean = rows.mean(0)  # (T,)
    scored = []
    for group in groups:
        per_head = rows[:, group].sum(-1)  # (H',)
        best = int(per_head.argmax())
        scored.append(
            AttendedWord(
                word=word_text(text, tokens, offsets, group),
                tokens=tuple(group),
                weight=float(mean[group].sum()),
                head=heads[best],
                head_weight=float(per_head[best]),
                is_focus=focus in group,
            )
        )
    scored.sort(key=lambda w: -w.weight)
    specials: dict[str, float] = {}
    for i, is_special in enumerate(special):
        if is_special:
            specials[tokens[i]] = specials.get(tokens[i], 0.0) + float(mean[i])
    return LayerFocus(layer=layer, words=scored[:top], special=specials)


def default_focus(
    text: str,
    offsets: list[tuple[int, int]],
    word_ids: list[int | None],
    special: list[bool],
    *,
    causal: bool,
) -> int:
    """The focus when none is given: the first real token; for a causal model the last token of
    the last word with a letter or digit (the final "." is rarely the question), which attends
    to every token before it."""
    if not causal:
        return next((i for i, s in enumerate(special) if not s), 0)
    groups = word_groups(word_ids, special)
    worded = [g for g in groups if any(ch.isalnum() for i in g for ch in text[slice(*offsets[i])])]
    chosen = (worded or groups or [[len(special) - 1]])[-1]
    return chosen[-1]


def choose_focus(
    text: str,
    tokens: list[str],
    offsets: list[tuple[int, int]],
    word_ids: list[int | None],
    special: list[bool],
    *,
    focus: str | None,
    focus_index: int | None,
    causal: bool,
    cut_from: str | None = None,
    max_tokens: int | None = None,
) -> int:
    """The focus token's position: ``focus_index`` (checked, negative from the end), else the
    word ``focus`` (:func:`find_focus`), else :func:`default_focus`."""
    if focus_index is not None:
        return check_index("focus_index", focus_index, len(tokens), "tokens in the text")
    if focus is not None:
        return find_focus(
            text, focus, tokens, offsets, word_ids, cut_from=cut_from, max_tokens=max_tokens
        )
    return default_focus(text, offsets, word_ids, special, causal=causal)
