"""multihead.cache: every site against a reference recorded here with plain torch hooks and the
attention recomputed by hand (TransformerLM, transformers' GPT-2 and a grouped-query Llama)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.runs.head_writes import head_writes
from multihead.circuits.runs.site_names import MODEL_SITES, SITES, hook_name
from multihead.circuits.runs.site_recorder import cache
from multihead.models import TransformerLM


def _hooks(pairs: list[tuple[nn.Module, Any]]) -> list[Any]:
    return [m.register_forward_hook(fn, with_kwargs=True) for m, fn in pairs]


def _record(model: nn.Module, ids: Tensor, modules: dict[str, nn.Module]) -> dict[str, Any]:
    """Each named module's (first input, first output) on one run."""
    seen: dict[str, Any] = {}

    def make(name: str) -> Any:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = args[0] if args else kwargs["hidden_states"]
            seen[name] = (x, out[0] if isinstance(out, tuple) else out)

        return hook

    handles = _hooks([(m, make(n)) for n, m in modules.items()])
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def _softmax_rows(q: Tensor, k: Tensor) -> Tensor:
    """Causal softmax weights (B, H, T, T) of q (B, T, H, D), k (B, T, H, D), by hand."""
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    t = q.shape[1]
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1)


def test_transformer_lm_sites_equal_hooks(device: torch.device) -> None:
    lm = TransformerLM(20, 24, 6, 2, 40, max_len=16).to(device, torch.float64).eval()
    ids = torch.randint(20, (3, 7), device=device)
    parts: dict[str, nn.Module] = {}
    for i, block in enumerate(lm.blocks):
        parts |= {f"block{i}": block, f"attn{i}": block.self_attn, f"ff{i}": block.ff}
        parts[f"out{i}"] = block.self_attn.out_proj
        parts[f"norm{i}"] = block.norm1
    ref = _record(lm, ids, parts)
    got = cache(lm, ids, names=lambda site, layer: True)
    assert {s for s, _ in got} == set(SITES)
    for i, block in enumerate(lm.blocks):
        x, y = ref[f"block{i}"]
        attn, mlp = ref[f"attn{i}"][1], ref[f"ff{i}"][1]
        torch.testing.assert_close(got["resid_pre", i], x, rtol=0, atol=0)
        torch.testing.assert_close(got["resid_post", i], y, rtol=0, atol=0)
        torch.testing.assert_close(got["attn_out", i], attn, rtol=0, atol=0)
        torch.testing.assert_close(got["mlp_out", i], mlp, rtol=0, atol=0)
        torch.testing.assert_close(got["resid_mid", i], x + attn)
        # per head, from the normed input and the projections' weights
        h_in = ref[f"norm{i}"][1]
        mha = block.self_attn
        packed = h_in @ mha.qkv_proj.weight.T + mha.qkv_proj.bias  # rows q, k, v
        q, k, v = (t.unflatten(-1, (6, 4)) for t in packed.split(24, -1))
        torch.testing.assert_close(got["q", i], q)
        torch.testing.assert_close(got["k", i], k)
        torch.testing.assert_close(got["v", i], v)
        pattern = _softmax_rows(q, k)
        torch.testing.assert_close(got["pattern", i], pattern)
        z = torch.einsum("bhts,bshd->bthd", pattern, v)
        torch.testing.assert_close(got["z", i], z)
        torch.testing.assert_close(ref[f"out{i}"][0], z.flatten(2))
        w = mha.out_proj.weight  # (E, H·Dv)
        result = torch.stack([z[:, :, h] @ w[:, 4 * h : 4 * h + 4].T for h in range(6)], 2)
        torch.testing.assert_close(got["result", i], result)
        torch.testing.assert_close(result.sum(2) + mha.out_proj.bias, attn)
    # TransformerLens's names read the same tensors
    assert (
        got["blocks.1.attn.hook_z"] is got["z", 1]
        and got[hook_name("resid_pre", 0)] is got["resid_pre", 0]
    )
    assert got["z", -1] is got["z", 1] and multihead.cache is cache


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_sites_equal_hooks(family: str, device: torch.device) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    if family == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=50, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(config)
        blocks = model.transformer.h
    else:
        config = transformers.LlamaConfig(
            vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        blocks = model.model.layers
    model = model.to(device, torch.float64).eval()
    ids = torch.randint(50, (2, 6), device=device)
    parts: dict[str, nn.Module] = {}
    for i, block in enumerate(blocks):
        attention = block.attn if family == "gpt2" else block.self_attn
        parts |= {f"block{i}": block, f"attn{i}": attention, f"mlp{i}": block.mlp}
        if family == "gpt2":
            parts |= {f"qkv{i}": attention.c_attn, f"proj{i}": attention.c_proj}
        else:
            parts |= {f"q{i}": attention.q_proj, f"k{i}": attention.k_proj}
            parts |= {f"v{i}": attention.v_proj, f"proj{i}": attention.o_proj}
    ref = _record(model, ids, parts)
    got = cache(model, {"input_ids": ids}, names=lambda site, layer: True)
    for i in range(len(blocks)):
        x, y = ref[f"block{i}"]
        attn, mlp = ref[f"attn{i}"][1], ref[f"mlp{i}"][1]
        torch.testing.assert_close(got["resid_pre", i], x, rtol=0, atol=0)
        torch.testing.assert_close(got["resid_post", i], y, rtol=0, atol=0)
        torch.testing.assert_close(got["attn_out", i], attn, rtol=0, atol=0)
        torch.testing.assert_close(got["mlp_out", i], mlp, rtol=0, atol=0)
        torch.testing.assert_close(got["resid_mid", i], x + attn)
        z_flat = ref[f"proj{i}"][0]  # what the output projection reads: (B, T, H·Dv)
        if family == "gpt2":
            q, k, v = ref[f"qkv{i}"][1].split(24, -1)
            q, k, v = (t.unflatten(-1, (4, 6)) for t in (q, k, v))
            heads, hk, d = 4, 4, 6
            w_o = parts[f"proj{i}"].weight.T  # Conv1D stores (in, out)
        else:
            heads, hk, d = 6, 2, 4
            q = ref[f"q{i}"][1].unflatten(-1, (6, 4))
            k = ref[f"k{i}"][1].unflatten(-1, (2, 4))
            v = ref[f"v{i}"][1].unflatten(-1, (2, 4))
            # rotary as transformers applies it, with the model's own position table
            from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

            positions = torch.arange(6, device=device)[None]
            cos, sin = model.model.rotary_emb(x, positions)
            q, k = (t.transpose(1, 2) for t in apply_rotary_pos_emb(
                q.transpose(1, 2), k.transpose(1, 2), cos, sin
            ))  # fmt: skip
            w_o = parts[f"proj{i}"].weight
        torch.testing.assert_close(got["q", i], q)
        assert got["k", i].shape == (2, 6, hk, d)
        torch.testing.assert_close(got["k", i], k)
        torch.testing.assert_close(got["v", i], v)
        per_query = heads // hk  # query head h reads key/value head h // per_query
        pattern = _softmax_rows(q, k.repeat_interleave(per_query, 2))
        torch.testing.assert_close(got["pattern", i], pattern)
        z = torch.einsum("bhts,bshd->bthd", pattern, v.repeat_interleave(per_query, 2))
        torch.testing.assert_close(got["z", i], z)
        torch.testing.assert_close(z_flat, z.flatten(2))
        result = torch.stack([z[:, :, h] @ w_o[:, d * h : d * h + d].T for h in range(heads)], 2)
        torch.testing.assert_close(got["result", i], result)


def test_names_positions_and_device_keep_only_what_was_asked(device: torch.device) -> None:
    lm = TransformerLM(20, 24, 6, 3, 40, max_len=16).to(device).eval()
    ids = torch.randint(20, (2, 9), device=device)
    whole = cache(lm, ids)
    assert not any(site in ("pattern", "attn_scores") for site, _ in whole)  # T×T when named
    # every other site of each of the 3 layers, and the 3 of the whole model once
    per_layer = [s for s in SITES if s not in (*MODEL_SITES, "pattern", "attn_scores")]
    assert len(whole) == 3 * len(per_layer) + len(MODEL_SITES)
    some = cache(lm, ids, names=["resid_post", ("z", -1), "blocks.0.attn.hook_pattern"])
    assert sorted(some) == sorted(
        [("resid_post", 0), ("resid_post", 1), ("resid_post", 2), ("z", 2), ("pattern", 0)]
    )
    torch.testing.assert_close(some["z", 2], whole["z", 2], rtol=0, atol=0)
    cut = cache(lm, ids, names=["resid_pre", "k", "pattern"], positions=[-1, 2], device="cpu")
    assert cut.positions == [8, 2]
    torch.testing.assert_close(cut["resid_pre", 1], whole["resid_pre", 1][:, [8, 2]].cpu())
    torch.testing.assert_close(cut["k", 0], whole["k", 0][:, [8, 2]].cpu())
    assert cut["pattern", 0].shape == (2, 6, 2, 9) and cut["pattern", 0].device.type == "cpu"
    full = cache(lm, ids, names="pattern")
    torch.testing.assert_close(cut["pattern", 0], full["pattern", 0][:, :, [8, 2]].cpu())
    assert some.nbytes == sum(t.numel() * t.element_size() for t in some.values())
    assert cache(lm, ids, names="z", positions=slice(2, 4))["z", 0].shape == (2, 2, 6, 4)
    torch.testing.assert_close(
        cut.stack("resid_pre"), torch.stack([cut["resid_pre", i] for i in range(3)])
    )


def test_sites_a_model_does_not_have_are_named() -> None:
    ids = torch.randint(20, (2, 5))
    attn_only = TransformerLM(20, 24, 6, 2, 40, max_len=16, attn_only=True).eval()
    kept = cache(attn_only, ids)
    assert ("resid_mid", 0) in kept and ("mlp_out", 0) not in kept
    with pytest.raises(KeyError, match="attention-only"):
        kept["mlp_out", 0]
    with pytest.raises(ValueError, match="mlp_out of layer 0: TransformerLM's blocks are"):
        cache(attn_only, ids, names="mlp_out")
    post_ln = TransformerLM(20, 24, 6, 2, 40, max_len=16, norm_first=False).eval()
    with pytest.raises(ValueError, match=r"is not the sum resid_post = resid_pre \+ attn_out"):
        cache(post_ln, ids, names=[("attn_out", 1)])
    assert ("resid_post", 1) in cache(post_ln, ids)  # the stream itself is still there


def test_errors() -> None:
    lm = TransformerLM(20, 24, 6, 2, 40, max_len=16).eval()
    ids = torch.randint(20, (2, 5))
    with pytest.raises(ValueError, match=r"names items must be one of resid_pre, .*got 'resid'"):
        cache(lm, ids, names=["resid"])
    with pytest.raises(ValueError, match=r"names: layer of \('z', 2\) must be in \[-2, 2\), got 2"):
        cache(lm, ids, names=[("z", 2)])
    with pytest.raises(
        TypeError, match=r"names must be a site, .*predicate \(site, layer\) -> bool, got 3"
    ):
        cache(lm, ids, names=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"positions must be in \[-5, 5\) for 5 tokens, got 5"):
        cache(lm, ids, positions=[5])
    with pytest.raises(TypeError, match="positions must be None, an int, ints or a slice"):
        cache(lm, ids, positions=[0.5])  # type: ignore[list-item]
    kept = cache(lm, ids, names="z")
    with pytest.raises(KeyError, match="q of layer 0 was not kept: name it in cache"):
        kept["q", 0]
    with pytest.raises(KeyError, match="TransformerLens hook names such as"):
        kept["blocks.0.hook_nothing"]
    with pytest.raises(KeyError, match=r"layer must be in \[-2, 2\), got 7"):
        kept["z", 7]


@pytest.mark.parametrize("tokens", [2, 40])  # B·T ≤ Dv: a call per head; else the matrix
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_head_writes_are_each_heads_slice_of_the_projection(tokens: int, layout: str) -> None:
    g = torch.Generator().manual_seed(3)
    heads, dv, width = 3, 8, 5
    weight = torch.randn(heads * dv, width, generator=g, dtype=torch.float64)  # x @ weight
    bias = torch.randn(width, generator=g, dtype=torch.float64)
    if layout == "linear":
        projection: nn.Module = nn.Linear(heads * dv, width, dtype=torch.float64)
        projection.weight.data, projection.bias.data = weight.T.contiguous(), bias
    else:  # GPT-2's Conv1D layout: y = x @ W + b, written out

        class Conv1D(nn.Module):
            def forward(self, x: Tensor) -> Tensor:
                return x @ weight + bias

        projection = Conv1D()
    z = torch.randn(1, tokens, heads, dv, generator=g, dtype=torch.float64)
    want = torch.stack([z[:, :, h] @ weight[h * dv : (h + 1) * dv] for h in range(heads)], 2)
    got = head_writes(projection, z)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    # the heads' writes and the bias make the projection's output
    torch.testing.assert_close(got.sum(2) + bias, projection(z.flatten(2)), atol=1e-12, rtol=0)


@pytest.mark.parametrize("positions", [[], slice(4, 2)])
def test_row18_empty_positions_are_a_value_error(positions: Any, device: torch.device) -> None:
    """Issue 51 row 18: empty positions (was: a RuntimeError from inside the forward): the
    documented ValueError, for ``cache`` and ``logit_lens`` alike."""
    lm = TransformerLM(20, 24, 2, 2, 40, max_len=16).to(device).eval()
    ids = torch.randint(20, (1, 6), device=device)
    with pytest.raises(ValueError, match="none of the 6 positions"):
        cache(lm, ids, names="resid_pre", positions=positions)
    with pytest.raises(ValueError, match="none of the 6 positions"):
        multihead.logit_lens(lm, ids, positions=positions)


def test_row18_a_pattern_only_cache_keeps_its_positions(device: torch.device) -> None:
    """Issue 51 row 18: a cache of patterns alone, with positions (was: ``positions`` None):
    the positions kept, as for any other site, and the rows are those positions' weights."""
    lm = TransformerLM(20, 24, 2, 2, 40, max_len=16).to(device).eval()
    ids = torch.randint(20, (1, 6), device=device)
    kept = cache(lm, ids, names=[("pattern", 0)], positions=[-1, 2])
    assert kept.positions == [5, 2]
    whole = cache(lm, ids, names=[("pattern", 0)])
    torch.testing.assert_close(kept["pattern", 0], whole["pattern", 0][:, :, [5, 2]])


def _parallel_family(name: str) -> Any:
    transformers = pytest.importorskip("transformers", minversion="5")
    t = transformers
    if name == "gptj":
        config: Any = t.GPTJConfig(vocab_size=50, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                                   n_positions=32)  # fmt: skip
        return t.GPTJForCausalLM(config).eval()
    if name == "phi":
        config = t.PhiConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=40)  # fmt: skip
        return t.PhiForCausalLM(config).eval()
    config = t.GPTNeoXConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, intermediate_size=40,
                             use_parallel_residual=name == "gpt_neox parallel")  # fmt: skip
    return t.GPTNeoXForCausalLM(config).eval()


