"""docs/tour.ipynb runs clean on a real Jupyter kernel, and shows what it says it shows.

The notebook is executed by nbclient on an ipykernel whose interpreter is this test's own
(``sys.executable``) and whose ``multihead`` is the tree under test (its ``src`` directory first
on ``PYTHONPATH``), from a kernelspec written to a temporary directory, so no globally installed
kernelspec is used. The kernel works in a temporary directory and is shut down (and checked to
be gone) at the end. One extra cell, appended in memory, prints what the checks need as JSON.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat ('.[test]')")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient ('.[test]')")
pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel ('.[test]')")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (after the skips)
from jupyter_client.manager import KernelManager  # noqa: E402

import multihead  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOUR = ROOT / "docs" / "tour.ipynb"
CELL_TIMEOUT_S = 600  # the training cell takes ~45 s alone, several times that on a busy machine
KERNEL = "multihead-test"
TEXT = "The animal didn't cross the street because it was too tired."  # the tour's sentence

# What the appended cell prints (one line, after this marker).
REPORT = "MULTIHEAD-TOUR-REPORT "
REPORT_CELL = f"""
import json, os
print({REPORT!r} + json.dumps({{
    "multihead_file": multihead.__file__,
    "pid": os.getpid(),
    "cwd": os.getcwd(),
    "workdir": workdir,
    "captured_shapes": captured_shapes,
    "induction_heads": induction_heads,
    "losses": [first, repeated, repeated_ablated],
}}))
"""

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only]  # a notebook in a kernel


def _kernelspec(directory: Path, tmp: Path) -> Path:
    """A ``python3``-style kernelspec for this interpreter that imports the multihead under test
    and makes its temporary files under ``tmp``."""
    src = str(Path(multihead.__file__).resolve().parents[1])
    path = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    spec = directory / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (multihead under test)",
                "language": "python",
                "env": {"PYTHONPATH": path, "TMPDIR": str(tmp)},
            }
        )
    )
    return spec.parent


def _text(output: Any) -> str:
    if output.get("output_type") == "stream":
        return str(output.get("text", ""))
    return str(output.get("data", {}).get("text/plain", ""))


def _cell(nb: Any, cell_id: str) -> Any:
    cells = [c for c in nb.cells if c.get("id") == cell_id]
    assert len(cells) == 1, f"docs/tour.ipynb should have one cell with id {cell_id!r}"
    return cells[0]


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the number now belongs to another user's process
        return False
    return True


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tour, executed; with the report its last cell printed."""
    base = tmp_path_factory.mktemp("tour")
    workdir, tmp = base / "cwd", base / "tmp"
    workdir.mkdir()
    tmp.mkdir()
    kernels = _kernelspec(base / "jupyter", tmp)
    nb = nbformat.read(TOUR, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "docs/tour.ipynb is committed with its outputs cleared; clear them "
        "(jupyter nbconvert --clear-output --inplace docs/tour.ipynb)"
    )
    nb.cells.append(nbformat.v4.new_code_cell(REPORT_CELL, id="test-report"))

    km = KernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )
    client = nbclient.NotebookClient(
        nb,
        km=km,
        timeout=CELL_TIMEOUT_S,
        extra_arguments=["--InteractiveShell.colors=nocolor"],  # plain tracebacks in failures
        resources={"metadata": {"path": str(workdir)}},
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JUPYTER_RUNTIME_DIR", str(base / "runtime"))  # connection files stay in tmp
        try:
            # A failing cell raises CellExecutionError naming the cell, with its traceback.
            client.execute(cleanup_kc=True)
        finally:
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    report = [
        line[len(REPORT) :]
        for o in _cell(nb, "test-report").outputs
        for line in _text(o).splitlines()
        if line.startswith(REPORT)
    ]
    assert len(report) == 1, "the report cell printed no report"
    return {"nb": nb, "report": json.loads(report[0]), "cwd": workdir, "tmp": tmp, "km": km}


def test_runs_clean_on_the_multihead_under_test(executed: dict[str, Any]) -> None:
    report = executed["report"]
    assert Path(report["multihead_file"]).resolve() == Path(multihead.__file__).resolve()
    assert Path(report["cwd"]).resolve() == executed["cwd"].resolve()
    errors = [
        o for c in executed["nb"].cells for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors
    # A warning in a kernel is printed to the cell's stderr (other stderr, such as matplotlib
    # building its font cache on a fresh machine, is not a fault of the tour).
    warned = [
        f"[{c.id}] {o.text}"
        for c in executed["nb"].cells
        for o in c.get("outputs", [])
        if o.output_type == "stream" and o.name == "stderr" and re.search(r"\w+Warning\b", o.text)
    ]
    assert not warned, "the tour's cells warned:\n" + "\n".join(warned)
    assert not executed["km"].has_kernel
    assert not _is_alive(report["pid"]), "the kernel process was left running"


def test_writes_only_to_a_temporary_directory_it_removes(executed: dict[str, Any]) -> None:
    # Nothing where the notebook runs; its files went to a tempfile.mkdtemp directory (under
    # the kernel's TMPDIR), which its last cell deletes.
    assert list(executed["cwd"].iterdir()) == []
    workdir = Path(executed["report"]["workdir"])
    assert workdir.parent.resolve() == executed["tmp"].resolve()
    assert not workdir.exists()


@pytest.fixture(scope="module")
def minilm() -> Any:
    from multihead.pretrained import minilm

    return minilm()


def test_explain_cell_shows_the_page_inline(executed: dict[str, Any], minilm: Any) -> None:
    outputs = _cell(executed["nb"], "explain").outputs
    pages = [o.data["text/html"] for o in outputs if "text/html" in o.get("data", {})]
    assert len(pages) == 1, "the explain cell should display the Explanation's page"
    page = pages[0]
    assert page.startswith("<iframe srcdoc=")
    srcdoc = html.unescape(page.split('srcdoc="', 1)[1].split('"', 1)[0])
    assert srcdoc.lstrip().lower().startswith("<!doctype html")
    # The page's data: the sentence's tokens, as the model's tokenizer makes them.
    data = srcdoc.split('<script type="application/json" id="mh-data">', 1)[1]
    data = json.loads(data.split("</script>", 1)[0])
    assert data["tokens"] == minilm.tokenize(TEXT).tokens[0]


def test_capture_cell_prints_one_row_per_head(executed: dict[str, Any], minilm: Any) -> None:
    model = minilm
    s = len(model.tokenize(TEXT).tokens[0])
    expected = (1, model.config.num_attention_heads, 1, s)  # (B, H, 1, S)
    printed = "".join(_text(o) for o in _cell(executed["nb"], "capture").outputs)
    assert f"{model.config.num_hidden_layers} layers captured" in printed
    assert f"(B, H, 1, S) = {expected}" in printed
    layers = model.config.num_hidden_layers
    assert executed["report"]["captured_shapes"] == [list(expected)] * layers


def test_finds_an_induction_head_in_the_second_layer(executed: dict[str, Any]) -> None:
    heads = executed["report"]["induction_heads"]
    assert any(layer == 1 and score >= 0.5 for layer, _, score in heads), heads
    printed = "".join(_text(o) for o in _cell(executed["nb"], "find").outputs)
    for layer, head, score in heads:
        assert f"induction head: L{layer} H{head} score {score:.2f}" in printed


def test_zeroing_the_induction_heads_makes_repeated_tokens_hard_again(
    executed: dict[str, Any],
) -> None:
    first, repeated, ablated = executed["report"]["losses"]
    assert repeated < first - 1.0  # the trained model reads repeated tokens off the first half
    # Zeroed, the repeated tokens' loss goes back more than halfway to that of random tokens.
    assert ablated > (first + repeated) / 2
    printed = "".join(_text(o) for o in _cell(executed["nb"], "break").outputs)
    assert f"with the induction heads zeroed: {ablated:.2f}" in printed
