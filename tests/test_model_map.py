"""``multihead.model_map``: where a model's heads, blocks, embeddings, final norm and unembedding
are, for multihead's own modules and for transformers models; its cache; and what builds on it
(``load_text_model`` without a probe forward, ``head="lm"``, texts in the circuit functions).

References are independent of the map: the modules themselves reached by their known attribute
paths (``model.blocks[i].self_attn``, ``model.transformer.h[i]``, ``model.model.norm``), the
constructor arguments and the transformers config, ``inspect.signature`` of the forward,
causality read off the model by changing the last token and watching the earlier positions,
and transformers' own models and tokenizers for the logits and the token ids.
"""

from __future__ import annotations

import copy
import gc
import inspect
import os
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from devices import generator
from torch import Tensor, nn

import multihead
from multihead.layers import TransformerEncoderLayer
from multihead.map_types import BlockParts, ModelMap
from multihead.mapping import model_map
from multihead.models import TransformerLM
from multihead.models.bert import BertModel

os.environ.setdefault("HF_HUB_OFFLINE", "1")

V = 23  # vocabulary of the multihead models here


def _transformers() -> Any:
    return pytest.importorskip("transformers", minversion="5")


def same(a: object, b: object) -> bool:
    """``a is b`` (a function: mypy would narrow b's declared type to a's)."""
    return a is b


def reads_later_tokens(run: Callable[[Tensor], Tensor], ids: Tensor, vocab: int) -> bool:
    """Whether any position before the last changes when only the last token changes: False
    for a causal model, True for one whose queries read later keys (the reference for
    ``causal``, read off the model itself)."""
    changed = ids.clone()
    changed[:, -1] = (changed[:, -1] + 1) % vocab
    with torch.no_grad():
        a, b = run(ids)[:, :-1], run(changed)[:, :-1]
    return not torch.allclose(a, b, rtol=0, atol=1e-5)


def _lm(device: torch.device, **kw: Any) -> TransformerLM:
    torch.manual_seed(0)
    lm = TransformerLM(V, 24, 4, 3, 40, max_len=16, num_kv_heads=2, **kw)
    return lm.to(device).eval()


def _ids(device: torch.device, vocab: int = V, shape: tuple[int, int] = (2, 7)) -> Tensor:
    return torch.randint(vocab, shape, generator=generator(3, device), device=device)


def _tiny_bert(device: torch.device) -> BertModel:
    from tiny_bert import CONFIG

    from multihead.pretrained import bert_config_from_dict

    torch.manual_seed(0)
    return BertModel(bert_config_from_dict(CONFIG)).to(device).eval()


# -- multihead's own models ------------------------------------------------------------------------


@pytest.mark.parametrize("norm_first", [True, False], ids=["pre_ln", "post_ln"])
def test_transformer_lm_map_is_its_modules(norm_first: bool, device: torch.device) -> None:
    lm = _lm(device, norm_first=norm_first)
    found = model_map(lm)
    assert isinstance(found, ModelMap) and found.family == "TransformerLM"
    assert found.num_layers == len(found.sites) == 3 and found.max_heads == 4
    for i, (site, block) in enumerate(zip(found.sites, found.blocks, strict=True)):
        mha: Any = lm.blocks[i].self_attn
        assert site.layer == i and site.name == f"blocks.{i}.self_attn"
        assert same(site.module, mha) and same(site.attention, mha)
        assert (site.num_heads, site.num_kv_heads) == (4, 2)  # constructor arguments
        assert site.head_dim == mha.out_proj.in_features // 4 == 6  # E // H
        assert site.shard is None
        assert block.index == i and block.name == f"blocks.{i}" and block.sites == (i,)
        assert block.module is lm.blocks[i] and block.reusable
        assert block.attention is lm.blocks[i].self_attn and block.mlp is lm.blocks[i].ff
        assert found.block_of(i) is block
    assert found.block_of(3) is None
    assert found.labels() == [[f"L{i}H{h}" for h in range(4)] for i in range(3)]
    assert len(found.embeddings) == 2
    assert found.embeddings[0] is lm.token_embedding
    assert found.embeddings[1] is lm.position_embedding
    assert found.position_table is lm.position_embedding.embedding  # the table itself
    assert found.unembedding is lm.head and same(found.base, lm)
    if norm_first:
        assert found.final_norm is lm.norm and isinstance(lm.norm, nn.LayerNorm)
        assert found.norm_eps == lm.norm.eps
    else:
        assert lm.norm is None and found.final_norm is None and found.norm_eps is None
    assert found.width == 24 and found.position_limit == 16 and not found.token_types
    assert found.causal is True
    assert not reads_later_tokens(lm, _ids(device), V)  # the model itself agrees
    assert dict(found.call_options) == {}


