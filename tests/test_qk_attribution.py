"""qk_attribution against references written here.

- The score: torch forward hooks record the head's query and key projections (GPT-2's
  ``c_attn``, Llama's ``q_proj``/``k_proj`` with rotary positions applied by transformers' own
  ``apply_rotary_pos_emb`` on the model's ``rotary_emb`` output, TransformerLM's packed
  ``qkv_proj``), and the score is q · k · D^-1/2 at the head; the pairs must sum to it within
  1e-4 relative (float32), on TransformerLM (LayerNorm, learned positions, grouped-query, feed-
  forward), GPT-2 (LayerNorm, learned positions) and a grouped-query Llama (RMSNorm, RoPE).
- The row: the softmax over the visible keys of each key's total equals the row
  :func:`multihead.capture` records.
- One pair by hand: on GPT-2 and Llama, the pair (an earlier head, another earlier head) is
  rebuilt from the hooked per-head outputs (the output projection's input), the block's norm with
  its scale recomputed from its hooked input, the projection weights and (Llama) the rotary
  tables.
- On an induction model trained here, the key-side component that rises most at the induction
  head's attended key is a previous-token head of layer 0 (picked by its own attention from
  :func:`multihead.capture`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.decompose.qk_attribution import QKAttribution, qk_attribution
from multihead.models import TransformerLM

T = 9


def _bigger(model: nn.Module, std: float) -> None:
    """Weights larger than the init's: scores well above rounding."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, std)
            elif "bias" in name:
                p.normal_(0, 0.1)


