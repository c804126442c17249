"""multihead.head_circuits: factored QK/OV circuits, composition, copying and SVD, from weights.

References written here, from each model's own parameters read by hand (GPT-2's fused Conv1D
c_attn and c_proj, Llama's q/k/v/o projections with 4 query heads on 2 key/value heads), in
float64: the dense (E, E) circuits and every composition score to 1e-10, with the pre-norms
folded in by hand for ``fold="norm"``; TransformerLens's ``QK``, ``OV`` and
``all_composition_scores`` on the same weights in float32 to 1e-5 (where it installs);
eigenvalues and singular values against torch.linalg on the materialised matrices; the rotary
QK circuit at an offset against the scores the model's own attention computes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from induction_patterns import head_patterns
from torch import nn

import multihead
from multihead import FactoredMatrix

transformers = pytest.importorskip("transformers", minversion="5")

pytestmark = pytest.mark.cpu_only  # weights only: the reads run where the model is


@pytest.fixture(autouse=True)
def _no_grad() -> Any:
    """The references are read off parameters: no graph is wanted."""
    with torch.no_grad():
        yield


def _perturbed(model: nn.Module, dtype: torch.dtype = torch.float64) -> Any:
    """``model`` with every parameter perturbed (initialisation zeroes biases and sets norm
    gains to 1, which would hide a bias or a fold mistake), in ``dtype``, eval mode."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


def tiny_gpt2(dtype: torch.dtype = torch.float64, vocab: int = 100) -> Any:
    config = transformers.GPT2Config(
        vocab_size=vocab, n_embd=64, n_layer=4, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    return _perturbed(transformers.GPT2LMHeadModel(config), dtype)


def tiny_llama(dtype: torch.dtype = torch.float64, **extra: Any) -> Any:
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_bias=True, **extra,
    )  # fmt: skip
    return _perturbed(transformers.LlamaForCausalLM(config), dtype)


# -- the references: each head's W_Q, W_K, W_V (E, D) and W_O (D, E), read by hand ------------


def _gpt2_heads(model: Any, layer: int, fold: str) -> dict[str, list[torch.Tensor]]:
    block = model.transformer.h[layer]
    e, heads = model.config.n_embd, model.config.n_head
    d = e // heads
    w = block.attn.c_attn.weight  # (E, 3E): x @ w = [q | k | v]
    parts = {name: w[:, i * e : (i + 1) * e] for i, name in enumerate("qkv")}
    out = {name: [parts[name][:, h * d : (h + 1) * d] for h in range(heads)] for name in "qkv"}
    out["o"] = [block.attn.c_proj.weight[h * d : (h + 1) * d] for h in range(heads)]
    if fold == "norm":  # LayerNorm: scale the rows by γ, then centre them
        gamma = block.ln_1.weight
        for name in "qkv":
            out[name] = [(gamma[:, None] * m) - (gamma[:, None] * m).mean(0) for m in out[name]]
    return out


