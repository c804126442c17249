"""``multihead.explain``: what does a word attend to, in every layer and head of a real model?

The library entry point that the CLI (``multihead explain``) and notebooks share::

    >>> from multihead import explain
    >>> ex = explain("The animal didn't cross the street because it was too tired.", focus="it")
    ... # doctest: +SKIP
    >>> ex.top_words[-1].words[0].word  # doctest: +SKIP
    'animal'
    >>> ex.save("attention/")  # doctest: +SKIP

In a notebook, the returned :class:`Explanation` shows the interactive page inline.
"""

from __future__ import annotations

import functools
import html
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead.observe.capture import capture
from multihead.observe.statistics import HeadStatistics

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from multihead.models.bert import BertBatch, BertModel

__all__ = [
    "explain",
    "Explanation",
    "LayerFocus",
    "AttendedWord",
    "DEFAULT_TEXT",
    "DEFAULT_FOCUS",
    "FORMATS",
]

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
DEFAULT_FOCUS = "it"
FORMATS: tuple[str, ...] = ("png", "svg", "html")
_TOP = 3


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


@dataclass
class Explanation:
    """One text's attention in every layer and head, with a focus token.

    Attributes:
        text: the input text (cut to what the model read when it was truncated).
        tokens: the T tokens, [CLS] and [SEP] included.
        weights: (L, H, T, T) float32 on the CPU, every layer and head.
        statistics: :class:`~multihead.observe.statistics.HeadStatistics` of every layer and head.
        focus_index: the focus token's position in ``tokens``.
        focus_token: that token.
        focus_word: the word it starts (the whole word when the tokenizer split it).
        layers: the layers the pictures and ``top_words`` cover.
        heads: the heads they cover (``top_words`` averages over these).
        top_words: per covered layer, the words the focus token attends to most.
        special: per token, whether it is a special token.
        word_ids: per token, the index of its word (None for special tokens).
        model_name: a name for the model, for titles.
        truncated: whether the text was longer than the model takes and was cut.
    """

    text: str
    tokens: list[str]
    weights: Tensor
    statistics: HeadStatistics
    focus_index: int
    focus_token: str
    focus_word: str
    layers: list[int]
    heads: list[int]
    top_words: list[LayerFocus]
    special: list[bool]
    word_ids: list[int | None] = field(repr=False)
    model_name: str = "model"
    truncated: bool = False

    @property
    def focus_head(self) -> tuple[int, int]:
        """The (layer, head) most worth a large picture: in the deepest covered layer where the
        focus token's top words include another word, the head attending most to the first of
        them (deeper layers are where words meet their referents)."""
        for lf in reversed(self.top_words):
            for word in lf.words:
                if not word.is_focus:
                    return lf.layer, word.head
        return self.layers[-1], self.heads[0]

    # -- pictures -------------------------------------------------------------------------------

    def grid_figure(self) -> Figure:
        """The covered layers × heads heatmaps (matplotlib; needs the ``viz`` extra)."""
        from multihead.viz.plots import grid_figure

        return grid_figure(
            self.weights[self.layers][:, self.heads],
            self.tokens,
            layers=self.layers,
            heads=self.heads,
            focus=self.focus_index,
            title=f"Attention in {self.model_name} (rows: queries, columns: keys; "
            f"focus: {self.focus_token!r}, token {self.focus_index})",
        )

    def head_figure(self, layer: int | None = None, head: int | None = None) -> Figure:
        """A large view of one head (default :attr:`focus_head`)."""
        from multihead.viz.plots import head_figure

        default_layer, default_head = self.focus_head
        layer = default_layer if layer is None else _index(layer, self.weights.shape[0], "layer")
        head = default_head if head is None else _index(head, self.weights.shape[1], "head")
        return head_figure(
            self.weights[layer, head],
            self.tokens,
            layer=layer,
            head=head,
            focus=self.focus_index,
            title=f"{self.model_name}: layer {layer}, head {head}",
        )

    def html(self) -> str:
        """The interactive page (one self-contained HTML document)."""
        from multihead.viz.page import render_page

        layer, head = self.focus_head
        return render_page(
            self.weights[self.layers][:, self.heads],
            self.tokens,
            special=self.special,
            layers=self.layers,
            heads=self.heads,
            statistics=self.statistics,
            focus=self.focus_index,
            initial=(self.layers.index(layer), self.heads.index(head)),
            title=f"Attention in {self.model_name}",
            subtitle=self.text if len(self.text) <= 300 else self.text[:300] + "…",
        )

    def save_png(self, path: str | Path) -> Path:
        """Save the heatmap grid as PNG."""
        return self._save_figure(self.grid_figure(), path, ".png")

    def save_svg(self, path: str | Path) -> Path:
        """Save the heatmap grid as SVG."""
        return self._save_figure(self.grid_figure(), path, ".svg")

    def save_html(self, path: str | Path) -> Path:
        """Save the interactive page."""
        path = Path(path)
        path.write_text(self.html(), encoding="utf-8")
        return path

    @staticmethod
    def _save_figure(fig: Figure, path: str | Path, suffix: str) -> Path:
        from multihead.viz.plots import save_figure

        path = Path(path)
        if path.suffix.lower() != suffix:
            raise ValueError(f"path must end in {suffix}, got {str(path)!r}")
        return save_figure(fig, path)

    def save(self, directory: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
        """Write the pictures and the page into ``directory`` (created if needed).

        Files: ``attention_grid.{png,svg}`` (layers × heads), ``head_L{l}_H{h}.{png,svg}`` (the
        :attr:`focus_head`, large) and ``attention.html`` (the interactive page).

        Args:
            directory: where to write.
            formats: any of "png", "svg", "html".

        Returns:
            The paths written, in that order.
        """
        formats = _check_formats(formats)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        figures = [f for f in ("png", "svg") if f in formats]
        if figures:
            from multihead.viz.plots import save_figure

            layer, head = self.focus_head
            grid, single = self.grid_figure(), self.head_figure(layer, head)
            for fmt in figures:
                written.append(save_figure(grid, directory / f"attention_grid.{fmt}"))
            for fmt in figures:
                written.append(save_figure(single, directory / f"head_L{layer}_H{head}.{fmt}"))
        if "html" in formats:
            written.append(self.save_html(directory / "attention.html"))
        return written

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and style apart from the notebook's.
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" '
            f'style="width: 100%; height: 760px; border: 1px solid #d9dee7;" '
            f'title="attention of {html.escape(self.model_name)}"></iframe>'
        )

    def summary(self) -> str:
        """Plain text: the focus token, then per covered layer its top words and [CLS]/[SEP]."""
        lines = [f"focus: {self.focus_token!r} (token {self.focus_index})"]
        for lf in self.top_words:
            words = ", ".join(f"{w.word} {w.weight:.2f} (head {w.head})" for w in lf.words)
            special = ", ".join(f"{k} {v:.2f}" for k, v in lf.special.items())
            lines.append(f"layer {lf.layer}: {words}; {special}")
        return "\n".join(lines)


