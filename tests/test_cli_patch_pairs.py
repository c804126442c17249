"""``multihead patch --model`` beyond one pair: ``--pairs FILE`` (JSON lines, batched; errors
naming the line), the warning for an answer written without its leading space, and a named
model's built-in pair. Tiny random GPT-2s saved with ``save_pretrained``; references from
single-pair runs and from transformers' own model."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import fails

from multihead.cli import main, text_pairs
from multihead.cli.patch_experiment import SPACED_GAP
from multihead.cli.text_pairs import TextPair

pytestmark = pytest.mark.cpu_only  # a CLI
transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

# Three pairs of 11 tokens each (the tiny tokenizer's pieces), answers and wrong tokens single
# pieces; nonsense is as good as sense to a random model
PAIRS = [
    {"clean": "The cat was too tired", "corrupt": "The animal was tired", "answer": " it",
     "wrong": " the"},
    {"clean": "The it was too tired", "corrupt": "The cat was too tired", "answer": " cat",
     "wrong": " it"},
    {"clean": "The the was too tired", "corrupt": "The to was too tired", "answer": " to",
     "wrong": " cat"},
]  # fmt: skip


def _write(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def _effects(stdout: str) -> dict[str, float]:
    rows = re.findall(r"^  (L\d+H\d+)\s+(-?\d+\.\d+)\s+-?\d+\.\d+$", stdout, re.MULTILINE)
    return {head: float(value) for head, value in rows}


def _clean(stdout: str) -> float:
    match = re.search(r"clean (-?\d+\.\d+)", stdout)
    assert match is not None, stdout
    return float(match[1])


def test_pairs_are_patched_together_as_the_mean_of_each_alone(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--top", "8", "--format", "png", "--device", "cpu"]  # 2 layers x 4 heads: all
    pairs = _write(tmp_path / "pairs.jsonl", [PAIRS[0], "", PAIRS[1], PAIRS[2]])  # blank: skipped
    argv = ["patch", "--model", str(gpt2), "--pairs", str(pairs), "--out", str(tmp_path / "all")]
    assert main([*argv, *common]) == 0
    together = capsys.readouterr().out
    assert "mean over 3 pairs" in together
    alone = []
    for i, pair in enumerate(PAIRS):
        texts = ["--clean", pair["clean"], "--corrupt", pair["corrupt"]]
        texts += ["--answer", pair["answer"], "--wrong", pair["wrong"]]
        out = ["--out", str(tmp_path / f"one{i}")]
        assert main(["patch", "--model", str(gpt2), *texts, *out, *common]) == 0
        alone.append(capsys.readouterr().out)
    # each pair's clean metric from transformers' own model: the mean is what --pairs prints
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(gpt2)
    clean = []
    with torch.no_grad():
        for pair in PAIRS:
            logits = model(**tokenizer(pair["clean"], return_tensors="pt")).logits[0, -1]
            a, w = (
                tokenizer(pair[k], add_special_tokens=False).input_ids for k in ("answer", "wrong")
            )
            assert len(a) == len(w) == 1
            clean.append(float(logits[a[0]] - logits[w[0]]))
    for value, stdout in zip(clean, alone, strict=True):
        assert _clean(stdout) == pytest.approx(value, abs=1e-3)
    assert _clean(together) == pytest.approx(sum(clean) / 3, abs=1e-3)
    # every head's effect on the batch is the mean of its effects on each pair (printed to 3
    # decimals: each within 5e-4 of the value)
    effects = _effects(together)
    singles = [_effects(stdout) for stdout in alone]
    assert len(effects) == 8 and all(len(s) == 8 for s in singles)
    for head, value in effects.items():
        assert value == pytest.approx(sum(s[head] for s in singles) / 3, abs=2e-3)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([PAIRS[0], "{not json"], r"line 2 is not a JSON object"),
        ([PAIRS[0], [1, 2]], r"line 2 must be a JSON object with clean, corrupt, answer"),
        ([{**PAIRS[0], "answr": " it"}], r"line 1: unknown key 'answr', expected clean"),
        ([{"clean": "a", "corrupt": "b"}], r"line 1: 'answer' must be a string, got nothing"),
        ([{**PAIRS[0], "clean": 3}], r"line 1: 'clean' must be a string, got int"),
        (
            [PAIRS[0], PAIRS[1], {k: v for k, v in PAIRS[2].items() if k != "wrong"}],
            r"line 3 lacks 'wrong', unlike the first pair",
        ),
        ([], r"holds no pair \(one JSON object a line"),
        (
            [PAIRS[0], {**PAIRS[1], "clean": "The it", "corrupt": "The cat"}],
            r"line 2: its texts have 2 tokens, the first pair's 11: every pair must have as many",
        ),
        (
            [PAIRS[0], {**PAIRS[1], "corrupt": "The cat was"}],
            r"line 2: clean and corrupt must have as many tokens, got 11 and 5",
        ),
        (
            [PAIRS[0], {**PAIRS[1], "answer": " street"}],
            r"line 2: answer must be one token of the model's vocabulary, got ' street'",
        ),
    ],
)
def test_a_bad_pairs_file_is_one_line_naming_the_line(
    lines: list[Any],
    message: str,
    gpt2: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", lines)
    argv = ["patch", "--model", str(gpt2), "--pairs", str(pairs), "--out", str(tmp_path / "o")]
    err = fails(capsys, [*argv, "--device", "cpu"])
    assert re.search(message, err), err
    assert f"--pairs '{pairs}'" in err
    assert not (tmp_path / "o").exists()


def test_pairs_flag_errors(gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = _write(tmp_path / "pairs.jsonl", PAIRS)
    argv = ["patch", "--model", str(gpt2), "--pairs", str(pairs), "--out", str(tmp_path / "o")]
    err = fails(capsys, [*argv, "--clean", "The cat", "--corrupt", "The dog", "--answer", " it"])
    assert "--pairs replaces --clean, --corrupt, --answer and --wrong: give one" in err
    err = fails(capsys, ["patch", "--checkpoint", str(tmp_path), "--pairs", str(pairs)])
    assert "--pairs takes texts for a --model's tokenizer" in err
    err = fails(capsys, ["patch", "--model", str(gpt2), "--pairs", str(tmp_path / "none")])
    assert "no such file" in err
    err = fails(capsys, ["patch", "--model", str(gpt2)])
    assert "--model needs --clean, --corrupt and --answer (the texts to compare), or --pairs" in err


def _lm_with_answers(path: Path, text: str, spaced: int, bare: int, gap: float) -> Path:
    """A tiny GPT-2 (untied head) whose next-token logits after ``text`` put ``spaced`` at
    +gap/2 and ``bare`` at -gap/2 above the rest's spread: its unembedding rows for the two
    tokens are ±(gap/2) times the unit final state there (the states do not depend on the
    head)."""
    from test_hf_explain import byte_level_bpe

    torch.manual_seed(1)
    tokenizer = byte_level_bpe()
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer), n_embd=48, n_layer=2, n_head=4, n_positions=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        h = model.transformer(ids).last_hidden_state[0, -1]
        model.lm_head.weight[spaced] = h / h.norm() ** 2 * gap / 2  # logit = gap / 2
        model.lm_head.weight[bare] = -h / h.norm() ** 2 * gap / 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("gap", [3 * SPACED_GAP, SPACED_GAP / 4])
def test_an_answer_without_its_space_is_warned_when_far_less_likely(
    gap: float, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean, corrupt = "The cat was too tired", "The animal was tired"
    from test_hf_explain import byte_level_bpe

    tokenizer = byte_level_bpe()
    (spaced,), (bare,) = (tokenizer(w, add_special_tokens=False).input_ids for w in (" it", "it"))
    path = _lm_with_answers(tmp_path / "lm", clean, spaced, bare, gap)
    # the reference: transformers' log-probabilities after the clean text
    model = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    with torch.no_grad():
        lp = model(tokenizer(clean, return_tensors="pt").input_ids).logits[0, -1].log_softmax(-1)
    assert float(lp[spaced] - lp[bare]) == pytest.approx(gap, rel=1e-3)
    argv = ["patch", "--model", str(path), "--clean", clean, "--corrupt", corrupt]
    out = ["--out", str(tmp_path / "o"), "--format", "png", "--device", "cpu"]
    assert main([*argv, "--answer", "it", *out]) == 0
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("warning: --answer 'it'")]
    if gap > SPACED_GAP:
        assert len(warned) == 1, err
        assert f"(log-probability {float(lp[bare]):.2f} against {float(lp[spaced]):.2f})" in err
        assert "did you mean ' it'?" in err
    else:
        assert not warned, err
    # written with its space, the answer is what the model predicts: no warning
    assert main([*argv, "--answer", " it", *out]) == 0
    assert "warning: --answer" not in capsys.readouterr().err


def test_a_named_model_without_texts_runs_its_built_in_pair(
    gpt2: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the IOI pair of the issue for the name "smollm2" (the loader resolves the name)
    ioi = text_pairs.BUILT_IN_PAIRS["smollm2"]
    assert (ioi.answer, ioi.wrong) == (" Mary", " John")
    clean, corrupt = ioi.clean.split(), ioi.corrupt.split()
    differ = [i for i, (a, b) in enumerate(zip(clean, corrupt, strict=True)) if a != b]
    assert differ == [8]
    assert clean[8] == "John" and corrupt[8] == "Mary"
    # any name keyed there: its pair runs when no text is given (here a tiny model's)
    pair = TextPair(**{k: v for k, v in PAIRS[1].items()})
    monkeypatch.setitem(text_pairs.BUILT_IN_PAIRS, str(gpt2), pair)
    out = ["--out", str(tmp_path / "o"), "--format", "png", "--device", "cpu"]
    assert main(["patch", "--model", str(gpt2), *out]) == 0
    captured = capsys.readouterr()
    assert "metric: logit of ' cat' minus ' it' at the last position" in captured.out
    assert f"note: --model {gpt2} without texts: its built-in pair, clean 'The it was too" in (
        captured.err
    )
