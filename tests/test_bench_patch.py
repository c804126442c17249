"""benchmarks/bench_patch.py runs end to end (``--quick``) and writes valid JSON. No timing is
asserted: only that the script runs and that the stacked patching equals the naive loop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu_only  # a benchmark subprocess; scripts/gpu_check.sh runs it on a GPU

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_bench_patch_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers", minversion="5")
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_patch.py"), "--quick"]
        + ["--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard, never a speed budget
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "patch_quick.json").read_text(encoding="utf-8"))
    assert payload["machine"]["torch"]
    assert payload["patches"] == 2 * 4 * 16 and payload["patches_timed"] == 128
    assert payload["max_abs_difference"] < 1e-5
    # the induction-shaped TransformerLM: 2 layers x 4 heads x 12 positions, as the loop gives
    assert payload["induction_patches"] == 2 * 4 * 12
    assert payload["max_abs_induction_difference"] < 1e-5
    assert payload["path_numbers"] == 2 * 4 * 3 and payload["max_abs_path_difference"] < 1e-5
    assert all(s > 0 for times in payload["seconds"].values() for s in times)
    assert "patch_heads, every head and position" in done.stdout