def _check_formats(formats: Sequence[str] | str) -> list[str]:
    items = [formats] if isinstance(formats, str) else list(formats)
    bad = [f for f in items if f not in FORMATS]
    if bad or not items:
        raise ValueError(
            f"formats must be some of {', '.join(FORMATS)}, got {', '.join(map(repr, items))}"
        )
    return items


def _index(value: int, count: int, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    if not -count <= value < count:
        plural = "layers" if what == "layer" else "heads"
        raise ValueError(
            f"{what} {value} is out of range: the model has {count} {plural} (0..{count - 1})"
        )
    return value % count


def _indices(value: int | Sequence[int] | None, count: int, what: str) -> list[int]:
    if value is None:
        return list(range(count))
    items = [value] if isinstance(value, int) else list(value)
    if not items:
        raise ValueError(f"{what}s must name at least one {what}, got an empty sequence")
    return [_index(v, count, what) for v in items]


def _word_spans(
    text: str, offsets: list[tuple[int, int]], word_ids: list[int | None]
) -> list[tuple[int, int]]:
    """Candidate words as (start, end) character spans, in text order: the tokenizer's words
    and the whitespace-separated words with surrounding punctuation stripped ("didn't")."""
    spans: dict[int, tuple[int, int]] = {}
    for (start, end), word in zip(offsets, word_ids, strict=True):
        if word is None:
            continue
        s, e = spans.get(word, (start, end))
        spans[word] = (min(s, start), max(e, end))
    found = set(spans.values())
    for m in re.finditer(r"\S+", text):
        chunk = m.group()
        core = chunk.strip(string.punctuation)
        if core:
            start = m.start() + chunk.index(core)
            found.add((start, start + len(core)))
    return sorted(found)


def _find_focus(
    text: str,
    focus: str,
    tokens: list[str],
    offsets: list[tuple[int, int]],
    word_ids: list[int | None],
) -> int:
    """The first token of the first word matching ``focus`` case-insensitively."""
    target = focus.strip().casefold()
    if not target:
        raise ValueError("focus must be a word of the text, got an empty string")
    for start, end in _word_spans(text, offsets, word_ids):
        if text[start:end].casefold() != target:
            continue
        for i, (s, e) in enumerate(offsets):
            if word_ids[i] is not None and e > s and s >= start and e <= end:
                return i
    shown = " ".join(tokens[:80]) + (" …" if len(tokens) > 80 else "")
    raise ValueError(f"focus word {focus!r} is not in the text; its tokens are: {shown}")


def _word_groups(word_ids: list[int | None], special: list[bool]) -> list[list[int]]:
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


def _layer_focus(
    weights: Tensor,
    layer: int,
    heads: list[int],
    focus: int,
    text: str,
    tokens: list[str],
    offsets: list[tuple[int, int]],
    groups: list[list[int]],
    special: list[bool],
) -> LayerFocus:
    rows = weights[layer, heads, focus]  # (H', T)
    mean = rows.mean(0)  # (T,)
    scored = []
    for group in groups:
        per_head = rows[:, group].sum(-1)  # (H',)
        best = int(per_head.argmax())
        start, end = offsets[group[0]][0], offsets[group[-1]][1]
        word = text[start:end] if end > start else "".join(tokens[i] for i in group)
        scored.append(
            AttendedWord(
                word=word,
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
    return LayerFocus(layer=layer, words=scored[:_TOP], special=specials)


@functools.lru_cache(maxsize=1)
def _default_model() -> BertModel:
    # Loaded once per process: a notebook calling explain() in a loop shouldn't reload it.
    from multihead.pretrained import minilm

    return minilm()


def _model_name(model: Any) -> str:
    name = getattr(model, "name", None) or getattr(model, "name_or_path", None)
    return str(name) if name else type(model).__name__


def explain(
    text: str | None = None,
    *,
    focus: str | None = None,
    focus_index: int | None = None,
    model: BertModel | None = None,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
) -> Explanation:
    """Run a text through a BERT model and gather its attention around one focus token.

    Args:
        text: the text; default the seeds' "The animal didn't cross the street because it was
            too tired." (with focus "it"). Longer than the model takes: truncated, with a warning.
        focus: a word: matched case-insensitively, its first occurrence, and its first token when
            the tokenizer splits it. Default: "it" for the default text, else the first word.
        focus_index: a token position instead (0 is [CLS]); negative counts from the end.
        model: a :class:`~multihead.models.bert.BertModel` with a tokenizer; default
            :func:`multihead.pretrained.minilm`.
        layers: the layers (0-based) the pictures and ``top_words`` cover; default all.
        heads: the heads they cover; default all.

    Returns:
        An :class:`Explanation` (every layer's and head's weights, head statistics, per covered
        layer the focus token's top words).

    Raises:
        ValueError: empty text, a focus word not in the text (the message lists the tokens),
            focus and focus_index both given, a layer/head/token index out of range.
    """
    if text is None:
        text = DEFAULT_TEXT
        if focus is None and focus_index is None:
            focus = DEFAULT_FOCUS
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError("text must hold at least one word, got an empty text")
    if focus is not None and focus_index is not None:
        raise ValueError(
            f"give focus or focus_index, not both (got focus={focus!r}, focus_index={focus_index})"
        )
    model_name = None
    if model is None:
        model, model_name = _default_model(), "all-MiniLM-L6-v2"
    config = model.config
    n_layers, n_heads = config.num_hidden_layers, config.num_attention_heads
    layer_list = _indices(layers, n_layers, "layer")
    head_list = _indices(heads, n_heads, "head")

    batch: BertBatch = model.tokenize(text)
    tokens = batch.tokens[0]
    t = len(tokens)
    offsets = [(int(o[0]), int(o[1])) for o in batch.offsets[0]]
    word_ids = list(batch.word_ids[0])
    special = [bool(x) for x in batch.special_mask[0, :t].tolist()]
    truncated = bool(batch.truncated[0])
    if truncated:
        last = max(
            (e for (s, e), w in zip(offsets, word_ids, strict=True) if w is not None), default=0
        )
        text = text[:last]

    if focus_index is not None:
        focus_at = _index(focus_index, t, "focus_index")
    elif focus is not None:
        focus_at = _find_focus(text, focus, tokens, offsets, word_ids)
    else:
        focus_at = next((i for i, s in enumerate(special) if not s), 0)

    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    batch = batch.to(device)
    with torch.no_grad(), capture(model, device="cpu") as rec:
        model(
            batch.input_ids,
            attention_mask=batch.attention_mask,
            token_type_ids=batch.token_type_ids,
        )
    weights = torch.stack([w[0] for w in rec.weights]).float()  # (L, H, T, T)
    special_mask = torch.tensor([special])
    statistics = HeadStatistics.from_weights(
        [weights.unsqueeze(0)[:, i] for i in range(weights.shape[0])],
        special_mask=special_mask,
        tokens=[tokens],
    )

    groups = _word_groups(word_ids, special)
    own = next((g for g in groups if focus_at in g), [focus_at])
    start, end = offsets[own[0]][0], offsets[own[-1]][1]
    focus_word = text[start:end] if end > start else tokens[focus_at]
    top_words = [
        _layer_focus(weights, layer, head_list, focus_at, text, tokens, offsets, groups, special)
        for layer in layer_list
    ]
    return Explanation(
        text=text,
        tokens=tokens,
        weights=weights,
        statistics=statistics,
        focus_index=focus_at,
        focus_token=tokens[focus_at],
        focus_word=focus_word,
        layers=layer_list,
        heads=head_list,
        top_words=top_words,
        special=special,
        word_ids=word_ids,
        model_name=model_name or _model_name(model),
        truncated=truncated,
    )
