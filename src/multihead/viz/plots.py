"""Heatmaps of attention weights with matplotlib: a layers × heads grid and a single-head view.

Figures come from :func:`multihead.viz.figure.new_figure` (no pyplot, no global state). Row =
query, column = key, as in the weights' (T, S) layout.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead._files import atomic_write
from multihead.viz.figure import (
    APART_COLOUR,
    matplotlib_module,
    new_figure,
    plain_text,
    wrap_text,
)
from multihead.viz.fonts import (
    MissingGlyphsWarning,
    drawn_with_fonts,
    fonts,
    missing_glyphs,
    quiet_glyph_warnings,
)
from multihead.viz.formats import FIGURE_FORMATS

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["grid_figure", "head_figure", "importance_figure", "effects_figure", "save_figure"]

# Above this many tokens the grid's small cells drop their token labels (unreadable anyway).
_GRID_LABEL_LIMIT = 40
# Maps longer than this are max-pooled to it before they are drawn (a grid cell is 170 pixels
# at 100 dpi): what matplotlib copies then grows with the figure, not with T².
_GRID_CELLS = 256
# The head figure labels every token up to this many; beyond, it is max-pooled to this size
# and drawn unlabelled, at a fixed size (a labelled one would grow past what can be drawn).
_HEAD_LABEL_LIMIT = 512
_CMAP = "Blues"
# zlib's level for PNGs: Pillow's default (6) takes twice as long on a tall grid for a file a
# fifth smaller.
_PNG_COMPRESSION = 1
# The grid's top margin, inches: above the title, each line of the title (10 pt), the heads'
# labels (8 pt, just above the maps).
_TITLE_PAD = 0.12
_TITLE_LINE = 0.2
_HEAD_LABELS = 0.3
# A line of the importance map's title (9 pt), inches.
_IMPORTANCE_TITLE_LINE = 0.16


def _numbers(
    layers: Sequence[int] | None,
    heads: Sequence[int] | None,
    n_layers: int,
    n_heads: int,
    what: str,
) -> tuple[list[int], list[int]]:
    """The layer and head numbers to label L × H cells with (default 0..L-1, 0..H-1)."""
    layers = list(range(n_layers)) if layers is None else list(layers)
    heads = list(range(n_heads)) if heads is None else list(heads)
    if len(layers) != n_layers or len(heads) != n_heads:
        raise ValueError(f"layers and heads must label {what}, got {len(layers)} and {len(heads)}")
    return layers, heads


def _check_weights(weights: Tensor, dims: int, what: str) -> Tensor:
    if not isinstance(weights, Tensor):
        raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if weights.dim() != dims:
        raise ValueError(f"weights must be {what}, got shape {tuple(weights.shape)}")
    return weights.detach().to("cpu", torch.float32)


def _blank_future(w: Tensor) -> Tensor:
    """(..., T, S) weights with the keys after each query set to NaN, drawn blank: a causal
    model's upper triangle is masked, not a weight of 0. Queries are the last T of S."""
    t, s = w.shape[-2:]
    future = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)  # (T, S) key after query
    return w.masked_fill(future, float("nan"))


def _fit(w: Tensor, size: int, causal: bool) -> Tensor:
    """(..., T, S) weights to draw: at most ``size`` × ``size`` cells, each the maximum of the
    weights it covers (a sharp peak stays visible); with ``causal``, the cells whose keys all
    come after their queries drawn blank (NaN), as :func:`_blank_future` does uncut."""
    t, s = w.shape[-2:]
    if t <= size and s <= size:
        return _blank_future(w) if causal else w
    import torch.nn.functional as F

    t2, s2 = min(t, size), min(s, size)
    pooled = F.adaptive_max_pool2d(w.reshape(-1, 1, t, s), (t2, s2)).reshape(*w.shape[:-2], t2, s2)
    if causal:  # cell (i, j) covers queries up to ceil((i+1)·T/t2) - 1 and keys from floor(j·S/s2)
        last_query = (torch.arange(1, t2 + 1) * t + t2 - 1) // t2 - 1  # (t2,)
        first_key = torch.arange(s2) * s // s2  # (s2,)
        future = first_key[None, :] > last_query[:, None] + (s - t)  # (t2, s2) queries last
        pooled = pooled.masked_fill(future, float("nan"))
    return pooled


