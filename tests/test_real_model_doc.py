"""docs/real-model.md is what ``benchmarks/real_model.py`` renders from its committed JSON.

Every number of the page is a field of ``docs/data/real_model.json`` filled into
``benchmarks/real_model.md.in``: re-rendering must give the page byte for byte, so a number
edited by hand (or a JSON regenerated without rendering) fails here. Files only: no model runs.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _script() -> ModuleType:
    path = ROOT / "benchmarks" / "real_model.py"
    spec = importlib.util.spec_from_file_location("_benchmarks_real_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_the_render_of_the_committed_results() -> None:
    script = _script()
    results = json.loads(script.RESULTS.read_text(encoding="utf-8"))
    want = script.render(results, script.TEMPLATE.read_text(encoding="utf-8"))
    got = script.PAGE.read_text(encoding="utf-8")
    assert got == want, "docs/real-model.md is stale: python benchmarks/real_model.py --render"


def test_every_number_of_the_page_comes_from_the_template_fields() -> None:
    # the template's own prose holds no measured number: each one on the page is a {field}
    template = (ROOT / "benchmarks" / "real_model.md.in").read_text(encoding="utf-8")
    prose = re.sub(r"\{[^{}]*\}", "", template.replace("{{", "").replace("}}", ""))
    prose = re.sub(r"```.*?```", "", prose, flags=re.S)  # commands and code, not measurements
    prose = re.sub(r"`[^`]*`", "", prose)
    measured = re.findall(r"(?<![\w.])\d+\.\d+(?![\w.])", prose)
    assert measured == [], measured


def test_the_results_hold_what_the_page_says() -> None:
    results = json.loads((ROOT / "docs" / "data" / "real_model.json").read_text("utf-8"))
    ind = results["induction"]
    assert len(ind["top"]) == 6 and len(ind["random_sets"]) == 10
    assert ind["zero_ablated"] > ind["random_max"]  # "what makes the copy cheap"
    for receiver, via in results["composition"]["paths"].items():
        assert abs(via["k"]) > abs(via["q"]) and abs(via["k"]) > abs(via["v"]), receiver
    ioi = results["ioi"]
    assert ioi["clean"] > 0 > ioi["corrupt"]
    # "the largest of these paths ... through its values"
    strongest = max((abs(v), via) for vias in ioi["paths"].values() for via, v in vias.items())
    assert strongest[1] == "v"
    assert all(h["effect"] > 0 for h in ioi["positive"])
    assert all(h["effect"] < 0 for h in ioi["negative"])
