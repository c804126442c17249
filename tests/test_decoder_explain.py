"""``explain`` on a decoder: its first token (the attention sink) set apart from the words as
[CLS] and [SEP] are, in the text and in the pictures; head importance as the KL divergence of
the next-token distribution at the focus when the model keeps its language-model head.

Tiny random models saved with ``save_pretrained`` (:mod:`test_hf_explain`'s families); the
references are transformers' own models, a head zeroed by zeroing its inputs to the output
projection."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

from test_hf_explain import BY_NAME, save_family  # noqa: E402

from multihead.circuits.importance import head_importance  # noqa: E402
from multihead.cli import main  # noqa: E402
from multihead.explanation import explain  # noqa: E402
from multihead.explanation.head_effects import (  # noqa: E402
    EMBEDDING_COSINE,
    NEXT_TOKEN_KL,
    embedding_distance,
    importance,
    next_token_divergence,
)
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text import TextModel  # noqa: E402
from multihead.viz.figure import APART_COLOUR  # noqa: E402

TEXT = "The animal didn't cross the street because it was too tired."


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: save_family(BY_NAME[name], tmp_path_factory.mktemp(name) / name)
        for name in ("gpt2", "llama", "bert")
    }


@pytest.fixture(scope="module")
def lm(saved: dict[str, Path]) -> TextModel:
    """GPT-2 with its head: no BOS, so its first token is the word "The"."""
    return load_text_model(saved["gpt2"], head="lm")


def test_a_decoder_s_first_token_is_set_apart_from_the_words(lm: TextModel) -> None:
    ex = explain(TEXT, model=lm, focus="it", importance=False)
    assert ex.tokens[0] == "The" and not ex.special[0]  # a word, not a special token
    assert ex.sink == 0 and ex.apart[0] and not any(ex.apart[1:])
    focus = ex.focus_index
    for lf in ex.top_words:
        # never a top word; its weight beside the specials', the mean over heads (reference:
        # the weights themselves)
        assert all(0 not in w.tokens for w in lf.words)
        want = float(ex.weights[lf.layer, ex.heads, focus, 0].mean())
        assert lf.special == {"The": pytest.approx(want, abs=1e-6)}
    # the large picture's head reads a word, never the sink alone
    layer, head = ex.focus_head
    assert any(w.head == head for lf in ex.top_words if lf.layer == layer for w in lf.words)


def test_the_sink_is_grey_in_the_pictures_and_shaded_on_the_page(lm: TextModel) -> None:
    ex = explain("The cat sat on the mat.", model=lm, importance=False)
    for fig in (ex.grid_figure(), ex.head_figure()):
        labels = [t for t in fig.axes[0].texts if t.get_text() in ex.tokens]
        first = [t for t in labels if t.get_text() == "The"]
        rest = [t for t in labels if t.get_text() != "The"]
        assert first and rest
        assert {t.get_color() for t in first} == {APART_COLOUR}
        assert {t.get_color() for t in rest} == {"black"}
    special = re.search(r'"special":\s*(\[[^\]]*\])', ex.html())
    assert special is not None
    assert json.loads(special[1]) == [True] + [False] * (len(ex.tokens) - 1)


def test_a_bos_token_is_the_sink_and_the_first_word_stays_a_word(saved: dict[str, Path]) -> None:
    # the Llama family's tokenizer writes "<s>" first: special already, so no sink is added
    # and "The" (token 1) may be a top word
    model = load_text_model(saved["llama"])
    ex = explain(TEXT, model=model, focus="it", importance=False)
    assert ex.tokens[:2] == ["<s>", "The"] and ex.special[0]
    assert ex.sink is None and ex.apart == ex.special
    assert all("<s>" in lf.special for lf in ex.top_words)


def test_an_encoder_sets_no_sink_apart(saved: dict[str, Path]) -> None:
    ex = explain(TEXT, model=load_text_model(saved["bert"]), focus="it")
    assert ex.sink is None and ex.apart == ex.special
    assert ex.importance_measure == EMBEDDING_COSINE


def _zeroed_c_proj(path: Path, layer: int, head: int) -> Any:
    """transformers' GPT-2 with its LM head, head (layer, head) zeroed: its 12 inputs to c_proj
    (Conv1D (in, out): head h's are rows 12h:12h+12 at width 48 over 4 heads)."""
    ref = transformers.GPT2LMHeadModel.from_pretrained(path, attn_implementation="eager").eval()
    with torch.no_grad():
        ref.transformer.h[layer].attn.c_proj.weight[12 * head : 12 * head + 12] = 0
    return ref


def test_importance_of_a_causal_lm_is_the_next_token_kl_at_the_focus(
    saved: dict[str, Path], lm: TextModel
) -> None:
    ex = explain(TEXT, model=lm, focus="because")
    assert ex.importance is not None and ex.importance_measure == NEXT_TOKEN_KL
    ids = lm.tokenize(TEXT).input_ids
    focus = ex.focus_index
    assert focus < len(ex.tokens) - 1  # not the last token: the position is the focus
    clean_model = transformers.GPT2LMHeadModel.from_pretrained(saved["gpt2"]).eval()
    with torch.no_grad():
        p = clean_model(input_ids=ids).logits[0, focus].double().log_softmax(-1)
        for layer in range(2):
            for head in range(4):
                q = _zeroed_c_proj(saved["gpt2"], layer, head)(input_ids=ids).logits[0, focus]
                kl = float((p.exp() * (p - q.double().log_softmax(-1))).sum())
                assert float(ex.importance[layer, head]) == pytest.approx(kl, abs=1e-5)
    assert float(ex.importance.max()) > 0  # random heads do move the distribution
    fig = ex.importance_figure()
    title = fig.axes[0].get_title()
    assert "KL divergence (nats) of the next-token distribution" in title
    assert f"focus {ex.focus_token!r} (token {focus})" in title
    assert fig.axes[1].get_ylabel() == "KL divergence (nats)"  # the colour bar


def test_cli_reports_the_sink_apart_and_the_kl(
    saved: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["explain", "--model", str(saved["gpt2"]), TEXT, "--focus", "it"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--format", "png"]) == 0
    report = capsys.readouterr().out
    assert "the first token 'The' (the attention sink) apart" in report
    layers = [line for line in report.splitlines() if line.strip().startswith("layer ")]
    assert len(layers) == 2
    for line in layers:
        words, _, apart = line.partition("|")
        assert "The " not in words  # "the" (lower case, a later word) may be
        assert re.fullmatch(r" The \d\.\d\d", apart)
    assert "most important (zeroed: next-token KL):" in report


def test_a_decoder_saved_without_its_head_keeps_the_embedding_measure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a Llama base model (untied, no lm_head in its files): the CLI does not run it with a
    # random head (no warning about weights initialised at random), and measures the last
    # token's state as before
    from test_hf_explain import sentencepiece_like

    torch.manual_seed(0)
    tokenizer = sentencepiece_like("<s> $A")
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=2, eos_token_id=3,
    )  # fmt: skip
    path = tmp_path / "base"
    transformers.LlamaModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    argv = ["explain", "--model", str(path), TEXT, "--out", str(tmp_path / "o"), "--format", "png"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "most important (zeroed: embedding moves):" in captured.out
    assert "random" not in captured.err, captured.err


def test_last_logits_only_is_the_last_row_of_transformers_logits(
    saved: dict[str, Path], lm: TextModel
) -> None:
    batch = lm.tokenize(TEXT)
    ref = transformers.GPT2LMHeadModel.from_pretrained(saved["gpt2"]).eval()
    with torch.no_grad():
        expected = ref(input_ids=batch.input_ids).logits[:, -1:]
        got = lm(batch.input_ids, batch.attention_mask, last_logits_only=True).logits
    assert got.shape == expected.shape == (1, 1, ref.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    encoder = load_text_model(saved["bert"])
    with pytest.raises(ValueError, match="last_logits_only needs head='lm'"):
        encoder(batch.input_ids, last_logits_only=True)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_stacked_importance_equals_one_ablation_per_head(saved: dict[str, Path], name: str) -> None:
    """importance() ablates a layer's heads in one stacked forward: the same (L, H) as
    head_importance's one run per head, in float64."""
    model = load_text_model(saved[name], head="lm" if name == "llama" else None).double()
    batch = model.tokenize(TEXT)
    focus = batch.input_ids.shape[1] - 3
    if name == "llama":
        _, metric = next_token_divergence(model, batch, focus)
    else:
        _, metric = embedding_distance(model, batch)
    expected = head_importance(model, metric, method="ablation", reuse_prefix=False)
    got = importance(model, batch, focus)
    assert got.shape == expected.shape and bool((expected > 0).all())
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=1e-9)
