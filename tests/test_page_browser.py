"""The interactive page in a real browser: Debian's headless Chromium driven by Selenium.

Loads the page from a file, switches head, hovers a token, and checks that the view changed,
that nothing was fetched from the network, that no JavaScript error was logged, and that a
screenshot isn't blank. Skipped only when Chromium or its driver is not installed (CI installs
them: ``apt-get install chromium chromium-driver``).
"""

from __future__ import annotations

import io
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from multihead.observe import HeadStatistics
from multihead.viz import write_page

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.skip(
        f"Debian's chromium and chromium-driver are not installed ({CHROMIUM}, {CHROMEDRIVER} "
        f"missing): apt-get install chromium chromium-driver",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402  (the test extra has it; only the browser may be absent)

pytestmark = pytest.mark.cpu_only  # a page in a browser

TOKENS = "[CLS] the animal didn ' t cross the street because it was too tired . [SEP]".split()


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--no-first-run",
        "--disable-sync",
        "--disable-component-update",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield d
    finally:
        d.quit()


def _page(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(1)
    t = len(TOKENS)
    weights = torch.softmax(torch.randn(3, 4, t, t, generator=gen) * 3, dim=-1)  # (L, H, T, T)
    special = [tok in ("[CLS]", "[SEP]") for tok in TOKENS]
    stats = HeadStatistics.from_weights(
        list(weights.unsqueeze(1)), special_mask=torch.tensor([special]), tokens=[TOKENS]
    )
    return write_page(
        tmp_path / "attention.html",
        weights,
        TOKENS,
        special=special,
        statistics=stats,
        focus=10,
        title="browser test",
    )


def _wait_ready(driver: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if driver.execute_script("return !!(window.mh && (window.mh.ready || mh.errors.length))"):
            return
        time.sleep(0.05)
    raise AssertionError("the page never became ready")


def _canvas(driver: Any, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').toDataURL()")


def test_page_in_chromium(driver: Any, tmp_path: Path) -> None:
    from PIL import Image
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    path = _page(tmp_path)
    driver.get(path.as_uri())
    _wait_ready(driver)
    assert driver.execute_script("return mh.errors") == []
    assert driver.execute_script("return mh.state.focus") == 10

    # switch head with the real <select>: the state and the heatmap's pixels change
    matrix_before = _canvas(driver, "matrix-canvas")
    Select(driver.find_element(By.ID, "head")).select_by_visible_text("2")
    assert driver.execute_script("return [mh.state.layer, mh.state.head]") == [0, 2]
    assert _canvas(driver, "matrix-canvas") != matrix_before
    renders = driver.execute_script("return mh.renders")

    # hover the token "animal" (position 2): the focus moves there and the text view redraws
    text_before = _canvas(driver, "text-canvas")
    canvas = driver.find_element(By.ID, "text-canvas")
    x, y = driver.execute_script("return mh.tokenCenter(2)")
    size = canvas.size
    ActionChains(driver).move_to_element_with_offset(
        canvas, int(x - size["width"] / 2), int(y - size["height"] / 2)
    ).perform()
    assert driver.execute_script("return mh.state.focus") == 2
    assert driver.execute_script("return mh.renders") > renders
    assert _canvas(driver, "text-canvas") != text_before
    assert "animal" in driver.find_element(By.ID, "info").text

    # the statistics table lists every (layer, head) and clicking a row selects that head
    rows = driver.find_elements(By.CSS_SELECTOR, "#stats tbody tr")
    assert len(rows) == 3 * 4
    rows[7].click()  # layer 1, head 3
    assert driver.execute_script("return [mh.state.layer, mh.state.head]") == [1, 3]

    # nothing came from the network; no JavaScript error anywhere
    fetched = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert not [u for u in fetched if u.startswith(("http:", "https:"))]
    assert driver.execute_script("return mh.errors") == []
    severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []

    # the screenshot shows something: many distinct colours, not a flat page
    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    small = image.resize((256, 180))
    colours = small.getcolors(maxcolors=256 * 180) or []
    assert len(colours) > 50
    grey = small.convert("L")
    pixels = list(grey.getdata())
    mean = sum(pixels) / len(pixels)
    variance = sum((p - mean) ** 2 for p in pixels) / len(pixels)
    assert variance > 50


# -- the whole model: model view, head view, causal maps, roles, a long text -----------------------

# T = 16 tokens, 2 layers × 3 heads; layer 0's heads are built so that where each query looks is
# known exactly: head 0 reads the previous token, head 1 reads [CLS] (position 0), head 2 itself.
T = len(TOKENS)
IMPORTANCE = torch.tensor([[0.52, 0.25, 0.125], [0.07, 0.75, 0.031]])


def _designed(causal: bool = False) -> torch.Tensor:
    eye = torch.eye(T)
    previous = torch.zeros(T, T)
    previous[torch.arange(T), (torch.arange(T) - 1).clamp(min=0)] = 1.0
    to_cls = torch.zeros(T, T)
    to_cls[:, 0] = 1.0
    scores = torch.randn(3, T, T, generator=torch.Generator().manual_seed(2)) * 3
    if causal:
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -float("inf"))
    layer1 = torch.softmax(scores, dim=-1)
    return torch.stack([torch.stack([previous, to_cls, eye]), layer1])  # (L, H, T, T)


def _designed_page(
    tmp_path: Path, causal: bool = False
) -> tuple[Path, torch.Tensor, HeadStatistics]:
    weights = _designed(causal)
    special = [tok in ("[CLS]", "[SEP]") for tok in TOKENS]
    stats = HeadStatistics.from_weights(
        list(weights.unsqueeze(1)), special_mask=torch.tensor([special]), tokens=[TOKENS]
    )
    path = write_page(
        tmp_path / "model.html",
        weights,
        TOKENS,
        special=special,
        statistics=stats,
        importance=IMPORTANCE,
        focus=10,
        causal=causal,
        title="model view",
    )
    return path, weights, stats


def _open(driver: Any, path: Path) -> None:
    driver.get(path.as_uri())
    _wait_ready(driver)
    assert driver.execute_script("return mh.errors") == []


def _pixels(driver: Any, element_id: str) -> tuple[int, int, list[int]]:
    """A canvas's (width, height, RGBA bytes), read back with getImageData."""
    w, h, px = driver.execute_script(
        "const c = document.getElementById(arguments[0]);"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "return [c.width, c.height, Array.from(d)];",
        element_id,
    )
    return w, h, px


def _rgba(image: tuple[int, int, list[int]], x: float, y: float) -> tuple[int, ...]:
    w, _, px = image
    k = 4 * (int(y) * w + int(x))
    return tuple(px[k : k + 4])


def _darkness(rgba: tuple[int, ...]) -> int:
    return 3 * 255 - sum(rgba[:3]) if rgba[3] else 0


def _no_errors_no_network(driver: Any) -> None:
    fetched = driver.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)"
    )
    assert not [u for u in fetched if u.startswith(("http:", "https:"))]
    assert driver.execute_script("return mh.errors") == []
    assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []


def _click(driver: Any, element: Any, shift: bool = False) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", element)
    chain = ActionChains(driver)
    if shift:
        chain.key_down(Keys.SHIFT).click(element).key_up(Keys.SHIFT).perform()
    else:
        chain.click(element).perform()


def test_model_view_draws_every_head_and_a_click_opens_it(driver: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    path, weights, _ = _designed_page(tmp_path)
    _open(driver, path)
    thumbs = driver.find_elements(By.CSS_SELECTOR, "#model-grid canvas")
    assert len(thumbs) == 2 * 3
    for layer in range(2):
        for head in range(3):
            image = _pixels(driver, f"thumb-{layer}-{head}")
            assert image[:2] == (T, T)  # T < 64: one thumbnail pixel per weight
            # drawn: opaque everywhere, and each query's strongest key is the darkest of its row
            assert all(a == 255 for a in image[2][3::4])
            for i in range(T):
                strongest = int(weights[layer, head, i].argmax())
                darkest = max(range(T), key=lambda j, i=i: _darkness(_rgba(image, j, i)))
                assert _darkness(_rgba(image, darkest, i)) == _darkness(_rgba(image, strongest, i))
    # the [CLS] head: column 0 dark, an empty cell near white; the previous-token head likewise
    cls = _pixels(driver, "thumb-0-1")
    assert _darkness(_rgba(cls, 0, 5)) > 400 > 30 > _darkness(_rgba(cls, 9, 5))
    previous = _pixels(driver, "thumb-0-0")
    assert _darkness(_rgba(previous, 4, 5)) > 400 > 30 > _darkness(_rgba(previous, 5, 5))

    # a click on the identity head's thumbnail opens it: state, title, heatmap and highlight
    assert driver.execute_script("return [mh.state.layer, mh.state.head]") == [0, 0]
    before = _pixels(driver, "matrix-canvas")
    _click(driver, driver.find_element(By.ID, "thumb-0-2"))
    assert driver.execute_script("return [mh.state.layer, mh.state.head]") == [0, 2]
    assert "layer 0, head 2" in driver.find_element(By.ID, "matrix-title").text
    after = _pixels(driver, "matrix-canvas")
    cell = after[1] / T
    # identity: cell (5, 5) dark now, (5, 4) empty; before (previous token) the other way round
    assert _darkness(_rgba(after, 5.5 * cell, 5.5 * cell)) > 400
    assert _darkness(_rgba(after, 4.5 * cell, 5.5 * cell)) < 30
    assert _darkness(_rgba(before, 4.5 * cell, 5.5 * cell)) > 400
    current = driver.find_elements(By.CSS_SELECTOR, "#model-grid canvas.current")
    assert [c.get_attribute("id") for c in current] == ["thumb-0-2"]
    _no_errors_no_network(driver)


def test_head_view_draws_lines_in_one_colour_per_head(driver: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path, _, _ = _designed_page(tmp_path)
    _open(driver, path)
    _click(driver, driver.find_element(By.ID, "thumb-0-0"))  # previous-token head
    _click(driver, driver.find_element(By.ID, "thumb-0-1"), shift=True)  # + the [CLS] head
    assert driver.execute_script("return mh.state.picked.map(p => [p.l, p.h])") == [[0, 0], [0, 1]]
    legend = driver.find_element(By.ID, "hv-legend").text
    assert "L0 H0" in legend and "L0 H1" in legend

    # hover the query "street" (position 8) in the left column
    base = driver.find_element(By.ID, "hv-base")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", base)
    x, y = driver.execute_script("return mh.headViewPoint('q', 8)")
    size = base.size
    ActionChains(driver).move_to_element_with_offset(
        base, int(x - size["width"] / 2), int(y - size["height"] / 2)
    ).perform()
    assert driver.execute_script("return [mh.state.focus, mh.state.side]") == [8, "q"]
    view = driver.execute_script("return mh.headView")
    assert view["lines"] == {"0:0": 1, "0:1": 1}  # one key each: token 7, and [CLS]
    colours = [tuple(int(c[k : k + 2], 16) for k in (1, 3, 5)) for c in view["colors"]]
    assert len(set(colours)) == 2

    lines = _pixels(driver, "hv-lines")
    dpr = driver.execute_script("return window.devicePixelRatio || 1")
    x_end = view["x"][1] - 3  # just left of the key column, where a line arrives

    def arriving(key: int) -> tuple[int, ...]:
        _, y_key = driver.execute_script("return mh.headViewPoint('k', arguments[0])", key)
        return _rgba(lines, x_end * dpr, y_key * dpr)

    def near(rgba: tuple[int, ...], colour: tuple[int, ...]) -> bool:  # antialiasing: a few levels
        off = max(abs(a - b) for a, b in zip(rgba[:3], colour, strict=True))
        return rgba[3] > 200 and off <= 12

    assert near(arriving(7), colours[0]) and not near(arriving(7), colours[1])  # previous token
    assert near(arriving(0), colours[1]) and not near(arriving(0), colours[0])  # [CLS]
    assert arriving(12)[3] == 0 and arriving(8)[3] == 0  # no line to keys it does not read
    # both head colours are drawn, each along a whole line
    px = lines[2]
    counts = dict.fromkeys(colours, 0)
    for k in range(0, len(px), 4):
        if px[k + 3] > 200:
            for c in colours:
                counts[c] += near(tuple(px[k : k + 4]), c)
    assert all(n > 20 for n in counts.values()), counts

    # the head view's own check boxes add a head (the identity head: a line from 8 to itself)
    box = driver.find_element(By.CSS_SELECTOR, '#hv-heads input[data-h="2"]')
    _click(driver, box)
    assert driver.execute_script("return mh.state.picked.map(p => [p.l, p.h])") == [
        [0, 0],
        [0, 1],
        [0, 2],
    ]
    assert driver.execute_script("return mh.headView.lines") == {"0:0": 1, "0:1": 1, "0:2": 1}
    third = driver.execute_script("return mh.headView.colors[2]")
    assert third not in view["colors"] and "L0 H2" in driver.find_element(By.ID, "hv-legend").text
    _no_errors_no_network(driver)


def test_causal_maps_are_lower_triangles(driver: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    path, weights, _ = _designed_page(tmp_path, causal=True)
    _open(driver, path)
    driver.execute_script("mh.select(1, 0)")
    heatmap = _pixels(driver, "matrix-canvas")
    cell = heatmap[1] / T
    for i in range(T):
        if i == 10:
            continue  # the focus row is outlined
        for j in range(T):
            alpha = _rgba(heatmap, (j + 0.5) * cell, (i + 0.5) * cell)[3]
            assert alpha == (0 if j > i else 255), (i, j)  # above: background, not "zero"
    for layer in range(2):
        for head in range(3):
            w, _, px = _pixels(driver, f"thumb-{layer}-{head}")
            alphas = [px[4 * (i * w + j) + 3] for i in range(T) for j in range(T)]
            assert alphas == [0 if j > i else 255 for i in range(T) for j in range(T)]

    # hover the key "didn" (position 3) in the head view's right column: lines come from the
    # queries that read it (3 and later), those at or above 2% of their row's peak
    base = driver.find_element(By.ID, "hv-base")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", base)
    x, y = driver.execute_script("return mh.headViewPoint('k', 3)")
    size = base.size
    ActionChains(driver).move_to_element_with_offset(
        base, int(x - size["width"] / 2), int(y - size["height"] / 2)
    ).perform()
    assert driver.execute_script("return [mh.state.focus, mh.state.side]") == [3, "k"]
    w = weights[1, 0]
    relative = torch.round(w / w.amax(-1, keepdim=True) * 255) / 255  # 8 bits per row, as stored
    readers = [i for i in range(T) if relative[i, 3] >= 0.02]
    assert readers and min(readers) >= 3
    assert driver.execute_script("return mh.headView.lines") == {"1:0": len(readers)}
    _no_errors_no_network(driver)


def test_statistics_table_has_role_and_importance(driver: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    path, _, stats = _designed_page(tmp_path)
    _open(driver, path)
    keys = [th.get_attribute("data-k") for th in driver.find_elements(By.CSS_SELECTOR, "#stats th")]
    assert keys[:4] == ["layer", "head", "role", "importance"]
    assert {"induction", "duplicate_token", "to_cls", "to_sep", "to_punctuation"} <= set(keys)

    def row(layer: int, head: int) -> dict[str, str]:
        tr = driver.find_element(By.CSS_SELECTOR, f'#stats tr[data-l="{layer}"][data-h="{head}"]')
        cells = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        return dict(zip(keys, cells, strict=True))

    roles = stats.roles()
    # the heads built as previous-token, [CLS] and identity heads carry those roles
    for head, role in enumerate(("previous token", "[CLS]", "self")):
        assert roles[0][head] == role and row(0, head)["role"] == role
    assert row(0, 2)["identity"] == "1.00" and row(0, 1)["to_cls"] == "1.00"
    for layer in range(2):
        for head in range(3):
            assert row(layer, head)["importance"] == f"{float(IMPORTANCE[layer, head]):.3f}"
    assert torch.isnan(stats.induction).all()  # no token ids given: unknown, shown as a dash
    assert row(1, 1)["induction"] == "\u2013"

    # sort by importance (largest first), then a click on the top row still opens its head
    driver.find_element(By.CSS_SELECTOR, '#stats th[data-k="importance"]').click()
    first = driver.find_element(By.CSS_SELECTOR, "#stats tbody tr")
    assert (first.get_attribute("data-l"), first.get_attribute("data-h")) == ("1", "1")
    first.click()
    assert driver.execute_script("return [mh.state.layer, mh.state.head]") == [1, 1]
    _no_errors_no_network(driver)


def test_512_token_page_opens_with_every_thumbnail(driver: Any, tmp_path: Path) -> None:
    """The page of a long text opens and draws the model view exactly; how fast it opens is
    benchmarks/bench_page.py's business (it reads the marks checked here)."""
    # 6 layers × 12 heads × 512² weights shaped like a BERT's: per head a local window (none for
    # the broad heads), a [CLS] sink and noise, so the page is about as large as a real one
    layers, heads, t = 6, 12, 512
    pos = torch.arange(t)
    distance = (pos[:, None] - pos[None, :]).abs().float()  # (T, T)
    width = (3.0 * torch.linspace(0, 1, layers * heads) ** 7).view(layers, heads, 1, 1)
    noise = torch.randn(layers, heads, t, t, generator=torch.Generator().manual_seed(0))
    scores = -distance * width + noise
    scores[..., 0] += 3.0
    weights = torch.softmax(scores, -1)  # (L, H, T, T)
    tokens = ["[CLS]", *(f"w{i}" for i in range(t - 2)), "[SEP]"]
    path = write_page(tmp_path / "long.html", weights, tokens, title="512 tokens")
    driver.get(path.as_uri())
    _wait_ready(driver, timeout=120)
    deadline = time.monotonic() + 30  # set once the first frame with every view has painted
    while not driver.execute_script("return !!window.__multiheadReady"):
        assert time.monotonic() < deadline, "window.__multiheadReady was never set"
        time.sleep(0.02)
    ready = driver.execute_script("return window.__multiheadReady")
    # the page's own marks, in the order its steps run (the benchmark reports them)
    assert ready["sinceNavigation"] >= ready["ms"] >= ready["drawn"] >= ready["decode"] > 0
    assert (
        driver.execute_script("return document.querySelectorAll('#model-grid canvas').length") == 72
    )
    # each thumbnail is the head's map max-pooled into 64 × 64 blocks of 8 × 8 weights, each
    # query relative to its peak, on the white -> blue ramp; reference: pooled here from the weights
    for layer, head in ((0, 0), (2, 5), (5, 11)):  # broad to sharp
        w = weights[layer, head]
        relative = torch.round(w / w.amax(-1, keepdim=True) * 255)  # 8 bits per row, as stored
        pooled = torch.nn.functional.max_pool2d(relative[None], 8)[0] / 255  # (64, 64)
        ramp = torch.stack([247 - 239 * pooled, 251 - 203 * pooled, 255 - 148 * pooled], -1)
        thumb = _pixels(driver, f"thumb-{layer}-{head}")
        assert thumb[:2] == (64, 64)
        drawn = torch.tensor(thumb[2], dtype=torch.float32).view(64, 64, 4)
        assert (drawn[..., :3] - ramp).abs().max() <= 1.0
    _no_errors_no_network(driver)


def test_qk_pairs_are_listed_beside_the_head_view(driver: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    path = _page(tmp_path)
    _open(driver, path)
    assert not driver.find_element(By.ID, "qk-panel").is_displayed()  # not asked: no panel
    qk = {
        "head": "L1H3", "query": 10, "key": 2, "query_token": "it", "key_token": "animal",
        "score": 4.25, "weight": 0.61, "rise": [["L0H1", 2.5], ["embed", -0.25]],
        "pairs": [["embed", "L0H1", 3.0], ["MLP0", "embed", -1.5], ["q bias", "<b>", 0.5]],
    }  # fmt: skip
    page = write_page(tmp_path / "qk.html", *_weights_and_tokens(), focus=10, qk=qk)
    _open(driver, page)
    assert driver.find_element(By.ID, "qk-panel").is_displayed()
    title = driver.find_element(By.ID, "qk-title").text
    assert "L1H3" in title and "key 2 (animal)" in title and "4.250" in title
    rows = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in driver.find_elements(By.CSS_SELECTOR, "#qk-pairs tbody tr")
    ]
    assert rows == [
        ["embed", "L0H1", "3.000"],
        ["MLP0", "embed", "-1.500"],
        ["q bias", "<b>", "0.500"],
    ]
    assert driver.find_element(By.ID, "qk-rise").text.endswith("L0H1 +2.500, embed -0.250")
    _no_errors_no_network(driver)


def _weights_and_tokens() -> tuple[torch.Tensor, list[str]]:
    t = len(TOKENS)
    gen = torch.Generator().manual_seed(2)
    return torch.softmax(torch.randn(2, 4, t, t, generator=gen), dim=-1), TOKENS
