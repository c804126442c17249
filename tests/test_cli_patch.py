"""``multihead patch`` end to end: an induction run (the built-in pair), a prompt task's run with
texts, a tiny Hugging Face GPT-2 with its tokenizer; and its one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from cli_support import fails, train_tiny

import multihead
from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training import TrainConfig, train
from multihead.training.induction_pair import induction_pair

pytestmark = pytest.mark.cpu_only  # a CLI
pytest.importorskip("matplotlib")

FILES = ["heads.png", "heads.svg", "positions.png", "positions.svg", "patching.html"]


@pytest.fixture(scope="module")
def induction_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("induction") / "run"
    config = TrainConfig.for_task(
        "induction", seq_len=16, steps=2, batch_size=8, embed_dim=32, num_heads=2, threads=1,
        probe_every=2, plots=False, out=str(out),
    )  # fmt: skip
    train(config)
    return out


def _heads(stdout: str) -> list[tuple[int, int, float, float]]:
    rows = re.findall(r"^  L(\d+)H(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$", stdout, re.MULTILINE)
    return [(int(a), int(b), float(c), float(d)) for a, b, c, d in rows]


def test_induction_run_with_the_built_in_pair(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["patch", "--checkpoint", str(induction_run), "--out", str(out), "--top", "3"]) == 0
    stdout = capsys.readouterr().out
    assert "mean log-probability of the repeated tokens (64 sequences of 16 tokens" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)
    # the printed heads are patch_heads' largest effects on the same pair, in order
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    effects = multihead.patch_heads(model, pair.clean, pair.corrupt, pair.metric)
    order = effects.flatten().abs().argsort(descending=True)[:3].tolist()
    printed = _heads(stdout)
    assert [(layer, head) for layer, head, _, _ in printed] == [(i // 2, i % 2) for i in order]
    for layer, head, value, _ in printed:
        assert value == pytest.approx(float(effects[layer, head]), abs=1e-3)
    with torch.no_grad():
        clean = float(pair.metric(model(pair.clean)).mean())
    assert f"clean {clean:.3f}" in stdout
    assert "importance column: denoise patching effect" in (out / "patching.html").read_text()


def test_prompt_task_run_with_texts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = train_tiny(tmp_path / "sort")
    argv = ["patch", "--checkpoint", str(run), "--out", str(tmp_path / "out"), "--format", "png"]
    texts = ["--clean", "3 1 2 0 =", "--corrupt", "3 1 2 1 =", "--answer", "0", "--wrong", "1"]
    assert main([*argv, *texts, "--direction", "noise"]) == 0
    stdout = capsys.readouterr().out
    assert "logit of '0' minus '1' at the last position" in stdout
    assert "noise: clean run, one head's output from the corrupt run" in stdout
    assert len(_heads(stdout)) == 4  # 2 layers x 2 heads
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["heads.png", "positions.png"]
    err = fails(capsys, argv)
    assert "the built-in pair serves induction runs only" in err
    err = fails(capsys, [*argv, *texts[:4], "--answer", "0 1"])
    assert "--answer must be one token, got '0 1' (2 tokens)" in err
    err = fails(capsys, [*argv, *texts[:2], "--corrupt", "3 1 2 =", "--answer", "0"])
    assert "--clean and --corrupt must have as many tokens, got 5 and 4" in err
    err = fails(capsys, [*argv, "--clean", "3 1 2 x =", *texts[2:]])
    assert "--clean: prompt token 'x' is not in the sort task's vocabulary" in err


def test_hugging_face_gpt2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("tokenizers")
    from test_hf_explain import BY_NAME, save_family

    model_dir = save_family(BY_NAME["gpt2"], tmp_path / "gpt2")
    argv = ["patch", "--model", str(model_dir), "--out", str(tmp_path / "out")]
    texts = ["--clean", "The cat was too tired", "--corrupt", "The animal was tired"]
    assert main([*argv, *texts, "--answer", " it", "--wrong", " the", "--device", "cpu"]) == 0
    stdout = capsys.readouterr().out
    assert "gpt2: 2 layers x 4 heads; metric: logit of ' it' minus ' the'" in stdout
    assert len(_heads(stdout)) == 5
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(FILES)
    err = fails(capsys, [*argv, *texts, "--answer", " street"])
    assert "--answer must be one token of the model's vocabulary, got ' street': 4 tokens" in err
    err = fails(capsys, [*argv, "--clean", "", "--corrupt", "", "--answer", " it"])
    assert "--clean must hold at least one token" in err


def test_flag_errors(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["patch", "--checkpoint", str(induction_run), "--out", str(tmp_path / "out")]
    assert "--clean, --corrupt and --answer go together" in fails(capsys, [*run, "--clean", "1 2"])
    assert "--top must be a positive number of heads, got 0" in fails(capsys, [*run, "--top", "0"])
    assert "--format must be some of png, svg, html" in fails(capsys, [*run, "--format", "gif"])
    err = fails(capsys, [*run, "--clean", "1 2 99", "--corrupt", "1 2 3", "--answer", "4"])
    assert "--clean must be token ids of the induction task (space-separated, 0 to 63)" in err
    err = fails(capsys, ["patch", "--checkpoint", str(tmp_path / "nothing")])
    assert "nothing" in err
    err = fails(capsys, ["patch", "--checkpoint", "a", "--model", "b"])
    assert "not allowed with argument" in err
    err = fails(capsys, ["patch", "--model", str(tmp_path)])
    assert "--model needs --clean, --corrupt and --answer" in err
    assert not (tmp_path / "out").exists()


def test_path_patching_table(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = ["patch", "--checkpoint", str(induction_run), "--out", str(tmp_path / "out")]
    argv = [*run, "--format", "png", "--senders", "L0H1", "l0 h0", "--receivers", "L1H1"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    rows = re.findall(
        r"^  L(\d+)H(\d+)\s+L(\d+)H(\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)\s+(-?\d+\.\d+)$",
        stdout,
        re.MULTILINE,
    )
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    senders, receivers = [(0, 1), (0, 0)], [(1, 1)]
    table = multihead.path_patching(
        model, pair.clean, pair.corrupt, pair.metric, senders, receivers
    )
    assert [tuple(map(int, row[:4])) for row in rows] == [(0, 1, 1, 1), (0, 0, 1, 1)]
    for i, row in enumerate(rows):
        assert [float(x) for x in row[4:]] == pytest.approx(table[i, 0].tolist(), abs=1e-3)
    assert "--senders and --receivers go together" in fails(capsys, [*run, "--senders", "L0H1"])
    err = fails(capsys, [*run, "--senders", "0:1", "--receivers", "L1H1"])
    assert "--senders takes heads such as L0H1 (layer 0, head 1), got '0:1'" in err
    err = fails(capsys, [*run, "--senders", "L1H0", "--receivers", "L1H1"])
    assert "senders item (1, 0) must be in an earlier layer than every receiver" in err
