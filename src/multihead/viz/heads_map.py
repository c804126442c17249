"""The head map: every head a point, placed by how alike heads attend, coloured by layer.

The positions come from :func:`multihead.head_distances` (classical MDS of
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

from multihead.viz.figure import matplotlib_module, new_figure, plain_text, wrap_text
from multihead.viz.fonts import drawn_with_fonts
from multihead.viz.formats import FIGURE_FORMATS
from multihead.viz.plots import save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["heads_map_figure", "heads_map_labels", "layer_colours", "save_heads_map", "HEADS_MAP"]

# The file name, without its suffix (heads_map.png, heads_map.svg).
HEADS_MAP = "heads_map"
# role -> marker: the shape says the role where labels crowd each other, the colour the layer.
_MARKERS = {
    "self": "o",
    "previous token": "<",
    "next token": ">",
    "sink": "X",
    "[CLS]": "s",
    "[SEP]": "D",
    "punctuation": "P",
    "induction": "^",
    "duplicate token": "v",
    "broad": "*",
    "other": "d",
}


# The map's size, inches (a square), and the column on its right for the legends.
_MAP = 8.0
_SIDE = 2.0
# Up to this many layers each is named in a legend with its own colour; more get a colour bar.
_NAMED_LAYERS = 10


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

    Up to 10 layers, each has a colour of its own (tab10), named in a legend; more layers are
    hues from blue to red (turbo: neighbouring layers' shades of viridis cannot be told apart
    at 30), read on a colour bar and in the labels. The legends and the bar stand beside the
    map, never over its points.

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
    # Fixed places, inches: the points on the left, the legends and the layers' colour bar on
    # the right, beside the points rather than over them.
    fw, fh = _MAP + 0.9 + _SIDE, _MAP + 1.5
    fig = new_figure(fw, fh)
    from matplotlib.lines import Line2D

    ax = fig.add_axes((0.8 / fw, 0.7 / fh, _MAP / fw, _MAP / fh))
    colours = layer_colours(len(layers))
    flat_roles = [role for row in roles for role in row]  # layer-major, as the positions
    for n, ((x, y), role) in enumerate(zip(xy, flat_roles, strict=True)):
        marker = _MARKERS.get(role, "o")
        ax.scatter([x], [y], color=colours[n // len(heads)], marker=marker, s=40, zorder=2)
    # Labels offset a little from their points; small type, since hundreds of heads may share it.
    span = float(max(xy.max(0) - xy.min(0))) or 1.0
    for (x, y), text in zip(xy, labels, strict=True):
        ax.text(x + 0.008 * span, y + 0.008 * span, plain_text(text), fontsize=5.5, zorder=3)
    ax.set_xlabel("MDS axis 1")
    ax.set_ylabel("MDS axis 2")
    ax.set_aspect("equal", adjustable="datalim")
    shapes = [
        Line2D([], [], color="grey", marker=_MARKERS.get(role, "o"), linestyle="", label=role)
        for role in dict.fromkeys(sorted(flat_roles, key=_role_order))
    ]
    side = (0.8 + _MAP + 0.25) / fw  # the right column's left edge, a fraction of the width
    fig.legend(
        handles=shapes, loc="upper left", bbox_to_anchor=(side, 1 - 0.7 / fh), fontsize=8,
        title="shape: role", title_fontsize=8, borderaxespad=0,
    )  # fmt: skip
    if len(layers) <= _NAMED_LAYERS:  # a colour each, named
        named = [
            Line2D([], [], color=c, marker="o", linestyle="", label=f"layer {layer}")
            for c, layer in zip(colours, layers, strict=True)
        ]
        fig.legend(
            handles=named, loc="lower left", bbox_to_anchor=(side, 0.7 / fh), fontsize=8,
            title="colour: layer", title_fontsize=8, borderaxespad=0,
        )  # fmt: skip
    else:  # a scale of hues, read on a bar (and in each point's label)
        bar = fig.add_axes((side, 0.7 / fh, 0.18 / fw, 0.45 * _MAP / fh))
        matplotlib = matplotlib_module()
        cmap = matplotlib.colors.ListedColormap(colours)
        norm = matplotlib.colors.BoundaryNorm([i - 0.5 for i in range(len(layers) + 1)], cmap.N)
        scale = matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap)
        ticks = list(range(0, len(layers), max(1, len(layers) // 10)))
        colour_bar = fig.colorbar(scale, cax=bar, ticks=ticks, label="colour: layer")
        colour_bar.ax.set_yticklabels([str(layers[i]) for i in ticks], fontsize=7)
    ax.set_title(
        wrap_text(
            title
            or "Heads placed by the Jensen–Shannon distance between their attention "
            "(classical MDS)",
            _MAP,
            10,
        ),
        fontsize=10,
    )
    return fig


def layer_colours(num_layers: int) -> list[tuple[float, float, float, float]]:
    """A colour per layer (RGBA): up to 10 layers, tab10's distinct colours; more, as many
    hues of turbo from blue to red (viridis' neighbouring shades of 30 layers cannot be told
    apart)."""
    cmaps = matplotlib_module().colormaps
    if num_layers <= _NAMED_LAYERS:
        return [cmaps["tab10"](i) for i in range(num_layers)]
    return [cmaps["turbo"](0.05 + 0.9 * i / (num_layers - 1)) for i in range(num_layers)]


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