@pytest.mark.parametrize("name", ["gptj", "phi", "gpt_neox parallel"])
def test_row6_a_parallel_block_has_no_resid_mid(name: str) -> None:
    """Issue 51 row 6: on parallel blocks (GPT-J, Phi, GPT-NeoX with use_parallel_residual)
    ``resid_mid`` was offered as what the feed-forward network reads, which it is not: refused
    by name, in the cache and in patch."""
    model = _parallel_family(name)
    g = torch.Generator().manual_seed(0)
    clean, corrupt = torch.randint(50, (2, 6), generator=g), torch.randint(50, (2, 6), generator=g)
    with pytest.raises(ValueError, match=r"resid_mid of layer 0: .* side by side \(a parallel"):
        multihead.cache(model, clean, names=["resid_mid"])
    with pytest.raises(ValueError, match="a parallel block"):
        multihead.patch(model, clean, corrupt, lambda logits: logits[:, -1, 3], site="resid_mid")
    kept = multihead.cache(model, clean, names=["resid_pre", "attn_out", "mlp_out"])
    assert ("attn_out", 1) in kept  # the sum's other parts stay


def test_row6_a_sequential_block_keeps_resid_mid() -> None:
    model = _parallel_family("gpt_neox sequential")
    ids = torch.randint(50, (2, 6), generator=torch.Generator().manual_seed(1))
    kept = multihead.cache(model, ids, names=["resid_pre", "attn_out", "resid_mid"])
    for layer in range(2):
        want = kept["resid_pre", layer] + kept["attn_out", layer]
        torch.testing.assert_close(kept["resid_mid", layer], want)


