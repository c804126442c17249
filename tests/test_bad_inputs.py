"""Bad inputs for ``explain``, the page, ``--corpus`` and ``train``, class by class (the table in
docs/bad_inputs.md names each row's test).

- memory before allocation: a text whose weights would not fit the memory limit is cut (with a
  warning) before anything is captured; a corpus text that alone would not fit is refused before
  any forward; a page over its size limit is refused before a file is written; long texts
  draw bounded pictures;
- unbounded inputs: ``--corpus`` reads within bounds (``/dev/zero``, an endless pipe); lines with
  no word are skipped with a note (CLI) or refused (library); ``--eval-size`` beyond the task;
- long work: a count and an estimate of the time left, with no thread beside torch's;
- missing glyphs: one warning of our own, fonts with fallbacks.

The model is a tiny random BERT (tests/tiny_bert.py) with a word-level tokenizer; nothing here
allocates more than a few MB: limits are lowered instead.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("safetensors.torch")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

import torch  # noqa: E402
from cli_support import fails, snapshot  # noqa: E402
from tiny_bert import CONFIG, WORDS, hf_tensors, write_dir  # noqa: E402

import multihead.cli.common as common  # noqa: E402
import multihead.cli.explain_corpus as corpus_cli  # noqa: E402
import multihead.explanation.explaining as explanation  # noqa: E402
import multihead.viz.fonts as fonts  # noqa: E402
import multihead.viz.page as page  # noqa: E402
from multihead import explain  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text import corpus_statistics, head_distances  # noqa: E402
from multihead.text.tokenization import TruncationWarning  # noqa: E402
from multihead.training import TrainConfig  # noqa: E402
from multihead.training.tasks import Task  # noqa: E402
from multihead.viz.plots import grid_figure, head_figure, save_figure  # noqa: E402

LAYERS, HEADS = CONFIG["num_hidden_layers"], CONFIG["num_attention_heads"]  # 2, 4
POSITIONS = 700
# 7 words a sentence; each word one token ([CLS] and [SEP] around): 701 words, cut at 700
LONG = " ".join(["the cat sat on the mat ."] * 100) + " dog"


def peak_bytes(t: int, copies: int) -> int:
    """explain's peak by hand: every head's (T, T) float32 map, ``copies`` times."""
    return copies * 4 * LAYERS * HEADS * t * t


def most_tokens(limit: int, copies: int) -> int:
    """The largest T whose peak_bytes fits ``limit``, by search (not by the code's formula)."""
    t = 1
    while peak_bytes(t + 1, copies) <= limit:
        t += 1
    return t


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT that takes 700 positions (a long-context model, in small)."""
    config = {**CONFIG, "max_position_embeddings": POSITIONS}
    torch.manual_seed(0)
    return write_dir(
        tmp_path_factory.mktemp("long") / "m", config, hf_tensors(config), tokenizer=True
    )


@pytest.fixture(scope="module")
def model(model_dir: Path) -> Any:
    return load_text_model(model_dir)


# -- memory before allocation: explain ---------------------------------------------------------


@pytest.mark.parametrize("ablate", [None, [(0, 1)]], ids=["plain", "ablate"])
def test_explain_cuts_a_text_over_the_memory_limit_before_capturing(
    model: Any, monkeypatch: pytest.MonkeyPatch, ablate: Any
) -> None:
    copies = 3 + (ablate is not None)
    limit = 2 * 2**20  # 2 MiB: about 144 tokens (3 copies), 125 (4 copies)
    fits = most_tokens(limit, copies)
    assert 100 < fits < 200
    captured: list[int] = []
    every_head = explanation.every_head

    def spy(m: Any, batch: Any) -> Any:  # what reaches the capture, before it allocates
        captured.append(batch.input_ids.shape[1])
        return every_head(m, batch)

    monkeypatch.setattr(explanation, "every_head", spy)
    with pytest.warns(TruncationWarning) as caught:
        ex = explain(LONG, model=model, ablate=ablate, importance=False, memory_limit=limit)
    assert captured and max(captured) == fits  # every token is a word here: exactly what fits
    assert ex.weights.shape == (LAYERS, HEADS, fits, fits)
    assert ex.truncated and ex.tokens[-1] == "[SEP]"
    assert LONG.startswith(ex.text) and len(ex.text) < len(LONG)
    message = str(caught[0].message)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert f"the text's {POSITIONS} tokens would hold" in message
    assert "over memory_limit=2.0 MiB: only its first" in message
    assert f"first {fits} tokens were read" in message
    assert explanation.explain_peak_bytes(LAYERS, HEADS, fits, ablate=ablate is not None) <= limit


def test_explain_within_the_memory_limit_reads_the_whole_text(model: Any) -> None:
    text = " ".join(["the cat sat on the mat ."] * 10)  # 72 tokens
    limit = peak_bytes(72, 3)  # exactly enough
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ex = explain(text, model=model, importance=False, memory_limit=limit)
    assert len(ex.tokens) == 72 and not ex.truncated


def test_explain_focus_cut_off_by_the_memory_limit(model: Any) -> None:
    with pytest.raises(ValueError, match=r"focus word 'dog' was cut off by truncation at \d+ tok"):
        explain(LONG, focus="dog", model=model, importance=False, memory_limit=2**20)


@pytest.mark.parametrize(
    ("limit", "error", "match"),
    [
        (0, ValueError, r"memory_limit must be a positive number of bytes, got 0"),
        (-5, ValueError, r"memory_limit must be a positive number of bytes, got -5"),
        (1.5, ValueError, r"memory_limit must be a positive number of bytes, got 1.5"),
        (True, ValueError, r"memory_limit must be a positive number of bytes, got True"),
        # room for 2 tokens: [CLS] and [SEP], no word
        (peak_bytes(2, 3), ValueError, r"leaves room for 2 tokens, too few for one word"),
    ],
)
def test_explain_memory_limit_refusals(model: Any, limit: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        explain("the cat sat on the mat", model=model, importance=False, memory_limit=limit)


def test_cli_memory_limit_cuts_with_one_warning(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["explain", LONG, "--model", str(model_dir), "--out", str(out), "--no-importance"]
    assert main([*argv, "--memory-limit", "2M"]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: the text's 700 tokens"), lines
    assert f"m: {most_tokens(2 * 2**20, 3)} tokens;" in captured.out
    assert (out / "attention.html").is_file()


@pytest.mark.parametrize(
    ("value", "bytes_"),
    [("2M", 2 * 2**20), ("2MiB", 2 * 2**20), ("1.5g", 3 * 2**29), ("3", 3 * 2**30), ("64K", 2**16)],
)
def test_cli_memory_limit_sizes(value: str, bytes_: int) -> None:
    from multihead.cli.explain import _size

    assert _size(value) == bytes_


@pytest.mark.parametrize("value", ["", "abc", "-1G", "0", "2X", "1e3", "nan"])
def test_cli_memory_limit_bad_sizes(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = snapshot(tmp_path)
    err = fails(capsys, ["explain", "the cat", f"--memory-limit={value}", "--out", str(tmp_path)])
    assert "argument --memory-limit: expected a size such as 512M, 16G or 2.5 (GiB)" in err
    assert snapshot(tmp_path) == before


# -- memory before allocation: the page and the pictures -----------------------------------------


def test_a_page_over_its_size_limit_is_refused_before_any_file(
    model: Any, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    ex = explain("the cat sat on the mat .", model=model, importance=False)  # 9 tokens
    monkeypatch.setattr(page, "PAGE_WEIGHTS_LIMIT", LAYERS * HEADS * 9 * 9 - 1)
    message = r"the page would carry 648 B of weights \(2 layers × 4 heads × 9² tokens, one byte"
    with pytest.raises(ValueError, match=message):
        ex.html()
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=message):
        ex.save(tmp_path / "out")  # png and svg come first in the list, and are not written
    assert snapshot(tmp_path) == before
    ex.save(tmp_path / "pictures", "png,svg")  # without the page it is fine
    # the CLI: one line, exit 2, nothing written
    argv = ["explain", "the cat sat on the mat .", "--model", str(model_dir), "--out"]
    err = fails(capsys, [*argv, str(tmp_path / "cli"), "--no-importance"])
    assert "error: the page would carry" in err and "or no page (html)" in err
    assert not (tmp_path / "cli").exists()
    # one head fewer fits
    monkeypatch.setattr(page, "PAGE_WEIGHTS_LIMIT", LAYERS * (HEADS - 1) * 9 * 9)
    assert main([*argv, str(tmp_path / "cli"), "--no-importance", "--head", "1"]) == 0


def _peaked(t: int, s: int, at: tuple[int, int]) -> torch.Tensor:
    w = torch.full((t, s), 1e-4)
    w[at] = 0.9
    return w


def test_a_long_head_figure_is_pooled_and_unlabelled() -> None:
    t = 1000
    w = _peaked(t, t, (700, 3))
    fig = head_figure(w, [f"w{i}" for i in range(t)])
    image = fig.axes[0].images[0].get_array()
    assert image.shape == (512, 512)  # max-pooled: the peak stays, in its cell
    assert float(image.max()) == pytest.approx(0.9)
    assert tuple(int(x) for x in divmod(int(image.argmax()), 512)) == (700 * 512 // t, 3 * 512 // t)
    assert max(fig.get_size_inches()) < 12  # 8 inches of map and margins, whatever T
    assert not any(text.get_text() == "w700" for text in fig.axes[0].texts)  # no labels
    small = head_figure(_peaked(30, 30, (1, 2)), [f"w{i}" for i in range(30)])
    assert small.axes[0].images[0].get_array().shape == (30, 30)  # unchanged below the limit
    assert any(text.get_text() == "w29" for text in small.axes[0].texts)


def test_a_long_causal_grid_is_pooled_with_blank_future_cells() -> None:
    t = 600
    w = torch.softmax(
        torch.randn(1, 2, t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf),
        -1,
    )
    fig = grid_figure(w, [str(i) for i in range(t)], causal=True)
    tile = torch.as_tensor(fig.axes[0].images[0].get_array().filled(math.nan))
    cell = tile[:256, :256]  # the first head's map, pooled to 256 × 256
    assert tile.shape[0] == 256  # one layer: no gutter rows
    # a cell is blank exactly when every key it covers comes after every query it covers
    for i, j in [(0, 0), (0, 1), (0, 2), (100, 100), (100, 101), (100, 102), (255, 255)]:
        last_query = math.ceil((i + 1) * t / 256) - 1
        first_key = j * t // 256
        assert bool(cell[i, j].isnan()) == (first_key > last_query), (i, j)
    # each kept cell is the maximum of the weights it covers
    assert float(cell[100, 50]) == pytest.approx(
        float(
            w[
                0,
                0,
                100 * t // 256 : math.ceil(101 * t / 256),
                50 * t // 256 : math.ceil(51 * t / 256),
            ].max()
        )
    )


# -- memory before allocation: --corpus --------------------------------------------------------

TEXTS = ["the cat sat on the mat .", "a dog sat .", "the mat the mat .", "dog . dog ."]


def test_corpus_batches_shrink_to_the_memory_limit_and_give_the_same_result(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches: list[int] = []
    forward = type(model).forward

    def counting(self: Any, ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        batches.append(ids.shape[0])
        return forward(self, ids, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", counting)
    one_text = 3 * 4 * LAYERS * HEADS * 9 * 9  # a batch's weights, 3 copies, one 9-token text
    small = head_distances(model, TEXTS, memory_limit=one_text)
    assert batches == [1, 1, 1, 1]  # two of the texts would not fit together
    batches.clear()
    want = head_distances(model, TEXTS)
    assert batches == [4]
    # float64 sums of float32 weights: batches padded to another length round differently
    torch.testing.assert_close(small.distances, want.distances, atol=1e-5, rtol=0)
    batches.clear()
    stats = corpus_statistics(model, TEXTS, memory_limit=12_000)
    assert len(batches) > 1
    whole = corpus_statistics(model, TEXTS).entropy
    torch.testing.assert_close(stats.entropy, whole, atol=1e-5, rtol=0)


def test_a_corpus_text_too_long_alone_is_refused_before_any_forward(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    texts = ["the cat", "the cat sat on the mat . the cat sat on the mat .", "a dog"]  # 16 tokens
    limit = 3 * 4 * LAYERS * HEADS * 15 * 15  # 15 tokens fit, alone
    with pytest.raises(
        ValueError,
        match=r"texts\[1\] \(line 2\) is 16 tokens long: its attention "
        r"weights would take 24.0 KiB, over memory_limit=21.1 KiB",
    ):
        head_distances(model, texts, memory_limit=limit)
    assert calls == []


def test_cli_corpus_too_long_text_names_the_file_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("the cat\n\n\n" + LONG + "\n")
    before = snapshot(tmp_path)
    argv = ["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out"]
    err = fails(capsys, [*argv, str(tmp_path / "o"), "--memory-limit", "1M"])
    assert f"error: --corpus {str(corpus)!r} line 4 is 700 tokens long" in err
    assert snapshot(tmp_path) == before


# -- unbounded inputs ----------------------------------------------------------------------------


class EndlessStream:
    """A pipe that never ends: ``line`` again and again (``b"x"``: x without a line break)."""

    def __init__(self, line: bytes) -> None:
        self.line = line

    def readline(self, limit: int = -1) -> bytes:
        if not self.line.endswith(b"\n"):  # one line that never ends: as much as asked for
            return self.line * max(limit, 1)
        return self.line if limit < 0 else self.line[:limit]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")
def test_corpus_dev_zero_is_refused_at_the_first_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(
        corpus_cli.CLIError,
        match=r"--corpus '/dev/zero': line 1 is longer than "
        r"4.0 MiB \(no line break\): expected one text a line",
    ):
        corpus_cli.read_corpus("/dev/zero")


def test_corpus_endless_pipe_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus_cli, "MAX_TEXTS", 1000)  # the bound, lowered to keep this quick
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": EndlessStream(b"the cat\n")}))
    with pytest.raises(corpus_cli.CLIError, match=r"standard input holds more than 1,000 texts"):
        corpus_cli.read_corpus("-")
    monkeypatch.setattr(corpus_cli, "MAX_CORPUS_BYTES", 4000)  # 500 lines of 8 bytes
    with pytest.raises(corpus_cli.CLIError, match=r"standard input holds more than 3.9 KiB"):
        corpus_cli.read_corpus("-")
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": EndlessStream(b"x")}))
    monkeypatch.setattr(corpus_cli, "MAX_LINE_BYTES", 100)
    with pytest.raises(corpus_cli.CLIError, match=r"line 1 is longer than 100 B \(no line break"):
        corpus_cli.read_corpus("-")


def test_corpus_lines_without_words_are_skipped_with_a_note(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.txt"
    lines = ["the cat sat .", "\u200b\u200b", "", "\x01\x07\u200d", "a dog .", "\ufeff\u2060"]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    texts, numbers = corpus_cli.read_corpus_lines(str(corpus))
    assert texts == ["the cat sat .", "a dog ."] and numbers == [1, 5]
    assert capsys.readouterr().err == (
        "note: --corpus skipped 3 lines with no visible character, only zero-width or control "
        "characters (line 2, 4, 6)\n"
    )
    out = tmp_path / "out"
    argv = ["explain", "--corpus", str(corpus), "--model", str(model_dir), "--out", str(out)]
    assert main(argv) == 0
    assert json.loads((out / "head_statistics.json").read_text())["num_texts"] == 2
    only_invisible = tmp_path / "blank.txt"
    only_invisible.write_text("\u200b\n\x01\n")
    capsys.readouterr()
    assert main([*argv[:2], str(only_invisible), *argv[3:]]) == 2
    assert capsys.readouterr().err.splitlines()[1:] == [
        f"multihead explain: error: --corpus {str(only_invisible)!r} holds no text (one text a "
        f"line; blank lines skipped)"
    ]


@pytest.mark.parametrize("text", ["\u200b", "\x01\x02", "\u200b\u200d\u2060"])
def test_library_refuses_texts_with_no_word(model: Any, text: str) -> None:
    with pytest.raises(
        ValueError, match=r"texts\[1\] \(line 2\) holds no word the tokenizer keeps"
    ):
        corpus_statistics(model, ["the cat", text])
    with pytest.raises(
        ValueError, match=r"texts\[1\] \(line 2\) holds no word the tokenizer keeps"
    ):
        head_distances(model, ["the cat", text])
    with pytest.raises(ValueError, match=r"text must hold at least one word the tokenizer keeps"):
        explain(text, model=model, importance=False)


def test_eval_size_is_bounded_by_the_task() -> None:
    task = Task("sort", 8)
    assert task.held_out_size == 10**7
    TrainConfig(task="sort", seq_len=8, eval_size=10**7)
    with pytest.raises(
        ValueError,
        match=r"eval_size must be at most 10000000 \(the sort task at "
        r"seq_len 8 holds out about 10000000 inputs; more would draw the same",
    ):
        TrainConfig(task="sort", seq_len=8, eval_size=10**12)
    # a small task keeps the default 1000 (its ~10 held-out inputs drawn again)
    assert Task("copy", 2).held_out_size == 10
    TrainConfig(task="copy", seq_len=2)
    with pytest.raises(ValueError, match=r"eval_size must be at most 1000 \(the copy task"):
        TrainConfig(task="copy", seq_len=2, eval_size=1001)


# -- long work: a count, an estimate, no thread --------------------------------------------------


def test_progress_off_a_terminal_writes_a_line_every_few_seconds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = iter([100.0, 101.0, 103.0, 106.0, 108.0, 112.0, 113.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    with common.progress("Distances between heads", 10) as update:
        for done in (2, 4, 6, 8, 9, 10):
            update(done)
    assert capsys.readouterr().err.splitlines() == [
        "Distances between heads: 6/10 texts, 0:00:06 elapsed, about 0:00:04 left",
        "Distances between heads: 9/10 texts, 0:00:12 elapsed, about 0:00:01 left",
        "Distances between heads: 10/10 texts, 0:00:13 elapsed, done",
    ]


def test_a_short_run_off_a_terminal_writes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with common.progress("Head statistics", 3) as update:
        for done in (1, 2, 3):
            update(done)
    assert capsys.readouterr().err == ""


def test_progress_and_status_on_a_terminal_start_no_thread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("rich")
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then takes stderr for a terminal
    monkeypatch.setenv("COLUMNS", "120")
    from rich.console import Console

    assert Console(stderr=True).is_terminal
    threads = threading.active_count()
    with common.progress("Distances between heads", 3) as update:
        for done in (1, 2, 3):
            update(done)
            assert threading.active_count() == threads
    with common.status("Loading the model…"):
        assert threading.active_count() == threads
    err = capsys.readouterr().err
    assert "3/3" in err and "texts" in err and "left" in err


# -- missing glyphs ------------------------------------------------------------------------------


def cjk_model(root: Path) -> Path:
    """The tiny BERT with 東 and 京 in its vocabulary."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = [*WORDS, "東", "京", "is", "large", "city"]
    path = write_dir(root / "cjk", tokenizer=False)
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    (path / "tokenizer.json").write_text(tok.to_str())
    return path


def test_cli_text_the_fonts_lack_is_at_most_one_warning_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = cjk_model(tmp_path)
    argv = ["explain", "東京 is a large city", "--model", str(path), "--out", str(tmp_path / "o")]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    fig = head_figure(torch.eye(2), ["東", "京"])
    if fonts.missing_glyphs(fig):  # no installed font has them: one line of our own
        assert len(err) == 1 and err[0].startswith("warning: no installed font has 東, 京"), err
    else:  # a CJK font is installed and is used
        assert err == []


def _glyph_only_a_fallback_has() -> tuple[str, str] | None:
    """A character DejaVu Sans lacks and another installed font has, with that font's family."""
    from matplotlib import font_manager as fm

    def charmap(family: str) -> set[int]:
        path = fm.findfont(fm.FontProperties(family=family), fallback_to_default=False)
        return set(fm.get_font(path).get_charmap())

    dejavu = charmap("DejaVu Sans")
    for family in sorted({f.name for f in fm.fontManager.ttflist} - {"DejaVu Sans"}):
        extra = sorted(c for c in charmap(family) - dejavu if chr(c).isprintable() and c < 0xE000)
        if extra:
            return chr(extra[0]), family
    return None


def test_fonts_fall_back_to_an_installed_family_and_warn_once_without_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = _glyph_only_a_fallback_has()
    if found is None:
        pytest.skip("no installed font has a character DejaVu Sans lacks")
    char, family = found
    monkeypatch.setattr(fonts, "FALLBACK_FAMILIES", ())
    assert fonts.font_families() == ["DejaVu Sans"]
    fig = head_figure(torch.eye(2), [char, "a"], title=f"{char} twice")
    with pytest.warns(fonts.MissingGlyphsWarning) as caught:
        save_figure(fig, tmp_path / "boxes.png")
        save_figure(fig, tmp_path / "boxes.svg")
    assert [w.message.chars for w in caught] == [char, char]  # type: ignore[union-attr]
    monkeypatch.setattr(fonts, "FALLBACK_FAMILIES", (family, "No Such Family"))
    assert fonts.font_families() == ["DejaVu Sans", family]  # only what is installed
    fig = head_figure(torch.eye(2), [char, "a"], title=f"{char} twice")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither ours nor matplotlib's
        save_figure(fig, tmp_path / "drawn.png")
        save_figure(fig, tmp_path / "drawn.svg")


def test_print_warnings_merges_missing_glyphs_into_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def caught(message: Warning) -> warnings.WarningMessage:
        return warnings.WarningMessage(message, type(message), "f.py", 1)

    common.print_warnings(
        [
            caught(fonts.MissingGlyphsWarning("東京")),
            caught(UserWarning("the text was cut")),
            caught(fonts.MissingGlyphsWarning("京都")),
            caught(UserWarning("the text was cut")),
        ]
    )
    assert capsys.readouterr().err.splitlines() == [
        "warning: the text was cut",
        "warning: no installed font has 東, 京, 都 (3 characters): the pictures draw them as "
        "boxes; install a font that has them (for Chinese, Japanese or Korean: Noto Sans CJK, "
        "Debian's fonts-noto-cjk)",
    ]


def test_io_stdin_still_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", type("Stdin", (), {"buffer": io.BytesIO(b"a\r\nb\rc")}))
    assert corpus_cli.read_corpus_lines("-") == (["a", "b", "c"], [1, 2, 3])
