"""The pictures of a deep model are laid out clear of their data: on a 30-layer tiny random
decoder (and a 6-layer one, MiniLM's depth), every title, legend and colour bar stays inside
the figure and off the axes' data region, measured on matplotlib's own bounding boxes after a
draw; the head map's 30 layer colours can be told apart."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

from test_hf_explain import byte_level_bpe  # noqa: E402

from multihead.explanation import explain  # noqa: E402
from multihead.observe.head_summary import HeadStatistics  # noqa: E402
from multihead.text import TextModel  # noqa: E402
from multihead.viz.heads_map import heads_map_figure, layer_colours  # noqa: E402

TEXT = "The animal didn't cross the street because it was too tired."
LONG_NAME = "SmolLM2-135M-Instruct-with-a-long-directory-name"


def _decoder(layers: int) -> TextModel:
    torch.manual_seed(0)
    tokenizer = byte_level_bpe()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=24, n_layer=layers, n_head=3, n_positions=64
    )
    model = transformers.GPT2LMHeadModel(config)
    return TextModel(model, tokenizer, name=LONG_NAME, head="lm")


@pytest.fixture(scope="module", params=[30, 6], ids=["30 layers", "6 layers"])
def explained(request: pytest.FixtureRequest) -> Any:
    return explain(TEXT, model=_decoder(request.param), focus="it")


def _drawn(fig: Any) -> Any:
    """The figure's renderer after a full draw (bounding boxes are known after one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def _area(a: Any, b: Any) -> float:
    """The area (square pixels) two bounding boxes share."""
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(w, 0.0) * max(h, 0.0)


def _inside(box: Any, fig: Any) -> bool:
    whole = fig.bbox
    return (
        box.x0 >= whole.x0 - 1
        and box.x1 <= whole.x1 + 1
        and box.y0 >= whole.y0 - 1
        and (box.y1 <= whole.y1 + 1)
    )


def test_the_grid_title_stands_above_the_maps_and_the_head_labels(explained: Any) -> None:
    fig = explained.grid_figure()
    renderer = _drawn(fig)
    maps = fig.axes[0]
    data = maps.get_window_extent(renderer)
    (title,) = fig.texts
    box = title.get_window_extent(renderer)
    assert LONG_NAME in title.get_text()
    assert _inside(box, fig)
    assert _area(box, data) == 0
    heads = [t for t in maps.texts if t.get_text().startswith("head ")]
    assert len(heads) == 3
    for label in heads:
        assert _area(label.get_window_extent(renderer), box) == 0


def test_the_importance_title_is_whole_and_off_the_map(explained: Any) -> None:
    fig = explained.importance_figure()
    renderer = _drawn(fig)
    ax = fig.axes[0]
    title = ax.title
    box = title.get_window_extent(renderer)
    # wrapped lines (a long name broken too), not a title cut at the figure's edges
    shown = "".join(title.get_text().split())
    assert shown.startswith("".join(f"{LONG_NAME}: head importance KL divergence".split()))
    assert _inside(box, fig)
    assert _area(box, ax.get_window_extent(renderer)) == 0
    bar = fig.axes[1].get_window_extent(renderer)
    assert _area(bar, ax.get_window_extent(renderer)) == 0
    # the margins hold the numbers and names of both axes and the colour bar's label
    labels = [ax.xaxis.label, ax.yaxis.label, fig.axes[1].yaxis.label]
    labels += ax.get_xticklabels() + ax.get_yticklabels()
    assert {ax.get_xlabel(), ax.get_ylabel()} == {"head", "layer"}
    for label in labels:
        assert label.get_text()
        box = label.get_window_extent(renderer)
        assert _inside(box, fig)
        assert _area(box, ax.get_window_extent(renderer)) == 0 and _area(box, bar) == 0


def test_the_head_figure_title_is_whole(explained: Any) -> None:
    fig = explained.head_figure()
    renderer = _drawn(fig)
    box = fig.axes[0].title.get_window_extent(renderer)
    assert _inside(box, fig)


def test_the_head_map_legends_stand_beside_the_points(explained: Any) -> None:
    stats: HeadStatistics = explained.statistics
    n_layers, n_heads = len(stats.layers), len(stats.heads)
    # the points as an MDS would spread them: a cloud filling the axes, corners included
    gen = torch.Generator().manual_seed(0)
    positions = torch.rand(n_layers * n_heads, 2, generator=gen, dtype=torch.float64)
    positions[:4] = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    fig = heads_map_figure(
        positions, stats.layers, stats.heads, stats.roles(), title=f"{LONG_NAME}: " + "x" * 150
    )
    renderer = _drawn(fig)
    ax = fig.axes[0]
    data = ax.get_window_extent(renderer)
    legends = fig.legends
    assert legends  # the roles' shapes, and (6 layers) the layers' colours
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert _inside(box, fig) and _area(box, data) == 0
    title = ax.title.get_window_extent(renderer)
    assert _inside(title, fig) and _area(title, data) == 0
    if n_layers > 10:  # a colour bar for the layers, beside the map too
        bar = fig.axes[1].get_window_extent(renderer)
        assert _inside(bar, fig) and _area(bar, data) == 0
        assert fig.axes[1].get_ylabel() == "colour: layer"
    else:
        assert len(legends) == 2 and len(legends[1].get_texts()) == n_layers


@pytest.mark.parametrize("layers", [6, 10, 30])
def test_layer_colours_can_be_told_apart(layers: int) -> None:
    rgb = np.array([c[:3] for c in layer_colours(layers)])
    steps = np.linalg.norm(np.diff(rgb, axis=0), axis=1)
    if layers <= 10:  # categorical: any two differ clearly
        apart = np.linalg.norm(rgb[:, None] - rgb[None], axis=-1) + np.eye(layers) * 9
        assert apart.min() > 0.25
    else:  # a scale: each layer's hue steps clearly from the last (viridis' steps are 0.03)
        assert steps.min() > 0.06
