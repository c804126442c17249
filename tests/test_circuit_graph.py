"""The circuit's graph picture on a deep model's circuit: no arrow runs behind a node it does
not reach, every arrow ends at its receiver, and the legend names what the colours and widths
mean, measured on matplotlib's own boxes and paths after a draw."""

from __future__ import annotations

import random
import re

import pytest

pytest.importorskip("matplotlib")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402
from matplotlib.path import Path  # noqa: E402

from multihead.viz.circuit_graph import Arrow, circuit_figure  # noqa: E402

# a 30-layer IOI-like circuit: long edges to the logits and between far layers, a sender
# whose edges part high up, MLPs and heads stacked in single-node rows
DEEP = [
    ("MLP0 -> L23H3.v", -3.0), ("MLP21 -> L23H3.v", -1.0), ("embed -> L23H3.k", -0.8),
    ("L23H3 -> logits", -4.0), ("L23H3 -> L29H0.v", 2.0), ("L23H3 -> L29H1.v", -2.0),
    ("L23H3 -> L24H4.q", 1.0), ("L24H4 -> L29H0.v", -1.0), ("L24H4 -> L29H1.v", 1.0),
    ("MLP23 -> logits", -0.5), ("MLP26 -> logits", -0.6), ("MLP28 -> logits", -0.6),
    ("MLP29 -> logits", -0.6), ("L29H0 -> logits", 2.0), ("L29H1 -> logits", -2.0),
]  # fmt: skip


def _random_circuit(seed: int, n: int = 25) -> list[tuple[str, float]]:
    """n edges of a 30-layer, 9-head graph: senders embed, heads, MLPs; receivers later heads'
    q/k/v, later MLPs, the logits."""
    rng = random.Random(seed)
    edges: set[tuple[str, float]] = set()
    while len(edges) < n:
        layer = rng.randrange(30)
        sender = rng.choice(["embed", f"L{layer}H{rng.randrange(9)}", f"MLP{layer}"])
        start = 0 if sender == "embed" else layer + (1 if sender.startswith("MLP") else 0)
        if start >= 30 or rng.random() < 0.3:
            receiver = "logits"
        else:
            later = rng.randrange(start, 30)
            receiver = rng.choice(
                [f"L{later}H{rng.randrange(9)}.{rng.choice('qkv')}", f"MLP{later}"]
                if later > layer or sender == "embed"
                else [f"MLP{later}"]
            )
        edges.add((f"{sender} -> {receiver}", rng.uniform(-2, 2)))
    return sorted(edges)


def _place(node: str) -> tuple[float, float]:
    """Where the graph puts a node, worked out here from its name: the embeddings at the bottom,
    layer l's heads in row 2l + 1 by number, its MLP in row 2l + 2, the logits at the top."""
    if node == "embed":
        return 0.0, 0.0
    if node == "logits":
        return 1e9, 0.0
    head = re.fullmatch(r"L(\d+)(?:H|KV)(\d+)", node)
    if head:
        return 2 * int(head[1]) + 1, float(head[2])
    return 2 * int(node.removeprefix("MLP")) + 2, 0.0


def _arrow(label: str, score: float) -> Arrow:
    sender, _, receiver = label.partition(" -> ")
    node, _, via = receiver.partition(".")
    return Arrow(sender, node, via, score, _place(sender), _place(node))


def _drawn(edges: list[tuple[str, float]]) -> tuple[object, dict[str, object], list[object]]:
    fig = circuit_figure([_arrow(label, score) for label, score in edges])
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    boxes = {
        t.get_text(): t.get_bbox_patch().get_window_extent()
        for t in ax.texts
        if t.get_bbox_patch() is not None
    }
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    return fig, boxes, arrows


@pytest.mark.parametrize("edges", [DEEP, _random_circuit(0), _random_circuit(1)],
                         ids=["IOI-like", "random 0", "random 1"])  # fmt: skip
