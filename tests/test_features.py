"""multihead.sae_features and multihead.feature_sources against outside references.

- ``sae_features`` equals ``sae.encode`` of TransformerLens 4's ``blocks.L.attn.hook_z`` (a
  ``TransformerBridge`` around the same random GPT-2; nothing downloaded), with an SAE SAELens
  itself wrote (tests/data/sae/standard_hook_z, loaded by ``multihead.sae.load``).
- ``feature_sources``: the split sums to the pre-activation computed here from transformers'
  own eager attention (the output projection's input, hooked) through the SAE's formula
  written out below, and each part equals SAEDashboard's direct feature attribution written
  out densely from TransformerLens-style tensors (v per source × the pattern, times W_enc:
  the (B, dest, src, H·Dv) tensor), in float64, on GPT-2 and a grouped-query Llama, for each
  input normalisation; an attn_out SAE on a tiny Gemma-3 splits through ``o_proj`` and the
  post-attention norm, the norm written out here from the modules' hooked tensors.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import multihead
from multihead.circuits.features.feature_sources import FeatureSources, feature_sources
from multihead.circuits.features.sae_features import sae_features
from multihead.mapping import model_heads
from multihead.sae import SAE, SAEConfig

transformers = pytest.importorskip("transformers", minversion="5")

DATA = Path(__file__).parent / "data" / "sae"
V = 50
EPS = 1e-5  # sae_lens/saes/sae.py run_time_activation_ln_in


def _perturbed(model: Any, dtype: torch.dtype) -> tuple[Any, Any]:
    """(the model for multihead, an eager copy for the references): every weight, bias and
    norm gain perturbed (transformers zeroes biases, which would hide a bias mistake)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model = model.to(dtype).eval()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return model, eager


def _gpt2(dtype: torch.dtype = torch.float32, width: int = 24, heads: int = 4) -> tuple[Any, Any]:
    config = transformers.GPT2Config(
        vocab_size=V, n_embd=width, n_layer=2, n_head=heads, n_positions=40, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return _perturbed(transformers.GPT2LMHeadModel(config), dtype)


def _llama(dtype: torch.dtype = torch.float64) -> tuple[Any, Any]:
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=40,
        attention_bias=True,
    )  # fmt: skip
    return _perturbed(transformers.LlamaForCausalLM(config), dtype)


def _gemma3(dtype: torch.dtype = torch.float64) -> tuple[Any, Any]:
    config = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=40,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    return _perturbed(transformers.Gemma3ForCausalLM(config), dtype)


def _sae(
    d_in: int,
    hook: str | None,
    *,
    d_sae: int = 10,
    normalize: str = "none",
    reshape: str = "none",
    head_index: int | None = None,
    architecture: str = "standard",
    dtype: torch.dtype = torch.float64,
) -> SAE:
    """A random SAE through the class's constructor, every bias nonzero."""
    config = SAEConfig(
        architecture=architecture, d_in=d_in, d_sae=d_sae, d_out=d_in, dtype=dtype,
        apply_b_dec_to_input=True, normalize_activations=normalize, reshape_activations=reshape,
        hook_name=hook, hook_head_index=head_index,
    )  # fmt: skip
    tensors = {
        name: torch.randn(shape, dtype=dtype) for name, shape in config.tensor_shapes().items()
    }
    return SAE(config.check("test"), tensors)


def _normalised(x: Tensor, normalize: str) -> Tensor:
    """The SAE's input normalisation, SAELens's formulas (sae_lens/saes/sae.py)."""
    if normalize == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        return (x - mu) / ((x - mu).std(-1, keepdim=True) + EPS)
    if normalize == "constant_norm_rescale":
        return x * math.sqrt(x.shape[-1]) / x.norm(dim=-1, keepdim=True)
    return x


def _pre_activation(sae: SAE, x: Tensor) -> Tensor:
    """x (..., E) -> (..., F): x' @ W_enc + b_enc, x' = norm_in(x) - b_dec."""
    return (_normalised(x, sae.normalize_activations) - sae.b_dec) @ sae.W_enc + sae.b_enc


