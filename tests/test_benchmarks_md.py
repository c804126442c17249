"""BENCHMARKS.md is what ``benchmarks/report.py`` writes from ``benchmarks/results/*.json``.

The committed results files each hold a report block (common.report_block: title, commands,
machine, versions, date, load, tables); report.py renders them in a fixed order. These tests read
files only: no benchmark runs.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _module(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_benchmarks_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _module("report")
common = _module("common")


# a coverage run, not a benchmark: docs/huggingface.md's table is made of it (held equal by
# tests/test_hf_coverage_docs.py), and it has no report block
NOT_BENCHMARKS = {"hf_coverage"}


def _results() -> list[Path]:
    """The results files BENCHMARKS.md is made of (smoke runs, ``*_quick``, are git-ignored)."""
    return sorted(
        p
        for p in RESULTS.glob("*.json")
        if not p.stem.endswith("_quick") and p.stem not in NOT_BENCHMARKS
    )


@pytest.mark.parametrize(("name", "gpu"), [("BENCHMARKS.md", False), ("BENCHMARKS-GPU.md", True)])
def test_benchmarks_md_is_the_reports_output(name: str, gpu: bool) -> None:
    want = report.render(report.load_reports(RESULTS), gpu=gpu)
    got = (ROOT / name).read_text(encoding="utf-8")
    assert got == want, f"{name} is stale: run python benchmarks/report.py"


@pytest.mark.parametrize("name", ["BENCHMARKS.md", "BENCHMARKS-GPU.md"])
def test_benchmarks_md_stays_under_500_lines(name: str) -> None:
    lines = (ROOT / name).read_text(encoding="utf-8").splitlines()
    assert len(lines) < 500


def test_a_run_on_a_gpu_is_in_the_gpu_file_alone() -> None:
    reports = report.load_reports(RESULTS)
    cpu, gpu = report.render(reports), report.render(reports, gpu=True)
    for stem, block in reports.items():
        heading = f"## {block['title']}\n"
        on_gpu = bool(block["machine"].get("gpu"))
        assert (heading in gpu, heading in cpu) == (on_gpu, not on_gpu), stem


def test_every_results_file_has_machine_versions_date_and_a_table() -> None:
    files = _results()
    assert {p.stem for p in files} >= {stem for stem, _ in report.SECTIONS}
    for path in files:
        payload = json.loads(path.read_text(encoding="utf-8"))
        assert "report" in payload, f"{path.name} has no report block: give it one or move it"
        block = report.check_report(path.name, payload["report"])
        assert block["machine"]["cpu"] or block["machine"]["gpu"], path.name
        assert block["versions"] and block["commands"], path.name
        datetime.date.fromisoformat(block["date"])
        assert block["tables"] and all(t["header"] and t["rows"] for t in block["tables"])
        for table in block["tables"]:
            assert table["target_column"] in (None, *table["header"]), path.name
        assert block["source"] == "measured" or block["source"].startswith(report.TRANSCRIBED)


def test_a_transcribed_section_keeps_the_title_its_script_writes() -> None:
    """A benchmark's next run replaces its transcribed file under the same heading."""
    titles = set()
    for script in BENCHMARKS.glob("bench_*.py"):
        for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                titles.add(node.value)
    # need_weights_cpu, capture_overhead: scripts that write no JSON; train_sort: a CLI command;
    # ring_65536: its script's title is an f-string of the length
    unwritten = {"need_weights_cpu", "capture_overhead", "train_sort", "ring_65536"}
    for stem, block in report.load_reports(RESULTS).items():
        if stem not in unwritten:
            assert block["title"] in titles, f"{stem}: no bench_*.py writes {block['title']!r}"


def test_a_report_block_of_a_fake_run_renders_as_markdown(tmp_path: Path) -> None:
    table = common.report_table(
        ["impl", "ms", "target"],
        [["ours", 1.5, "≤ 2×"], ["a|b", "2.25", "–"]],
        caption="Fake, 1 thread:",
        target_column="target",
    )
    block = common.report_block(
        "A fake run",
        [table],
        commands=["python benchmarks/bench_fake.py --rounds 1"],
        load_before=[0.3, 0.2, 0.1],
        notes=["Met."],
    )
    # what the running process is, filled in
    assert block["source"] == "measured"
    assert block["date"] == datetime.date.today().isoformat()
    assert block["versions"]["torch"] == torch.__version__
    assert block["machine"]["cpu"] and block["machine"]["cores"] >= 1
    assert block["load"] == "0.3 before the run"
    assert table == {
        "caption": "Fake, 1 thread:",
        "header": ["impl", "ms", "target"],
        "rows": [["ours", "1.5", "≤ 2×"], ["a|b", "2.25", "–"]],
        "target_column": "target",
    }

    common.write_json("fake", {"raw": [1, 2]}, directory=tmp_path, report=None)
    assert report.load_reports(tmp_path) == {}  # no report block: not a section
    common.write_json(
        "fake",
        {"raw": [1, 2]},
        directory=tmp_path,
        report={
            "title": "A fake run",
            "tables": [{"header": ["impl", "ms"], "rows": [["ours", "1.50"]]}],
            "commands": ["python benchmarks/bench_fake.py"],
        },
    )
    written = json.loads((tmp_path / "fake.json").read_text(encoding="utf-8"))
    assert written["raw"] == [1, 2]  # the raw keys stay
    assert written["report"]["tables"][0]["rows"] == [["ours", "1.50"]]
    markdown = report.render(report.load_reports(tmp_path))
    assert (
        "## A fake run\n" in markdown
        and "\n| impl | ms |\n|---|---|\n| ours | 1.50 |\n" in markdown
    )

    lines = report.render_section(block, "What it measures.")
    assert lines[:4] == ["## A fake run", "", "What it measures.", ""]
    assert lines[4].startswith(
        "Run: `python benchmarks/bench_fake.py --rounds 1`; "
        f"{block['date']}; {report.render_machine(block['machine'])}; Python "
    )
    assert lines[4].endswith(
        "; load average 0.3 before the run"
        + (f"; commit {block['commit']}." if "commit" in block else ".")
    )
    assert lines[5:] == [
        "",
        "Fake, 1 thread:",
        "",
        "| impl | ms | target |",
        "|---|---|---|",
        "| ours | 1.5 | ≤ 2× |",
        "| a\\|b | 2.25 | – |",
        "",
        "Met.",
        "",
    ]


