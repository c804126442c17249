"""``multihead patch`` end to end: an induction run (the built-in pair), a prompt task's run with
texts, a tiny Hugging Face GPT-2 with its tokenizer; and its one-line errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from cli_support import fails, train_tiny

import multihead
from multihead.cli import main
from multihead.models import TransformerLM
from multihead.training.induction_pair import induction_pair

pytestmark = pytest.mark.cpu_only  # a CLI
pytest.importorskip("matplotlib")

FILES = ["heads.png", "heads.svg", "positions.png", "positions.svg", "patching.html"]


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
    effects = multihead.patch_heads(model, pair.clean, pair.corrupt, pair.metric).values
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
    ).values
    assert [tuple(map(int, row[:4])) for row in rows] == [(0, 1, 1, 1), (0, 0, 1, 1)]
    for i, row in enumerate(rows):
        assert [float(x) for x in row[4:]] == pytest.approx(table[i, 0].tolist(), abs=1e-3)
    assert "--senders and --receivers go together" in fails(capsys, [*run, "--senders", "L0H1"])
    err = fails(capsys, [*run, "--senders", "0:1", "--receivers", "L1H1"])
    assert "--senders takes heads such as L0H1 (layer 0, head 1), got '0:1'" in err
    err = fails(capsys, [*run, "--senders", "L1H0", "--receivers", "L1H1"])
    assert "senders item (1, 0) must be in an earlier layer than every receiver" in err


def _gpt2_dir(tmp_path: Path) -> Path:
    pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("tokenizers")
    from test_hf_explain import BY_NAME, save_family

    return save_family(BY_NAME["gpt2"], tmp_path / "gpt2")


def _clean_value(stdout: str) -> float:
    match = re.search(r"clean (-?\d+\.\d+)", stdout)
    assert match is not None, stdout
    return float(match[1])


def test_patch_model_reads_texts_through_the_one_loader_not_the_files_own_truncation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34 #3: a tokenizer.json carrying its own truncation (4 tokens) and fixed padding
    (16) neither cuts the prompt nor pads it: the clean metric is the whole text's."""
    import json

    import tokenizers
    import transformers

    model_dir = _gpt2_dir(tmp_path)
    file = model_dir / "tokenizer.json"
    spec = json.loads(file.read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst",
                          "stride": 0}  # fmt: skip
    spec["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}  # fmt: skip
    file.write_text(json.dumps(spec))
    clean, corrupt = "The cat was too tired to sleep", "The cat was too sleep to tired"
    argv = ["patch", "--model", str(model_dir), "--out", str(tmp_path / "out"), "--format", "png"]
    texts = ["--clean", clean, "--corrupt", corrupt, "--answer", " it", "--wrong", " the"]
    assert main([*argv, *texts]) == 0
    got = _clean_value(capsys.readouterr().out)
    # the reference: the whole text's ids, without the file's truncation or padding
    raw = tokenizers.Tokenizer.from_file(str(file))
    raw.no_truncation()
    raw.no_padding()
    ids = raw.encode(clean).ids
    assert len(ids) > 4
    answer, wrong = raw.encode(" it").ids[0], raw.encode(" the").ids[0]
    model = transformers.GPT2LMHeadModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert got == pytest.approx(float(logits[answer] - logits[wrong]), abs=1e-3)


def test_patch_model_refuses_texts_past_the_positions_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34 #7: GPT-2 takes 64 positions here; a longer text is one line naming it."""
    model_dir = _gpt2_dir(tmp_path)
    capsys.readouterr()  # the save's progress bar
    long = " ".join(["word"] * 80)
    argv = ["patch", "--model", str(model_dir), "--out", str(tmp_path / "out")]
    err = fails(capsys, [*argv, "--clean", long, "--corrupt", long, "--answer", " it"])
    assert "--clean is longer than the 64 tokens" in err
    assert not (tmp_path / "out").exists()


def test_patch_model_refuses_a_tokenizer_with_ids_past_the_embedding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 34 #6: a tokenizer whose ids pass the embedding's rows is refused at load, in one
    line, before any text is run (no IndexError traceback)."""
    import transformers

    model_dir = _gpt2_dir(tmp_path)
    config = transformers.GPT2Config.from_pretrained(model_dir)
    small = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(**{**config.to_dict(), "vocab_size": 50})
    )
    small.save_pretrained(model_dir)  # 50 rows; the tokenizer's ids go further
    capsys.readouterr()  # the save's progress bar
    argv = ["patch", "--model", str(model_dir), "--out", str(tmp_path / "out")]
    err = fails(capsys, [*argv, "--clean", "The cat", "--corrupt", "The dog", "--answer", " it"])
    assert "50" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seq_len", [10**9, 17, 8, "32", True])
def test_row8_an_edited_task_length_is_refused_before_anything_is_drawn(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], seq_len: object
) -> None:
    """Issue 34 #8: a task.seq_len of 10**9 drew layouts for ever before any check; past the
    model's 16 positions, under the task's 11, or not an int, it is one line naming both."""
    run = tmp_path / "run"
    shutil.copytree(induction_run, run)
    config = json.loads((run / "config.json").read_text())
    config["task"]["seq_len"] = seq_len
    (run / "config.json").write_text(json.dumps(config))
    err = fails(capsys, ["patch", "--checkpoint", str(run), "--out", str(tmp_path / "out")])
    assert f"task.seq_len must be an int from 11 to the model's max_len=16, got {seq_len!r}" in err
    assert not (tmp_path / "out").exists()


def test_site_flag_patches_the_residual_stream_and_other_head_sites(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30: ``--site resid_pre`` prints the layer x position cells that move the metric
    most (multihead.patch's numbers) and writes a layer x position map; ``--site v`` the heads'
    maps; path patching only with the heads' outputs."""
    out = tmp_path / "stream"
    argv = ["patch", "--checkpoint", str(induction_run), "--format", "png", "--top", "3"]
    assert main([*argv, "--out", str(out), "--site", "resid_pre"]) == 0
    stdout = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["resid_pre.png"]
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    want = multihead.patch(
        model, pair.clean, pair.corrupt, pair.metric, site="resid_pre", per_position=True
    )
    printed = re.findall(r"^  (L\d+ resid_pre pos \d+)\s+(-?\d+\.\d+)", stdout, re.MULTILINE)
    assert [label for label, _ in printed] == [label for label, _ in want.top(3)]
    for (_, value), (_, expected) in zip(printed, want.top(3), strict=True):
        assert float(value) == pytest.approx(expected, abs=1e-3)
    heads_out = tmp_path / "v"
    assert main([*argv, "--out", str(heads_out), "--site", "v"]) == 0
    assert sorted(p.name for p in heads_out.iterdir()) == ["heads.png", "positions.png"]
    assert "site v" in capsys.readouterr().out
    err = fails(
        capsys,
        [*argv, "--out", str(tmp_path / "x"), "--site", "q", "--senders", "L0H0", "--receivers",
         "L1H0"],
    )  # fmt: skip
    assert "--senders and --receivers patch heads' outputs: give them with --site z" in err


def test_site_flag_patches_the_transformer_lens_sites(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--site embed`` (a site of the whole model: one row of positions) and ``--site
    attn_scores`` (per head), multihead.patch's numbers; an attention-only model's ``mlp_pre``
    is one line naming what it lacks."""
    argv = ["patch", "--checkpoint", str(induction_run), "--format", "png", "--top", "2"]
    out = tmp_path / "embed"
    assert main([*argv, "--out", str(out), "--site", "embed"]) == 0
    stdout = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["embed.png"]
    model = TransformerLM.load(induction_run).eval()
    pair = induction_pair(16)
    want = multihead.patch(
        model, pair.clean, pair.corrupt, pair.metric, site="embed", per_position=True
    )
    assert want.values.shape == (1, 16)
    printed = re.findall(r"^  (embed pos \d+)\s+(-?\d+\.\d+)", stdout, re.MULTILINE)
    assert [label for label, _ in printed] == [label for label, _ in want.top(2)]
    assert main([*argv, "--out", str(tmp_path / "scores"), "--site", "attn_scores"]) == 0
    assert "site attn_scores" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "scores").iterdir()) == ["heads.png", "positions.png"]
    err = fails(capsys, [*argv, "--out", str(tmp_path / "mlp"), "--site", "mlp_pre"])
    assert "mlp_pre of layer 0: the map of TransformerLM does not know block 0's" in err
    assert not (tmp_path / "mlp").exists()


def test_row17_a_page_of_another_site_is_refused(
    induction_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 51 row 17: ``patch --site q --format html`` (was: exit 0, "Wrote:" and nothing):
    one line, exit 2, nothing written."""
    out = tmp_path / "out"
    argv = ["patch", "--checkpoint", str(induction_run), "--out", str(out), "--site", "q"]
    err = fails(capsys, [*argv, "--format", "html"])
    assert "--format html: the page shows the heads' outputs (--site z); --site q writes" in err
    assert not out.exists()