def _check_tokens(tokens: Sequence[str], t: int, s: int) -> None:
    # Queries are the last T of the S positions (bottom-right, as causal masks align them).
    if len(tokens) != s or t > s:
        raise ValueError(
            f"tokens must name the {s} key positions, got {len(tokens)} tokens for weights of "
            f"{t} queries × {s} keys"
        )


def _label_colours(apart: Sequence[bool] | None, s: int) -> list[str]:
    """Per key position the colour of its label: grey for a token set apart from the words."""
    if apart is None:
        return ["black"] * s
    if len(apart) != s:
        raise ValueError(f"apart must hold one flag per token ({s}), got {len(apart)}")
    return [APART_COLOUR if a else "black" for a in apart]


@drawn_with_fonts
def grid_figure(
    weights: Tensor,
    tokens: Sequence[str],
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    focus: int | None = None,
    title: str | None = None,
    cell_inches: float = 1.7,
    causal: bool = False,
    apart: Sequence[bool] | None = None,
) -> Figure:
    """A grid of heatmaps, one per (layer, head): rows are layers, columns heads.

    Args:
        weights: (L, H, T, S) attention weights of one sequence.
        tokens: the S token strings (labels the left column and the bottom row when T ≤ 40).
        layers: the layer numbers of the L rows (titles only); default 0..L-1.
        heads: the head numbers of the H columns; default 0..H-1.
        focus: a query position whose row is outlined in every cell.
        title: the figure's title.
        cell_inches: the size of one heatmap.
        causal: a causal model's weights: the keys after each query are drawn blank (white),
            each map a lower triangle.
        apart: per token (S), whether it is set apart from the words (special tokens, a
            decoder's first token): its labels are drawn grey.

    The title stands above the heads' labels, wrapped to the figure's width. Maps of more
    than 256 tokens are drawn max-pooled to 256 × 256 cells (each cell the
    largest weight it covers), so the figure's memory does not grow with T².

    Returns:
        A matplotlib Figure; save it with :func:`save_figure`.
    """
    w = _check_weights(weights, 4, "(L, H, T, S)")
    n_layers, n_heads, full_t, full_s = w.shape
    _check_tokens(tokens, full_t, full_s)
    colours = _label_colours(apart, full_s)
    w = _fit(w, _GRID_CELLS, causal)
    t, s = w.shape[-2:]
    layers, heads = _numbers(
        layers, heads, n_layers, n_heads, f"the weights' {n_layers} layers and {n_heads} heads"
    )
    # One image of all the cells, separated by blank (NaN) gutters: a single Axes draws and
    # saves many times faster than L × H of them. Interpolation "none" draws the PNG as
    # "nearest" does, and puts the cells themselves in the SVG (scaled up by its viewer, not
    # smoothed), not a resampled picture of millions of pixels.
    gap = max(1, round(0.12 * max(t, s)))
    tile = torch.full((n_layers * (t + gap) - gap, n_heads * (s + gap) - gap), float("nan"))
    for i in range(n_layers):
        for j in range(n_heads):
            tile[i * (t + gap) : i * (t + gap) + t, j * (s + gap) : j * (s + gap) + s] = w[i, j]
    labelled = t <= _GRID_LABEL_LIMIT
    # Fixed margins (inches) instead of a layout engine, and labels as plain texts instead of
    # ticks: ticks and constrained layout cost seconds with hundreds of labels.
    left, bottom = (1.0, 1.0) if labelled else (0.3, 0.3)
    right = 1.3
    width, height = n_heads * cell_inches, n_layers * cell_inches
    fw = left + width + right
    # The title in fixed inches from the top (a suptitle's place is a fraction of the height,
    # inside the maps of a tall grid), then the heads' labels, then the maps.
    title = wrap_text(title or "Attention weights (rows: queries, columns: keys)", fw - 0.4, 10)
    top = _TITLE_PAD + (title.count("\n") + 1) * _TITLE_LINE + _HEAD_LABELS
    fh = bottom + height + top
    fig = new_figure(fw, fh)
    ax = fig.add_axes((left / fw, bottom / fh, width / fw, height / fh))
    cmap = matplotlib_module().colormaps[_CMAP].with_extremes(bad="white")
    image = ax.imshow(
        tile.numpy(), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="none"
    )
    ax.set_axis_off()
    font = max(3.0, min(7.0, 110.0 / max(t, 1)))
    if labelled:
        # Tokens label each layer's rows on the left and each head's columns at the bottom.
        bottom_row = n_layers * (t + gap) - gap - 0.5
        for i in range(n_layers):
            for r, token in enumerate(tokens[-t:]):
                ax.text(
                    -0.8,
                    i * (t + gap) + r,
                    plain_text(token),
                    ha="right",
                    va="center",
                    fontsize=font,
                    clip_on=False,
                    color=colours[full_s - t + r],
                )
        for j in range(n_heads):
            for c, token in enumerate(tokens):
                ax.text(
                    j * (s + gap) + c,
                    bottom_row + 0.6,
                    plain_text(token),
                    ha="center",
                    va="top",
                    rotation=90,
                    fontsize=font,
                    clip_on=False,
                    color=colours[c],
                )
    for j, head in enumerate(heads):
        ax.text(
            j * (s + gap) + (s - 1) / 2, -0.8, f"head {head}", ha="center", va="bottom", fontsize=8
        )
    for i, layer in enumerate(layers):
        ax.text(
            n_heads * (s + gap) - gap,
            i * (t + gap) + (t - 1) / 2,
            f" layer {layer}",
            ha="left",
            va="center",
            fontsize=8,
            rotation=90,
        )
    if focus is not None:
        row = (focus - (full_s - full_t)) * t // full_t  # its cell when the maps were pooled
        for i in range(n_layers):
            _outline_row(ax, i * (t + gap) + row, n_heads * (s + gap) - gap)
    bar = fig.add_axes(
        ((left + width + 0.45) / fw, (bottom + 0.2 * height) / fh, 0.12 / fw, 0.6 * height / fh)
    )
    fig.colorbar(image, cax=bar, label="attention weight")
    fig.text(0.5, 1 - _TITLE_PAD / fh, title, ha="center", va="top", fontsize=10)
    return fig


