"""PatchResult.plot: one heatmap for every kind of result (patch's per layer, per head, per
position; attribution_patching's; path_patching's), its cells and labels read back from the
figure and compared with the result's values and axes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

import multihead
from multihead.models import TransformerLM

pytest.importorskip("matplotlib")

V = 30


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


@pytest.fixture(scope="module")
def setup() -> tuple[TransformerLM, Tensor, Tensor]:
    torch.manual_seed(0)
    lm = TransformerLM(V, 24, 4, 3, 40, max_len=16).eval()
    clean = torch.randint(V, (2, 5))
    corrupt = torch.randint(V, (2, 5))
    return lm, clean, corrupt


def _drawn(fig: Any) -> tuple[Any, Any, list[str], list[str]]:
    """(the heatmap's axes, its image's data, x tick labels, y tick labels)."""
    ax = fig.axes[0]
    assert len(ax.images) == 1
    data = ax.images[0].get_array()
    xs = [t.get_text() for t in ax.get_xticklabels()]
    ys = [t.get_text() for t in ax.get_yticklabels()]
    return ax, data, xs, ys


def _cells(data: Any) -> Tensor:
    """The image's data as a tensor, masked (blank) cells NaN."""
    return torch.tensor(data.filled(math.nan), dtype=torch.float32)


def _colour_bar_clear_of_the_data(fig: Any) -> None:
    fig.draw_without_rendering()
    heatmap, bar = fig.axes[0].get_window_extent(), fig.axes[1].get_window_extent()
    assert not heatmap.overlaps(bar)


def test_layers_by_heads_with_a_blank_cell(setup: Any) -> None:
    lm, clean, corrupt = setup
    # two heads patched: every other cell is NaN, drawn blank
    result = multihead.patch(lm, clean, corrupt, _metric, heads=[(0, 1), (2, 3)])
    fig = result.plot()
    ax, data, xs, ys = _drawn(fig)
    assert data.shape == (3, 4)
    torch.testing.assert_close(_cells(data), result.values.float(), equal_nan=True)
    assert bool(data.mask[1, 0]) and not bool(data.mask[0, 1])  # NaN: masked, blank
    assert ax.images[0].cmap.get_bad().tolist() == [1.0, 1.0, 1.0, 1.0]  # white
    assert ys == ["0", "1", "2"] and xs == ["0", "1", "2", "3"]
    assert (ax.get_ylabel(), ax.get_xlabel()) == ("layer", "head")
    # only the two patched cells carry their values
    written = {(round(t.get_position()[1]), round(t.get_position()[0])) for t in ax.texts}
    assert written == {(0, 1), (2, 3)}
    assert ax.get_title() == "Patching z (denoise)"
    assert fig.axes[1].get_ylabel() == "metric change (denoise)"
    _colour_bar_clear_of_the_data(fig)


def test_layers_by_positions_named_by_tokens(setup: Any) -> None:
    lm, clean, corrupt = setup
    result = multihead.patch(lm, clean, corrupt, _metric, site="resid_pre", per_position=True)
    tokens = ["a", "b", "$c", "d", "e"]
    fig = result.plot(tokens=tokens, title="the stream")
    ax, data, xs, ys = _drawn(fig)
    assert data.shape == (3, 5)
    torch.testing.assert_close(_cells(data), result.values.float())
    assert ys == ["0", "1", "2"] and xs == ["a", "b", r"\$c", "d", "e"]  # "$" drawn as written
    assert (ax.get_ylabel(), ax.get_xlabel(), ax.get_title()) == ("layer", "position", "the stream")
    _colour_bar_clear_of_the_data(fig)
    with pytest.raises(ValueError, match="tokens must name the result's 5 positions, got 2"):
        result.plot(tokens=["a", "b"])
    with pytest.raises(TypeError, match="tokens must be a sequence of 5 strings"):
        result.plot(tokens="abcde")


def test_one_value_per_layer(setup: Any) -> None:
    lm, clean, corrupt = setup
    result = multihead.patch(lm, clean, corrupt, _metric, site="resid_post", direction="noise")
    ax, data, xs, ys = _drawn(result.plot())
    assert data.shape == (3, 1) and xs == ["resid_post"] and ys == ["0", "1", "2"]
    torch.testing.assert_close(_cells(data)[:, 0], result.values.float())
    assert ax.get_title() == "Patching resid_post (noise)"


