"""docs/huggingface.md's coverage table is the committed coverage run's
(``benchmarks/results/hf_coverage.json``, rendered by ``benchmarks/hf_coverage.py``), and the
families with no softmax attention are told apart from the refused ones."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "hf_coverage.json"


def _script() -> ModuleType:
    """benchmarks/hf_coverage.py as a module (its ``common`` beside it on the path)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(
            "hf_coverage", ROOT / "benchmarks" / "hf_coverage.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_docs_table_is_the_committed_runs() -> None:
    """The block between docs/huggingface.md's markers is the script's rendering of the JSON,
    and the JSON is a full run's: every row counted under one status, no silent mismatch."""
    pytest.importorskip("transformers", minversion="5")
    script = _script()
    payload: dict[str, Any] = json.loads(RESULTS.read_text(encoding="utf-8"))
    text = (ROOT / "docs" / "huggingface.md").read_text(encoding="utf-8")
    start, stop = text.index(script.BEGIN) + len(script.BEGIN), text.index(script.END)
    assert text[start:stop].strip() == script.render_table(payload).strip()
    rows, counts = payload["rows"], payload["counts"]
    assert sum(counts.values()) == len(rows) and set(counts) == set(script.STATUSES)
    for status in script.STATUSES:
        assert counts[status] == sum(r["status"] == status for r in rows), status
    assert counts["mismatch"] == 0
    assert counts["supported"] > 100  # a full run's, not --only's
    quiet = {r["family"] for r in rows if r["status"] == "no softmax attention"}
    assert {"mamba", "fnet"} <= quiet


@pytest.mark.parametrize("family", ["mamba", "fnet"])
def test_a_model_with_no_attention_layers_is_named_so(family: str) -> None:
    """A state-space or Fourier-mixing model has no heads: its refusal says so, not that its
    attention is not routed."""
    transformers = pytest.importorskip("transformers", minversion="5")
    import multihead

    try:
        config = transformers.AutoConfig.for_model(
            family, vocab_size=50, hidden_size=16, num_hidden_layers=1, intermediate_size=32
        )
    except (KeyError, ValueError):  # a transformers without the family
        pytest.skip(f"the installed transformers has no {family}")
    model = transformers.AutoModel.from_config(config)
    with pytest.raises(ValueError, match=f"{family} .* has no attention layers"):
        multihead.model_map(model)