def test_transformer_lens_hook_q_on_a_rotary_model_is_refused_by_name() -> None:
    """Issue 51: ``"blocks.l.attn.hook_q"`` / ``hook_k`` on a rotary model returned the rotated
    q/k (TransformerLens's hook_rot_q, 19.8 off its hook_q on a test Llama), silently; now
    refused, naming hook_rot_q. On a model without rotary the names are multihead's q and k."""
    transformers = pytest.importorskip("transformers", minversion="5")
    shape = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=40)  # fmt: skip
    ids = torch.randint(50, (2, 6), generator=torch.Generator().manual_seed(0))
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**shape, num_key_value_heads=2)
    ).eval()
    kept = multihead.cache(llama, ids)
    assert kept.rotary == {0, 1}
    with pytest.raises(
        KeyError, match=r"before the turn.*'blocks.1.attn.hook_rot_q' or \('q', 1\)"
    ):
        kept["blocks.1.attn.hook_q"]
    assert kept["blocks.1.attn.hook_rot_q"] is kept["q", 1]
    with pytest.raises(ValueError, match=r"'blocks.0.attn.hook_k': layer 0 turns its queries"):
        multihead.cache(llama, ids, names=["blocks.0.attn.hook_k"])
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4)
    ).eval()
    plain = multihead.cache(gpt2, ids, names=["blocks.0.attn.hook_q"])
    assert plain.rotary == frozenset()
    assert plain["blocks.0.attn.hook_q"] is plain["q", 0]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_row4_a_padded_batch_of_a_transformers_model_has_its_heads_writes(family: str) -> None:
    """Issue 51 row 4: ``cache("result")`` and ``logit_lens`` on a transformers model given any
    padding raised a ValueError about the output projection (the wiring looked for the heads'
    outputs at the real tokens alone, as a packing model gives them). Each sequence's real
    tokens equal the same sequence run alone."""
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(0)
    if family == "gpt2":
        config: Any = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4)
        model: Any = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2,
                                          intermediate_size=40)  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    model = model.double().eval()
    ids = torch.randint(50, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0  # the second sequence: 4 tokens, then padding on the right
    padded = multihead.cache(model, {"input_ids": ids, "attention_mask": mask}, names=["result"])
    lens = multihead.logit_lens(model, {"input_ids": ids, "attention_mask": mask}, top_k=None)
    assert lens.logits is not None
    for row, n in ((0, 7), (1, 4)):
        alone = multihead.cache(model, ids[row : row + 1, :n], names=["result"])
        alone_lens = multihead.logit_lens(model, ids[row : row + 1, :n], top_k=None)
        assert alone_lens.logits is not None
        for layer in range(2):
            torch.testing.assert_close(
                padded["result", layer][row, :n], alone["result", layer][0], rtol=1e-9, atol=1e-10
            )
        torch.testing.assert_close(
            lens.logits[:, row, :n], alone_lens.logits[:, 0], rtol=1e-9, atol=1e-10
        )


def test_row4_qk_attribution_of_a_padded_sequence_is_the_sequence_alone() -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    ids = torch.randint(50, (1, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[0, 5:] = 0
    padded = multihead.qk_attribution(
        model, {"input_ids": ids, "attention_mask": mask}, layer=1, head=0, query=4, key=2
    )
    alone = multihead.qk_attribution(model, ids[:, :5], layer=1, head=0, query=4, key=2)
    assert padded.score == pytest.approx(alone.score, rel=1e-9)
    torch.testing.assert_close(padded.query_parts, alone.query_parts)


def test_row1_positions_of_a_packed_batch_count_tokens(tmp_path: Any) -> None:
    """Issue 51 row 1: on multihead's own BERT a padded batch runs packed (N, E), and
    ``positions`` were counted in the packed tensor's width: ``positions=-1`` kept position 15
    (the width 16 less one), not the last token 25, and a valid 20 was refused "for 16 tokens"."""
    pytest.importorskip("tokenizers")
    from tiny_bert import CONFIG, hf_tensors, write_dir

    from multihead.pretrained import load_text_model

    config = {**CONFIG, "max_position_embeddings": 32}
    tm = load_text_model(write_dir(tmp_path / "bert", config, hf_tensors(config), tokenizer=True))
    long = " ".join(["the cat sat on the mat ."] * 4)[:-2]  # more tokens than the width, 16
    texts = [long, "a dog"]
    batch = tm.tokenize(texts)
    t = batch.input_ids.shape[1]
    assert t > 16 and not bool(batch.attention_mask.bool().all())  # padded, so packed
    whole = multihead.cache(tm, texts, names=["resid_post"])
    last = multihead.cache(tm, texts, names=["resid_post"], positions=-1)
    assert last.positions == [t - 1]
    torch.testing.assert_close(last["resid_post", 1][:, 0], whole["resid_post", 1][:, t - 1])
    twenty = multihead.cache(tm, texts, names=["resid_post"], positions=20)
    assert twenty.positions == [20]
    torch.testing.assert_close(twenty["resid_post", 0][:, 0], whole["resid_post", 0][:, 20])


def _hand(modules: dict[str, nn.Module], run: Any) -> dict[str, tuple[Any, Any]]:
    """(input, output) of each named module in one ``run()``, by plain forward hooks."""
    seen: dict[str, tuple[Any, Any]] = {}

    def keeper(key: str) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            seen.setdefault(key, (args[0], out))

        return hook

    hooks = [m.register_forward_hook(keeper(key)) for key, m in modules.items()]
    try:
        with torch.no_grad():
            run()
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_other_sites_of_a_transformer_lm_equal_its_modules(device: torch.device) -> None:
    """Issue 51's TransformerLens sites on multihead's own pre-LN TransformerLM, against its
    modules read by hand: the token embedding's output, the position table's rows, each
    LayerNorm's σ = sqrt(var(x) + eps) (norm1 read by the attention: ln1; norm2: ln2; the final
    norm), the feed-forward's first layer's output (pre) and second layer's input (post)."""
    lm = TransformerLM(20, 24, 4, 2, 40, max_len=16).to(device, torch.float64).eval()
    ids = torch.randint(20, (2, 9), device=device)
    blocks: Any = lm.blocks
    parts: dict[str, nn.Module] = {"token": lm.token_embedding}
    for i, block in enumerate(blocks):
        parts |= {f"norm1{i}": block.norm1, f"norm2{i}": block.norm2}
        parts |= {f"fc{i}": block.ff.linear1, f"proj{i}": block.ff.linear2}
    assert lm.norm is not None
    parts["final"] = lm.norm
    ref = _hand(parts, lambda: lm(ids))
    got = cache(
        lm,
        ids,
        names=lambda site, layer: (
            site in (*MODEL_SITES, "ln1_scale", "ln2_scale", "mlp_pre", "mlp_post")
        ),
    )

    def sigma(x: Tensor) -> Tensor:
        return (x.var(-1, unbiased=False, keepdim=True) + 1e-5).sqrt()

    torch.testing.assert_close(got["embed"], ref["token"][1], rtol=0, atol=0)
    table = lm.position_embedding.embedding.weight[:9]
    torch.testing.assert_close(got["hook_pos_embed"], table.expand(2, 9, 24), rtol=0, atol=0)
    torch.testing.assert_close(got["ln_final.hook_scale"], sigma(ref["final"][0]))
    for i in range(2):
        torch.testing.assert_close(got["ln1_scale", i], sigma(ref[f"norm1{i}"][0]))
        torch.testing.assert_close(got[f"blocks.{i}.ln2.hook_scale"], sigma(ref[f"norm2{i}"][0]))
        torch.testing.assert_close(got["mlp_pre", i], ref[f"fc{i}"][1], rtol=0, atol=0)
        torch.testing.assert_close(got[f"blocks.{i}.mlp.hook_post"], ref[f"proj{i}"][0])
    assert got["ln1_scale", 0].shape == (2, 9, 1) and got["mlp_pre", 1].shape == (2, 9, 40)


def test_the_other_sites_a_model_lacks_are_named() -> None:
    """A site named outright that the model does not have is a ValueError with its reason (a
    predicate keeps what there is); a site of the whole model has one key, at layer 0."""
    post = TransformerLM(20, 24, 4, 2, 40, max_len=16, norm_first=False).eval()
    ids = torch.randint(20, (2, 6))
    with pytest.raises(ValueError, match=r"ln1_scale of layer 0: block 0's attention reads no"):
        cache(post, ids, names=["ln1_scale"])
    # its feed-forward network reads the norm after the attention: TransformerLens's ln1 there
    with pytest.raises(ValueError, match=r"ln2_scale of layer 1: .*\(a post-LN block: its norms"):
        cache(post, ids, names=[("ln2_scale", 1)])
    with pytest.raises(ValueError, match="final_scale: the map of TransformerLM knows no final"):
        cache(post, ids, names=["final_scale"])
    kept = cache(post, ids, names=lambda site, layer: site in ("ln1_scale", "embed"))
    assert list(kept) == [("embed", 0)]
    with pytest.raises(KeyError, match="attention reads no norm's output"):
        kept["blocks.1.ln1.hook_scale"]
    with pytest.raises(ValueError, match=r"embed is one activation of the whole model, .* layer 1"):
        cache(post, ids, names=[("embed", 1)])
    with pytest.raises(KeyError, match="keyed at layer 0"):
        kept["embed", 1]
    gptj = _parallel_family("gptj")  # one norm feeds its attention and its feed-forward network
    g = torch.Generator().manual_seed(0)
    clean, corrupt = torch.randint(50, (2, 6), generator=g), torch.randint(50, (2, 6), generator=g)
    with pytest.raises(ValueError, match=r"ln2_scale of layer 0: .*one norm for both"):
        cache(gptj, clean, names=["ln2_scale"])
    assert cache(gptj, clean, names=["ln1_scale"])["ln1_scale", 1].shape == (2, 6, 1)

    def metric(logits: Tensor) -> Tensor:
        return logits[:, -1, 3].mean()

    with pytest.raises(ValueError, match="layers: embed is one activation of the whole model"):
        multihead.patch(gptj, clean, corrupt, metric, site="embed", layers=[0])
    with pytest.raises(ValueError, match="heads: ln1_scale is one activation per layer"):
        multihead.patch(gptj, clean, corrupt, metric, site="ln1_scale", heads=[(0, 0)])
    with pytest.raises(ValueError, match="ln2_scale of layer 0: .*one norm for both"):
        multihead.patch(gptj, clean, corrupt, metric, site="ln2_scale")
    with pytest.raises(ValueError, match="site must be one of"):
        multihead.attribution_patching(gptj, clean, corrupt, metric, site="ln1_scale")


def test_attention_scores_of_padded_batches_are_each_sequences(tmp_path: Any) -> None:
    """``attn_scores`` on a padded batch: a transformers GPT-2's padded row equals the
    sequence run alone (-inf at the padding), and multihead's own BERT, which
    runs a padded batch packed, gives scores whose softmax is its captured pattern."""
    pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    padded = cache(gpt2, {"input_ids": ids, "attention_mask": mask}, names=["attn_scores"])
    alone = cache(gpt2, {"input_ids": ids[1:, :5]}, names=["attn_scores"])
    for layer in range(2):
        got = padded["attn_scores", layer][1, :, :5]  # the real queries
        torch.testing.assert_close(got[..., :5], alone["attn_scores", layer][0], atol=1e-5, rtol=0)
        assert bool((got[..., 5:] == float("-inf")).all())  # the padding, hidden
    from tiny_bert import CONFIG, hf_tensors, write_dir

    from multihead.pretrained import load_text_model

    tm = load_text_model(write_dir(tmp_path / "bert", CONFIG, hf_tensors(CONFIG), tokenizer=True))
    texts = ["the cat sat on the mat", "a dog"]
    kept = multihead.cache(tm, texts, names=["attn_scores", "pattern"])
    real = tm.tokenize(texts).attention_mask.bool()
    for layer in range(kept.num_layers):
        weights = torch.softmax(kept["attn_scores", layer], -1).transpose(1, 2)[real]
        pattern = kept["pattern", layer].transpose(1, 2)[real]
        torch.testing.assert_close(weights, pattern, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_patching_a_norms_scale_from_itself_changes_nothing_in_half_precision(
    dtype: torch.dtype,
) -> None:
    """clean == corrupt: every norm's scale patched from the run it came from leaves the metric
    where it was in bfloat16 and float16 too (only the patched cells are rebuilt, in float32),
    as the heads' outputs do."""
    transformers = pytest.importorskip("transformers", minversion="5")
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    llama = transformers.LlamaForCausalLM(config).to(dtype).eval()
    ids = torch.randint(50, (3, 6))

    def metric(logits: Tensor) -> Tensor:
        return (logits[:, -1, 3] - logits[:, -1, 7]).float().mean()

    for site in ("ln1_scale", "ln2_scale", "final_scale", "z"):
        same = multihead.patch(llama, ids, ids, metric, site=site, per_position=True)
        assert float(same.values.abs().max()) == 0.0, site


def test_patching_a_layer_site_of_a_packed_padded_batch_is_named(tmp_path: Any) -> None:
    """multihead's own BERT runs a padded batch packed ((N, E), no batch axis to stack patches
    along): patching a per-layer site there is a ValueError saying so, not a RuntimeError."""
    pytest.importorskip("tokenizers")
    from tiny_bert import CONFIG, hf_tensors, write_dir

    from multihead.pretrained import load_text_model

    tm = load_text_model(write_dir(tmp_path / "bert", CONFIG, hf_tensors(CONFIG), tokenizer=True))
    ids = torch.randint(5, 50, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    clean = {"input_ids": ids, "attention_mask": mask}
    corrupt = {"input_ids": ids.flip(1), "attention_mask": mask}

    def metric(output: Any) -> Tensor:
        hidden = output if isinstance(output, Tensor) else output.last_hidden_state
        return hidden[..., 0, :3].sum()

    for site in ("embed", "pos_embed", "mlp_pre", "mlp_post", "resid_pre"):
        with pytest.raises(ValueError, match=f"patching {site}: the model ran this padded batch"):
            multihead.patch(tm.model, clean, corrupt, metric, site=site, metric_input="output")