def test_attention_only_lm_has_blocks_without_mlp(device: torch.device) -> None:
    from multihead.models.attention_only_block import AttentionOnlyBlock

    lm = _lm(device, attn_only=True)
    found = model_map(lm)
    assert len(found.blocks) == found.num_layers == 3
    for i, block in enumerate(found.blocks):
        assert isinstance(lm.blocks[i], AttentionOnlyBlock)
        assert block.module is lm.blocks[i] and block.reusable
        assert block.attention is lm.blocks[i].self_attn and block.mlp is None
        assert found.sites[i].module is lm.blocks[i].self_attn
    assert found.final_norm is lm.norm and found.unembedding is lm.head and found.causal is True


def test_bert_model_map(device: torch.device) -> None:
    bert = _tiny_bert(device)
    c = bert.config
    found = model_map(bert)
    assert found.family == "bert" and found.num_layers == c.num_hidden_layers == 2
    layers = bert.encoder.layers
    for i, (site, block) in enumerate(zip(found.sites, found.blocks, strict=True)):
        assert site.module is layers[i].self_attn and site.name == f"encoder.layers.{i}.self_attn"
        assert site.num_heads == site.num_kv_heads == c.num_attention_heads == 4
        assert site.head_dim == c.hidden_size // c.num_attention_heads
        assert block.module is layers[i] and block.reusable and block.sites == (i,)
        assert block.attention is layers[i].self_attn and block.mlp is layers[i].ff
    e = bert.embeddings
    assert len(found.embeddings) == 3 and found.embeddings[0] is e.word
    assert found.embeddings[1] is e.position and found.embeddings[2] is e.token_type
    assert found.position_table is e.position.embedding
    assert found.final_norm is None and found.unembedding is None and same(found.base, bert)
    assert found.width == c.hidden_size and found.position_limit == c.max_position_embeddings
    assert found.token_types is True and found.causal is False
    ids = _ids(device, c.vocab_size, (2, 6))
    assert reads_later_tokens(lambda x: bert(x).last_hidden_state, ids, c.vocab_size)


def test_a_bare_attention_module_is_one_site_and_no_block(device: torch.device) -> None:
    mha = multihead.MultiHeadAttention(16, 4, head_dim=6, num_kv_heads=2).to(device)
    found = model_map(mha)
    assert found.family == "MultiHeadAttention" and same(found.base, mha)
    assert len(found.sites) == 1 and found.blocks == ()
    site = found.sites[0]
    assert site.module is mha and site.name == "" and site.layer == 0
    assert (site.num_heads, site.num_kv_heads) == (4, 2)
    assert site.head_dim == mha.out_proj.in_features // 4 == 6  # not E // H
    assert found.embeddings == () and found.final_norm is None and found.unembedding is None
    assert found.causal is None and found.width is None and found.position_limit is None


def test_a_sequential_of_layers_has_one_block_per_layer(device: torch.device) -> None:
    stack = nn.Sequential(*[TransformerEncoderLayer(16, 4, 32) for _ in range(3)]).to(device)
    found = model_map(stack)
    assert found.family == "Sequential" and found.num_layers == 3
    assert [b.module for b in found.blocks] == list(stack)
    for i, block in enumerate(found.blocks):
        assert block.module is stack[i] and block.name == str(i) and block.sites == (i,)
        assert block.reusable and block.attention is stack[i].self_attn
        assert block.mlp is stack[i].ff and found.sites[i].module is stack[i].self_attn
    assert found.causal is None and found.final_norm is None and found.embeddings == ()


