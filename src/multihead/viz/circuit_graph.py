"""Pictures of a circuit of edges: the graph (senders and receivers as nodes in layer rows,
edges as arrows coloured by their score, routed beside the nodes of the rows they cross) and
the faithfulness curves.

Arrows in, figures out: an :class:`Arrow` names its two nodes (``"L0H1"``, ``"MLP0"``,
``"embed"``, ``"logits"``), the receiver's input (the arrow's label: q, k, v) and where each
node sits (the row it is drawn in, its order there: the graph's stages, ``Sender.place``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from multihead.viz.figure import new_figure, plain_text

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["Arrow", "circuit_figure", "faithfulness_figure"]

_POSITIVE, _NEGATIVE = "#c0392b", "#2e6fb5"


class Arrow(NamedTuple):
    """One edge to draw: its sender's and receiver's node names, the receiver's input (``"q"``,
    ``"k"``, ``"v"`` or ``""``), its score, and each node's place (row, order in the row:
    rows from the bottom up, a node's order among the nodes of its row)."""

    sender: str
    receiver: str
    via: str
    score: float
    sender_place: tuple[float, float]
    receiver_place: tuple[float, float]


def circuit_figure(edges: Sequence[Arrow], *, title: str = "Circuit: the top edges") -> Figure:
    """The ``edges`` as a layered graph: nodes in rows by their places (embeddings at
    the bottom, each layer's heads, then its MLP, the logits at the top), arrows from sender to
    receiver, red for a positive score (corrupting the edge raises the metric) and blue for a
    negative one, wider for a larger ``|score|``, labelled with the receiver's input (q, k, v).

    An edge that skips rows passes each row it crosses in a place of its own beside that row's
    nodes (one place per sender and row: a sender's long edges run together until they part),
    so no edge runs behind a node it does not reach. The places in a row are ordered by where
    their edges come from (the layered-graph layout's barycentre ordering, one sweep upwards),
    the nodes among them in their own order (a layer's heads by number).
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyArrowPatch
    from matplotlib.path import Path

    drawn = [(e.sender, e.receiver, e.via, e.score) for e in edges]
    where = {e.sender: e.sender_place for e in edges} | {
        e.receiver: e.receiver_place for e in edges
    }
    nodes = sorted(where, key=where.__getitem__)
    rank = {row: i for i, row in enumerate(sorted({where[n][0] for n in nodes}))}
    # a place (name, row): a node in its own row, or where a sender's edges pass a later row
    home = {node: (node, rank[where[node][0]]) for node in nodes}
    rows: list[list[tuple[str, int]]] = [[] for _ in rank]
    for node in nodes:
        rows[home[node][1]].append(home[node])
    routes = []
    for sender, node, _, _ in drawn:
        passing = [(sender, r) for r in range(home[sender][1] + 1, home[node][1])]
        for place in passing:
            if place not in rows[place[1]]:
                rows[place[1]].append(place)
        routes.append([home[sender], *passing, home[node]])
    below: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for route in routes:
        for a, b in zip(route, route[1:], strict=False):
            below.setdefault(b, []).append(a)
    x: dict[tuple[str, int], float] = {}
    for row in rows:  # upwards: each place beneath where its edges come from

        def key(place: tuple[str, int]) -> tuple[float, float]:
            came = [x[a] for a in below.get(place, [])]
            order = where[place[0]][1] if home[place[0]] == place else 0.0
            return (sum(came) / len(came) if came else 0.5, order)

        row.sort(key=key)
        # the nodes keep the slots the ordering gave them, in their own order (heads by number)
        slots = [i for i, place in enumerate(row) if home[place[0]] == place]
        nodes_in_order = sorted((row[i] for i in slots), key=lambda p: where[p[0]][1])
        for i, place in zip(slots, nodes_in_order, strict=True):
            row[i] = place
        for i, place in enumerate(row):
            x[place] = (i + 1) / (len(row) + 1)
    widest = max((len(row) for row in rows), default=1)
    width = max(7.0, 0.9 * widest)
    fig = new_figure(width, 1.6 + 1.0 * max(len(rows), 1), layout="constrained")
    ax = fig.add_subplot()
    largest = max((abs(v) for *_, v in drawn), default=1.0) or 1.0
    gap = 0.16  # where an arrow leaves or meets a node's box, in rows
    paths = [[(x[p], float(p[1])) for p in route] for route in routes]
    # the arrows that leave (meet) one node spread along its box, in the order they go (come)
    for end, step, side in ((0, 1, gap), (-1, -2, -gap)):
        at: dict[tuple[str, int], list[list[tuple[float, float]]]] = {}
        for route, points in zip(routes, paths, strict=True):
            at.setdefault(route[end], []).append(points)
        for group in at.values():
            group.sort(key=lambda points: points[step][0])
            spread = min(0.08, 0.24 / max(len(group) - 1, 1)) / width  # inches, inside the box
            for i, points in enumerate(group):
                px, py = points[end]
                points[end] = (px + (i - (len(group) - 1) / 2) * spread, py + side)
    for points, (_, _, via, score) in zip(paths, drawn, strict=True):
        verts, codes = [points[0]], [Path.MOVETO]
        for i in range(1, len(points) - 1):  # through the midpoints, bent at each place
            (ax0, ay0), (bx, by), (cx, cy) = points[i - 1], points[i], points[i + 1]
            verts += [((ax0 + bx) / 2, (ay0 + by) / 2), (bx, by), ((bx + cx) / 2, (by + cy) / 2)]
            codes += [Path.LINETO, Path.CURVE3, Path.CURVE3]
        verts.append(points[-1])
        codes.append(Path.LINETO)
        colour = _POSITIVE if score > 0 else _NEGATIVE
        ax.add_patch(
            FancyArrowPatch(
                path=Path(verts, codes), arrowstyle="-|>", mutation_scale=10, color=colour,
                alpha=0.8, lw=0.6 + 3.4 * abs(score) / largest, zorder=1,
            )
        )  # fmt: skip
        if via:  # on the last stretch, near the receiver
            (px, py), (qx, qy) = points[-2], points[-1]
            ax.text(
                px + 0.7 * (qx - px) + 0.012, py + 0.7 * (qy - py), via, fontsize=7,
                color=colour, ha="left", va="center", zorder=2,
            )  # fmt: skip
    for node in nodes:
        ax.text(
            x[home[node]], home[node][1], plain_text(node), ha="center", va="center", fontsize=9,
            zorder=3, bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#555555"},
        )  # fmt: skip
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, max(len(rows), 1) - 0.5)
    ax.set_axis_off()
    ax.set_title(plain_text(title))
    if drawn:
        handles = [
            Line2D(
                [],
                [],
                color=_POSITIVE,
                lw=2,
                label="score > 0: corrupting the edge raises the metric",
            ),
            Line2D([], [], color=_NEGATIVE, lw=2, label="score < 0: it lowers the metric"),
            Line2D(
                [],
                [],
                color="#888888",
                lw=3,
                label="width: |score|; q, k, v: the receiving head's input",
            ),
        ]
        fig.legend(handles=handles, loc="outside lower center", ncols=2, frameon=False, fontsize=8)
    return fig


def faithfulness_figure(
    curves: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    total: int,
    *,
    title: str | None = None,
) -> Figure:
    """Faithfulness against the circuit's size, one line per ``(name, sizes, values)``; a dotted
    line at 1 (the clean run) and 0 (the corrupt run); the legend below the axes. The size is the
    fraction of the ``total`` edges, or on a graph of 1000 edges or more (a model's circuits are
    a few hundred of its tens of thousands of edges) the number of edges on a log scale (linear
    below one edge, so that 0 is drawn)."""
    large = total >= 1000
    fig = new_figure(6.0, 4.4, layout="constrained")
    ax = fig.add_subplot()
    for name, sizes, values in curves:
        style = ":" if name.startswith("random") else "-"
        x = list(sizes) if large else [n / total for n in sizes]
        ax.plot(x, list(values), style, marker="o", ms=3, label=name)
    for level in (0.0, 1.0):
        ax.axhline(level, color="#999999", lw=0.8, ls="--")
    if large:
        ax.set_xscale("symlog", linthresh=1, linscale=0.4)
        ax.set_xlim(0, total * 1.05)
        ax.set_xlabel(f"edges in the circuit, of {total} (log scale)")
    else:
        ax.set_xlabel(f"fraction of the {total} edges in the circuit")
    ax.set_ylabel("faithfulness")
    ax.set_title(plain_text(title or "Faithfulness of the top edges"))
    fig.legend(loc="outside lower center", ncols=len(curves), frameon=False)
    return fig
