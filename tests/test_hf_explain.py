"""``explain`` and ``multihead explain --model`` on any Hugging Face model (load_text_model).

Every model is a tiny random one saved with ``save_pretrained``, beside a tokenizer trained with
the ``tokenizers`` library on a few sentences and saved as ``PreTrainedTokenizerFast``: the
directories look like the Hub's, and nothing is downloaded. References are transformers' own:
``attn_implementation="eager"`` with ``output_attentions=True`` for the weights, the fast
tokenizer's own ``__call__`` for the ids, and zeroed output-projection rows for ablation.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("matplotlib")

from cli_support import fails, snapshot  # noqa: E402

from multihead.cli import main  # noqa: E402
from multihead.explanation import explain  # noqa: E402
from multihead.pretrained import load_text_model  # noqa: E402
from multihead.text import TextModel  # noqa: E402
from multihead.text.tokenization import TruncationWarning  # noqa: E402

CORPUS = [
    "The animal didn't cross the street because it was too tired.",
    "The cat sat on the mat, and then it slept in the sun.",
    "A dog ran across the road to catch the ball.",
    "London is the capital of England and a large city.",
]
TEXT = "The animal didn't cross the street because it was too tired."


# -- tokenizers trained on CORPUS ------------------------------------------------------------------


def byte_level_bpe() -> Any:
    """GPT-2's kind: byte-level BPE ("Ġthe"), offsets that keep the space, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>"
    )


def wordpiece() -> Any:
    """BERT's kind: lower-cased WordPiece ("##s"), [CLS] text [SEP]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(
        CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def sentencepiece_like(template: str) -> Any:
    """Llama's and T5's kind: "▁the" pieces (Metaspace), specials placed by ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=250, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single=template,
        special_tokens=[(s, tok.token_to_id(s)) for s in ("<s>", "</s>")],
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )


# -- tiny random models ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    name: str
    tokenizer: Callable[[], Any]
    build: Callable[[int], Any]  # vocab size -> a random transformers model
    causal: bool
    layers: int
    heads: int


FAMILIES = [
    Family(
        "gpt2",
        byte_level_bpe,
        lambda v: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=v,
                n_embd=48,
                n_layer=2,
                n_head=4,
                n_positions=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        causal=True,
        layers=2,
        heads=4,
    ),
    Family(
        "gpt_neo",  # attention in the module's own code; global and local (window 4) layers
        byte_level_bpe,
        lambda v: transformers.GPTNeoForCausalLM(
            transformers.GPTNeoConfig(
                vocab_size=v,
                hidden_size=48,
                num_layers=2,
                num_heads=4,
                attention_types=[[["global", "local"], 1]],
                window_size=4,
                max_position_embeddings=64,
                bos_token_id=0,
                eos_token_id=0,
            )
        ),
        causal=True,
        layers=2,
        heads=4,
    ),
    Family(
        "bert",
        wordpiece,
        lambda v: transformers.BertModel(
            transformers.BertConfig(
                vocab_size=v,
                hidden_size=48,
                intermediate_size=96,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=64,
            )
        ),
        causal=False,
        layers=2,
        heads=4,
    ),
    Family(
        "llama",  # grouped-query: 6 query heads read 2 key/value heads
        lambda: sentencepiece_like("<s> $A"),
        lambda v: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=v,
                hidden_size=48,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=6,
                num_key_value_heads=2,
                max_position_embeddings=128,
                pad_token_id=0,
                bos_token_id=2,
                eos_token_id=3,
            )
        ),
        causal=True,
        layers=3,
        heads=6,
    ),
    Family(
        "t5",  # encoder-decoder: its encoder's self-attention is explained
        lambda: sentencepiece_like("$A </s>"),
        lambda v: transformers.T5Model(
            transformers.T5Config(
                vocab_size=v,
                d_model=48,
                d_kv=16,
                d_ff=96,
                num_layers=2,
                num_decoder_layers=3,
                num_heads=4,
                decoder_start_token_id=0,
            )
        ),
        causal=False,
        layers=2,
        heads=4,
    ),
]
BY_NAME = {f.name: f for f in FAMILIES}


