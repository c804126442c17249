"""How fast the interactive page opens: a 512-token, 6-layer × 12-head page in headless Chromium.

Builds the page ``multihead explain --format html`` writes for a long input (6 layers × 12 heads
× 512² weights, with the head-statistics table and an importance column), opens it from a file in
Debian's headless Chromium (Selenium) ``--repeats`` times, and reads what the page measures of
itself, ``window.__multiheadReady``:

- ``ms``: script start -> weights decoded, every view drawn (text, heatmap, the 72-thumbnail
  model view, head view, statistics table) and that frame painted;
- ``sinceNavigation``: the same end, counted from navigation (adds reading and parsing the file);
- ``decode``: script start -> weights inflated (``DecompressionStream``) and ready;
- ``drawn``: script start -> every view drawn, before the browser lays out and paints.

The weights are synthetic but shaped like a BERT's: per head a local window of its own width
(none for the broad heads), a [CLS] sink and noise, so the page deflates about as a real one does
(~10 MB; the file size is printed).

Usage::

    python benchmarks/bench_page.py [--tokens 512] [--layers 6] [--heads 12] [--repeats 5]

Prints the machine (``lscpu``'s model name), the file size and the median/min of each time;
writes ``benchmarks/results/page.json``. Needs ``chromium`` and ``chromium-driver``.
``tests/test_page_browser.py`` checks what the page shows (times are measured here only).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import format_table, machine_info, write_json

from multihead.observe import HeadStatistics
from multihead.viz import write_page

TIMES = ("ms", "sinceNavigation", "decode", "drawn")


def lscpu_model() -> str:
    """``lscpu``'s "Model name" line (the CPU the browser ran on), or "unknown"."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def build_page(directory: Path, tokens: int, layers: int, heads: int) -> Path:
    """A BERT-shaped page: per head a local window, a [CLS] sink and noise; statistics included."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(tokens)
    distance = (pos[:, None] - pos[None, :]).abs().float()  # (T, T)
    # window widths from none (broad heads: noise only) to sharp, most heads broad-ish: the page
    # deflates to about the size of a real MiniLM page of 512 tokens (~10 MB)
    width = (3.0 * torch.linspace(0, 1, layers * heads) ** 7).view(layers, heads, 1, 1)
    scores = -distance * width + torch.randn(layers, heads, tokens, tokens, generator=gen)
    scores[..., 0] += 3.0  # the [CLS] sink
    weights = torch.softmax(scores, dim=-1)  # (L, H, T, T)
    words = ["[CLS]", *(f"w{i}" for i in range(tokens - 2)), "[SEP]"]
    special = [w in ("[CLS]", "[SEP]") for w in words]
    stats = HeadStatistics.from_weights(
        list(weights.unsqueeze(1)), special_mask=torch.tensor([special]), tokens=[words]
    )
    importance = torch.rand(layers, heads, generator=gen)
    return write_page(
        directory / "page.html",
        weights,
        words,
        special=special,
        statistics=stats,
        importance=importance,
        focus=tokens // 2,
        title=f"{tokens} tokens",
    )


def open_times(path: Path, repeats: int) -> list[dict[str, float]]:
    """Open ``path`` ``repeats`` times in one headless Chromium; the page's timings of each."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(flag)
    driver = webdriver.Chrome(
        options=options, service=Service(shutil.which("chromedriver") or "/usr/bin/chromedriver")
    )
    runs = []
    try:
        for _ in range(repeats):
            driver.get("about:blank")
            driver.get(path.as_uri())
            deadline = time.monotonic() + 120
            while not driver.execute_script("return !!window.__multiheadReady"):
                errors = driver.execute_script("return window.mh ? mh.errors : []")
                if errors or time.monotonic() > deadline:
                    raise RuntimeError(f"the page did not open: {errors or 'timed out'}")
                time.sleep(0.02)
            ready = driver.execute_script("return window.__multiheadReady")
            # the page's marks in the order its steps run, or the table would mean nothing
            order = [ready[name] for name in ("sinceNavigation", "ms", "drawn", "decode")]
            if not order[0] >= order[1] >= order[2] >= order[3] > 0:
                raise RuntimeError(f"the page's marks are out of order: {ready}")
            runs.append(ready)
    finally:
        driver.quit()
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--tokens", type=int, default=512, help="T, tokens (default 512)")
    parser.add_argument("--layers", type=int, default=6, help="L, layers (default 6)")
    parser.add_argument("--heads", type=int, default=12, help="H, heads per layer (default 12)")
    parser.add_argument("--repeats", type=int, default=5, help="page opens (default 5)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        path = build_page(Path(tmp), args.tokens, args.layers, args.heads)
        size_mb = path.stat().st_size / 1e6
        runs = open_times(path, args.repeats)
    rows = []
    for name in TIMES:
        times = [r[name] for r in runs]
        rows.append([name, f"{statistics.median(times):.0f}", f"{min(times):.0f}"])
    machine = {**machine_info(), "lscpu_model": lscpu_model()}
    shape = f"{args.layers} layers x {args.heads} heads x {args.tokens}^2"
    cpu, cores, load = machine["lscpu_model"], machine["cores"], machine["load_average"]
    print(f"machine: {cpu} ({cores} cores), load average {load}")
    print(f"page: {shape}, {size_mb:.1f} MB, opened {args.repeats} times in headless Chromium")
    print(format_table(["time (ms)", "median", "min"], rows))
    write_json(
        "page",
        {
            "machine": machine,
            "shape": {"layers": args.layers, "heads": args.heads, "tokens": args.tokens},
            "size_mb": size_mb,
            "runs": runs,
        },
        report={
            "title": "The interactive page: `benchmarks/bench_page.py`",
            "tables": [
                {
                    "caption": f"{shape}, {size_mb:.1f} MB, opened {args.repeats} times in "
                    "headless Chromium:",
                    "header": ["time (ms)", "median", "min"],
                    "rows": rows,
                }
            ],
            "load_after": load,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
