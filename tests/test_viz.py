"""Pictures and the interactive page: files written and valid, page self-contained and small."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import zlib
from html.parser import HTMLParser
from pathlib import Path
from xml.etree import ElementTree

import pytest
import torch

import multihead
from multihead.observe import HeadStatistics
from multihead.viz import encode_weights, grid_figure, head_figure, render_page, save_figure

TOKENS = ["[CLS]", "the", "animal", "didn", "'", "t", "cross", "$5", "it", "[SEP]"]
L, H, T = 2, 3, len(TOKENS)


def _weights(layers: int = L, heads: int = H, t: int = T, sharp: float = 3.0) -> torch.Tensor:
    return torch.softmax(torch.randn(layers, heads, t, t) * sharp, dim=-1)


def _stats(w: torch.Tensor) -> HeadStatistics:
    special = torch.tensor([[tok in ("[CLS]", "[SEP]") for tok in TOKENS]])
    return HeadStatistics.from_weights(list(w.unsqueeze(1)), special_mask=special, tokens=[TOKENS])


def test_grid_png_and_svg(tmp_path: Path) -> None:
    fig = grid_figure(_weights(), TOKENS, layers=[4, 5], heads=[0, 7, 9], focus=8)
    png = save_figure(fig, tmp_path / "grid.png")
    svg = save_figure(fig, tmp_path / "grid.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    root = ElementTree.parse(svg).getroot()  # well-formed XML
    assert root.tag.endswith("svg")
    text = svg.read_text()
    # labels stay text: every token, the head and layer numbers we passed
    for label in ("animal", "didn", "head 7", "head 9", "layer 5", "$5"):
        assert label in text
    assert "Date" not in text  # reproducible output


def test_a_picture_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    from multihead import _files

    fig = grid_figure(_weights(), TOKENS)
    path = save_figure(fig, tmp_path / "grid.png")
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as any new file, not 0600
    before = path.read_bytes()
    real = _files.write_synced

    def crash(file: Path, data: bytes) -> None:
        real(file, data[: len(data) // 2])  # half a picture, then the "crash"
        raise OSError("disk full")

    monkeypatch.setattr(_files, "write_synced", crash)
    with pytest.raises(OSError, match="disk full"):
        save_figure(grid_figure(_weights(sharp=0.1), TOKENS), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["grid.png"]  # no half-written leftover


def test_head_figure(tmp_path: Path) -> None:
    fig = head_figure(_weights()[1, 2], TOKENS, layer=1, head=2, focus=3)
    path = save_figure(fig, tmp_path / "head.svg")
    text = path.read_text()
    assert "layer 1 head 2" in text and "cross" in text
    assert save_figure(fig, tmp_path / "head.png").stat().st_size > 1000


def test_long_inputs_drop_grid_labels(tmp_path: Path) -> None:
    tokens = [f"tok_{i}" for i in range(64)]  # "_" never occurs in the SVG's base64 image
    fig = grid_figure(_weights(1, 2, 64), tokens)
    text = save_figure(fig, tmp_path / "grid.svg").read_text()
    assert "tok_" not in text and "head 1" in text


def test_grid_labels_name_every_row_of_every_layer_and_every_key() -> None:
    n_layers = 4
    fig = grid_figure(_weights(n_layers), TOKENS)
    ax = fig.axes[0]
    cells = torch.as_tensor(ax.images[0].get_array().filled(float("nan")))
    # the rows of each layer's maps, as drawn: runs of rows that are not all blank (gutters)
    drawn = (~cells.isnan().all(dim=1)).nonzero().flatten().tolist()
    assert len(drawn) == n_layers * T
    shown = [token.replace("$", r"\$") for token in TOKENS]  # drawn as written, not mathtext
    rows = [(float(y), shown[i % T]) for i, y in enumerate(drawn)]
    left = sorted((t.get_position()[1], t.get_text()) for t in ax.texts if t.get_position()[0] < 0)
    assert left == rows  # one label per row of every layer, at that row's height
    columns = (~cells.isnan().all(dim=0)).nonzero().flatten().tolist()
    below = sorted(
        (t.get_position()[0], t.get_text()) for t in ax.texts if t.get_rotation() == 90
        and t.get_position()[1] > cells.shape[0] - 1
    )  # fmt: skip
    assert below == [(float(x), shown[i % T]) for i, x in enumerate(columns)]


def test_the_grid_svg_holds_the_cells_not_a_resampled_picture(tmp_path: Path) -> None:
    fig = grid_figure(_weights(), TOKENS)
    rows, cols = fig.axes[0].images[0].get_array().shape
    svg = save_figure(fig, tmp_path / "grid.svg").read_text()
    images = re.findall(r'<image [^>]*xlink:href="data:image/png;base64,([^"]*)"[^>]*>', svg)
    assert len(images) == 2  # the maps and the colour bar
    png = base64.b64decode(images[0])
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (cols, rows)  # one pixel per cell, scaled by the viewer
    assert "image-rendering:pixelated" in svg.split(images[0])[1].split(">")[0]


def test_figure_errors(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"weights must be \(L, H, T, S\), got shape \(3, 10, 10\)"
    ):
        grid_figure(_weights()[0], TOKENS)
    with pytest.raises(ValueError, match="tokens must name the 10 key positions, got 3 tokens"):
        grid_figure(_weights(), TOKENS[:3])
    with pytest.raises(ValueError, match="must label the weights' 2 layers and 3 heads, got 1"):
        grid_figure(_weights(), TOKENS, layers=[0])
    with pytest.raises(TypeError, match="weights must be a torch.Tensor, got list"):
        head_figure([[1.0]], ["a"])  # type: ignore[arg-type]
    fig = head_figure(_weights()[0, 0], TOKENS)
    with pytest.raises(ValueError, match=r"path must end in .png or .svg, got '.*grid.pdf'"):
        save_figure(fig, tmp_path / "grid.pdf")


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"needs matplotlib .*: pip install 'multihead\[viz\]'"):
        grid_figure(_weights(), TOKENS)


def test_imports_stay_lazy() -> None:
    # The CLI's start-up time depends on it: nothing heavy until a picture is drawn.
    src = str(Path(multihead.__file__).resolve().parents[1])
    code = (
        "import sys, multihead, multihead.viz, multihead.observe, multihead.explanation, "
        "multihead.cli.explain, multihead.viz.page; "
        "heavy = [m for m in ('matplotlib', 'rich', 'tokenizers', 'PIL') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": src},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr


def test_encode_weights_round_trip() -> None:
    w = _weights()
    q, scales = encode_weights(w)
    assert len(q) == L * H * T * T and len(scales) == 4 * L * H * T
    codes = torch.frombuffer(bytearray(q), dtype=torch.uint8).view(L, H, T, T).float()
    maxima = torch.frombuffer(bytearray(scales), dtype=torch.float32).view(L, H, T, 1)
    back = codes / 255 * maxima
    # 8 bits per row, relative to the row's peak
    assert (back - w).abs().max() <= (maxima / 510 + 1e-7).max()
    assert codes.amax(-1).eq(255).all()


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _data(page: str) -> dict:
    blob = page.split('<script type="application/json" id="mh-data">')[1].split("</script>")[0]
    return json.loads(blob)


def test_page_is_self_contained_and_round_trips() -> None:
    w = _weights()
    tokens = [*TOKENS[:-2], "</script><script>alert(1)</script>", "[SEP]"]
    page = render_page(
        w,
        tokens,
        special=[t in ("[CLS]", "[SEP]") for t in tokens],
        statistics=_stats(w),
        focus=8,
        title="A <b>title</b>",
    )
    parser = _Refs()
    parser.feed(page)
    scripts = [attrs for tag, attrs in parser.tags if tag == "script"]
    assert len(scripts) == 2 and all("src" not in a for a in scripts)  # data + code, inline
    assert not [tag for tag, _ in parser.tags if tag in ("link", "img", "iframe", "object")]
    for _, attrs in parser.tags:
        for key in ("src", "href"):
            assert not re.match(r"\s*(https?:)?//", attrs.get(key) or "")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page)
    assert "@import" not in page and "url(" not in page
    assert "<title>A &lt;b&gt;title&lt;/b&gt;</title>" in page
    data = _data(page)
    assert data["tokens"] == tokens  # the hostile token survived as data
    assert data["focus"] == 8 and data["stats"]["layers"] == [0, 1]
    raw = zlib.decompress(base64.b64decode(data["weights"]))
    assert raw == encode_weights(w)[0]


def test_page_size_for_512_tokens() -> None:
    # 6 layers × 12 heads × 512² weights are 18.9 million numbers. Uncompressed they must cost
    # one byte each (base64: 4/3), never JSON floats; a realistic pattern (a [CLS] sink plus a
    # local window) deflates to a small fraction of that.
    layers, heads, t = 6, 12, 512
    tokens = [f"w{i}" for i in range(t)]
    n = layers * heads * t * t
    raw = render_page(torch.rand(layers, heads, t, t), tokens, compress=False)
    row_maxima = 4 * layers * heads * t  # float32 each
    assert len(raw.encode()) < 4 / 3 * (n + row_maxima) + 50_000
    pos = torch.arange(t)
    scores = (
        -(pos[:, None] - pos[None, :]).abs().float() * torch.linspace(0.3, 3, heads)[:, None, None]
    )
    scores[..., 0] += 2.0
    realistic = torch.softmax(scores, -1).expand(layers, heads, t, t)
    page = render_page(realistic, tokens)
    assert len(page.encode()) < 0.1 * n


def test_page_errors() -> None:
    w = _weights()
    with pytest.raises(ValueError, match=r"weights must be a \(L, H, T, T\) self-attention tensor"):
        render_page(w[..., :4], TOKENS)
    with pytest.raises(ValueError, match="tokens must hold T=10 tokens, got 9"):
        render_page(w, TOKENS[:-1])
    with pytest.raises(ValueError, match=r"focus must be a token position in 0..9, got 10"):
        render_page(w, TOKENS, focus=10)
    with pytest.raises(ValueError, match=r"initial must be \(layer, head\) positions within"):
        render_page(w, TOKENS, initial=(2, 0))


def test_page_causal_flag_is_checked_against_the_weights() -> None:
    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # key after query
    scores = torch.randn(L, H, T, T, generator=torch.Generator().manual_seed(3))
    causal = torch.softmax(scores.masked_fill(future, -float("inf")), dim=-1)
    assert causal.triu(1).eq(0).all()
    data = _data(render_page(causal, TOKENS, causal=True))
    assert data["causal"] is True
    assert _data(render_page(causal, TOKENS))["causal"] is False  # a causal map may be shown flat
    # one weight after its query (layer 1, head 2, query 3 on key 7): the flag must be wrong
    leaky = causal.clone()
    leaky[1, 2, 3, 7] = 0.25
    with pytest.raises(
        ValueError,
        match=r"causal=True but weights put 0.25 above the diagonal \(layer position 1, head 2, "
        r"query 3 on later key 7\): these are not a causal model's weights; pass causal=False",
    ):
        render_page(leaky, TOKENS, causal=True)
    with pytest.raises(ValueError, match="causal=True but weights put"):
        render_page(_weights(), TOKENS, causal=True)  # a bidirectional model's weights


def test_page_carries_roles_importance_and_the_new_views() -> None:
    w = _weights()
    stats = _stats(w)
    importance = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    page = render_page(w, TOKENS, statistics=stats, importance=importance)
    data = _data(page)
    assert data["stats"]["role"] == stats.roles()
    assert data["stats"]["importance"] == [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]
    for element in ('id="model-grid"', 'id="hv-base"', 'id="hv-lines"', 'id="stats"'):
        assert element in page
    assert "__multiheadReady" in page


def test_formats_are_one_list_checked_once() -> None:
    from multihead.explanation.result import Explanation
    from multihead.viz import FORMATS, check_formats
    from multihead.viz.formats import FIGURE_FORMATS

    assert FORMATS == ("png", "svg", "html") and FIGURE_FORMATS == ("png", "svg")
    assert Explanation.save.__defaults__ == (FORMATS,)  # the same object, not a copy
    assert check_formats("f", " SVG, png,svg ") == ["svg", "png"]
    assert check_formats("f", ("html",)) == ["html"]
    with pytest.raises(ValueError, match=r"f must be some of png, svg, html, got \['gif'\]"):
        check_formats("f", ["gif"])
    with pytest.raises(ValueError, match=r"f must be some of png, svg, html, got \(\)"):
        check_formats("f", ())
    with pytest.raises(TypeError, match="f must be a str or a sequence of str, got b'png'"):
        check_formats("f", b"png")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="f must name formats as str, got 3"):
        check_formats("f", ["png", 3])  # type: ignore[list-item]


def test_check_output_dir_creates_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from multihead.viz import check_output_dir

    deep = tmp_path / "a" / "b"
    assert check_output_dir("out", str(deep), ["x.png"]) == deep
    assert list(tmp_path.iterdir()) == []  # checked, not created
    with pytest.raises(TypeError, match="out must be a str or a path, got int"):
        check_output_dir("out", 3)
    (tmp_path / "x.png").write_text("old")
    access = os.access
    # root may write anywhere: deny the write where the check asks about this one file
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).name != "x.png" and access(p, mode))
    with pytest.raises(PermissionError, match=r"out: '.*x.png' exists and is not writable"):
        check_output_dir("out", tmp_path, ["x.png"])
    assert check_output_dir("out", tmp_path, ["y.png"]) == tmp_path
