"""The result of :func:`multihead.explain`: the :class:`Explanation` dataclass (one text's
attention in every layer and head, around a focus token) and what it shows: the pictures
(matplotlib, the ``viz`` extra), the interactive page, the files :meth:`Explanation.save` writes,
the plain-text summary, and the notebook view.

:mod:`multihead.explanation` computes it (and exports it under its own name); nothing here runs
a model.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from multihead._checks import check_index
from multihead.circuits.decompose.qk_attribution import QKAttribution
from multihead.explanation.focus import LayerFocus
from multihead.explanation.head_effects import NEXT_TOKEN_KL, Ablation
from multihead.observe.head_summary import HeadStatistics
from multihead.viz.formats import FIGURE_FORMATS, FORMATS, check_formats, check_output_dir
from multihead.viz.page import check_page_size, render_page
from multihead.viz.plots import grid_figure, head_figure, importance_figure, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Explanation"]


@dataclass
class Explanation:
    """One text's attention in every layer and head, with a focus token.

    Attributes:
        text: the input text (cut to what the model read when it was truncated).
        tokens: the T tokens, special tokens ([CLS], [SEP], <s>, ...) included.
        weights: (L, H, T, T) float32 on the CPU, every layer and head.
        statistics: :class:`~multihead.observe.statistics.HeadStatistics` of every layer and head.
        focus_index: the focus token's position in ``tokens``.
        focus_token: that token.
        focus_word: the word it starts (the whole word when the tokenizer split it); for a
            ``focus`` given by name, that word as written in the text ("well-known" whole, where
            the tokens split it at the hyphen).
        layers: the layers the pictures and ``top_words`` cover.
        heads: the heads they cover (``top_words`` averages over these).
        top_words: per covered layer, the words the focus token attends to most.
        special: per token, whether it is a special token.
        sink: a decoder's first token when it is a word (not a special token such as BOS): the
            attention sink, where heads park the weight they have nowhere else to put. It is
            set apart from the words as special tokens are (:attr:`apart`): not a top word, its
            weight reported beside the specials', its label grey in the pictures, shaded on
            the page. None for an encoder, or when the first token is special.
        word_ids: per token, the index of its word (None for special tokens).
        model_name: a name for the model, for titles.
        truncated: whether the text was longer than the model takes and was cut.
        importance: (L, H) how far zeroing each head moves what the model puts out: for a
            causal language model with its head, the KL divergence of the next-token
            distribution at the focus; else the cosine distance of the sentence embedding (see
            :mod:`multihead.explanation.head_effects`); None when not computed.
        importance_measure: what :attr:`importance` measures, in words (None without it).
        ablation: the run with the ``ablate`` heads zeroed, or None.
        ablated_top_words: per covered layer, the focus token's top words in that run.
        causal: the model is a decoder: each token attends only to itself and earlier tokens
            (every weight above the diagonal is 0); pictures and the page draw lower triangles.
        qk: with ``explain(qk=head)``, that head's score of the key it attends to most from the
            focus token, split into component pairs (the page lists the top ones), else None.
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
    importance: Tensor | None = None
    importance_measure: str | None = None
    ablation: Ablation | None = None
    ablated_top_words: list[LayerFocus] | None = None
    causal: bool = False
    qk: QKAttribution | None = None
    sink: int | None = None

    @property
    def apart(self) -> list[bool]:
        """Per token, whether it is set apart from the words: a special token, or the
        :attr:`sink`."""
        return [s or i == self.sink for i, s in enumerate(self.special)]

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

    def _covered(self) -> Tensor:
        """(L', H', T, T): the weights of the covered layers and heads (the weights themselves,
        not a copy, when every head is covered: they may be most of the memory there is)."""
        n_layers, n_heads = self.weights.shape[:2]
        w = self.weights
        if self.layers != list(range(n_layers)):
            w = w[self.layers]
        if self.heads != list(range(n_heads)):
            w = w[:, self.heads]
        return w

    # -- pictures -------------------------------------------------------------------------------

    def grid_figure(self) -> Figure:
        """The covered layers × heads heatmaps (matplotlib; needs the ``viz`` extra)."""

        return grid_figure(
            self._covered(),
            self.tokens,
            layers=self.layers,
            heads=self.heads,
            focus=self.focus_index,
            causal=self.causal,
            apart=self.apart,
            title=f"Attention in {self.model_name} (rows: queries, columns: keys; "
            f"focus: {self.focus_token!r}, token {self.focus_index})",
        )

    def head_figure(self, layer: int | None = None, head: int | None = None) -> Figure:
        """A large view of one head (default :attr:`focus_head`)."""

        default_layer, default_head = self.focus_head
        n_layers, n_heads = self.weights.shape[:2]
        layer = default_layer if layer is None else check_index("layer", layer, n_layers, "layers")
        head = default_head if head is None else check_index("head", head, n_heads, "heads")
        return head_figure(
            self.weights[layer, head],
            self.tokens,
            layer=layer,
            head=head,
            focus=self.focus_index,
            causal=self.causal,
            apart=self.apart,
            title=f"{self.model_name}: layer {layer}, head {head}",
        )

    def importance_figure(self) -> Figure:
        """The layers × heads map of :attr:`importance`, its title saying what is measured.

        Raises:
            ValueError: no importance was computed (``explain(..., importance=False)``).
        """
        if self.importance is None:
            raise ValueError("importance_figure needs the importance: explain(importance=True)")
        measure = self.importance_measure or "importance"
        kl = measure == NEXT_TOKEN_KL
        focus = f"{self.focus_token!r} (token {self.focus_index})"
        return importance_figure(
            self.importance,
            title=f"{self.model_name}: head importance\n{measure}"
            + (f"; focus {focus}" if kl else ""),
            label="KL divergence (nats)" if kl else "cosine distance",
        )

    def html(self) -> str:
        """The interactive page (one self-contained HTML document)."""

        layer, head = self.focus_head
        return render_page(
            self._covered(),
            self.tokens,
            special=self.apart,
            layers=self.layers,
            heads=self.heads,
            statistics=self.statistics,
            importance=self.importance,
            focus=self.focus_index,
            initial=(self.layers.index(layer), self.heads.index(head)),
            title=f"Attention in {self.model_name}",
            subtitle=self.text if len(self.text) <= 300 else self.text[:300] + "…",
            causal=self.causal,
            qk=self._qk_panel(),
        )

    def _qk_panel(self, top: int = 10) -> dict[str, object] | None:
        """What the page shows of :attr:`qk`: its top pairs and the key-side components that
        rise most at its key (plain values), or None."""
        qk = self.qk
        if qk is None:
            return None
        rise = qk.key_rise()[:5] if int(qk.visible.sum()) > 1 else []
        return {
            "head": f"L{qk.layer}H{qk.head}",
            "query": qk.query,
            "key": qk.key,
            "query_token": self.tokens[qk.query],
            "key_token": self.tokens[qk.key],
            "score": round(qk.score, 5),
            "weight": round(float(qk.weights[qk.key]), 5),
            "pairs": [[a, b, round(v, 5)] for a, b, v in qk.top(top)],
            "rise": [[label, round(v, 5)] for label, v in rise],
        }

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

        path = Path(path)
        if path.suffix.lower() != suffix:
            raise ValueError(f"path must end in {suffix}, got {str(path)!r}")
        return save_figure(fig, path)

    def file_names(self, formats: Sequence[str] = FORMATS) -> list[str]:
        """The names :meth:`save` writes for ``formats``, in its order."""
        formats = check_formats("formats", formats)
        layer, head = self.focus_head
        figures = [f for f in FIGURE_FORMATS if f in formats]
        names = [f"attention_grid.{f}" for f in figures]
        names += [f"head_L{layer}_H{head}.{f}" for f in figures]
        if self.importance is not None:
            names += [f"head_importance.{f}" for f in figures]
        return names + (["attention.html"] if "html" in formats else [])

    def save(self, directory: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
        """Write the pictures and the page into ``directory`` (created if needed).

        Files: ``attention_grid.{png,svg}`` (layers × heads), ``head_L{l}_H{h}.{png,svg}`` (the
        :attr:`focus_head`, large) and ``attention.html`` (the interactive page). Every check
        runs before the first file is written: a failure leaves the disk as it was.

        Args:
            directory: where to write.
            formats: any of "png", "svg", "html" (a sequence, or one comma-separated str).

        Returns:
            The paths written, in :meth:`file_names` order.

        Raises:
            ValueError / TypeError: unknown formats; a ``directory`` that is a file, or that
                holds a directory where a file goes; a page (html) over its size limit
                (:func:`multihead.viz.page.check_page_size`).
            PermissionError: ``directory`` or a file in it is not writable.
        """
        names = self.file_names(formats)
        directory = check_output_dir("directory", directory, names)
        if "attention.html" in names:
            check_page_size(len(self.layers), len(self.heads), len(self.tokens))
        figures: dict[str, Figure] = {}
        if any(not name.endswith(".html") for name in names):  # drawn before the disk changes
            layer, head = self.focus_head
            figures = {
                "attention_grid": self.grid_figure(),
                f"head_L{layer}_H{head}": self.head_figure(layer, head),
            }
            if self.importance is not None:
                figures["head_importance"] = self.importance_figure()
        directory.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for name in names:
            stem, _, fmt = name.rpartition(".")
            path = directory / name
            written.append(
                self.save_html(path) if fmt == "html" else save_figure(figures[stem], path)
            )
        return written

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and style apart from the notebook's.
        return (
            f'<iframe srcdoc="{html.escape(self.html(), quote=True)}" '
            f'style="width: 100%; height: 760px; border: 1px solid #d9dee7;" '
            f'title="attention of {html.escape(self.model_name)}"></iframe>'
        )

    def summary(self) -> str:
        """Plain text: the focus token, then per covered layer its top words (earlier words for a
        causal model) and the special tokens apart."""
        lines = [f"focus: {self.focus_token!r} (token {self.focus_index})"]
        for lf in self.top_words:
            words = ", ".join(f"{w.word} {w.weight:.2f} (head {w.head})" for w in lf.words)
            special = ", ".join(f"{k} {v:.2f}" for k, v in lf.special.items())
            lines.append(f"layer {lf.layer}: {words}" + (f"; {special}" if special else ""))
        return "\n".join(lines)