class _OverridesForward(TransformerEncoderLayer):
    """Overrides forward without declaring its parts again: may keep state."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


class _KeepsForward(TransformerEncoderLayer):
    """A subclass that runs the declaring class's forward."""


class _DeclaresAgain(TransformerEncoderLayer):
    block_parts = BlockParts(attention="self_attn", mlp="ff")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)


class _Impure(TransformerEncoderLayer):
    block_parts = BlockParts(attention="self_attn", mlp="ff", pure=False)


def test_reusable_only_where_the_declared_forward_runs(device: torch.device) -> None:
    layers = [cls(16, 4, 32) for cls in (_OverridesForward, _KeepsForward, _DeclaresAgain, _Impure)]
    stack = nn.Sequential(*layers).to(device)
    found = model_map(stack)
    assert [b.module for b in found.blocks] == layers
    assert [b.reusable for b in found.blocks] == [False, True, True, False]


def test_nested_layers_are_not_reusable(device: torch.device) -> None:
    outer = TransformerEncoderLayer(16, 4, 32)
    outer.inner = TransformerEncoderLayer(16, 4, 32)
    found = model_map(nn.Sequential(outer).to(device))
    assert found.num_layers == 2
    assert not any(b.reusable for b in found.blocks)


def test_nested_layers_give_no_blocks(device: torch.device) -> None:
    outer = TransformerEncoderLayer(16, 4, 32)
    outer.inner = TransformerEncoderLayer(16, 4, 32)
    found = model_map(nn.Sequential(outer).to(device))
    assert found.blocks == ()


def test_a_bare_layer_is_its_own_block(device: torch.device) -> None:
    layer = TransformerEncoderLayer(16, 4, 32).to(device)
    found = model_map(layer)
    assert len(found.blocks) == 1 and found.blocks[0].module is layer
    assert found.blocks[0].attention is layer.self_attn and found.blocks[0].sites == (0,)


# -- transformers models ---------------------------------------------------------------------------


def _build(name: str, device: torch.device) -> Any:
    transformers = _transformers()
    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=50, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
                eos_token_id=0,
            )
        )  # fmt: skip
    elif name == "llama":  # grouped-query: 6 query heads read 2 key/value heads
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=40,
            )
        )  # fmt: skip
    elif name == "bert":
        model = transformers.BertModel(
            transformers.BertConfig(
                vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=36,
            )
        )  # fmt: skip
    else:
        model = transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=50, d_model=24, d_kv=8, d_ff=40, num_layers=2, num_decoder_layers=3,
                num_heads=4, decoder_start_token_id=0,
            )
        )  # fmt: skip
    return model.to(device).eval()


def _takes_use_cache(model: nn.Module) -> bool:
    return "use_cache" in inspect.signature(model.forward).parameters


def test_gpt2_map(device: torch.device) -> None:
    model = _build("gpt2", device)
    c = model.config
    found = model_map(model)
    assert found.family == "gpt2" and found.num_layers == c.n_layer == 3
    h = model.transformer.h
    for i, (site, block) in enumerate(zip(found.sites, found.blocks, strict=True)):
        assert site.module is h[i].attn and site.name == f"transformer.h.{i}.attn"
        assert site.num_heads == site.num_kv_heads == c.n_head
        assert site.head_dim == c.n_embd // c.n_head
        assert block.module is h[i] and block.reusable and block.sites == (i,)
        assert block.attention is h[i].attn and block.mlp is h[i].mlp
    assert found.final_norm is model.transformer.ln_f
    assert found.norm_eps == c.layer_norm_epsilon
    assert found.unembedding is model.lm_head and same(found.base, model.transformer)
    assert found.embeddings[0] is model.transformer.wte
    assert any(e is model.transformer.wpe for e in found.embeddings)
    assert found.width == c.n_embd and found.position_limit == c.n_positions
    assert not found.token_types
    assert _takes_use_cache(model) and dict(found.call_options) == {"use_cache": False}
    assert found.causal is True
    assert not reads_later_tokens(lambda x: model(x).logits, _ids(device, 50), 50)


