"""``multihead circuit`` end to end on an induction run (the built-in pair) and on a Hugging Face
directory (texts or a pairs file): the printed edges
are edge_attribution's, the printed curve faithfulness_curve's, the pictures are written; and
its errors are one line with exit code 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import multihead
from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training.induction_pair import induction_pair

pytestmark = pytest.mark.cpu_only  # a CLI
pytest.importorskip("matplotlib")


@pytest.mark.parametrize("method", ["top", "greedy"])
def test_induction_run(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str
) -> None:
    """The default (no --method) is top; --method greedy prints the greedy circuits' curve."""
    out = tmp_path / "out"
    argv = ["circuit", "--checkpoint", str(induction_run), "--out", str(out), "--ig-steps", "2"]
    argv += ["--method", "greedy"] if method == "greedy" else []
    assert (
        main([*argv, "--top", "4", "--draws", "1", "--format", "png,svg", "--graph-edges", "2"])
        == 0
    )
    stdout = capsys.readouterr().out
    reported = re.search(r"the (?:top|greedy circuit of) (\d+) edges, \d+ once pruned", stdout)
    assert reported and int(reported[1]) > 2, stdout
    assert "circuit.png shows the circuit's first 2 edges (--graph-edges)" in stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "circuit.png", "circuit.svg", "faithfulness.png", "faithfulness.svg",
    ]  # fmt: skip
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    scores = multihead.edge_attribution(model, pair.clean, pair.corrupt, pair.metric, ig_steps=2)
    printed = re.findall(r"^  (\S+ -> \S+)\s+(-?\d+\.\d+)$", stdout, re.MULTILINE)
    assert [label for label, _ in printed] == [label for label, _ in scores.top(4)]
    for (_, value), (_, want) in zip(printed, scores.top(4), strict=True):
        assert float(value) == pytest.approx(want, abs=1e-3)
    curve = re.findall(r"^\s+(\d+)\s+(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$", stdout, re.MULTILINE)
    sizes = [int(n) for n, _, _, _ in curve]
    assert sizes[0] == 0 and sizes[-1] == len(scores)
    want_edges = [len(scores.circuit(n, method=method)) for n in sizes]
    assert [int(e) for _, e, _, _ in curve] == want_edges
    assert float(curve[0][2]) == pytest.approx(0, abs=1e-3)  # no edge: the corrupt run
    assert float(curve[-1][2]) == pytest.approx(1, abs=1e-3)  # every edge: the clean run
    middle = len(sizes) // 2
    want = multihead.faithfulness(
        model, pair.clean, pair.corrupt, pair.metric, scores.circuit(sizes[middle], method=method)
    )
    assert float(curve[middle][2]) == pytest.approx(want, abs=1e-3)
    assert "each circuit pruned of its inert edges" in stdout
    # the QK attribution of the circuit's heads whose edges, in or out, weigh most
    reported_circuit = scores.circuit(int(reported[1]), method=method)
    weight: dict[str, float] = {}
    for edge in reported_circuit.edges:
        sender, receiver = edge.split(" -> ")
        for end in (sender, receiver.split(".")[0]):
            if end.startswith("L"):
                weight[end] = weight.get(end, 0.0) + abs(scores.score(sender, receiver))
    shown = re.findall(r"^  (L\d+H\d+): key (\d+) scores (-?\d+\.\d+);", stdout, re.MULTILINE)
    assert [h for h, _, _ in shown] == sorted(weight, key=lambda h: -weight[h])[:3]
    first, key, total = shown[0]
    layer, head = (int(x) for x in first[1:].split("H"))
    qk = multihead.qk_attribution(
        model, pair.clean[:1], layer=layer, head=head, query=-1, key=int(key)
    )
    assert int(key) == int(qk.scores().nan_to_num(float("-inf")).argmax())
    assert float(total) == pytest.approx(qk.total(), abs=1e-2)
    header = next(line for line in stdout.splitlines() if line.endswith("random circuits"))
    assert header.split() == [method, "n", "edges", "kept", method, "edges", "random", "circuits"]
    row = next(line for line in stdout.splitlines() if re.fullmatch(r"\s+0\s+0\s.*", line))
    for title, field in ((f"{method} n", 0), ("edges kept", 1), (f"{method} edges", 2)):
        end = header.index(title) + len(title)  # each column's numbers end under its title
        assert [m.end() for m in re.finditer(r"\S+", row)][field] == end


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--ig-steps", "0"], "--ig-steps must be a positive number, got 0"),
        (["--format", "gif"], "--format must list png or svg, got 'gif'"),
        (["--clean", "1 2 3"], "--clean, --corrupt and --answer go together"),
        (["--reach", "1.5"], "--reach must be in (0, 1], got 1.5"),
        (["--graph-edges", "0"], "--graph-edges must be a positive number, got 0"),
        (["--method", "best"], "argument --method: invalid choice: 'best'"),
    ],
)
def test_errors_are_one_line(
    induction_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    argv = ["circuit", "--checkpoint", str(induction_run), "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _logit_difference(directory: Path, text: str, answer: str, wrong: str) -> float:
    """transformers' own model and tokenizer, without multihead: the answer's logit minus the
    wrong token's at the last position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    (a,), (w,) = tokenizer(answer).input_ids, tokenizer(wrong).input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    return float(logits[a] - logits[w])


def test_a_model_directory_with_texts_or_pairs(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    texts = {"clean": "The cat was too tired", "corrupt": "The it was too tired",
             "answer": " it", "wrong": " cat"}  # fmt: skip
    want = {
        key: _logit_difference(gpt2, texts[key], texts["answer"], texts["wrong"])
        for key in ("clean", "corrupt")
    }
    common = ["--ig-steps", "2", "--draws", "1", "--device", "cpu", "--threads", "1"]
    argv = ["circuit", "--model", str(gpt2), *common]
    flags = [f"--{key}={value}" for key, value in texts.items()]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps(texts) + "\n")
    for i, given in enumerate((flags, ["--pairs", str(pairs)])):
        out = tmp_path / f"out{i}"
        assert main([*argv, *given, "--out", str(out)]) == 0
        stdout = capsys.readouterr().out
        found = re.search(r"^  clean (-?\d+\.\d+)   corrupt (-?\d+\.\d+)$", stdout, re.MULTILINE)
        assert found, stdout
        assert float(found[1]) == pytest.approx(want["clean"], abs=2e-3)
        assert float(found[2]) == pytest.approx(want["corrupt"], abs=2e-3)
        assert sorted(p.name for p in out.iterdir()) == ["circuit.png", "faithfulness.png"]


def test_a_model_without_texts_is_one_line(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["circuit", "--model", str(gpt2), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--model needs --clean, --corrupt and --answer" in err
    assert len(err.strip().splitlines()) == 1


def test_row10_a_query_outside_the_inputs_is_refused_before_any_scoring(
    induction_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51 row 10: ``--query 999`` (was: refused only after the whole EAP-IG run and the
    curve): one line, exit 2, before edge attribution runs, nothing written."""

    def scored(*args: object, **kwargs: object) -> None:
        raise AssertionError("edge_attribution ran before --query was checked")

    monkeypatch.setattr(multihead, "edge_attribution", scored)
    out = tmp_path / "o"
    argv = ["circuit", "--checkpoint", str(induction_run), "--out", str(out), "--query", "999"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--query must be a position of the 16-token inputs in [-16, 16), got 999" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def test_mib_out_writes_mibs_folder_and_cpr_cmd_are_the_curves(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, mib = tmp_path / "out", tmp_path / "mib"
    argv = ["circuit", "--checkpoint", str(induction_run), "--out", str(out), "--ig-steps", "2"]
    argv += ["--draws", "1", "--mib-out", str(mib), "--mib-task", "induction"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    files = [p.relative_to(mib).as_posix() for p in mib.rglob("*") if p.is_file()]
    assert files == ["EAP-IG-inputs_patching_edge/induction_run/importances.json"]
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    every = ("q", "k", "v", "mlp", "logits")
    scores = multihead.edge_attribution(
        model, pair.clean, pair.corrupt, pair.metric, ig_steps=2, receivers=every
    )
    written = multihead.EdgeScores.from_mib(mib / files[0], model)
    assert written.labels == scores.labels
    assert torch.allclose(written.values, scores.values, atol=1e-5, equal_nan=True)
    data = json.loads((mib / files[0]).read_text())
    assert sum(e["in_graph"] for e in data["edges"].values()) > 0  # the reported circuit
    curve = multihead.faithfulness_curve(
        model, pair.clean, pair.corrupt, pair.metric, scores, sizes="mib", draws=0
    )
    assert "of MIB's graph, top circuits: CPR" in stdout
    found = re.search(r"CPR (-?\d+\.\d+) \(higher is better\), CMD (-?\d+\.\d+)", stdout)
    assert found, stdout
    assert float(found[1]) == pytest.approx(curve.cpr, abs=2e-3)
    assert float(found[2]) == pytest.approx(curve.cmd, abs=2e-3)
    assert main([*argv[:-2], "--mib-task", "a/b"]) == 2
    assert "--mib-task must be a name" in capsys.readouterr().err
    # the folder is checked before any scoring: a file where it would go
    taken = tmp_path / "taken"
    (taken / "EAP-IG-inputs_patching_edge").mkdir(parents=True)
    (taken / "EAP-IG-inputs_patching_edge" / "induction_run").write_text("mine")
    assert main([*argv[:-4], "--mib-out", str(taken), "--mib-task", "induction"]) == 2
    err = capsys.readouterr().err
    assert "--mib-out" in err and len(err.strip().splitlines()) == 1, err
    assert (taken / "EAP-IG-inputs_patching_edge" / "induction_run").read_text() == "mine"