def test_arrows_pass_beside_the_nodes_they_do_not_reach(edges: list[tuple[str, float]]) -> None:
    fig, boxes, arrows = _drawn(edges)
    nodes = {
        n
        for label, _ in edges
        for n in (label.split(" -> ")[0], label.split(" -> ")[1].split(".")[0])
    }
    assert set(boxes) == nodes
    assert len(arrows) == len(edges)
    ax = fig.axes[0]  # type: ignore[attr-defined]
    for (label, _), arrow in zip(edges, arrows, strict=True):
        sender, receiver = label.split(" -> ")
        receiver = receiver.split(".")[0]
        path = arrow.get_path().transformed(ax.transData)  # the line and its head, on screen
        lines = [Path(p) for p in path.to_polygons(closed_only=False)]  # curves made lines
        for node, box in boxes.items():
            if node not in (sender, receiver):
                for line in lines:
                    assert not line.intersects_bbox(box, filled=False), f"{label} behind {node}"
        # it ends at its receiver's box: the tip of its head (the last polygon, "-|>": the
        # head's corner, its tip, its other corner) just below the box
        tip = lines[-1].vertices[1]
        box = boxes[receiver]
        assert box.x0 <= tip[0] <= box.x1 and 0 <= box.y0 - tip[1] < 15, label  # 0.15 inch


def test_the_legend_says_what_colours_and_widths_mean_and_stays_off_the_nodes() -> None:
    fig, boxes, _ = _drawn(DEEP)
    (legend,) = fig.legends  # type: ignore[attr-defined]
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [
        "score > 0: corrupting the edge raises the metric",
        "score < 0: it lowers the metric",
        "width: |score|; q, k, v: the receiving head's input",
    ]
    frame = legend.get_window_extent()
    figure = fig.bbox  # type: ignore[attr-defined]
    assert figure.x0 <= frame.x0 and frame.x1 <= figure.x1 and figure.y0 <= frame.y0
    assert not any(frame.overlaps(box) for box in boxes.values())
    title = fig.axes[0].title.get_window_extent()  # type: ignore[attr-defined]
    assert not any(title.overlaps(box) for box in boxes.values()) and title.y1 <= figure.y1


def test_an_empty_circuit_draws_an_empty_picture() -> None:
    fig, boxes, arrows = _drawn([])
    assert boxes == {} and arrows == [] and fig.legends == []  # type: ignore[attr-defined]


@pytest.mark.parametrize(("total", "scale"), [(81, "linear"), (118_561, "symlog")])
def test_a_large_graphs_curve_is_on_a_log_scale(total: int, scale: str) -> None:
    """SmolLM2's graph has 118,561 edges and its circuits a few hundred: on a linear axis they
    all stand at 0; the log scale of edge counts keeps 0 (linear below one edge) and the whole
    graph apart. The legend stands below the axes, off the curves."""
    from multihead.viz.circuit_graph import faithfulness_figure

    sizes = [0, 10, 100, total]
    fig = faithfulness_figure([("top edges", sizes, [0.0, 0.5, 0.9, 1.0])], total)
    ax = fig.axes[0]
    assert ax.get_xscale() == scale
    FigureCanvasAgg(fig).draw()
    ends = [n if scale == "symlog" else n / total for n in (0, total)]
    x = ax.transData.transform([(n, 0.0) for n in ends])[:, 0]
    box = ax.get_window_extent()
    assert box.x0 - 1 <= x[0] and x[1] <= box.x1 + 1  # 0 and every edge inside the axes
    if scale == "symlog":  # 10 and 100 edges apart on screen, not both at 0
        ten, hundred = ax.transData.transform([(10, 0.0), (100, 0.0)])[:, 0]
        assert hundred - ten > 0.1 * (x[1] - x[0])
    (legend,) = fig.legends
    assert legend.get_window_extent().y1 <= box.y0  # below the axes
    labels = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()]
    assert not any(a.overlaps(b) for i, a in enumerate(labels) for b in labels[i + 1 :])


def test_a_layers_heads_stand_in_order() -> None:
    """L0H0 feeds L1H3 and L0H3 feeds L1H0 (crossing): the layer-1 heads still stand H0 left of
    H3, as the layer-0 heads do."""
    labels = ["L0H0 -> L1H3.q", "L0H3 -> L1H0.k", "L1H0 -> logits", "L1H3 -> logits"]
    edges = [(label, 1.0) for label in [*labels, "embed -> L0H0.v", "embed -> L0H3.v"]]
    _, boxes, _ = _drawn(edges)
    for left, right in (("L0H0", "L0H3"), ("L1H0", "L1H3")):
        assert boxes[left].x1 < boxes[right].x0  # type: ignore[attr-defined]