def _frozen_columns(sae: SAE, x: Tensor) -> tuple[Tensor, Tensor]:
    """(E, F) the encoder's columns as a part of x reads them, and the row factor (B, T): the
    normalisation frozen at each row (layer_norm: columns centred, / (σ + eps); constant norm:
    √E / ‖x‖)."""
    w = sae.W_enc
    if sae.normalize_activations == "layer_norm":
        centred = x - x.mean(-1, keepdim=True)
        return w - w.mean(0, keepdim=True), 1 / (centred.std(-1) + EPS)
    if sae.normalize_activations == "constant_norm_rescale":
        return w, math.sqrt(x.shape[-1]) / x.norm(dim=-1)
    return w, torch.ones(x.shape[:-1], dtype=x.dtype)


def _keep(got: dict[str, Tensor], name: str, value: Tensor) -> None:
    """Keep a hooked tensor (a hook returning None changes nothing)."""
    got.setdefault(name, value)


def _eager_run(eager: Any, ids: Tensor, layer: int, **kwargs: Any) -> dict[str, Tensor]:
    """transformers' own eager run: the pattern (B, H, T, S), the values (B, S, Hk, Dv) and
    the output projection's input z (B, T, H·Dv) of ``layer``, hooked on its modules."""
    attention = eager.transformer.h[layer].attn if hasattr(eager, "transformer") else (
        eager.model.layers[layer].self_attn
    )  # fmt: skip
    got: dict[str, Tensor] = {}
    if hasattr(attention, "c_attn"):  # GPT-2: c_attn gives q, k, v side by side
        width = eager.config.n_embd
        hooks = [
            attention.c_attn.register_forward_hook(
                lambda m, a, out: _keep(got, "v", out[..., 2 * width :])
            ),
            attention.c_proj.register_forward_pre_hook(lambda m, a: _keep(got, "z", a[0])),
        ]
        dv = width // eager.config.n_head
    else:
        hooks = [
            attention.v_proj.register_forward_hook(lambda m, a, out: _keep(got, "v", out)),
            attention.o_proj.register_forward_pre_hook(lambda m, a: _keep(got, "z", a[0])),
        ]
        dv = attention.head_dim
    with torch.no_grad():
        out = eager(ids, output_attentions=True, **kwargs)
    for h in hooks:
        h.remove()
    got["v"] = got["v"].unflatten(-1, (-1, dv))  # (B, S, Hk, Dv)
    got["pattern"] = out.attentions[layer]
    return got


