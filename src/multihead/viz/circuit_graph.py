"""Pictures of a circuit of edges: the graph (senders and receivers as nodes in layer rows,
edges as arrows coloured by their score) and the faithfulness curves.

Labels in, figures out: a node ``"L0H1"``, ``"MLP0"``, ``"embed"`` or ``"logits"``; an edge
``"L0H1 -> L1H3.k"`` (its receiver's input after the dot: the arrow's label).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from multihead.viz.figure import new_figure, plain_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["circuit_figure", "faithfulness_figure"]

_NODE = re.compile(r"L(\d+)(?:H|KV)(\d+)|MLP(\d+)")


def _row_and_order(node: str) -> tuple[float, float]:
    """(row, order within the row): the embeddings at the bottom, each layer's heads, then its
    MLP half a row up, the logits at the top."""
    if node == "embed":
        return 0.0, 0.0
    if node == "logits":
        return 1e9, 0.0
    match = _NODE.fullmatch(node)
    if match is None:
        return 0.5, 0.0
    if match[3] is not None:
        return 2 * int(match[3]) + 2, 0.0
    return 2 * int(match[1]) + 1, float(match[2])


def circuit_figure(
    edges: Sequence[tuple[str, float]], *, title: str = "Circuit: the top edges"
) -> Figure:
    """The edges ``[(label, score)]`` as a graph: nodes in rows by layer (embeddings at the
    bottom, logits at the top), arrows from sender to receiver, red for a positive score and
    blue for a negative one, wider for a larger ``|score|``, labelled with the receiver's
    input (q, k, v)."""
    parsed = []
    for label, score in edges:
        sender, _, receiver = label.partition(" -> ")
        node, _, via = receiver.partition(".")
        parsed.append((sender, node, via, score))
    nodes = sorted({n for s, r, _, _ in parsed for n in (s, r)}, key=_row_and_order)
    rows: dict[float, list[str]] = {}
    for node in nodes:
        rows.setdefault(_row_and_order(node)[0], []).append(node)
    ranks = {row: i for i, row in enumerate(sorted(rows))}
    place: dict[str, tuple[float, float]] = {}
    for row, members in rows.items():
        for i, node in enumerate(members):
            place[node] = ((i + 1) / (len(members) + 1), ranks[row])
    fig = new_figure(7.0, 1.2 + 1.1 * max(len(rows), 1), layout="constrained")
    ax = fig.add_subplot()
    largest = max((abs(v) for *_, v in parsed), default=1.0) or 1.0
    for sender, node, via, score in parsed:
        (x0, y0), (x1, y1) = place[sender], place[node]
        colour = "#c0392b" if score > 0 else "#2e6fb5"
        ax.annotate(
            "", xy=(x1, y1 - 0.12), xytext=(x0, y0 + 0.12),
            arrowprops={"arrowstyle": "-|>", "color": colour, "alpha": 0.8,
                        "lw": 0.6 + 3.4 * abs(score) / largest,
                        "connectionstyle": "arc3,rad=0.08"},
        )  # fmt: skip
        if via:
            ax.text((x0 + x1) / 2, (y0 + y1) / 2, via, fontsize=7, color=colour, ha="center")
    for node, (x, y) in place.items():
        ax.text(
            x, y, plain_text(node), ha="center", va="center", fontsize=9,
            bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#555555"},
        )  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, max(len(rows), 1) - 0.5)
    ax.set_axis_off()
    ax.set_title(plain_text(title))
    return fig


def faithfulness_figure(
    curves: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    total: int,
    *,
    title: str | None = None,
) -> Figure:
    """Faithfulness against the fraction of edges kept, one line per ``(name, sizes,
    values)``; a dotted line at 1 (the clean run) and 0 (the corrupt run)."""
    fig = new_figure(6.0, 4.0, layout="constrained")
    ax = fig.add_subplot()
    for name, sizes, values in curves:
        style = ":" if name.startswith("random") else "-"
        ax.plot([n / total for n in sizes], list(values), style, marker="o", ms=3, label=name)
    for level in (0.0, 1.0):
        ax.axhline(level, color="#999999", lw=0.8, ls="--")
    ax.set_xlabel(f"fraction of the {total} edges in the circuit")
    ax.set_ylabel("faithfulness")
    ax.set_title(plain_text(title or "Faithfulness of the top edges"))
    ax.legend()
    return fig
