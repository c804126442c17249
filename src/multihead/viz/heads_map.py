"""The head map: every head a point, placed by how alike heads attend, coloured by layer.

The positions come from :func:`multihead.observe.head_distance.head_distances` (classical MDS of
the mean Jensen–Shannon distances, as in Clark et al. 2019, figure 6); the labels from
:meth:`HeadStatistics.roles <multihead.observe.statistics.HeadStatistics.roles>`. Drawing only:
the math lives in ``observe/head_distance.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from multihead.viz.figure import matplotlib_module, new_figure, plain_text
from multihead.viz.fonts import drawn_with_fonts
from multihead.viz.formats import FIGURE_FORMATS
from multihead.viz.plots import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["heads_map_figure", "heads_map_labels", "save_heads_map", "HEADS_MAP"]

# The file name, without its suffix (heads_map.png, heads_map.svg).
HEADS_MAP = "heads_map"
# role -> marker: the shape says the role where labels crowd each other, the colour the layer.
_MARKERS = {
    "self": "o",
    "previous token": "<",
    "next token": ">",
    "[CLS]": "s",
    "[SEP]": "D",
    "punctuation": "P",
    "induction": "^",
    "duplicate token": "v",
    "broad": "*",
}


def _role_order(role: str) -> int:
    order = list(_MARKERS)
    return order.index(role) if role in order else len(order)


def heads_map_labels(
    layers: Sequence[int], heads: Sequence[int], roles: Sequence[Sequence[str]]
) -> list[str]:
    """ "L{l}H{h} role" for each head, layer-major (the order of the map's N points).

    Raises:
        ValueError: ``roles`` is not (L', H') for these layers and heads.
    """
    if len(roles) != len(layers) or any(len(r) != len(heads) for r in roles):
        raise ValueError(
            f"roles must be (L', H') = ({len(layers)}, {len(heads)}) labels, got "
            f"{len(roles)} rows of {sorted({len(r) for r in roles})}"
        )
    return [
        f"L{layer}H{head} {roles[i][j]}"
        for i, layer in enumerate(layers)
        for j, head in enumerate(heads)
    ]


@drawn_with_fonts
def heads_map_figure(
    positions: Tensor,
    layers: Sequence[int],
    heads: Sequence[int],
    roles: Sequence[Sequence[str]],
    *,
    title: str | None = None,
) -> Figure:
    """Heads as points in 2-D, coloured by layer, each labelled "L{l}H{h}" and its role.

    Args:
        positions: (N, 2) with N = L'·H', layer-major (head h of the i-th layer is i·H' + h).
        layers, heads: the layer (L') and head (H') numbers.
        roles: (L', H') each head's dominant role (``HeadStatistics.roles()``).
        title: the figure's title.

    Returns:
        A matplotlib Figure; save it with :func:`save_heads_map` or ``save_figure``.
    """
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
    n = len(layers) * len(heads)
    if tuple(positions.shape) != (n, 2):
        raise ValueError(
            f"positions must be (N, 2) with N = {len(layers)} layers × {len(heads)} heads = {n}, "
            f"got shape {tuple(positions.shape)}"
        )
    labels = heads_map_labels(layers, heads, roles)
    xy = positions.detach().to("cpu", torch.float64).numpy()
    fig = new_figure(11, 9)
    from matplotlib.lines import Line2D

    ax = fig.add_subplot()
    cmap = matplotlib_module().colormaps["viridis"]
    colours = [cmap(i / max(1, len(layers) - 1)) for i in range(len(layers))]
    flat_roles = [role for row in roles for role in row]  # layer-major, as the positions
    for n, ((x, y), role) in enumerate(zip(xy, flat_roles, strict=True)):
        marker = _MARKERS.get(role, "o")
        ax.scatter([x], [y], color=colours[n // len(heads)], marker=marker, s=40, zorder=2)
    handles = [
        Line2D([], [], color=c, marker="o", linestyle="", label=f"layer {layer}")
        for c, layer in zip(colours, layers, strict=True)
    ]
    handles += [
        Line2D([], [], color="grey", marker=_MARKERS.get(role, "o"), linestyle="", label=role)
        for role in dict.fromkeys(sorted(flat_roles, key=_role_order))
    ]
    # Labels offset a little from their points; small type, since 72 heads share the plot.
    span = float(max(xy.max(0) - xy.min(0))) or 1.0
    for (x, y), text in zip(xy, labels, strict=True):
        ax.text(x + 0.008 * span, y + 0.008 * span, plain_text(text), fontsize=5.5, zorder=3)
    ax.set_xlabel("MDS axis 1")
    ax.set_ylabel("MDS axis 2")
    ax.set_aspect("equal", adjustable="datalim")
    ax.legend(handles=handles, loc="best", fontsize=8, title="colour: layer; shape: role")
    ax.set_title(
        title
        or "Heads placed by the Jensen–Shannon distance between their attention (classical MDS)",
        fontsize=10,
    )
    fig.tight_layout()
    return fig


def save_heads_map(fig: Figure, directory: str | Path, formats: Sequence[str]) -> list[Path]:
    """Save ``fig`` as ``heads_map.<fmt>`` in ``directory`` for each picture format asked for
    ("html" is skipped: the map has no page); returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        save_figure(fig, directory / f"{HEADS_MAP}.{fmt}", dpi=150)
        for fmt in formats
        if fmt in FIGURE_FORMATS
    ]