def _dfa(sae: SAE, pattern: Tensor, v: Tensor, z: Tensor) -> Tensor:
    """SAEDashboard's direct feature attribution written out densely: (B, dest, src, H, F).

    v per source (B, S, Hk, Dv) repeated to the query heads (B, S, H, Dv), times the pattern
    (B, H, dest, src): the (B, dest, src, H·Dv) tensor whose sum over src is z; times the
    encoder's columns (normalisation frozen at dest), per head."""
    h = pattern.shape[1]
    v = v.repeat_interleave(h // v.shape[2], dim=2)  # (B, S, H, Dv)
    weighted = pattern.permute(0, 2, 3, 1)[..., None] * v[:, None]  # (B, dest, src, H, Dv)
    columns, factor = _frozen_columns(sae, z)
    per_head = columns.view(h, v.shape[-1], -1)  # (H, Dv, F)
    dfa = (weighted[..., None] * per_head).sum(-2)  # (B, dest, src, H, F)
    return dfa * factor[:, :, None, None, None]


# -- (a) sae_features: TransformerLens's hook_z through SAELens's own SAE ---------------------


def test_sae_features_equal_encode_of_transformer_lens_hook_z() -> None:
    pytest.importorskip("transformer_lens")
    sources = pytest.importorskip("transformer_lens.model_bridge.sources")
    if not hasattr(sources, "build_bridge_from_module"):
        pytest.skip("TransformerLens before 4.0 has no TransformerBridge")
    sae = multihead.sae.load(DATA / "standard_hook_z")  # SAELens wrote it: blocks.1.attn.hook_z
    assert (sae.site, sae.d_in, sae.reshape_activations) == (("z", 1), 12, "hook_z")
    model, _ = _gpt2(torch.float32, width=12, heads=3)  # 3 heads of 4: H·Dv = 12
    bridge = sources.build_bridge_from_module(
        copy.deepcopy(model), "GPT2LMHeadModel", hf_config=model.config
    )
    ids = torch.randint(V, (2, 9))
    _, theirs = bridge.run_with_cache(ids)
    for layer, positions in ((None, None), (0, [-1, 2])):
        hook_z = theirs[f"blocks.{1 if layer is None else layer}.attn.hook_z"]  # (B, T, H, Dv)
        expected = sae.encode(hook_z)
        if positions is not None:
            expected = expected[:, [ids.shape[1] - 1, 2]]
        got = sae_features(model, {"input_ids": ids}, sae, layer=layer, positions=positions)
        assert got.shape == expected.shape == (2, 9 if positions is None else 2, sae.d_sae)
        assert 0 < int((expected != 0).sum()) < expected.numel()  # some fire, some do not
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_sae_features_of_a_residual_site_and_one_head() -> None:
    model, eager = _gpt2(torch.float64)
    ids = torch.randint(V, (2, 7))
    got = _eager_run(eager, ids, 1)
    resid = _sae(24, "blocks.1.hook_resid_pre")
    with torch.no_grad():
        hidden = eager(ids, output_hidden_states=True).hidden_states[1]  # block 1's input
    torch.testing.assert_close(
        sae_features(model, ids, resid), resid.encode(hidden), rtol=0, atol=1e-10
    )
    flat = _sae(24, "blocks.1.attn.hook_z")  # Gemma Scope 2's: z, its heads flattened by us
    expected = torch.relu(_pre_activation(flat, got["z"]))
    torch.testing.assert_close(sae_features(model, ids, flat), expected, rtol=0, atol=1e-10)
    one = _sae(6, "blocks.1.attn.hook_z", reshape="hook_z", head_index=2)
    z = got["z"].unflatten(-1, (4, 6))[:, :, 2]  # head 2 alone (B, T, Dv)
    expected = torch.relu(_pre_activation(one, z))
    torch.testing.assert_close(sae_features(model, ids, one), expected, rtol=0, atol=1e-10)


def test_a_transcoder_reads_hook_mlp_in_the_stream_the_feed_forward_norm_reads() -> None:
    """TransformerLens's hook_mlp_in is its copy of resid_mid: what Llama's pre-feed-forward
    norm (``post_attention_layernorm``) is given, read here by a hook of the eager copy."""
    model, eager = _llama()
    ids = torch.randint(V, (2, 7))
    seen: list[Tensor] = []
    norm = eager.model.layers[1].post_attention_layernorm
    handle = norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():
        eager(ids)
    handle.remove()
    config = SAEConfig(
        architecture="transcoder", d_in=24, d_sae=10, d_out=16, dtype=torch.float64,
        hook_name="blocks.1.hook_mlp_in", hook_name_out="blocks.1.hook_mlp_out",
    ).check("test")  # fmt: skip
    tensors = {
        n: torch.randn(shape, dtype=torch.float64) for n, shape in config.tensor_shapes().items()
    }
    transcoder = SAE(config, tensors)
    assert (transcoder.site, transcoder.site_out) == (("resid_mid", 1), ("mlp_out", 1))
    expected = torch.relu(seen[0] @ transcoder.W_enc + transcoder.b_enc)  # no b_dec: its output's
    assert bool((expected > 0).any())
    # eager's softmax runs in float32 (transformers' eager_attention_forward): 1e-6, not 1e-10
    torch.testing.assert_close(sae_features(model, ids, transcoder), expected, rtol=0, atol=1e-6)


def test_an_sae_of_queries_before_the_turn_is_refused_on_a_rotary_model() -> None:
    """TransformerLens's hook_q is before rotary positions, which multihead does not keep: an
    SAE of it is refused as the cache refuses the name; hook_rot_q (multihead's q) is read."""
    model, _ = _llama()
    ids = torch.randint(V, (1, 5))
    with pytest.raises(ValueError, match=r"'blocks\.1\.attn\.hook_q': layer 1 turns its queries"):
        sae_features(model, ids, _sae(4, "blocks.1.attn.hook_q", head_index=0))
    after = _sae(4, "blocks.1.attn.hook_rot_q", head_index=0)
    q = multihead.cache(model, ids, names=[("q", 1)])["q", 1][:, :, 0]  # (B, T, D): head 0
    torch.testing.assert_close(
        sae_features(model, ids, after), torch.relu(_pre_activation(after, q))
    )


# -- (b) feature_sources on z: the sum, and SAEDashboard's DFA -----------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("normalize", ["none", "layer_norm", "constant_norm_rescale"])
def test_feature_sources_of_z_equal_the_dense_dfa(family: str, normalize: str) -> None:
    model, eager = _gpt2(torch.float64) if family == "gpt2" else _llama(torch.float64)
    h = model.config.num_attention_heads
    layer, t = 1, 32
    sae = _sae(24, f"blocks.{layer}.attn.hook_z", normalize=normalize, reshape="hook_z")
    ids = torch.randint(V, (2, t))
    rows, features = [5, -1, 0], [3, 0, 7]
    split = feature_sources(model, ids, sae, features, rows=rows)
    assert isinstance(split, FeatureSources)
    assert split.values.shape == (2, 3, h, t, 3)
    assert (split.rows, split.features) == ((5, t - 1, 0), (3, 0, 7))
    assert split.heads == tuple(f"L1H{i}" for i in range(h))
    assert split.tokens is None

    ref = _eager_run(eager, ids, layer)
    at = [5, t - 1, 0]
    z = ref["z"]  # (B, T, H·Dv): the output projection's input
    pre = _pre_activation(sae, z)[:, at][..., features]  # (B, R, F')
    # the formula written here is the SAE's: its features are relu of it
    torch.testing.assert_close(
        torch.relu(_pre_activation(sae, z)), sae.encode(z.unflatten(-1, (h, -1)))
    )
    scale = float(pre.abs().max())
    torch.testing.assert_close(split.pre_activation, pre, rtol=0, atol=1e-5 * scale)
    constant = sae.b_enc - sae.b_dec @ sae.W_enc  # (F,)
    torch.testing.assert_close(
        split.values.sum((2, 3)), pre - constant[features], rtol=0, atol=1e-5 * scale
    )
    torch.testing.assert_close(
        split.constant, constant[features].expand(2, 3, 3), rtol=0, atol=1e-5 * scale
    )
    torch.testing.assert_close(split.total(), pre, rtol=0, atol=1e-5 * scale)

    dfa = _dfa(sae, ref["pattern"], ref["v"], z)[:, at][..., features]  # (B, R, S, H, F')
    torch.testing.assert_close(split.values, dfa.transpose(2, 3), rtol=0, atol=1e-6)
    # causal: a row's later sources have no part, and its earlier ones do
    assert bool((split.values[:, 0, :, 6:] == 0).all())
    assert bool((split.values[:, 0, :, :6] != 0).any(-1).any(-1).all())


def test_a_padded_source_has_no_part() -> None:
    model, eager = _gpt2(torch.float64)
    sae = _sae(24, "blocks.0.attn.hook_z", reshape="hook_z")
    ids = torch.randint(V, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 2:4] = 0  # two padded sources in the second example
    split = feature_sources(model, {"input_ids": ids, "attention_mask": mask}, sae, 1, rows=[-1, 5])
    assert bool((split.values[1, :, :, 2:4] == 0).all())
    assert bool((split.values[0, :, :, 2:4] != 0).any())
    ref = _eager_run(eager, ids, 0, attention_mask=mask)
    pre = _pre_activation(sae, ref["z"])[:, [7, 5]][..., [1]]
    torch.testing.assert_close(split.total(), pre, rtol=0, atol=1e-8)


def test_a_text_model_gives_its_tokens_and_its_padding_no_part() -> None:
    pytest.importorskip("tokenizers")
    from tiny_bert import tokenizer_json
    from tokenizers import Tokenizer

    from multihead.text.model import TextModel

    model, eager = _gpt2(torch.float64)
    text_model = TextModel(model, Tokenizer.from_str(tokenizer_json()))
    sae = _sae(24, "blocks.1.attn.hook_z", reshape="hook_z", normalize="layer_norm")
    texts = ["the cat sat", "a dog"]  # the second is padded by one token
    split = feature_sources(text_model, texts, sae, [2, 5], rows=[3])
    assert split.tokens == (
        ("[CLS]", "the", "cat", "sat", "[SEP]"),
        ("[CLS]", "a", "dog", "[SEP]", ""),
    )
    assert bool((split.values[1, :, :, 4] == 0).all())  # the padding
    assert bool((split.values[0, :, :, :4] != 0).all())
    batch = text_model.tokenize(texts)
    ref = _eager_run(eager, batch.input_ids, 1, attention_mask=batch.attention_mask)
    pre = _pre_activation(sae, ref["z"])[:, [3]][..., [2, 5]]
    torch.testing.assert_close(split.pre_activation, pre, rtol=0, atol=1e-8)
    torch.testing.assert_close(split.total(), pre, rtol=0, atol=1e-8)
    assert {e["token"] for e in split.to_rows() if e["example"] == 1} == {
        "[CLS]",
        "a",
        "dog",
        "[SEP]",
        "",
    }


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_feature_sources_in_float32(family: str) -> None:
    """The model and the SAE in float32: the split still sums to the pre-activation to 1e-5
    of its size."""
    model, eager = _gpt2(torch.float32) if family == "gpt2" else _llama(torch.float32)
    sae = _sae(
        24, "blocks.0.attn.hook_z", reshape="hook_z", normalize="layer_norm", dtype=torch.float32
    )
    ids = torch.randint(V, (2, 16))
    split = feature_sources(model, ids, sae, list(range(10)), rows=[15, 4])
    assert split.values.dtype == torch.float32
    pre = _pre_activation(sae, _eager_run(eager, ids, 0)["z"])[:, [15, 4]]
    scale = float(pre.abs().max())
    constant = sae.b_enc - sae.b_dec @ sae.W_enc
    torch.testing.assert_close(split.pre_activation, pre, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(split.values.sum((2, 3)), pre - constant, rtol=0, atol=1e-5 * scale)


def test_one_head_sae_splits_over_its_sources() -> None:
    model, eager = _gpt2(torch.float64)
    sae = _sae(6, "blocks.1.attn.hook_z", reshape="hook_z", head_index=3, normalize="layer_norm")
    ids = torch.randint(V, (1, 10))
    split = feature_sources(model, ids, sae, [0, 4], rows=[9, 3])
    assert split.heads == ("L1H3",)
    assert split.values.shape == (1, 2, 1, 10, 2)
    ref = _eager_run(eager, ids, 1)
    z = ref["z"].unflatten(-1, (4, 6))[:, :, 3]  # (B, T, Dv)
    pre = _pre_activation(sae, z)[:, [9, 3]][..., [0, 4]]
    torch.testing.assert_close(split.pre_activation, pre, rtol=0, atol=1e-8)
    torch.testing.assert_close(split.total(), pre, rtol=0, atol=1e-8)
    columns, factor = _frozen_columns(sae, z)
    v = ref["v"][:, :, 3]  # (B, S, Dv): head 3's own values
    expected = torch.einsum("brs,bsd,df->brsf", ref["pattern"][:, 3][:, [9, 3]], v, columns)
    expected = expected * factor[:, [9, 3], None, None]
    torch.testing.assert_close(split.values[:, :, 0], expected[..., [0, 4]], rtol=0, atol=1e-10)


# -- (c) an attn_out SAE on Gemma-3: through o_proj and the post-attention norm ---------------


@pytest.mark.parametrize("layer", [0, 1])  # 0 slides a window of 4 tokens, 1 sees them all
@pytest.mark.parametrize("normalize", ["none", "layer_norm"])
def test_attn_out_sae_splits_through_the_post_attention_norm(layer: int, normalize: str) -> None:
    model, eager = _gemma3(torch.float64)
    h, dv, t = 4, 8, 12
    sae = _sae(24, f"blocks.{layer}.hook_attn_out", normalize=normalize)
    ids = torch.randint(V, (2, t))
    at, features = [11, 6], [2, 9]
    split = feature_sources(model, ids, sae, features, rows=at)
    assert split.values.shape == (2, 2, h, t, 2)

    block = eager.model.layers[layer]
    got: dict[str, Tensor] = {}
    hooks = [
        block.self_attn.o_proj.register_forward_pre_hook(lambda m, a: _keep(got, "z", a[0])),
        block.post_attention_layernorm.register_forward_hook(
            lambda m, a, out: got.update(y=a[0], x=out)
        ),
    ]
    with torch.no_grad():
        eager(ids)
    for hook in hooks:
        hook.remove()
    x = got["x"]  # (B, T, E): attn_out, the post-attention norm's output
    pre = _pre_activation(sae, x)[:, at][..., features]
    scale = float(pre.abs().max())
    torch.testing.assert_close(split.pre_activation, pre, rtol=0, atol=1e-5 * scale)
    constant = (sae.b_enc - sae.b_dec @ sae.W_enc)[features]  # Gemma: no o_proj bias, no β
    torch.testing.assert_close(split.values.sum((2, 3)), pre - constant, rtol=0, atol=1e-5 * scale)
    # each head's own share: its slice of o_proj, through Gemma's RMSNorm (1 + w) x / rms(y)
    # with the rms of the whole attention output y frozen, through the frozen SAE input norm
    norm = block.post_attention_layernorm
    rms = (got["y"].pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()  # (B, T, 1)
    weight = block.self_attn.o_proj.weight  # (E, H·Dv)
    columns, factor = _frozen_columns(sae, x)
    for head in range(h):
        written = (
            got["z"][..., head * dv : (head + 1) * dv] @ weight[:, head * dv : (head + 1) * dv].T
        )
        through = (1 + norm.weight) * written / rms  # (B, T, E)
        share = (through @ columns) * factor[..., None]  # (B, T, F)
        torch.testing.assert_close(
            split.values[:, :, head].sum(2), share[:, at][..., features], rtol=0, atol=1e-5 * scale
        )
    if layer == 0:  # the window: row 11 sees sources 8..11 alone
        assert bool((split.values[:, 0, :, :8] == 0).all())
        assert bool((split.values[:, 0, :, 8:] != 0).any())


# -- the result's views --------------------------------------------------------------------------


def test_top_to_rows_and_plot() -> None:
    model, _ = _gpt2(torch.float64)
    sae = _sae(24, "blocks.1.attn.hook_z", reshape="hook_z")
    split = feature_sources(model, torch.randint(V, (1, 6)), sae, [4, 1], rows=[5, 2])
    flat = [
        (split.rows[r], split.heads[hh], s, split.features[f], float(split.values[0, r, hh, s, f]))
        for r in range(2) for hh in range(4) for s in range(6) for f in range(2)
    ]  # fmt: skip
    expected = sorted(flat, key=lambda e: -abs(e[4]))[:5]
    assert split.top(5) == expected
    table = split.to_rows()
    assert len(table) == split.values.numel()
    assert table[0] == {"example": 0, "row": 5, "head": "L1H0", "source": 0, "feature": 4,
                        "value": float(split.values[0, 0, 0, 0, 0])}  # fmt: skip
    assert sum(e["value"] for e in table) == pytest.approx(float(split.values.sum()))
    pytest.importorskip("matplotlib")
    figure = split.plot(row=2, feature=1)
    image = figure.axes[0].images[0].get_array()
    # GPT-2 is causal: row 2 sees sources 0-2 alone, and the picture leaves the rest out
    assert not split.values[0, 1, :, 3:, 1].any()
    assert image is not None and image.shape == (4, 3)
    torch.testing.assert_close(torch.as_tensor(image.data), split.values[0, 1, :, :3, 1].float())
    labels = [t.get_text() for t in figure.axes[0].get_xticklabels()]
    assert labels == ["0", "1", "2"]
    assert split.plot(row=5).axes[0].images[0].get_array().shape == (4, 6)
    with pytest.raises(ValueError, match=r"row must be one of the rows split, \[5, 2\], got 3"):
        split.plot(row=3)


# -- (d) bad inputs: one clear error each, naming the argument -----------------------------------


@pytest.fixture(scope="module")
def gpt2() -> Any:
    torch.manual_seed(0)
    return _gpt2(torch.float64)[0]


Z = "blocks.1.attn.hook_z"
# (SAE, arguments, error, message): feature_sources(gpt2, ids (1, 6), sae, feature=0, rows=[-1])
SOURCES_BAD = [
    (_sae(24, "blocks.1.hook_resid_post"), {}, ValueError, r"resid_post.*cannot be split by"),
    (_sae(24, "blocks.1.hook_mlp_out"), {}, ValueError, r"only an SAE of z \(hook_z\) or at"),
    (
        _sae(24, "blocks.1.ln2.hook_normalized"),
        {},
        ValueError,
        r"sae: this SAE reads 'blocks\.1\.ln2",
    ),
    (_sae(24, None), {}, ValueError, r"sae: this SAE's files name no hook"),
    (
        _sae(24, "blocks.5.attn.hook_z", reshape="hook_z"),
        {},
        ValueError,
        r"layer 5, and the model has 2 attention layers \(0\.\.1\)$",  # it takes no layer=
    ),
    (
        _sae(20, Z, reshape="hook_z"),
        {},
        ValueError,
        r"reads 20 values per position \(d_in\), and z of layer 1 of the model has 24",
    ),
    (
        _sae(24, Z, reshape="hook_z", head_index=4),
        {},
        ValueError,
        r"sae\.hook_head_index index 4 is out of range: there are 4 heads",
    ),
    (_sae(24, Z), {"feature": 10}, ValueError, r"feature index 10 is out of range: there are 10"),
    (_sae(24, Z), {"feature": []}, ValueError, r"feature must name at least one feature"),
    (_sae(24, Z), {"feature": "3"}, TypeError, r"feature must be an int or a sequence of ints"),
    (_sae(24, Z), {"rows": 6}, ValueError, r"rows index 6 is out of range: there are 6 positions"),
    (_sae(24, Z), {"rows": []}, ValueError, r"rows must name at least one destination row"),
    (_sae(24, Z), {"rows": 1.5}, TypeError, r"rows must be an int or a sequence of ints"),
    ("not an sae", {}, TypeError, r"sae must be a multihead\.sae\.SAE"),
]
RESID = "blocks.1.hook_resid_pre"
# (SAE, keyword arguments, error, message): sae_features(gpt2, ids (1, 6), sae, **kwargs)
FEATURES_BAD = [
    (
        _sae(24, "blocks.1.ln2.hook_normalized"),
        {},
        ValueError,
        r"sae_features: sae: this SAE reads 'bl",
    ),
    (_sae(24, None), {"layer": 0}, ValueError, r"this SAE's files name no hook"),
    (
        _sae(20, Z, reshape="hook_z"),
        {},
        ValueError,
        r"reads 20 values per position \(d_in\), and z",
    ),
    (
        _sae(24, RESID),
        {"layer": 2},
        ValueError,
        r"sae_features: layer index 2 is out of range: there are 2 attention layers",
    ),
    (_sae(24, RESID), {"layer": "1"}, TypeError, r"layer must be an int or None"),
    (_sae(24, "hook_embed"), {"layer": 1}, ValueError, r"layer: the SAE reads embed, one activ"),
    (_sae(24, RESID), {"positions": 9}, ValueError, r"positions must be in \[-6, 6\)"),
]


@pytest.mark.parametrize(("sae", "kwargs", "error", "match"), SOURCES_BAD)
def test_feature_sources_bad_inputs(
    gpt2: Any, sae: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    arguments = {"feature": 0, "rows": [-1], **kwargs}
    ids = torch.randint(V, (1, 6))
    with pytest.raises(error, match=match):
        feature_sources(gpt2, ids, sae, arguments["feature"], rows=arguments["rows"])


@pytest.mark.parametrize(("sae", "kwargs", "error", "match"), FEATURES_BAD)
def test_sae_features_bad_inputs(
    gpt2: Any, sae: SAE, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        sae_features(gpt2, torch.randint(V, (1, 6)), sae, **kwargs)


def test_values_handed_per_query_head_read_the_same_split() -> None:
    """A q/k/v editor may hand the keys and values back per query head ((B, H, S, D)): each
    query head then reads its own row of them, and the split is the one without the editor."""
    model, _ = _llama(torch.float64)
    sae = _sae(24, "blocks.1.attn.hook_z", reshape="hook_z")
    ids = torch.randint(V, (2, 12))
    plain = feature_sources(model, ids, sae, [1, 4], rows=[-1, 5])
    site = model_heads(model)[1].attention
    group = model.config.num_attention_heads // model.config.num_key_value_heads

    def per_query_head(call: Any) -> tuple[Tensor, Tensor, Tensor]:
        return call.q, call.k.repeat_interleave(group, 1), call.v.repeat_interleave(group, 1)

    with site.register_qkv_editor(per_query_head):
        edited = feature_sources(model, ids, sae, [1, 4], rows=[-1, 5])
    torch.testing.assert_close(edited.values, plain.values, rtol=0, atol=1e-12)
    torch.testing.assert_close(edited.constant, plain.constant, rtol=0, atol=1e-12)


def test_a_split_that_does_not_add_up_is_an_error() -> None:
    """Heads whose outputs are not Σ_src A v of the call (an edit after attention) are refused,
    never folded into the constant; dropout in training mode is refused before the run."""
    model, _ = _gpt2(torch.float64)
    sae = _sae(24, "blocks.1.attn.hook_z", reshape="hook_z")
    ids = torch.randint(V, (1, 10))
    with multihead.intervene(model, {(1, 2): 3.0}), pytest.raises(ValueError, match="misses"):
        feature_sources(model, ids, sae, 0, rows=-1)
    dropped, _ = _gpt2(torch.float64)
    dropped.config.attn_pdrop = 0.5
    for module in dropped.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    dropped.train()
    with pytest.raises(ValueError, match="eval mode"):
        feature_sources(dropped, ids, sae, 0, rows=-1)