def _outline_row(ax: Axes, row: int, width: int) -> None:
    from matplotlib.patches import Rectangle

    ax.add_patch(
        Rectangle((-0.5, row - 0.5), width, 1, fill=False, edgecolor="#e6550d", linewidth=0.8)
    )


@drawn_with_fonts
def head_figure(
    weights: Tensor,
    tokens: Sequence[str],
    *,
    layer: int | None = None,
    head: int | None = None,
    focus: int | None = None,
    title: str | None = None,
    causal: bool = False,
    apart: Sequence[bool] | None = None,
) -> Figure:
    """A large view of one head's (T, S) weights, every token labelled, with a colour bar.

    Args:
        weights: (T, S) attention weights of one head for one sequence.
        tokens: the S token strings.
        layer, head: numbers for the title.
        focus: a query position whose row is outlined.
        title: overrides the default title.
        causal: a causal model's weights: the keys after each query are drawn blank (white).
        apart: per token (S), whether it is set apart from the words (special tokens, a
            decoder's first token): its labels are drawn grey.

    Up to 512 tokens every token is labelled; a longer map is drawn max-pooled to 512 × 512
    cells, unlabelled, 8 inches wide (a labelled one would outgrow what can be drawn).
    """
    w = _check_weights(weights, 2, "(T, S)")
    full_t, full_s = w.shape
    _check_tokens(tokens, full_t, full_s)
    colours = _label_colours(apart, full_s)
    vmax = float(w.max().clamp(min=1e-6))  # before NaNs hide the maximum
    w = _fit(w, _HEAD_LABEL_LIMIT, causal)
    t, s = w.shape
    labelled = max(full_t, full_s) <= _HEAD_LABEL_LIMIT
    # Fixed margins and plain texts for the labels, as in grid_figure: ticks cost seconds at
    # a few hundred tokens. A cell is at least one label line high; unlabelled, the map is
    # 8 inches whatever T.
    n = max(t, s)
    font = max(4.0, min(10.0, 400.0 / n))
    cell = max(font * 1.3 / 72, min(0.4, 6.0 / n)) if labelled else 8.0 / n
    label = (max(len(x) for x in tokens) * 0.62 * font + 8) / 72 if labelled else 0.0
    left, bottom, top, right = label + 0.45, label + 0.45, 0.5, 1.3
    width, height = s * cell, t * cell
    fw, fh = left + width + right, bottom + height + top
    fig = new_figure(fw, fh)
    ax = fig.add_axes((left / fw, bottom / fh, width / fw, height / fh))
    image = ax.imshow(
        w.numpy(),
        cmap=matplotlib_module().colormaps[_CMAP].with_extremes(bad="white"),
        vmin=0.0,
        vmax=vmax,
        aspect="auto",
        interpolation="none",  # the cells themselves in an SVG, as in grid_figure
    )
    ax.set_xticks([])
    ax.set_yticks([])
    for j, token in enumerate(tokens if labelled else []):
        ax.text(
            j,
            t - 0.5 + 0.3,
            plain_text(token),
            rotation=90,
            ha="center",
            va="top",
            fontsize=font,
            clip_on=False,
            color=colours[j],
        )
    for i, token in enumerate(tokens[-t:] if labelled else []):
        ax.text(
            -0.8, i, plain_text(token), ha="right", va="center", fontsize=font, clip_on=False,
            color=colours[full_s - t + i],
        )  # fmt: skip
    fig.text((left + width / 2) / fw, 0.12 / fh, "key (attended to)", ha="center", va="bottom")
    fig.text(
        0.12 / fw,
        (bottom + height / 2) / fh,
        "query (attending)",
        rotation=90,
        ha="left",
        va="center",
    )
    if focus is not None:
        _outline_row(ax, (focus - (full_s - full_t)) * t // full_t, s)
    bar = fig.add_axes(
        ((left + width + 0.3) / fw, (bottom + 0.1 * height) / fh, 0.15 / fw, 0.8 * height / fh)
    )
    fig.colorbar(image, cax=bar, label="attention weight")
    where = " ".join(
        x
        for x in (
            f"layer {layer}" if layer is not None else "",
            f"head {head}" if head is not None else "",
        )
        if x
    )
    ax.set_title(wrap_text(title or f"Attention, {where}".rstrip(", "), fw - 0.3, 12))
    return fig


@drawn_with_fonts
def importance_figure(
    importance: Tensor,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str = "Head importance",
    label: str = "importance",
) -> Figure:
    """A layers × heads heatmap of one score per head, each cell labelled with its value.

    Args:
        importance: (L, H) scores, e.g. :func:`multihead.head_importance`'s.
        layers, heads: the numbers of the rows and columns (default 0..L-1, 0..H-1).
        title: the figure's title.
        label: the colour bar's label.
    """
    w = _check_weights(importance, 2, "(L, H)")
    n_layers, n_heads = w.shape
    layers, heads = _numbers(layers, heads, n_layers, n_heads, f"the {n_layers} × {n_heads} scores")
    # Fixed margins (inches) instead of tight_layout, which draws every text once more to
    # measure it: the numbers' ticks and the axis label on the left and bottom, the colour bar
    # and its label on the right, the wrapped title above.
    left, bottom, right = 0.8, 0.65, 1.4
    width, height = 0.55 * n_heads, 0.45 * n_layers
    fw = left + width + right
    title = wrap_text(title, fw - 0.3, 9)
    above = _TITLE_PAD + (title.count("\n") + 1) * _IMPORTANCE_TITLE_LINE + 0.1
    fh = bottom + height + above
    fig = new_figure(fw, fh)
    ax = fig.add_axes((left / fw, bottom / fh, width / fw, height / fh))
    finite = w[torch.isfinite(w)]
    low = min(0.0, float(finite.min())) if finite.numel() else 0.0
    top = float(finite.abs().max()) if finite.numel() else 1.0
    image = ax.imshow(
        w.numpy(), cmap="Reds", vmin=low, vmax=max(top, 1e-12), aspect="auto", interpolation="none"
    )
    for i in range(n_layers):
        for j in range(n_heads):
            value = float(w[i, j])
            text = f"{value:.3f}" if abs(value) < 10 else f"{value:.0f}"
            dark = abs(value) > 0.6 * top
            ax.text(
                j, i, text, ha="center", va="center", fontsize=6, color="white" if dark else "black"
            )
    ax.set_xticks(range(n_heads), [str(h) for h in heads])
    ax.set_yticks(range(n_layers), [str(layer) for layer in layers])
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9, x=(fw / 2 - left) / width)  # centred on the figure
    bar = fig.add_axes(((left + width + 0.25) / fw, bottom / fh, 0.2 / fw, height / fh))
    fig.colorbar(image, cax=bar, label=label)
    return fig


