"""A heatmap of a score for every pair of heads (sender × receiver), grouped by layer.

Composition scores (:class:`multihead.CompositionScores`) give one number per pair of heads of
a model: 72² pairs on a 6-layer model, 270² on SmolLM2-135M. One cell per pair, senders down and
receivers across in layer order, a thin line between layers, ticks at each layer's first head
(every head is named when there are at most 48): a 30-layer model's whole matrix fits a page,
and the blocks above the diagonal are the pairs that can compose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from multihead.heads import head_label
from multihead.viz.figure import matplotlib_module, new_figure, wrap_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["head_pairs_figure"]

_NAMED = 48  # at most this many heads are each named on the axes


def head_pairs_figure(
    scores: Tensor,
    heads: Sequence[int],
    *,
    title: str,
    label: str = "score",
    xlabel: str = "receiver",
    ylabel: str = "sender",
) -> Figure:
    """Scores of every (sender, receiver) pair of heads as one square heatmap.

    Args:
        scores: (N, N), N = Σ heads, heads in layer order (layer 0's first): row i is sender
            i, column j receiver j; NaN cells (pairs without a score) are drawn blank.
        heads: each layer's number of heads.
        title, label: the figure's title and the colour bar's label; xlabel, ylabel: the axes'.

    A scale from 0 up (viridis) for scores that are all ≥ 0, else diverging around 0 (RdBu_r).

    Raises:
        ValueError: ``scores`` is not (N, N) for the heads given.
    """
    n = sum(heads)
    if scores.dim() != 2 or tuple(scores.shape) != (n, n):
        raise ValueError(
            f"scores must be (N, N) with N = {n}, the heads of {len(heads)} layers, got "
            f"{tuple(scores.shape)}"
        )
    w = scores.detach().double().cpu()
    finite = w[torch.isfinite(w)]
    side = min(10.0, max(4.0, 0.16 * n + 2.0))
    fig = new_figure(side + 1.6, side + 0.6)
    ax = fig.add_subplot()
    signed = finite.numel() > 0 and float(finite.min()) < 0
    top = float(finite.abs().max()) if finite.numel() else 1.0
    top = max(top, 1e-12)
    cmaps = matplotlib_module().colormaps
    if signed:
        cmap, low = cmaps["RdBu_r"].with_extremes(bad="white"), -top
    else:
        cmap, low = cmaps["viridis"].with_extremes(bad="white"), 0.0
    image = ax.imshow(w.numpy(), cmap=cmap, vmin=low, vmax=top, interpolation="nearest")
    starts = [sum(heads[:layer]) for layer in range(len(heads))]
    for start in starts[1:]:
        ax.axhline(start - 0.5, color="#555555", linewidth=0.4)
        ax.axvline(start - 0.5, color="#555555", linewidth=0.4)
    if n <= _NAMED:
        ticks = list(range(n))
        names = [head_label(layer, h) for layer, count in enumerate(heads) for h in range(count)]
        size = 7 if n <= 24 else 5
    else:
        every = max(1, len(heads) // 15)  # at most ~15 layer names per axis
        shown = list(range(0, len(heads), every))
        ticks = [starts[layer] for layer in shown]
        names = [f"L{layer}" for layer in shown]
        size = 7
    ax.set_xticks(ticks, names, fontsize=size, rotation=90)
    ax.set_yticks(ticks, names, fontsize=size)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(wrap_text(title, side, 10), fontsize=10)
    fig.colorbar(image, ax=ax, label=label, shrink=0.8)
    fig.tight_layout()
    return fig