def save_family(fam: Family, path: Path) -> Path:
    torch.manual_seed(0)
    tokenizer = fam.tokenizer()
    fam.build(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {f.name: save_family(f, tmp_path_factory.mktemp(f.name)) for f in FAMILIES}


@pytest.fixture(scope="module")
def loaded(saved: dict[str, Path]) -> dict[str, TextModel]:
    # "bert" too runs through transformers here; multihead's own BERT is compared below
    return {name: load_text_model(path, backend="transformers") for name, path in saved.items()}


def own_tokenizer(path: Path) -> Any:
    """transformers' own fast tokenizer of a saved directory: the reference for ids."""
    return transformers.AutoTokenizer.from_pretrained(path)


def reference_tokens(path: Path, text: str) -> tuple[list[str], list[int | None], list[int]]:
    """The reference display tokens and word ids of ``text``, from the tokenizers library's own
    encoding: each piece shown as the text its offsets cover without surrounding whitespace
    (specials as the tokenizer names them), its word the index of the word of the text (a
    regular expression: runs of word characters, each other visible character alone; right
    for texts of letters and punctuation) its first character falls in; and where each shown
    piece starts. A piece of spaces alone is shown as "␣"."""
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    enc = tok.encode(text)
    words = [m.span() for m in re.finditer(r"\w+|[^\w\s]", text)]
    shown: list[str] = []
    owner: list[int | None] = []
    starts: list[int] = []
    for piece, (s, e), special in zip(
        enc.tokens, enc.offsets, enc.special_tokens_mask, strict=True
    ):
        core = text[s:e].strip()
        start = s + text[s:e].index(core) if core else e
        shown.append(piece if special else core or "␣")
        word = next((i for i, (a, b) in enumerate(words) if a <= start < b), None)
        owner.append(None if special or not core else word)
        starts.append(start)
    return shown, owner, starts


def eager(path: Path) -> Any:
    """transformers' own eager model of a saved directory (the encoder of an encoder-decoder)."""
    model = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return model.get_encoder() if model.config.is_encoder_decoder else model


# -- the library ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_weights_equal_eager_output_attentions(
    fam: Family, saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    model = loaded[fam.name]
    assert model.causal is fam.causal
    assert (model.num_layers, model.num_heads) == (fam.layers, fam.heads)
    ex = explain(TEXT, model=model, importance=False)
    assert ex.causal is fam.causal
    batch = model.tokenize(TEXT)
    # the ids are transformers' own fast tokenizer's, specials included
    assert batch.input_ids[0].tolist() == own_tokenizer(saved[fam.name])(TEXT)["input_ids"]
    ref = eager(saved[fam.name])
    kwargs = {"token_type_ids": batch.token_type_ids} if fam.name == "bert" else {}
    with torch.no_grad():
        out = ref(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_attentions=True,
            **kwargs,
        )
    want = torch.stack([a[0] for a in out.attentions])  # (L, H, T, T)
    t = len(ex.tokens)
    assert ex.weights.shape == (fam.layers, fam.heads, t, t)
    torch.testing.assert_close(ex.weights, want, atol=1e-6, rtol=0)
    above = torch.ones(t, t, dtype=torch.bool).triu(1)
    if fam.causal:
        assert (ex.weights[..., above] == 0).all()
    else:
        assert (ex.weights[..., above] > 0).all()


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert"])
def test_display_tokens_are_the_text_they_cover(
    name: str, saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    model = loaded[name]
    batch = model.tokenize(TEXT)
    tokens, offsets, word_ids = batch.tokens[0], batch.offsets[0], batch.word_ids[0]
    assert (tokens, word_ids) == reference_tokens(saved[name], TEXT)[:2]  # token by token
    for tok, (s, e) in zip(tokens, offsets, strict=True):
        assert e == s or tok == TEXT[s:e]  # the offsets are the shown text's
    special = batch.special_mask[0].tolist()
    assert any(special) is (name != "gpt2")
    assert all("Ġ" not in t and "▁" not in t for t in tokens)


def test_focus_defaults_to_the_last_word_for_a_causal_model(
    saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    text = "The cat sat on the mat."
    ex = explain(text, model=loaded["gpt2"], importance=False)
    assert ex.focus_word == "mat"
    group = [i for i, w in enumerate(ex.word_ids) if w == ex.word_ids[ex.focus_index]]
    assert ex.focus_index == group[-1]  # the word's last token: it reads the whole word
    # the focus token's top words are earlier tokens (later weights are zero)
    for lf in ex.top_words:
        assert all(max(w.tokens) <= ex.focus_index for w in lf.words)
    # an encoder keeps the first word; a word given is found through the trimmed offsets
    assert explain(text, model=loaded["t5"], importance=False).focus_word == "The"
    ex = explain(TEXT, focus="street", model=loaded["gpt2"], importance=False)
    # the reference: the first piece that starts where "street" does
    tokens, _, starts = reference_tokens(saved["gpt2"], TEXT)
    first = starts.index(TEXT.index("street"))
    assert ex.focus_word == "street" and ex.focus_index == first
    assert ex.tokens[first] == tokens[first] and "street".startswith(tokens[first])


def test_decoder_embedding_is_the_last_real_token(
    saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    model = loaded["gpt2"]
    batch = model.tokenize(["The cat sat.", TEXT])  # the first padded on the right
    ref = eager(saved["gpt2"])
    with torch.no_grad():
        hidden = model(batch.input_ids, batch.attention_mask).last_hidden_state
        got = model.sentence_embedding(hidden, batch.attention_mask)
        for i, text in enumerate(["The cat sat.", TEXT]):
            ids = torch.tensor([own_tokenizer(saved["gpt2"])(text)["input_ids"]])
            alone = ref(input_ids=ids).last_hidden_state[0, -1]
            torch.testing.assert_close(got[i], F.normalize(alone, dim=0), atol=1e-5, rtol=0)


def test_importance_and_ablation_equal_a_zeroed_projection(
    saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    model = loaded["gpt2"]
    ex = explain(TEXT, model=model, ablate=[(1, 2)])
    assert ex.importance is not None and ex.ablation is not None
    ids = model.tokenize(TEXT).input_ids
    ref = eager(saved["gpt2"])
    with torch.no_grad():
        clean = F.normalize(ref(input_ids=ids).last_hidden_state[0, -1], dim=0)
        proj = ref.h[1].attn.c_proj.weight  # Conv1D (in, out): head 2's inputs are rows 24:36
        proj[24:36] = 0
        out = ref(input_ids=ids, output_attentions=True)
        ablated = F.normalize(out.last_hidden_state[0, -1], dim=0)
    cosine = float(ablated @ clean)
    assert ex.ablation.cosine == pytest.approx(cosine, abs=1e-5)
    assert float(ex.importance[1, 2]) == pytest.approx(1 - cosine, abs=1e-5)
    want = torch.stack([a[0] for a in out.attentions])
    torch.testing.assert_close(ex.ablation.weights, want, atol=1e-6, rtol=0)


def test_causal_pictures_and_page_blank_the_upper_triangle(
    loaded: dict[str, TextModel],
) -> None:
    ex = explain("The cat sat on the mat.", model=loaded["gpt2"], importance=False)
    t = len(ex.tokens)
    above = torch.ones(t, t, dtype=torch.bool).triu(1).numpy()
    head = ex.head_figure(1, 0).axes[0].images[0].get_array()
    assert (head.mask == above).all()  # masked (drawn blank), not a colour for 0
    grid = ex.grid_figure().axes[0].images[0].get_array()
    gap = max(1, round(0.12 * t))
    for i in range(len(ex.layers)):
        for j in range(len(ex.heads)):
            cell = grid[i * (t + gap) : i * (t + gap) + t, j * (t + gap) : j * (t + gap) + t]
            assert (cell.mask == above).all()
    assert re.search(r'"causal":\s*true', ex.html())
    encoder = explain("The cat sat on the mat.", model=loaded["t5"], importance=False)
    assert (
        not encoder.causal
        and not encoder.head_figure(0, 0).axes[0].images[0].get_array().mask.any()
    )
    assert re.search(r'"causal":\s*false', encoder.html())


def test_a_long_text_is_truncated_at_the_position_limit(loaded: dict[str, TextModel]) -> None:
    model = loaded["gpt2"]  # n_positions = 64
    with pytest.warns(TruncationWarning, match="max_seq_length=64"):
        ex = explain(" ".join(CORPUS * 4), model=model, importance=False)
    assert ex.truncated and len(ex.tokens) == 64 == model.max_seq_length
    assert loaded["t5"].max_seq_length == 512  # relative positions: no limit in the files


def test_a_short_max_seq_length_loads_quietly(saved: dict[str, Path]) -> None:
    # the load-time probe is longer than 4 tokens: its truncation is not the user's (warnings
    # are errors in this suite)
    model = transformers.AutoModel.from_pretrained(saved["gpt2"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved["gpt2"])
    wrapped = TextModel(model, tokenizer, max_seq_length=4)
    assert wrapped.causal and wrapped.num_layers == 2
    with pytest.warns(TruncationWarning):
        assert len(wrapped.tokenize(TEXT).tokens[0]) == 4


def test_a_name_in_the_local_cache_loads_without_the_network(
    saved: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    cache = tmp_path / "hub"
    snap = cache / "models--tiny--gpt2" / "snapshots" / "0123abcd"
    shutil.copytree(saved["gpt2"], snap)
    (cache / "models--tiny--gpt2" / "refs").mkdir()
    (cache / "models--tiny--gpt2" / "refs" / "main").write_text("0123abcd")
    _no_network(monkeypatch)
    model = load_text_model("tiny/gpt2", cache_dir=str(cache))
    assert model.name == "tiny/gpt2" and model.causal
    with pytest.raises(FileNotFoundError, match=r"'tiny/nothing' is neither a directory nor"):
        load_text_model("tiny/nothing", cache_dir=str(cache))
    # the command looks names up in the default cache (HF_HUB_CACHE)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)  # "tiny/gpt2" is not a directory here
    out = tmp_path / "out"
    argv = ["explain", "--model", "tiny/gpt2", "--out", str(out), "--format", "html"]
    assert main([*argv, "--no-importance"]) == 0
    assert capsys.readouterr().out.startswith("tiny/gpt2: ")
    assert (out / "attention.html").is_file()


def test_weights_missing_from_the_files_are_a_warning(
    saved: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    from safetensors.torch import load_file, save_file

    path = Path(shutil.copytree(saved["gpt2"], tmp_path / "model"))
    weights = load_file(path / "model.safetensors")
    dropped = next(k for k in weights if k.endswith("h.1.ln_1.weight"))
    del weights[dropped]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"1 weights are not in its files .*h\.1\.ln_1\.weight"):
        load_text_model(path)
    capsys.readouterr()
    argv = ["explain", "--model", str(path), "--out", str(tmp_path / "o"), "--format", "html"]
    assert main([*argv, "--no-importance"]) == 0
    err = capsys.readouterr().err
    assert "warning: model" in err and "initialised at random" in err


def _no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def test_library_refusals(saved: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"model must be a multihead.text.TextModel"):
        explain(TEXT, model=eager(saved["gpt2"]))
    with pytest.raises(TypeError, match=r"or a fast transformers tokenizer"):
        TextModel(eager(saved["gpt2"]), object())
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load_text_model(tmp_path, backend="transformers")


def test_layers_with_different_head_counts_are_refused(saved: dict[str, Path]) -> None:
    model = transformers.AutoModel.from_pretrained(saved["gpt2"], attn_implementation="multihead")
    model.h[1].attn.num_heads, model.h[1].attn.head_dim = 2, 24  # layer 1: 2 heads of width 24
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved["gpt2"])
    with pytest.raises(ValueError, match=r"different head counts \(layer 0: 4, layer 1: 2\)"):
        TextModel(model, tokenizer)


# -- the command ---------------------------------------------------------------------------------


def test_cli_explains_gpt2(saved: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "out"
    code = main(["explain", "--model", str(saved["gpt2"]), "--out", str(out)])  # the default text
    report = capsys.readouterr().out
    assert code == 0, report
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [
            "attention_grid.png",
            "attention_grid.svg",
            "attention.html",
            "head_importance.png",
            "head_importance.svg",
        ]
        + [p.name for p in out.glob("head_L*_H*.*")]
    )
    assert len(list(out.glob("head_L*_H*.png"))) == 1
    assert "itself and earlier tokens only" in report
    assert "[CLS]" not in report and "[SEP]" not in report
    assert report.startswith(f"{saved['gpt2'].name}: ")
    assert re.search(r"focus 'it' \(token \d+\)", report)


def test_cli_explains_a_gpt_neo_directory(
    saved: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "out"
    code = main(["explain", "--model", str(saved["gpt_neo"]), "--out", str(out), "--format", "png"])
    printed = capsys.readouterr().out
    assert code == 0
    assert (out / "attention_grid.png").is_file() and (out / "head_importance.png").is_file()
    assert "most important" in printed


def test_cli_ablates_a_gpt2_head(saved: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    argv = ["explain", "--model", str(saved["gpt2"]), "--out", str(tmp_path / "o"), "--ablate"]
    assert main([*argv, "1:2", "--format", "png", "--no-importance"]) == 0
    report = capsys.readouterr().out
    assert "With L1H2 zeroed" in report and re.search(r"cosine 0\.\d{4} to the clean one", report)


def test_cli_explains_bert_on_multiheads_own_model(
    saved: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    out = tmp_path / "out"
    code = main(
        ["explain", "--model", str(saved["bert"]), TEXT, "--out", str(out), "--format", "png"]
    )
    report = capsys.readouterr().out
    assert code == 0, report
    assert "[CLS]/[SEP] apart" in report and "earlier tokens" not in report
    assert (out / "attention_grid.png").is_file()
    # the same tokens, words and weights as through transformers on the same directory
    ours = explain(TEXT, model=load_text_model(saved["bert"]), importance=False)
    theirs = explain(TEXT, model=load_text_model(saved["bert"], backend="transformers"))
    assert ours.tokens == theirs.tokens == reference_tokens(saved["bert"], TEXT)[0]
    assert ours.word_ids == theirs.word_ids
    torch.testing.assert_close(ours.weights, theirs.weights, atol=1e-5, rtol=0)


def _without(saved: Path, tmp_path: Path, name: str) -> Path:
    copy = Path(shutil.copytree(saved, tmp_path / "model"))
    (copy / name).unlink()
    return copy


def _unrouted(tmp_path: Path) -> Path:
    """A family whose attention is not routed through transformers' AttentionInterface."""
    from unrouted_model import save_unrouted

    tokenizer = byte_level_bpe()
    return save_unrouted(tmp_path / "unrouted", vocab_size=len(tokenizer), tokenizer=tokenizer)


@pytest.mark.parametrize(
    "case, pattern",
    [
        ("missing", r"model directory '.*nowhere' does not exist"),
        ("no tokenizer", r"needs a fast tokenizer \(tokenizer\.json\) to read text, got no"),
        ("not routed", r"multihead_test_unrouted \(UnroutedModel\) does not route its"),
        (
            "uncached name",
            r"'nobody/no-such-model' is neither a directory nor a model in the local",
        ),
    ],
)
def test_cli_errors_are_one_line_and_write_nothing(
    case: str,
    pattern: str,
    saved: dict[str, Path],
    tmp_path: Path,
    capsys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = {
        "missing": lambda: str(tmp_path / "nowhere"),
        "no tokenizer": lambda: str(_without(saved["gpt2"], tmp_path, "tokenizer.json")),
        "not routed": lambda: str(_unrouted(tmp_path)),
        "uncached name": lambda: "nobody/no-such-model",
    }[case]()
    _no_network(monkeypatch)
    out = tmp_path / "out"
    before = snapshot(tmp_path)
    capsys.readouterr()  # what building the models printed
    err = fails(capsys, ["explain", "--model", model, "--out", str(out)])
    assert re.search(pattern, err), err
    assert err.startswith("multihead explain: error: ")
    assert snapshot(tmp_path) == before and not out.exists()


def test_cli_without_transformers_names_the_extra(
    saved: dict[str, Path], tmp_path: Path, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    err = fails(capsys, ["explain", "--model", str(saved["gpt2"]), "--out", str(tmp_path / "o")])
    assert "pip install 'multihead[hf]'" in err


# -- over a corpus -------------------------------------------------------------------------------

MANY_TEXTS = [
    "The cat sat on the mat.",
    "A dog, a cat and a bird met at the river bank.",
    "It rained again, so the game was moved to Sunday.",
    "Why did the model attend to the last word?",
]


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_corpus_statistics_of_a_hf_model_are_the_mean_of_per_text_statistics(
    name: str, saved: dict[str, Path], loaded: dict[str, TextModel]
) -> None:
    from multihead import corpus_statistics

    model = loaded[name]
    together = corpus_statistics(model, MANY_TEXTS, batch_size=3)  # a padded batch, then one text
    # the reference: transformers' own eager weights of each text alone, summarised by hand
    ref = eager(saved[name])
    per_text: dict[str, list[torch.Tensor]] = {"entropy": [], "identity": [], "previous_token": []}
    for text in MANY_TEXTS:
        batch = model.tokenize([text])
        with torch.no_grad():
            weights = torch.stack(
                ref(batch.input_ids, output_attentions=True).attentions
            )  # (L, 1, H, T, T)
        w = weights[:, 0].double()  # (L, H, T, T)
        t = w.shape[-1]
        per_text["entropy"].append(-torch.special.xlogy(w, w).sum(-1).mean(-1))
        per_text["identity"].append(w.diagonal(dim1=-2, dim2=-1).mean(-1))
        per_text["previous_token"].append(w.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1))
        assert t > 1
    for metric, values in per_text.items():
        expected = torch.stack(values).mean(0).float()  # the mean over texts, each alike
        torch.testing.assert_close(getattr(together, metric), expected, atol=1e-5, rtol=1e-4)


def test_cli_explains_a_gpt2_corpus(saved: dict[str, Path], tmp_path: Path, capsys: Any) -> None:
    import json

    corpus = tmp_path / "texts.txt"
    corpus.write_text("\n".join(MANY_TEXTS) + "\n", encoding="utf-8")
    out = tmp_path / "heads"
    argv = ["explain", "--corpus", str(corpus), "--model", str(saved["gpt2"]), "--out", str(out)]
    assert main(argv) == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {
        "heads_map.png",
        "heads_map.svg",
        "head_statistics.json",
    }
    data = json.loads((out / "head_statistics.json").read_text(encoding="utf-8"))
    config = loaded_config(saved["gpt2"])
    assert len(data["role"]) == config.n_layer and len(data["role"][0]) == config.n_head


def loaded_config(path: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


# -- words, padding, limits ------------------------------------------------------------------------


def llama2_layout_tokenizer() -> Any:
    """A Llama-2-style tokenizer.json: the "▁" is added by the normalizer and there is no
    pre-tokenizer, so the tokenizer's own word_ids see one word in a whole sentence."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # trained word by word, as SentencePiece splits by whitespace: no piece spans two words
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=250, special_tokens=specials))
    tok.pre_tokenizer = None
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>"
    )


@pytest.fixture(scope="module")
def llama2_layout(saved: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama2")
    tokenizer = llama2_layout_tokenizer()
    torch.manual_seed(0)
    BY_NAME["llama"].build(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_words_come_from_the_text_whatever_the_pre_tokenizer(llama2_layout: Path) -> None:
    model = load_text_model(llama2_layout)
    text = "The cat sat on the mat."
    raw = own_tokenizer(llama2_layout)(text)
    assert len({w for w in raw.word_ids() if w is not None}) == 1  # the trap: one "word"
    batch = model.tokenize(text)
    # the reference: each real token's word is the whitespace/punctuation-split word its
    # first character falls in, found here by counting in the text itself
    words = [(m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]", text)]
    for tok, (s, e), w in zip(batch.tokens[0], batch.offsets[0], batch.word_ids[0], strict=True):
        if w is None:
            assert e == s or tok in ("<s>",)
        else:
            assert words[w][0] <= s < words[w][1] and e <= words[w][1], (tok, s, e, w)
    ex = explain(text, model=model, importance=False)
    assert ex.focus_word == "mat"  # the last word, not the final "." nor the whole sentence
    assert all(
        w.word in text.split() or w.word in ("mat", ".") for lf in ex.top_words for w in lf.words
    )
    ex = explain(text, focus="sat", model=model, importance=False)
    assert ex.focus_word == "sat"


def test_a_marker_only_piece_shows_as_a_blank(llama2_layout: Path) -> None:
    model = load_text_model(llama2_layout)
    batch = model.tokenize("Hello world")  # "Hello" is not in the corpus: "▁" then letters
    pieces = [model.tokenizer.id_to_token(i) for i in batch.input_ids[0].tolist()]
    assert "▁" in pieces  # the case under test: a marker-only piece, its offsets on "H"
    for piece, shown, (s, e) in zip(pieces, batch.tokens[0], batch.offsets[0], strict=True):
        if piece == "▁":
            assert shown == "␣" and s == e
    assert "".join(t for t in batch.tokens[0] if t not in ("<s>", "␣")) == "Helloworld"


def test_decoder_embedding_reads_the_last_real_token_on_either_padding_side(
    loaded: dict[str, TextModel],
) -> None:
    model = loaded["gpt2"]
    texts = ["The cat sat.", TEXT]
    right = model.tokenize(texts)
    # the same ids padded on the left, by hand
    lengths = right.attention_mask.sum(1).tolist()
    t = right.input_ids.shape[1]
    left_ids = torch.zeros_like(right.input_ids)
    left_mask = torch.zeros_like(right.attention_mask)
    for i, n in enumerate(lengths):
        left_ids[i, t - n :] = right.input_ids[i, :n]
        left_mask[i, t - n :] = 1
    with torch.no_grad():
        hidden_right = model(right.input_ids, right.attention_mask).last_hidden_state
        a = model.sentence_embedding(hidden_right, right.attention_mask)
        hidden = model(left_ids, left_mask).last_hidden_state
        b = model.sentence_embedding(hidden, left_mask)
    # the references: a right-padded row's last real token is at its length - 1; a left-padded
    # row's at the last position (GPT-2 numbers positions from the left edge, padding included,
    # so the two paddings' states differ: each is checked against its own)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(a[i], F.normalize(hidden_right[i, n - 1], dim=0))
    torch.testing.assert_close(b, F.normalize(hidden[:, -1], dim=1))


@pytest.mark.parametrize("bad", [0, -3, 1, 65, 2.5, "x", True])
def test_max_seq_length_is_checked(saved: dict[str, Path], bad: Any) -> None:
    model = load_text_model(saved["gpt2"])  # 64 positions
    with pytest.raises(ValueError, match=r"max_seq_length must be an int in 2\.\.64"):
        TextModel(model.model, model.tokenizer, max_seq_length=bad)
    assert TextModel(model.model, model.tokenizer, max_seq_length=64).max_seq_length == 64


def test_roberta_positions_reserve_padding_idx_plus_one(tmp_path: Path) -> None:
    tokenizer = wordpiece()
    config = transformers.RobertaConfig(
        vocab_size=len(tokenizer),
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=20,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.RobertaModel(config).save_pretrained(tmp_path)
    tokenizer.model_max_length = int(1e30)  # the tokenizer sets no limit
    tokenizer.save_pretrained(tmp_path)
    model = load_text_model(tmp_path)
    assert model.max_seq_length == 20 - (0 + 1)  # positions start at padding_idx + 1
    # a task-head wrapper reserves the same positions (its embeddings sit in base_model)
    with_head = TextModel(transformers.RobertaForMaskedLM(config), model.tokenizer)
    assert with_head.max_seq_length == 19
    with pytest.warns(TruncationWarning):
        ex = explain(" ".join(["the cat sat on the mat"] * 6), model=model, importance=False)
    assert len(ex.tokens) == 19


def test_a_config_that_builds_no_model_is_one_line(
    saved: dict[str, Path], tmp_path: Path, capsys: Any
) -> None:
    import json

    broken = tmp_path / "broken"
    shutil.copytree(saved["gpt2"], broken)
    config = json.loads((broken / "config.json").read_text())
    config["n_head"] = 0
    (broken / "config.json").write_text(json.dumps(config))
    before = snapshot(tmp_path)
    message = fails(capsys, ["explain", "--model", str(broken), "--out", str(tmp_path / "o")])
    assert "cannot" in message and "broken" in message
    assert snapshot(tmp_path) == before


def test_a_newline_piece_shows_as_a_newline(loaded: dict[str, TextModel]) -> None:
    model = loaded["gpt2"]
    batch = model.tokenize("one cat.\nThe dog")
    pieces = [model.tokenizer.id_to_token(i) for i in batch.input_ids[0].tolist()]
    shown = dict(zip(pieces, batch.tokens[0], strict=True))
    assert "Ċ" in pieces  # byte-level BPE's newline, a piece of its own
    assert all(shown[p] == "⏎" for p in pieces if p == "Ċ")


def test_a_focus_word_inside_a_longer_piece_is_found(loaded: dict[str, TextModel]) -> None:
    # a piece that runs past the word's edge: the word is found at the piece that holds it
    model = loaded["llama"]
    text = "London is a city."
    batch = model.tokenize(text)
    pieces = batch.tokens[0]
    holder = next(
        (i for i, (s, e) in enumerate(batch.offsets[0]) if s <= text.index("city") < e), None
    )
    assert holder is not None
    ex = explain(text, focus="city", model=model, importance=False)
    assert ex.focus_index == holder, pieces


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_a_named_focus_is_reported_as_written(name: str, loaded: dict[str, TextModel]) -> None:
    text = "The well-known animal didn't cross."
    for focus in ("well-known", "didn't", "Animal"):
        ex = explain(text, focus=focus, model=loaded[name], importance=False)
        assert ex.focus_word.casefold() == focus.casefold()  # whole, as written in the text
        # the focus token is the one where that word starts (BERT lower-cases its pieces)
        start = text.casefold().index(focus.casefold())
        assert ex.tokens[ex.focus_index].casefold()[0] == text[start].casefold()


def test_the_bytes_of_one_character_are_numbered(loaded: dict[str, TextModel]) -> None:
    model = loaded["gpt2"]  # byte-level BPE: a character outside its merges splits into bytes
    text = "a 東 b"
    batch = model.tokenize(text)
    pieces = [model.tokenizer.id_to_token(i) for i in batch.input_ids[0].tolist()]
    # the reference: how many bytes UTF-8 gives the character, and so how many pieces
    count = len("東".encode())
    assert len(pieces) == 3 + count  # "a", "Ġ", the bytes, "Ġb"
    assert [t for t in batch.tokens[0] if t.startswith("東")] == [
        f"東{k}/{count}" for k in range(1, count + 1)
    ]
    ex = explain(text, focus="東", model=model, importance=False)
    assert ex.focus_word == "東" and ex.tokens[ex.focus_index] == f"東1/{count}"