def _lm(device: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    lm = TransformerLM(20, 24, 4, 3, 40, max_len=16, num_kv_heads=2)
    _bigger(lm, 0.3)
    return lm.to(device).eval()


def _gpt2(device: torch.device) -> nn.Module:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(1)
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    _bigger(model, 0.3)
    return model.to(device).eval()


def _llama(device: torch.device) -> nn.Module:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    _bigger(model, 0.3)
    return model.to(device).eval()


# -- the reference: q and k at the head, by torch hooks --------------------------------------


def _record(model: nn.Module, ids: Tensor, modules: list[nn.Module]) -> list[Any]:
    """Each module's output in one forward, in the order of ``modules``."""
    seen: dict[int, Any] = {}

    def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen[id(m)] = out

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return [seen[id(m)] for m in modules]


def _qk_lm(model: nn.Module, ids: Tensor, layer: int, head: int) -> tuple[Tensor, Tensor]:
    attn = model.blocks[layer].self_attn
    (qkv,) = _record(model, ids, [attn.qkv_proj])  # (1, T, (H + 2 Hk) D)
    h, hk, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = qkv[0, :, : h * d].unflatten(-1, (h, d))[:, head]
    k = qkv[0, :, h * d : (h + hk) * d].unflatten(-1, (hk, d))[:, head // (h // hk)]
    return q, k  # (T, D) each


def _qk_gpt2(model: nn.Module, ids: Tensor, layer: int, head: int) -> tuple[Tensor, Tensor]:
    (qkv,) = _record(model, ids, [model.transformer.h[layer].attn.c_attn])  # (1, T, 3E)
    e, h = model.config.n_embd, model.config.n_head
    q, k = qkv[0, :, :e], qkv[0, :, e : 2 * e]
    return q.unflatten(-1, (h, e // h))[:, head], k.unflatten(-1, (h, e // h))[:, head]


def _qk_llama(model: nn.Module, ids: Tensor, layer: int, head: int) -> tuple[Tensor, Tensor]:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    q_out, k_out, (cos, sin) = _record(
        model, ids, [attn.q_proj, attn.k_proj, model.model.rotary_emb]
    )
    d = attn.head_dim
    q = q_out.unflatten(-1, (-1, d)).transpose(1, 2)  # (1, H, T, D)
    k = k_out.unflatten(-1, (-1, d)).transpose(1, 2)  # (1, Hk, T, D)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    group = q.shape[1] // k.shape[1]
    return q[0, head], k[0, head // group]


MODELS: dict[str, tuple[Callable[[torch.device], nn.Module], Callable[..., Any]]] = {
    "transformer_lm": (_lm, _qk_lm),
    "gpt2": (_gpt2, _qk_gpt2),
    "llama": (_llama, _qk_llama),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_pairs_sum_to_the_score_and_give_the_captured_row(name: str, device: torch.device) -> None:
    build, reference = MODELS[name]
    model = build(device)
    vocab = 20 if name == "transformer_lm" else 50
    ids = torch.randint(vocab, (1, T), generator=torch.Generator().manual_seed(3)).to(device)
    for layer, head, query, key in [(2, 1, 7, 3), (2, 3, 8, 8), (1, 0, 5, 0), (0, 2, 6, 2)]:
        got = qk_attribution(model, ids, layer=layer, head=head, query=query, key=key)
        q, k = reference(model, ids, layer, head)
        want = float(q[query].double() @ k[key].double()) / math.sqrt(q.shape[-1])
        assert abs(got.total() - want) <= 1e-4 * abs(want), (layer, head, got.total(), want)
        assert got.score == pytest.approx(want, rel=1e-4)
        assert abs(sum(v for _, _, v in got.pairs) - want) <= 1e-4 * abs(want)
        # every key's total: the softmax over the keys the query sees is the captured row
        with multihead.capture(model, heads=[(layer, head)], rows=[query]) as rec, torch.no_grad():
            model(ids)
        row = rec.weights[0][0, 0, 0].double().cpu()  # (S,)
        scores = got.scores().cpu()
        assert torch.isnan(scores[query + 1 :]).all() and not torch.isnan(scores[: query + 1]).any()
        expected = torch.zeros(T, dtype=torch.float64)
        expected[: query + 1] = scores[: query + 1].softmax(0)
        torch.testing.assert_close(expected, row, atol=1e-5, rtol=0)
        torch.testing.assert_close(got.weights.double().cpu(), row, atol=1e-6, rtol=0)
        # each key-side column sums to that key's score
        assert got.key_side().shape == (len(got.key_labels), T)


def test_the_result_reads_consistently(device: torch.device) -> None:
    model = _lm(device)
    ids = torch.randint(20, (1, T), generator=torch.Generator().manual_seed(5)).to(device)
    got = qk_attribution(model, ids, layer=-1, head=-1, query=-1, key=2)
    assert (got.layer, got.head, got.query, got.key) == (2, 3, T - 1, 2)
    labels = ["embed", "L0H0", "L0H1", "L0H2", "L0H3", "L0 attn bias", "MLP0"]
    labels += ["L1H0", "L1H1", "L1H2", "L1H3", "L1 attn bias", "MLP1", "norm bias"]
    assert list(got.query_labels) == [*labels, "q bias"]
    assert list(got.key_labels) == [*labels, "k bias"]
    pairs = got.pairs
    assert len(pairs) == len(labels + ["b"]) ** 2
    top = got.top(5)
    assert [abs(v) for _, _, v in top] == sorted((abs(v) for _, _, v in pairs), reverse=True)[:5]
    assert top[0] in pairs
    # the rise at a key: its key-side share there less its mean over the other visible keys
    side = got.key_side()
    rise = dict(got.key_rise())
    others = [s for s in range(T) if s != 2]
    for i, label in enumerate(got.key_labels):
        assert rise[label] == pytest.approx(float(side[i, 2] - side[i, others].mean()), abs=1e-9)
    assert list(rise.values()) == sorted(rise.values(), reverse=True)
    assert "QKAttribution(L2H3, query 8, key 2" in repr(got)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_forward_splits_every_key(name: str, device: torch.device) -> None:
    """One call (one forward of the model) holds every key's split: ``at(key)`` equals a call
    for that key, and the default key is the one the reference scores highest."""
    build, reference = MODELS[name]
    model = build(device)
    vocab = 20 if name == "transformer_lm" else 50
    ids = torch.randint(vocab, (1, T), generator=torch.Generator().manual_seed(4)).to(device)
    forwards = []
    hook = model.register_forward_pre_hook(lambda m, a: forwards.append(1))
    try:
        got = qk_attribution(model, ids, layer=2, head=1, query=5)
    finally:
        hook.remove()
    assert len(forwards) == 1
    q, k = reference(model, ids, 2, 1)
    scores = (q[5].double() @ k[:6].double().T).cpu()
    assert got.key == int(scores.argmax())
    for key in (0, 3, 5):
        alone = qk_attribution(model, ids, layer=2, head=1, query=5, key=key)
        other = got.at(key)
        assert other.key == key and other.score == pytest.approx(alone.score, rel=1e-9)
        torch.testing.assert_close(other.table(), alone.table(), rtol=0, atol=1e-9)
        assert [label for label, _ in other.key_rise()] == [label for label, _ in alone.key_rise()]
    with pytest.raises(ValueError, match="key must be a position query 5 may attend to, got 7"):
        got.at(7)


# -- one pair by hand -------------------------------------------------------------------------


def _inputs_of(model: nn.Module, ids: Tensor, modules: list[nn.Module]) -> list[Tensor]:
    """Each module's input (hidden states) in one forward, in the order of ``modules``."""
    seen: dict[int, Tensor] = {}

    def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen[id(m)] = args[0] if args else kwargs["hidden_states"]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return [seen[id(m)] for m in modules]


@torch.no_grad()
def test_one_pair_by_hand_on_gpt2(device: torch.device) -> None:
    model = _gpt2(device)
    ids = torch.randint(50, (1, T), generator=torch.Generator().manual_seed(6)).to(device)
    blocks = model.transformer.h
    e, h = model.config.n_embd, model.config.n_head
    d = e // h
    z0, z1, x = _inputs_of(model, ids, [blocks[0].attn.c_proj, blocks[1].attn.c_proj, blocks[2]])
    x = x.double()

    def write(layer: int, z: Tensor, head: int) -> Tensor:  # (T, E): the head's write, no bias
        w = blocks[layer].attn.c_proj.weight.double()  # Conv1D: (in, out)
        return z[0, :, head * d : (head + 1) * d].double() @ w[head * d : (head + 1) * d]

    ln = blocks[2].ln_1
    sigma = ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True).add(ln.eps).sqrt()[0]

    def normed(c: Tensor) -> Tensor:
        return ln.weight.double() * (c - c.mean(-1, keepdim=True)) / sigma

    w_attn = blocks[2].attn.c_attn.weight.double()  # (E, 3E)
    q = normed(write(0, z0, 1)) @ w_attn[:, :e]  # (T, E): all heads' queries, L0H1's part
    k = normed(write(1, z1, 2)) @ w_attn[:, e : 2 * e]
    query, key, head = 7, 4, 3
    want = float(q[query, head * d : (head + 1) * d] @ k[key, head * d : (head + 1) * d])
    want /= math.sqrt(d)
    got = qk_attribution(model, ids, layer=2, head=head, query=query, key=key)
    value = next(v for a, b, v in got.pairs if (a, b) == ("L0H1", "L1H2"))
    assert value == pytest.approx(want, rel=1e-4, abs=1e-6)


@torch.no_grad()
def test_one_pair_by_hand_on_a_grouped_query_llama(device: torch.device) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = _llama(device)
    ids = torch.randint(50, (1, T), generator=torch.Generator().manual_seed(7)).to(device)
    layers = model.model.layers
    d = layers[0].self_attn.head_dim
    z0, z1, x = _inputs_of(
        model, ids, [layers[0].self_attn.o_proj, layers[1].self_attn.o_proj, layers[2]]
    )
    (cos, sin) = _record(model, ids, [model.model.rotary_emb])[0]
    x = x.double()

    def write(layer: int, z: Tensor, head: int) -> Tensor:
        w = layers[layer].self_attn.o_proj.weight.double()  # (E, H D)
        return z[0, :, head * d : (head + 1) * d].double() @ w[:, head * d : (head + 1) * d].T

    norm = layers[2].input_layernorm
    rms = x.pow(2).mean(-1, keepdim=True).add(norm.variance_epsilon).sqrt()[0]
    attn = layers[2].self_attn
    query, key, head = 8, 5, 4
    kv = head // (attn.config.num_attention_heads // attn.config.num_key_value_heads)
    q = (norm.weight.double() * write(0, z0, 5) / rms) @ attn.q_proj.weight.double().T
    k = (norm.weight.double() * write(1, z1, 0) / rms) @ attn.k_proj.weight.double().T
    q = q[:, head * d : (head + 1) * d][None, None]  # (1, 1, T, D)
    k = k[:, kv * d : (kv + 1) * d][None, None]
    q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    want = float(q[0, 0, query] @ k[0, 0, key]) / math.sqrt(d)
    got = qk_attribution(model, ids, layer=2, head=head, query=query, key=key)
    value = next(v for a, b, v in got.pairs if (a, b) == ("L0H5", "L1H0"))
    assert value == pytest.approx(want, rel=1e-4, abs=1e-6)
    assert "norm bias" not in got.query_labels  # RMSNorm has no bias


# -- refusals ---------------------------------------------------------------------------------


def test_bad_inputs_are_refused(device: torch.device) -> None:
    model = _lm(device)
    ids = torch.randint(20, (1, T), device=device)
    with pytest.raises(ValueError, match="explains one sequence: inputs must hold 1, got 2"):
        qk_attribution(model, ids.expand(2, T), layer=1, head=0, query=3, key=1)
    with pytest.raises(ValueError, match="key must be a position query 3 may attend to, got 5"):
        qk_attribution(model, ids, layer=1, head=0, query=3, key=5)
    with pytest.raises(ValueError, match="layer index 3 is out of range: there are 3 attention"):
        qk_attribution(model, ids, layer=3, head=0, query=3, key=1)
    with pytest.raises(ValueError, match="head index 4 is out of range"):
        qk_attribution(model, ids, layer=0, head=4, query=3, key=1)
    with pytest.raises(ValueError, match="query index 9 is out of range"):
        qk_attribution(model, ids, layer=0, head=0, query=T, key=1)
    with pytest.raises(TypeError, match="key must be an int"):
        qk_attribution(model, ids, layer=0, head=0, query=3, key=1.0)  # type: ignore[arg-type]
    got = qk_attribution(model, ids, layer=0, head=0, query=0, key=0)
    with pytest.raises(ValueError, match="key 0 is the only key query 0 sees"):
        got.key_rise()
    with pytest.raises(ValueError, match="k must be a positive int"):
        got.top(0)


def test_a_post_ln_stack_is_refused(device: torch.device) -> None:
    torch.manual_seed(0)
    model = TransformerLM(20, 24, 4, 2, 40, max_len=16, norm_first=False).to(device).eval()
    ids = torch.randint(20, (1, T), device=device)
    with pytest.raises(ValueError, match="not the sum resid_post = resid_pre"):
        qk_attribution(model, ids, layer=1, head=0, query=3, key=1)


def test_a_score_bias_is_refused(device: torch.device) -> None:
    """A float mask that adds finite values to the scores (ALiBi's form) is not q·k."""
    model = _llama(device)
    ids = torch.randint(50, (1, T), device=device)
    bias = -0.5 * (torch.arange(T)[:, None] - torch.arange(T)[None]).clamp(min=0).float()
    mask = bias.masked_fill(torch.ones(T, T).triu(1).bool(), torch.finfo(torch.float32).min)
    inputs = {"input_ids": ids, "attention_mask": mask[None, None].to(device)}
    with pytest.raises(ValueError, match="adds a bias to them"):
        qk_attribution(model, inputs, layer=1, head=0, query=3, key=1)


# -- the induction model ----------------------------------------------------------------------


@pytest.mark.slow
def test_the_induction_heads_keys_rise_by_the_previous_token_head(
    induction_model: TransformerLM, device: torch.device
) -> None:
    from multihead.training.induction_pair import induction_pair

    model = induction_model.to(device)
    pair = induction_pair(32)
    n, s1, s2 = pair.layout
    ids = pair.clean[:4].to(device)
    # previous-token heads of layer 0 and the best induction head of layer 1, by their weights
    with multihead.capture(model) as rec, torch.no_grad():
        model(ids)
    first, second = rec.weights[0], rec.weights[1]  # (B, H, T, T)
    t = torch.arange(1, ids.shape[1])
    previous = first[:, :, t, t - 1].mean((0, 2))  # (H,)
    prev_heads = {f"L0H{h}" for h in range(len(previous)) if previous[h] > 0.3}
    repeat = torch.arange(s2, s2 + n - 1)
    induction = second[:, :, repeat, repeat - s2 + s1 + 1].mean((0, 2))
    head = int(induction.argmax())
    assert prev_heads and float(induction[head]) > 0.5, (previous, induction)
    found = 0
    for b in range(ids.shape[0]):
        for query in repeat.tolist():
            attended = int(second[b, head, query].argmax())
            if attended != query - s2 + s1 + 1:  # not the token after the first occurrence
                continue
            found += 1
            got = qk_attribution(
                model, ids[b : b + 1], layer=1, head=head, query=query, key=attended
            )
            (top, rise), *_ = got.key_rise()
            assert top in prev_heads and rise > 1.0, (b, query, got.key_rise()[:4])
    assert found >= 0.8 * ids.shape[0] * len(repeat)


def test_path_is_importable() -> None:
    assert multihead.qk_attribution is qk_attribution
    assert multihead.QKAttribution is QKAttribution
    assert Path(multihead.circuits.decompose.qk_attribution.__file__).name == "qk_attribution.py"


# -- explain(qk=...), the page and `multihead explain --qk` -----------------------------------


@pytest.mark.cpu_only  # the CLI and its files
def test_explain_and_the_cli_show_the_top_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", minversion="5")
    from cli_support import fails
    from test_hf_explain import BY_NAME, save_family

    from multihead.cli import main
    from multihead.explanation import explain
    from multihead.pretrained import load_text_model

    path = save_family(BY_NAME["gpt2"], tmp_path / "gpt2")
    model = load_text_model(path, backend="transformers")
    text = "The cat sat on the mat because it was tired."
    ex = explain(text, model=model, importance=False, qk="L1H2")
    assert ex.qk is not None
    key = int(ex.weights[1, 2, ex.focus_index].argmax())  # the key the head attends to most
    batch = model.tokenize(text)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
    want = qk_attribution(model, inputs, layer=1, head=2, query=ex.focus_index, key=key)
    assert (ex.qk.query, ex.qk.key) == (ex.focus_index, key)
    assert ex.qk.top(4) == want.top(4)
    page = ex.html()
    assert '"qk":{"head":"L1H2"' in page and f'"key":{key},' in page
    a, b, _ = want.top(1)[0]
    assert f'"pairs":[["{a}","{b}",' in page
    assert '"qk":null' in explain(text, model=model, importance=False).html()

    out = tmp_path / "out"
    argv = ["explain", text, "--model", str(path), "--out", str(out), "--no-importance"]
    assert main([*argv, "--format", "html", "--qk", "L1H2"]) == 0
    printed = capsys.readouterr().out
    assert f"Why L1H2 looks at {ex.tokens[key]!r} (token {key})" in printed
    assert f"{a:>14s} x {b:<14s}" in printed
    assert "expected one head such as L1H3, got 'L1H2,L0H0'" in fails(
        capsys, [*argv, "--qk", "L1H2,L0H0"]
    )
    assert "qk (5, 0): layer index 5 is out of range: there are 2 layers" in fails(
        capsys, [*argv, "--qk", "L5H0"]
    )