def test_llama_map_has_grouped_query_heads(device: torch.device) -> None:
    model = _build("llama", device)
    c = model.config
    assert c.num_key_value_heads < c.num_attention_heads
    found = model_map(model)
    assert found.family == "llama" and found.num_layers == c.num_hidden_layers
    layers = model.model.layers
    for i, (site, block) in enumerate(zip(found.sites, found.blocks, strict=True)):
        assert site.module is layers[i].self_attn
        assert site.num_heads == c.num_attention_heads == 6
        assert site.num_kv_heads == c.num_key_value_heads == 2
        assert site.head_dim == c.hidden_size // c.num_attention_heads
        assert block.module is layers[i] and block.reusable and block.sites == (i,)
        assert block.attention is layers[i].self_attn and block.mlp is layers[i].mlp
    assert found.final_norm is model.model.norm and found.norm_eps == c.rms_norm_eps
    assert found.unembedding is model.lm_head and same(found.base, model.model)
    assert found.embeddings[0] is model.model.embed_tokens
    assert found.width == c.hidden_size and found.position_limit == c.max_position_embeddings
    assert not found.token_types
    assert _takes_use_cache(model) and dict(found.call_options) == {"use_cache": False}
    assert found.causal is True
    assert not reads_later_tokens(lambda x: model(x).logits, _ids(device, 50), 50)


def test_transformers_bert_map(device: torch.device) -> None:
    model = _build("bert", device)
    c = model.config
    found = model_map(model)
    assert found.family == "bert" and found.num_layers == c.num_hidden_layers
    layer = model.encoder.layer
    for i, (site, block) in enumerate(zip(found.sites, found.blocks, strict=True)):
        assert site.module is layer[i].attention.self
        assert site.num_heads == site.num_kv_heads == c.num_attention_heads
        assert block.module is layer[i] and block.reusable and block.sites == (i,)
    assert found.final_norm is None and found.unembedding is None and same(found.base, model)
    assert found.embeddings[0] is model.embeddings.word_embeddings
    assert any(e is model.embeddings.position_embeddings for e in found.embeddings)
    assert found.width == c.hidden_size and found.position_limit == c.max_position_embeddings
    assert found.token_types is True
    want = {"use_cache": False} if _takes_use_cache(model) else {}
    assert dict(found.call_options) == want
    assert found.causal is False
    assert reads_later_tokens(lambda x: model(x).last_hidden_state, _ids(device, 50), 50)


def test_t5_map_has_every_site_and_reads_its_encoder(device: torch.device) -> None:
    model = _build("t5", device)
    c = model.config
    found = model_map(model)
    # encoder self-attention, then per decoder block its self- and cross-attention
    assert found.num_layers == c.num_layers + 2 * c.num_decoder_layers == 8
    want = [b.layer[0].SelfAttention for b in model.encoder.block]
    for b in model.decoder.block:
        want += [b.layer[0].SelfAttention, b.layer[1].EncDecAttention]
    assert [s.module for s in found.sites] == want
    assert all(s.module is m for s, m in zip(found.sites, want, strict=True))
    for site in found.sites:
        assert site.num_heads == site.num_kv_heads == c.num_heads and site.head_dim == c.d_kv
    stacks = [*model.encoder.block, *model.decoder.block]
    assert [b.module for b in found.blocks] == stacks
    assert all(b.module is m and b.reusable for b, m in zip(found.blocks, stacks, strict=True))
    assert [b.sites for b in found.blocks] == [(0,), (1,), (2, 3), (4, 5), (6, 7)]
    assert same(found.base, model.encoder) and same(found.base, model.get_encoder())
    assert found.unembedding is model.lm_head
    assert found.width == c.d_model and found.position_limit is None  # relative positions
    assert not found.token_types
    assert _takes_use_cache(model) and dict(found.call_options) == {"use_cache": False}
    assert found.causal is False
    ids = _ids(device, 50)
    assert reads_later_tokens(lambda x: model.encoder(input_ids=x).last_hidden_state, ids, 50)