def test_a_table_row_as_wide_as_its_header_and_a_named_target_column() -> None:
    with pytest.raises(ValueError, match="a row of 1 cells under 2 headers"):
        common.report_table(["a", "b"], [["1"]])
    with pytest.raises(ValueError, match="target column 'c' is not a header"):
        common.report_table(["a", "b"], [["1", "2"]], target_column="c")
    with pytest.raises(ValueError, match="at least one table"):
        common.report_block("Nothing", [])


LSCPU = """\
Architecture:                            x86_64
CPU(s):                                  4
Model name:                              Intel(R) Xeon(R) Platinum 8480+
Flags:                                   fpu sse4_2 avx fma avx2 avx512f avx512bw avx512_bf16 \
amx_tile amx_bf16
NUMA node0 CPU(s):                       0-3
"""


def test_the_machine_comes_from_lscpu() -> None:
    machine = common.report_machine(fields=common.parse_lscpu(LSCPU))
    assert machine == {
        "cpu": "Intel(R) Xeon(R) Platinum 8480+",
        "cores": 4,
        "cpu_flags": ["avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16"],
        "cpu_lacks": [],
        "gpu": None,
    }
    amd = common.report_machine(
        fields={"Model name": "AMD EPYC", "CPU(s)": "2", "Flags": "sse4_2 avx fma avx2"}
    )
    assert report.render_machine(amd) == "AMD EPYC, 2 cores (avx2, fma; no AVX-512, no AMX)"
    unknown = {"cpu": "Intel Xeon VM", "cores": 2, "cpu_flags": None, "gpu": None}
    assert report.render_machine(unknown) == "Intel Xeon VM, 2 cores (flags not recorded)"
    gpu = {**amd, "gpu": "NVIDIA H200", "gpu_memory_gib": 139.8}
    assert report.render_machine(gpu) == (
        "NVIDIA H200 (139.8 GiB); host AMD EPYC, 2 cores (avx2, fma; no AVX-512, no AMX)"
    )
    assert report.render_versions({"torch": "2.13.0+cpu", "python": "3.11.7"}) == (
        "Python 3.11.7, torch 2.13.0+cpu"
    )


def _block(**changes: object) -> dict[str, object]:
    block: dict[str, object] = {
        "title": "A fake run",
        "source": "measured",
        "commands": ["python benchmarks/bench_fake.py"],
        "machine": {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2"], "gpu": None},
        "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"},
        "date": "2026-11-27",
        "load": "0.3 before the run",
        "tables": [{"caption": None, "header": ["a"], "rows": [["1"]], "target_column": None}],
    }
    block.update(changes)
    return block


def test_check_exits_1_in_one_line_when_the_file_is_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "fake.json").write_text(json.dumps({"report": _block()}), encoding="utf-8")
    smoke = _block(title="A smoke run")
    (results / "fake_quick.json").write_text(json.dumps({"report": smoke}), encoding="utf-8")
    out = tmp_path / "BENCHMARKS.md"
    args = ["--results", str(results), "--output", str(out)]
    assert report.main(args) == 0
    text = out.read_text(encoding="utf-8")
    assert "## A fake run\n" in text and "A smoke run" not in text  # smoke runs left out
    # the GPU runs' file is written beside --output, never over the repository's own
    gpu_text = (tmp_path / "BENCHMARKS-GPU.md").read_text(encoding="utf-8")
    assert gpu_text.startswith("# Benchmarks on a GPU")
    assert report.main([*args, "--check"]) == 0
    capsys.readouterr()

    out.write_text(text.replace("| 1 |", "| 2 |"), encoding="utf-8")
    assert report.main([*args, "--check"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run python benchmarks/report.py" in err

    (results / "fake.json").write_text(json.dumps({"report": _block(date="today")}))
    assert report.main(args) == 2
    assert capsys.readouterr().err == "report: fake.json: date 'today' is not YYYY-MM-DD\n"


# A figure in prose: a decimal, or a number with a unit.
FIGURE = re.compile(r"\d\.\d|\d\s?(?:×|%|ms\b|s\b|MiB|GiB|GB|MB|TB/s|GFLOP/s)")


def test_the_fixed_text_holds_no_figures() -> None:
    """Figures live in the JSON; the script's notes say what a section measures."""
    for stem, about in report.SECTIONS:
        assert not FIGURE.search(about), f"{stem}: {FIGURE.search(about)}"
    assert not FIGURE.search(report.PREAMBLE)