def _llama_heads(model: Any, layer: int, fold: str) -> dict[str, list[torch.Tensor]]:
    block = model.model.layers[layer]
    c = model.config
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    d = c.hidden_size // heads
    attn = block.self_attn
    group = heads // kv

    def rows(linear: nn.Linear, i: int) -> torch.Tensor:  # (E, D): x @ it
        return linear.weight[i * d : (i + 1) * d].T

    out = {
        "q": [rows(attn.q_proj, h) for h in range(heads)],
        "k": [rows(attn.k_proj, h // group) for h in range(heads)],
        "v": [rows(attn.v_proj, h // group) for h in range(heads)],
        "o": [attn.o_proj.weight[:, h * d : (h + 1) * d].T for h in range(heads)],
    }
    if fold == "norm":  # RMSNorm: scale the rows by γ
        gamma = block.input_layernorm.weight
        for name in "qkv":
            out[name] = [gamma[:, None] * m for m in out[name]]
    return out


MODELS = {"gpt2": (tiny_gpt2, _gpt2_heads), "llama": (tiny_llama, _llama_heads)}


def _dense_scores(model: Any, read: Any, kind: str, fold: str) -> torch.Tensor:
    """(L, H, L, H) composition scores from dense (E, E) products, NaN where not later."""
    n, h = model.config.num_hidden_layers, model.config.num_attention_heads
    heads = [read(model, layer, fold) for layer in range(n)]
    ov = [[heads[la]["v"][i] @ heads[la]["o"][i] for i in range(h)] for la in range(n)]
    qk = [[heads[la]["q"][i] @ heads[la]["k"][i].T for i in range(h)] for la in range(n)]
    right = {"q": qk, "k": [[m.T for m in row] for row in qk], "v": ov}[kind]
    out = torch.full((n, h, n, h), float("nan"), dtype=torch.float64)
    for l1 in range(n):
        for l2 in range(l1 + 1, n):
            for h1 in range(h):
                for h2 in range(h):
                    a, b = ov[l1][h1], right[l2][h2]
                    out[l1, h1, l2, h2] = torch.linalg.norm(a @ b) / (
                        torch.linalg.norm(a) * torch.linalg.norm(b)
                    )
    return out


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("fold", ["none", "norm"])
def test_circuits_and_composition_equal_dense_references(family: str, fold: str) -> None:
    make, read = MODELS[family]
    model = make()
    circuits = multihead.head_circuits(model, fold=fold)
    for layer in range(4):
        ref = read(model, layer, fold)
        for h in range(4):
            qk, ov = circuits.qk(layer, h), circuits.ov(layer, h)
            assert (qk.ab() - ref["q"][h] @ ref["k"][h].T).abs().max() < 1e-10
            assert (ov.ab() - ref["v"][h] @ ref["o"][h]).abs().max() < 1e-10
    for kind in ("q", "k", "v"):
        got = circuits.composition_scores(kind).scores
        want = _dense_scores(model, read, kind, fold)
        assert torch.equal(got.isnan(), want.isnan()), kind
        assert (got - want).nan_to_num().abs().max() < 1e-10, kind


def test_biases_are_reported_apart() -> None:
    model = tiny_gpt2()
    circuits = multihead.head_circuits(model)
    attn = model.transformer.h[2].attn
    e, d = 64, 16
    bias = attn.c_attn.bias
    qk, ov = circuits.qk(2, 1), circuits.ov(2, 1)
    assert torch.allclose(qk.biases["q"], bias[d : 2 * d], atol=1e-12)
    assert torch.allclose(qk.biases["k"], bias[e + d : e + 2 * d], atol=1e-12)
    assert torch.allclose(ov.biases["v"], bias[2 * e + d : 2 * e + 2 * d], atol=1e-12)
    assert torch.allclose(ov.biases["o"], attn.c_proj.bias, atol=1e-12)
    assert qk.scale == pytest.approx(1 / math.sqrt(d))


def test_grouped_heads_share_their_key_value_heads_weights() -> None:
    circuits = multihead.head_circuits(tiny_llama())
    # query heads 0 and 1 read key/value head 0; 2 and 3 read head 1
    same = [circuits.qk(1, h).b.untyped_storage().data_ptr() for h in range(4)]
    assert circuits.qk(1, 0).b.data_ptr() == circuits.qk(1, 1).b.data_ptr()
    assert circuits.ov(1, 2).a.data_ptr() == circuits.ov(1, 3).a.data_ptr()
    assert circuits.qk(1, 1).b.data_ptr() != circuits.qk(1, 2).b.data_ptr()
    assert len(set(same)) == 1  # one tensor holds every key/value head


# -- rotary: the QK circuit at an offset is the score the forward computes ----------------------


@pytest.mark.parametrize("delta", [0, 1, 5, 17])
def test_rotary_circuit_at_an_offset_is_the_forward_score(delta: int) -> None:
    model = tiny_llama(torch.float32)
    circuits = multihead.head_circuits(model)
    layer, t = 1, 24
    generator = torch.Generator().manual_seed(delta)
    stream = torch.randn(1, t, 64, generator=generator)
    seen: dict[str, Any] = {}
    attn = model.model.layers[layer].self_attn

    def swap(m: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        return args, {**kwargs, "hidden_states": stream}

    def observer(call: multihead.observers.AttentionCall, out: torch.Tensor) -> None:
        seen.update(q=call.q, k=call.k, scale=call.scale)

    site = multihead.model_map(model).sites[layer].attention
    with multihead.observers.registered(
        [attn.register_forward_pre_hook(swap, with_kwargs=True), site.register_observer(observer)]
    ), torch.no_grad():  # fmt: skip
        model(torch.zeros(1, t, dtype=torch.long))
    query = t - 1
    key = query - delta
    for h in range(4):
        circuit = circuits.qk(layer, h, offset=delta)
        want = seen["scale"] * seen["q"][0, h, query] @ seen["k"][0, h // 2, key]
        got = circuit.score(stream[0, query], stream[0, key])
        assert abs(float(got) - float(want)) < 1e-5 * max(1.0, abs(float(want))), (h, got, want)
        assert not circuit.position_free and circuit.offset == delta
    plain = circuits.qk(layer, 0)
    assert plain.position_free and "position-free" in repr(plain)
    if delta:  # the turn is in it: the position-free circuit gives another score
        other = plain.score(stream[0, query], stream[0, key])
        assert abs(float(other) - float(circuits.qk(layer, 0, offset=delta).score(
            stream[0, query], stream[0, key]))) > 1e-4  # fmt: skip


def test_a_model_without_rotary_is_not_position_free() -> None:
    circuits = multihead.head_circuits(tiny_gpt2())
    assert not circuits.qk(0, 0).position_free
    a, b = circuits.qk(0, 0).ab(), circuits.qk(0, 0, offset=7).ab()
    assert torch.equal(a, b)


# -- copying scores and the SVD -------------------------------------------------------------


def test_copying_scores_equal_eigenvalues_of_the_materialised_circuit() -> None:
    model = tiny_gpt2(vocab=100)
    circuits = multihead.head_circuits(model)
    scores = circuits.copying_scores()
    w_e = model.transformer.wte.weight  # (V, E)
    w_u = model.lm_head.weight.T  # (E, V)
    for layer in range(4):
        ref = _gpt2_heads(model, layer, "none")
        for h in range(4):
            full = w_e @ ref["v"][h] @ ref["o"][h] @ w_u  # (V, V)
            eig = torch.linalg.eigvals(full)
            want = float(eig.sum().real / eig.abs().sum())
            assert abs(float(scores.values[layer, h]) - want) < 1e-6, (layer, h)
    top = scores.top(3)
    assert [s for _, s in top] == sorted((s for _, s in top), reverse=True)
    assert len(scores.to_rows()) == 16


def test_singular_values_equal_a_dense_svd() -> None:
    model = tiny_llama()
    circuits = multihead.head_circuits(model, fold="norm")
    for which in ("ov", "qk"):
        circuit = circuits.ov(2, 3) if which == "ov" else circuits.qk(2, 3)
        got = circuits.svd(2, 3, which=which)
        want = torch.linalg.svdvals(circuit.ab())[: got.values.shape[0]]
        assert (got.values - want).abs().max() < 1e-6
        u, s, vh = circuit.svd()
        assert (u @ torch.diag(s) @ vh - circuit.ab()).abs().max() < 1e-10
    first = got.subspaces[0]
    assert len(first.right_tokens) == 10 and len(first.negative_right_tokens) == 10
    logits = first.right[:, 0] @ circuits._unembedding()
    assert first.right_tokens[0] == int(logits.argmax())


def test_equal_singular_values_are_one_subspace() -> None:
    model = tiny_gpt2()
    attn = model.transformer.h[1].attn
    e, d = 64, 16
    generator = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(e, d, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(e, d, generator=generator, dtype=torch.float64))
    values = torch.tensor([3.0, 3.0] + [2.0 - 0.1 * i for i in range(d - 2)], dtype=torch.float64)
    with torch.no_grad():  # head 0's OV circuit := u diag(values) vᵀ
        attn.c_attn.weight[:, 2 * e : 2 * e + d] = u * values
        attn.c_proj.weight[:d] = v.T
    got = multihead.head_circuits(model).svd(1, 0, which="ov")
    first = got.subspaces[0]
    assert first.dim == 2 and len(got.subspaces) == d - 1
    assert (first.projector("left") - u[:, :2] @ u[:, :2].T).abs().max() < 1e-6
    assert (first.projector("right") - v[:, :2] @ v[:, :2].T).abs().max() < 1e-6
    assert first.negative_left_tokens == ()  # a subspace has no sign
    with pytest.raises(ValueError, match="side must be"):
        first.projector("up")


# -- TransformerLens on the same weights ----------------------------------------------------


def _bridge(model: nn.Module, architecture: str, fold: str) -> Any:
    sources = pytest.importorskip("transformer_lens.model_bridge.sources")
    wrapped: Any = copy.deepcopy(model)
    bridge = sources.build_bridge_from_module(wrapped, architecture, hf_config=wrapped.config)
    if fold == "norm":
        bridge.enable_compatibility_mode(
            disable_warnings=True, fold_ln=True, center_writing_weights=False,
            center_unembed=False, fold_value_biases=False, refactor_factored_attn_matrices=False,
        )  # fmt: skip
    return bridge


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("fold", ["none", "norm"])
def test_transformer_lens_agrees(family: str, fold: str) -> None:
    pytest.importorskip("transformer_lens")
    make, _ = MODELS[family]
    model = make(torch.float32)
    architecture = "GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM"
    bridge = _bridge(model, architecture, fold)
    circuits = multihead.head_circuits(model, fold=fold)
    qk, ov = bridge.QK.AB, bridge.OV.AB  # (L, H, E, E)
    for layer in range(4):
        for h in range(4):
            assert (circuits.qk(layer, h).ab() - qk[layer, h]).abs().max() < 1e-5
            assert (circuits.ov(layer, h).ab() - ov[layer, h]).abs().max() < 1e-5
    for kind in ("q", "k", "v"):
        theirs = bridge.all_composition_scores(kind.upper())
        theirs = getattr(theirs, "scores", theirs)
        ours = circuits.composition_scores(kind).scores
        later = ~ours.isnan()
        assert (ours[later] - theirs[later]).abs().max() < 1e-5, kind


# -- the factored matrix itself -------------------------------------------------------------


def test_factored_matrix_operations_equal_dense_ones() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(3, 12, 4, generator=generator, dtype=torch.float64)
    b = torch.randn(3, 4, 12, generator=generator, dtype=torch.float64)
    other = torch.randn(12, 5, generator=generator, dtype=torch.float64)
    m = FactoredMatrix(a, b)
    dense = a @ b
    assert m.shape == dense.shape and m.inner == 4
    assert torch.allclose(m.T.ab(), dense.mT)
    assert torch.allclose((m @ other).ab(), dense @ other)
    assert torch.allclose((other.T @ m).ab(), other.T @ dense)
    second = FactoredMatrix(b.mT[:, :, :3], a.mT[:, :3])  # (12, 3) @ (3, 12)
    assert torch.allclose((m @ second).ab(), dense @ second.ab())
    assert (m @ second).inner == 3
    assert torch.allclose(m.norm(), torch.linalg.matrix_norm(dense))
    u, s, vh = m.svd()
    assert torch.allclose(s, torch.linalg.svdvals(dense)[:, :4])
    assert torch.allclose(u @ torch.diag_embed(s) @ vh, dense)
    eig = m.eigenvalues()  # (3, 4): the nonzero ones of the (12, 12) product
    full = torch.linalg.eigvals(dense)
    for i in range(3):
        big = full[i][full[i].abs() > 1e-8]
        assert torch.allclose(
            torch.sort(big.abs()).values, torch.sort(eig[i].abs()).values, atol=1e-8
        )
    with pytest.raises(ValueError, match="a's columns must be b's rows"):
        FactoredMatrix(a, b.mT)
    with pytest.raises(ValueError, match="square"):
        FactoredMatrix(a, b[..., :5]).eigenvalues()


# -- multihead's own models, and what is refused --------------------------------------------


def test_multiheads_own_lm_reads_its_projections() -> None:
    from multihead.models import TransformerLM

    torch.manual_seed(0)
    lm = TransformerLM(50, 32, 4, 2, 48, 16, num_kv_heads=2)
    lm = _perturbed(lm)
    circuits = multihead.head_circuits(lm, fold="norm")
    layer = lm.blocks[1]
    attn = layer.self_attn
    gamma, d = layer.norm1.weight, 8
    if attn.qkv_proj is not None:  # fused: [q (32) | k (16) | v (16)] rows
        w = attn.qkv_proj.weight
        q_rows, k_rows, v_rows = w[:32], w[32:48], w[48:]
    else:
        q_rows, k_rows, v_rows = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight

    def folded(rows: torch.Tensor, i: int) -> torch.Tensor:  # (E, D), LayerNorm folded in
        m = gamma[:, None] * rows[i * d : (i + 1) * d].T
        return m - m.mean(0)

    for h in range(4):
        want_qk = folded(q_rows, h) @ folded(k_rows, h // 2).T
        want_ov = folded(v_rows, h // 2) @ attn.out_proj.weight[:, h * d : (h + 1) * d].T
        assert (circuits.qk(1, h).ab() - want_qk).abs().max() < 1e-10
        assert (circuits.ov(1, h).ab() - want_ov).abs().max() < 1e-10


def test_circuits_hold_no_graph_of_the_model() -> None:
    with torch.enable_grad():
        circuits = multihead.head_circuits(tiny_llama(), fold="norm")
        tensors = [circuits.qk(1, 0).a, circuits.ov(1, 0).b, circuits.qk(2, 1, offset=3).a]
        tensors += [circuits.svd(0, 0).values, circuits.copying_scores().values]
        tensors.append(circuits.composition_scores("q").scores)
    assert not any(t.requires_grad for t in tensors)


def test_bad_arguments_are_named() -> None:
    circuits = multihead.head_circuits(tiny_gpt2())
    with pytest.raises(ValueError, match="fold must be one of"):
        multihead.head_circuits(tiny_gpt2(), fold="ln")
    with pytest.raises(ValueError, match="kind must be one of"):
        circuits.composition_scores("z")
    with pytest.raises(ValueError, match="baseline must be one of"):
        circuits.composition_scores("k", baseline="shuffled")
    with pytest.raises(ValueError, match="layer index 4 is out of range"):
        circuits.qk(4, 0)
    with pytest.raises(ValueError, match="head index 7 is out of range"):
        circuits.ov(0, 7)
    with pytest.raises(ValueError, match="which must be one of"):
        circuits.svd(0, 0, which="vo")
    with pytest.raises(ValueError, match="k must be at most"):
        circuits.svd(0, 0, k=17)
    rotary = multihead.head_circuits(tiny_llama())
    with pytest.raises(ValueError, match="offset must be >= 0 on a causal model"):
        rotary.qk(0, 0, offset=-1)
    with pytest.raises(TypeError, match="offset must be an int"):
        rotary.qk(0, 0, offset=1.5)
    with pytest.raises(ValueError, match="less than the 64 positions"):
        rotary.qk(0, 0, offset=64)


def test_a_norm_on_the_queries_has_no_qk_circuit() -> None:
    config = transformers.Qwen3Config(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    model = _perturbed(transformers.Qwen3ForCausalLM(config))
    circuits = multihead.head_circuits(model)
    with pytest.raises(ValueError, match="queries and keys are not a linear function"):
        circuits.qk(0, 0)
    with pytest.raises(ValueError, match="not a linear function"):
        circuits.composition_scores("k")
    circuits.ov(0, 0)  # the values are linear
    circuits.composition_scores("v")


def test_a_random_baseline_is_subtracted() -> None:
    circuits = multihead.head_circuits(tiny_gpt2())
    plain = circuits.composition_scores("k")
    less = circuits.composition_scores("k", baseline="random")
    assert less.baseline is not None and 0 < less.baseline < 1
    assert torch.allclose(less.scores, plain.scores - less.baseline, equal_nan=True)
    # random (64, 16) factors score about as a real head does, far above 0
    assert abs(less.baseline - float(plain.scores.nanmean())) < 0.1


def test_results_label_rank_and_plot() -> None:
    pytest.importorskip("matplotlib")
    circuits = multihead.head_circuits(tiny_gpt2())
    scores = circuits.composition_scores("q")
    top = scores.top(5)
    assert len(top) == 5 and top[0][1] == float(scores.scores.nan_to_num(-1).max())
    assert all(label.endswith(".q") and " -> " in label for label, _ in top)
    rows = scores.to_rows()
    assert len(rows) == 6 * 16  # 6 (earlier, later) pairs of layers, 16 head pairs each
    assert rows[0]["label"] == "L0H0 -> L1H0.q"
    partners = scores.partners(3, 1, n=2)
    assert partners[0][1] == float(scores.into(3, 1).nan_to_num(-1).max())
    figure = scores.plot()
    ax = figure.axes[0]
    assert "Q-composition" in ax.get_title() and ax.get_ylabel().startswith("sender")
    copy_figure = circuits.copying_scores().plot()
    assert "Copying" in copy_figure.axes[0].get_title()


# -- the trained induction model: K-composition finds what path patching finds ---------------


@pytest.mark.slow
def test_k_composition_picks_the_previous_token_heads_path_patching_finds(
    induction_model: Any,
) -> None:
    from multihead.training.induction_pair import induction_pair

    model = induction_model.cpu()
    pair = induction_pair(32, batch=16)
    previous, induction = head_patterns(model, pair)  # (H,) each, by the attention patterns
    prev_heads = {f"L0H{h}" for h in range(4) if previous[h] > 0.3}
    head = int(induction.argmax())  # the top induction head, L1H{head}
    assert prev_heads and float(induction[head]) > 0.5, (previous, induction)

    scores = multihead.head_circuits(model).composition_scores("k")
    (partner, score), *_ = scores.partners(1, head, n=4)
    assert partner in prev_heads, (scores.partners(1, head, n=4), prev_heads)

    with torch.enable_grad():
        paths = multihead.path_patching(
            model, pair.clean, pair.corrupt, pair.metric, senders=[(0, h) for h in range(4)],
            receivers=[(1, head)], via=["k"],
        )  # fmt: skip
    through_keys = paths.values[:, 0, 0].abs()  # (4,): each layer-0 head's path through the keys
    strongest = f"L0H{int(through_keys.argmax())}"
    assert strongest in prev_heads, (through_keys, prev_heads)
    assert float(through_keys[int(partner[3:])]) > 0.5 * float(through_keys.max())