def test_t5_block_attention_is_a_module_that_runs(device: torch.device) -> None:
    model = _build("t5", device)
    for block, module in zip(model_map(model).blocks, model.encoder.block, strict=False):
        assert (
            block.attention is module.layer[0] or block.attention is module.layer[0].SelfAttention
        )


def test_gpt2_site_dropout_is_the_configs(device: torch.device) -> None:
    model = _build("gpt2", device)
    assert model.config.attn_pdrop > 0
    assert all(s.dropout == model.config.attn_pdrop for s in model_map(model).sites)


# -- the cache -------------------------------------------------------------------------------------


def _gpt2_modules(model: nn.Module) -> list[nn.Module]:
    return [b.attn for b in model.transformer.h]  # type: ignore[union-attr]


@pytest.mark.parametrize("kind", ["multihead", "transformers"])
def test_the_map_is_kept_rebuilt_on_request_and_a_copy_gets_its_own(
    kind: str, device: torch.device
) -> None:
    model: Any = _lm(device) if kind == "multihead" else _build("gpt2", device)
    attention: Callable[[Any], list[nn.Module]] = (
        (lambda m: [b.self_attn for b in m.blocks]) if kind == "multihead" else _gpt2_modules
    )
    first = model_map(model)
    assert model_map(model) is first and multihead.model_map(model) is first
    rebuilt = model_map(model, rebuild=True)
    assert rebuilt is not first and model_map(model) is rebuilt
    assert [s.module for s in rebuilt.sites] == attention(model)
    twin = copy.deepcopy(model)
    theirs = model_map(twin)
    assert theirs is not rebuilt
    assert all(s.module is m for s, m in zip(theirs.sites, attention(twin), strict=True))
    assert not any(s.module is m for s, m in zip(theirs.sites, attention(model), strict=True))
    own = dict(twin.named_modules())
    assert all(own[b.name] is b.module for b in theirs.blocks) and len(theirs.blocks) == 3
    assert model_map(model) is rebuilt  # the original keeps its own


def test_rebuild_sees_a_replaced_block(device: torch.device) -> None:
    lm = _lm(device)
    before = model_map(lm)
    lm.blocks[1] = TransformerEncoderLayer(24, 4, 40, num_kv_heads=2).to(device)
    assert model_map(lm) is before  # kept until asked to rebuild
    after = model_map(lm, rebuild=True)
    assert (
        after.blocks[1].module is lm.blocks[1] and after.sites[1].module is lm.blocks[1].self_attn
    )


@pytest.mark.parametrize("kind", ["multihead", "transformers"])
def test_a_mapped_model_can_be_garbage_collected(kind: str, device: torch.device) -> None:
    model: Any = _lm(device) if kind == "multihead" else _build("gpt2", device)
    vocab = V if kind == "multihead" else 50
    assert model_map(model).num_layers == 3
    with torch.no_grad(), multihead.capture(model) as rec:
        model(_ids(device, vocab))
    assert len(rec.weights) == 3
    gone = weakref.ref(model)
    del model, rec
    gc.collect()
    assert gone() is None


def test_model_map_refuses_what_is_not_a_module() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        model_map("gpt2")  # type: ignore[arg-type]


