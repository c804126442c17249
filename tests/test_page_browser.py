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