def test_top_heads_by_positions(setup: Any) -> None:
    lm, clean, corrupt = setup
    result = multihead.patch(lm, clean, corrupt, _metric, per_position=True)  # (3, 4, 5)
    ax, data, xs, ys = _drawn(result.plot(top=3))
    assert data.shape == (3, 5) and xs == [str(t) for t in range(5)]
    # the three heads with the largest sum of |effect| over positions, largest first
    sums = {(la, h): float(result.values[la, h].abs().sum()) for la in range(3) for h in range(4)}
    want = sorted(sums, key=sums.__getitem__, reverse=True)[:3]
    assert ys == [f"L{la}H{h}" for la, h in want]
    for row, (la, h) in enumerate(want):
        torch.testing.assert_close(_cells(data)[row], result.values[la, h].float())
    # a result with two heads patched draws those two, whatever top asks
    two = multihead.patch(lm, clean, corrupt, _metric, per_position=True, heads=["L2H0", "L0H3"])
    _, data, _, ys = _drawn(two.plot(top=10))
    assert data.shape == (2, 5) and sorted(ys) == ["L0H3", "L2H0"]
    with pytest.raises(ValueError, match="top must be a positive int, got 0"):
        result.plot(top=0)


def test_key_value_heads_and_attribution(setup: Any) -> None:
    lm, clean, corrupt = setup
    estimate = multihead.attribution_patching(lm, clean, corrupt, _metric)
    ax, data, xs, ys = _drawn(estimate.plot(title="estimate"))
    torch.testing.assert_close(_cells(data), estimate.values.float())
    assert (ax.get_xlabel(), ax.get_title()) == ("head", "estimate")
    keys = multihead.patch(lm, clean, corrupt, _metric, site="k", layers=[1])
    ax, data, xs, _ = _drawn(keys.plot())
    assert ax.get_xlabel() == "key/value head" and data.shape == (3, 4)


def test_senders_by_receivers_inputs(setup: Any) -> None:
    lm, clean, corrupt = setup
    paths = multihead.path_patching(
        lm, clean, corrupt, _metric, ["L0H1", "L1H2"], ["L2H0", "L2H3"], via=("k", "v")
    )
    ax, data, xs, ys = _drawn(paths.plot())
    assert ys == ["L0H1", "L1H2"] and xs == ["L2H0.k", "L2H0.v", "L2H3.k", "L2H3.v"]
    torch.testing.assert_close(_cells(data), paths.values.reshape(2, 4).float())
    assert (ax.get_ylabel(), ax.get_title()) == ("sender", "Path patching (noise)")
    _colour_bar_clear_of_the_data(fig=ax.figure)


def test_a_set_and_the_logits_draw_only_the_inputs_they_have(setup: Any) -> None:
    lm, clean, corrupt = setup
    paths = multihead.path_patching(
        lm, clean, corrupt, _metric, ["L0H1", "mlp1"], [(2, 0, -1), [(2, 3), (2, 1)], "logits"]
    )  # via q, k, v, resid: the heads' resid and the logits' q, k, v are NaN, and not drawn
    ax, data, xs, ys = _drawn(paths.plot())
    heads = [f"{r}.{x}" for r in ("L2H0@[4]", "{L2H3, L2H1}") for x in "qkv"]
    assert ys == ["L0H1", "MLP1"] and xs == [*heads, "logits"]
    want = torch.cat([paths.values[:, :2, :3].reshape(2, 6), paths.values[:, 2, 3:]], dim=1)
    assert not want.isnan().any()
    torch.testing.assert_close(_cells(data), want.float())


def test_effects_figure_is_exported() -> None:
    from multihead.viz import effects_figure
    from multihead.viz.plots import effects_figure as plots_effects_figure

    assert effects_figure is plots_effects_figure


def test_row15_top_lists_only_patched_cells(setup: tuple[TransformerLM, Tensor, Tensor]) -> None:
    """Issue 51 row 15: ``patch(layers=[1])``'s ``top(k)`` (was: the unpatched, NaN cells of
    the other layers listed as 0.0 effects): only patched cells, as many as there are."""
    lm, clean, corrupt = setup
    result = multihead.patch(lm, clean, corrupt, _metric, layers=[1])  # layer 1's 4 heads
    listed = result.top(10)
    assert len(listed) == 4 and all(label.startswith("L1H") for label, _ in listed)
    by_hand = sorted(
        ((f"L1H{h}", float(result.values[1, h])) for h in range(4)), key=lambda c: -abs(c[1])
    )
    assert listed == by_hand
    assert all(not math.isnan(v) for _, v in listed)