# -- text models: load_text_model without a probe, head="lm", texts in the circuit functions -------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random GPT-2, Llama (grouped-query) and BERT directories with their tokenizer.json
    (test_hf_explain's families, saved with save_pretrained)."""
    _transformers()
    pytest.importorskip("tokenizers")
    from test_hf_explain import BY_NAME, save_family

    return {
        name: save_family(BY_NAME[name], tmp_path_factory.mktemp(name))
        for name in ("gpt2", "llama", "bert")
    }


@pytest.mark.parametrize(
    ("name", "backend"),
    [("gpt2", None), ("llama", None), ("bert", "transformers"), ("bert", "multihead")],
)
def test_load_text_model_runs_no_forward(
    saved: dict[str, Path], name: str, backend: str | None, device: torch.device
) -> None:
    transformers = _transformers()
    calls: list[str] = []
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: calls.append(type(module).__name__)
    )
    try:
        text_model = multihead.load_text_model(saved[name], backend=backend, device=device)
        during_load = list(calls)
        batch = text_model.tokenize("The cat sat on the mat")
        with torch.no_grad():
            text_model(batch.input_ids, batch.attention_mask)
    finally:
        handle.remove()
    assert during_load == []
    assert len(calls) > 0  # the hook sees a forward: none ran during the load
    config = transformers.AutoConfig.from_pretrained(saved[name])
    assert text_model.num_layers == config.num_hidden_layers
    assert text_model.num_heads == config.num_attention_heads
    assert text_model.hidden_size == config.hidden_size
    assert text_model.causal is (name != "bert")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_lm_head_gives_the_models_own_logits(
    saved: dict[str, Path], name: str, device: torch.device
) -> None:
    transformers = _transformers()
    with_head = multihead.load_text_model(saved[name], head="lm", device=device)
    plain = multihead.load_text_model(saved[name], device=device)
    assert with_head.head == "lm" and plain.head is None
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved[name]).to(device).eval()
    vocab = reference.config.vocab_size
    ids = torch.randint(4, vocab, (2, 9), generator=generator(5, device), device=device)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding: the real positions do not read it
    with torch.no_grad():
        got = with_head(ids, mask)
        want = reference(input_ids=ids, attention_mask=mask)
        base = reference.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert got.logits.shape == want.logits.shape == (2, 9, vocab)
    torch.testing.assert_close(got.logits[real], want.logits[real], rtol=0, atol=1e-5)
    with torch.no_grad():
        hidden = with_head.hidden_states(ids, mask)
    torch.testing.assert_close(hidden[real], base[real], rtol=0, atol=1e-5)
    texts = ["The cat sat on the mat", "A dog ran across the road to catch the ball."]
    torch.testing.assert_close(with_head.encode(texts), plain.encode(texts))
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved[name])
    for text in texts:
        want_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert with_head.token_ids(text) == plain.token_ids(text) == want_ids


def test_lm_head_is_refused_where_there_is_none(
    saved: dict[str, Path], device: torch.device
) -> None:
    with pytest.raises(ValueError, match="head"):
        multihead.load_text_model(saved["gpt2"], head="lm", backend="multihead")
    with pytest.raises(ValueError, match="head"):
        multihead.load_text_model(saved["bert"], head="lm", backend="multihead")
    with warnings.catch_warnings():
        # transformers' BERT LM head is not in the files: said by a warning before the refusal
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match="head"):
            multihead.load_text_model(saved["bert"], head="lm", device=device)


def test_text_model_refuses_an_unknown_head(device: torch.device) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tiny_bert import tokenizer_json

    bert = _tiny_bert(device)
    tokenizer = tokenizers.Tokenizer.from_str(tokenizer_json())
    with pytest.raises(ValueError, match="head"):
        multihead.TextModel(bert, tokenizer, head="xyz")
    with pytest.raises(ValueError, match="head"):  # multihead's BERT has no LM head
        multihead.TextModel(bert, tokenizer, head="lm")
    text_model = multihead.TextModel(bert, tokenizer)
    found = model_map(text_model)  # the wrapper's map: the model's sites, named under it
    layers = bert.encoder.layers
    assert [s.module for s in found.sites] == [layer.self_attn for layer in layers]
    assert [s.name for s in found.sites] == [f"model.encoder.layers.{i}.self_attn" for i in (0, 1)]
    own = dict(text_model.named_modules())
    assert all(own[s.name] is s.module for s in found.sites)
    assert all(own[b.name] is b.module for b in found.blocks) and len(found.blocks) == 2


CLEAN = "The cat sat on the mat"
CORRUPT = "The mat sat on the cat"  # as many tokens (checked below)


def _logit_diff(output: Any) -> Tensor:
    logits = output.logits if hasattr(output, "logits") else output
    return logits[:, -1, 5] - logits[:, -1, 7]