@drawn_with_fonts
def effects_figure(
    effects: Tensor,
    rows: Sequence[str],
    columns: Sequence[str],
    *,
    title: str,
    label: str = "effect",
    xlabel: str = "",
    ylabel: str = "",
) -> Figure:
    """A heatmap of signed scores, one per row × column (e.g. activation patching's (L, H), or
    the top heads × positions: :meth:`multihead.PatchResult.plot` draws every patching result
    with it), on a diverging scale centred on 0 (blue below, red above);
    cells labelled with their values when there are at most 24 columns, columns labelled
    when there are at most 40 (the grid's rule for token labels).

    Args:
        effects: (R, C) scores; NaN cells (not computed) are drawn blank.
        rows, columns: the R row and C column labels (tokens are escaped for mathtext).
        title: the figure's title; label: the colour bar's; xlabel, ylabel: the axes'.
    """
    w = _check_weights(effects, 2, "(R, C)")
    n_rows, n_cols = w.shape
    if len(rows) != n_rows or len(columns) != n_cols:
        raise ValueError(
            f"rows and columns must label the {n_rows} × {n_cols} scores, got {len(rows)} and "
            f"{len(columns)}"
        )
    cell = 0.55 if n_cols <= 24 else 0.28
    fw = 1.6 + cell * n_cols + 1.2
    # tall enough for the colour bar's label beside a row or two
    fig = new_figure(fw, max(2.6, 1.3 + 0.42 * n_rows))
    ax = fig.add_subplot()
    finite = w[torch.isfinite(w)]
    top = max(float(finite.abs().max()), 1e-12) if finite.numel() else 1.0
    cmap = matplotlib_module().colormaps["RdBu_r"].with_extremes(bad="white")
    image = ax.imshow(w.numpy(), cmap=cmap, vmin=-top, vmax=top, aspect="auto")
    if n_cols <= 24:
        for i in range(n_rows):
            for j in range(n_cols):
                value = float(w[i, j])
                if value == value:  # not NaN
                    text = f"{value:.2f}" if abs(value) < 10 else f"{value:.0f}"
                    dark = abs(value) > 0.6 * top
                    ax.text(j, i, text, ha="center", va="center", fontsize=6,
                            color="white" if dark else "black")  # fmt: skip
    labelled = n_cols <= _GRID_LABEL_LIMIT
    ax.set_xticks(
        range(n_cols) if labelled else [], [plain_text(c) for c in columns] if labelled else []
    )
    ax.tick_params(axis="x", labelrotation=90 if labelled and n_cols > 12 else 0, labelsize=7)
    ax.set_yticks(range(n_rows), [plain_text(r) for r in rows], fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(wrap_text(title, fw - 0.3, 9), fontsize=9)
    fig.colorbar(image, ax=ax, label=label)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int = 100) -> Path:
    """Save a figure as PNG or SVG, chosen by the path's suffix; returns the path.

    The file is replaced atomically (drawn in memory, written aside, renamed): a reader sees the
    old picture or the new one, never half of one.

    Raises:
        ValueError: a suffix other than .png or .svg.

    Warns:
        MissingGlyphsWarning: once, when no installed font has some of the figure's characters
            (:mod:`multihead.viz.fonts`); they are drawn as boxes.
    """
    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        suffixes = " or ".join(f".{f}" for f in FIGURE_FORMATS)
        raise ValueError(f"path must end in {suffixes}, got {str(path)!r}")
    # The SVG's text stays text (smaller, searchable) and its ids stay stable across runs.
    matplotlib = matplotlib_module()
    options: dict[str, Any] = (
        {"metadata": {"Date": None}}
        if fmt == "svg"
        else {"pil_kwargs": {"compress_level": _PNG_COMPRESSION}}
    )
    missing = missing_glyphs(fig)
    if missing:  # once, in place of matplotlib's warning per glyph and draw
        warnings.warn(MissingGlyphsWarning(missing), stacklevel=2)
    with (
        fonts(),
        matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "multihead"}),
        quiet_glyph_warnings(),
    ):
        fig.savefig(drawn := io.BytesIO(), format=fmt, dpi=dpi, **options)
    atomic_write(path, drawn.getvalue())
    return path