def test_patch_heads_takes_texts_for_a_text_model(
    saved: dict[str, Path], device: torch.device
) -> None:
    transformers = _transformers()
    text_model = multihead.load_text_model(saved["gpt2"], head="lm", device=device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved["gpt2"])

    def tokens(texts: str | list[str]) -> dict[str, Tensor]:
        batch = tokenizer(texts, return_tensors="pt")  # no padding needed: equal lengths
        return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}

    clean, corrupt = tokens(CLEAN), tokens(CORRUPT)
    assert clean["input_ids"].shape == corrupt["input_ids"].shape == (1, 10)
    assert not torch.equal(clean["input_ids"], corrupt["input_ids"])
    got = multihead.patch_heads(text_model, CLEAN, CORRUPT, _logit_diff).values
    want = multihead.patch_heads(text_model, clean, corrupt, _logit_diff).values
    assert got.shape == (2, 4)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert float(got.abs().max()) > 0  # the pair differs where it matters
    # transformers' own model on the same ids: the same effects
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved["gpt2"]).to(device).eval()
    theirs = multihead.patch_heads(reference, clean, corrupt, _logit_diff).values
    torch.testing.assert_close(got, theirs, rtol=0, atol=1e-5)
    # lists of texts (of one token count each, so that no padding enters)
    cleans, corrupts = [CLEAN, "The cat sat in the sun"], [CORRUPT, "The cat sat on the sun"]
    many = multihead.patch_heads(text_model, cleans, corrupts, _logit_diff).values
    clean_ids, corrupt_ids = tokens(cleans), tokens(corrupts)
    assert clean_ids["input_ids"].shape == corrupt_ids["input_ids"].shape == (2, 10)
    torch.testing.assert_close(
        many,
        multihead.patch_heads(text_model, clean_ids, corrupt_ids, _logit_diff).values,
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match="same shape"):
        multihead.patch_heads(text_model, CLEAN, "The dog sat on the mat", _logit_diff)


def test_a_text_for_a_model_that_reads_no_text_is_a_type_error(device: torch.device) -> None:
    lm = _lm(device)
    ids = _ids(device)
    with pytest.raises(TypeError, match=r"\bclean\b.*text"):
        multihead.patch_heads(lm, "one text", "two texts", _logit_diff)
    with pytest.raises(TypeError, match=r"\bcorrupt\b.*text"):
        multihead.patch_heads(lm, ids, ["two texts"], _logit_diff)
    with pytest.raises(TypeError, match=r"\bclean\b"):
        multihead.path_patching(lm, "one text", "two texts", _logit_diff, [(0, 1)], [(1, 0)])


def test_the_map_holds_each_sites_window_and_the_stream_keyword() -> None:
    """A sliding window is a site's fact, declared by hf/: Mistral's window on every layer,
    Gemma-2's on its local layers alone (its global ones None), none on Llama; transformers'
    layers take the stream by ``hidden_states``, read and written by the map alone."""
    transformers = pytest.importorskip("transformers", minversion="5")
    common = dict(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    mistral = transformers.MistralForCausalLM(
        transformers.MistralConfig(**common, sliding_window=6)
    )
    gemma = transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**common, head_dim=8, sliding_window=5)
    )
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    assert [s.window for s in multihead.model_map(mistral).sites] == [6, 6, 6, 6]
    local = [layer.self_attn.sliding_window for layer in gemma.model.layers]  # the reference
    assert [s.window for s in multihead.model_map(gemma).sites] == local
    assert None in local and 5 in local
    assert [s.window for s in multihead.model_map(llama).sites] == [None] * 4
    mapped = multihead.model_map(llama)
    x, y = torch.zeros(1, 2, 32), torch.ones(1, 2, 32)
    assert mapped.stream_keyword == "hidden_states"
    assert mapped.stream_of((), {"hidden_states": x, "other": 1}) is x
    assert mapped.stream_of((x, 2), {}) is x and mapped.stream_of((), {}) is None
    args, kwargs = mapped.with_stream((), {"hidden_states": x, "other": 1}, y)
    assert args == () and kwargs["hidden_states"] is y and kwargs["other"] == 1
    args, kwargs = mapped.with_stream((x, 2), {"k": 3}, y)
    assert args[0] is y and args[1] == 2 and kwargs == {"k": 3}
    own = multihead.model_map(TransformerLM(11, 16, 2, 2, 24, max_len=8))
    assert own.stream_keyword is None and all(s.window is None for s in own.sites)
