"""Lenses beyond the logit lens: multihead.JacobianLens and multihead.TunedLens, read by
``logit_lens(..., lens=)``.

Reference-first: the Jacobian lens's fit against Jacobians computed here by
``torch.autograd.functional.jacobian`` of the last block's output on a replaced block output
(float64: every Jacobian, summed and averaged by hand), and against TransformerLens 4.3's own
``JacobianLens.fit`` on the same token ids (float32, 1e-5), files of each read by the other;
the lenses' readings against ``W_U · final_norm(M h + b)`` computed here from hooked block
outputs; a tuned lens written by hand in tuned-lens's layouts (``config.json`` and a
``torch.save`` state dict); the least-squares fit against an augmented least-squares problem
solved by ``torch.linalg.lstsq``. Tiny models from configs, random weights; nothing downloaded.
"""

from __future__ import annotations

import copy
import json
import string
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import multihead
from multihead.circuits.decompose.jacobian_lens import JacobianLens
from multihead.circuits.decompose.tuned_lens import TunedLens, unembed_hash
from multihead.models import TransformerLM

V = 50


def _family_model(
    family: str, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu"
) -> tuple[nn.Module, Any]:
    """(model, {"blocks", "norm", "head"}) of ``family``, weights perturbed (biases nonzero),
    in eval mode."""
    if family == "lm":
        lm = TransformerLM(V, 24, 6, 3, 40, max_len=32)
        parts = {"blocks": list(lm.blocks), "norm": lm.norm, "head": lm.head}
        model: Any = lm
    else:
        transformers = pytest.importorskip("transformers", minversion="5")
        if family == "gpt2":
            config: Any = transformers.GPT2Config(
                vocab_size=V, n_embd=24, n_layer=3, n_head=4, n_positions=32, bos_token_id=0,
                eos_token_id=0,
            )  # fmt: skip
            model = transformers.GPT2LMHeadModel(config)
            parts = {"blocks": list(model.transformer.h), "norm": model.transformer.ln_f}
        else:
            config = transformers.LlamaConfig(
                vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
            )  # fmt: skip
            model = transformers.LlamaForCausalLM(config)
            parts = {"blocks": list(model.model.layers), "norm": model.model.norm}
        parts["head"] = model.lm_head
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(device, dtype).eval(), parts


def _first(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _block_outputs(model: nn.Module, blocks: list[nn.Module], inputs: Any) -> list[torch.Tensor]:
    """Every block's output stream on ``inputs`` (ids, or a dict), by forward hooks."""
    outs: list[torch.Tensor] = []
    handles = [b.register_forward_hook(lambda m, a, o: outs.append(_first(o))) for b in blocks]
    with torch.no_grad():
        model(**inputs) if isinstance(inputs, dict) else model(inputs)
    for h in handles:
        h.remove()
    return outs


def _reference_jacobian(
    model: nn.Module, blocks: list[nn.Module], row: dict[str, Any], layer: int, positions: list[int]
) -> torch.Tensor:
    """(E, E) ``1/|V| Σ_{t∈V} Σ_{t'∈V} ∂h_last,t' / ∂h_layer,t`` for one prompt ``row`` (batch
    1), from the full Jacobian (T, E, T, E) of the last block's output as a function of block
    ``layer``'s output (put in by a hook)."""
    stream = _block_outputs(model, blocks, row)[layer]  # (1, T, E)
    caught: dict[str, torch.Tensor] = {}

    def last_output(x: torch.Tensor) -> torch.Tensor:
        put = blocks[layer].register_forward_hook(
            lambda m, a, o: (x[None], *o[1:]) if isinstance(o, tuple) else x[None]
        )
        keep = blocks[-1].register_forward_hook(lambda m, a, o: caught.update(out=_first(o)))
        try:
            model(**row)
        finally:
            put.remove()
            keep.remove()
        return caught["out"][0]

    full = torch.autograd.functional.jacobian(last_output, stream[0].detach())  # (T, E, T, E)
    v = torch.tensor(positions, device=stream.device)
    picked = full[v][:, :, v]  # (|V|, E, |V|, E): [t', i, t, j]
    return picked.sum(0).mean(1)  # Σ over targets t', mean over sources t: (E, E) [i, j]


@pytest.mark.parametrize("family", ["lm", "gpt2", "llama"])
def test_fit_is_the_mean_of_the_jacobians_summed_over_later_positions(
    family: str, device: torch.device
) -> None:
    model, parts = _family_model(family, device=device)
    blocks = parts["blocks"]
    ids = torch.randint(1, V, (3, 9), device=device)
    skip = 2
    if family == "lm":  # token ids alone: every row whole
        inputs: Any = ids[:2]
        rows, lengths = [{"ids": ids[:1]}, {"ids": ids[1:2]}], (9, 9)
        lens = JacobianLens.fit(
            model, inputs, skip_first_positions=skip, dim_batch=5, corpus="random ids",
            metadata={"note": [1, "x"]},
        )  # fmt: skip
    else:  # three prompts: whole, padded on the right (run on its tokens), too short (skipped)
        mask = torch.ones(3, 9, dtype=torch.long, device=device)
        mask[1, 7:] = 0
        mask[2, 3:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        rows, lengths = [{"input_ids": ids[:1]}, {"input_ids": ids[1:2, :7]}], (9, 7)
        with pytest.warns(UserWarning, match=r"skipped 1 prompt\(s\) \(rows 2\) with at most 3"):
            lens = JacobianLens.fit(
                model, inputs, skip_first_positions=skip, dim_batch=5, corpus="random ids",
                metadata={"note": [1, "x"]},
            )  # fmt: skip
    assert lens.source_layers == [0, 1] and lens.n_prompts == 2 and lens.d_model == 24
    # transformers' Llama RMSNorm computes in float32 whatever the model's dtype
    atol = 1e-6 if family == "llama" else 1e-10
    for layer in (0, 1):
        want = (
            sum(
                _reference_jacobian(model, blocks, row, layer, list(range(skip, n - 1)))
                for row, n in zip(rows, lengths, strict=True)
            )
            / 2
        )
        assert lens.jacobians[layer].dtype == torch.float64
        torch.testing.assert_close(lens.jacobians[layer], want, rtol=0, atol=atol)
    meta = lens.metadata
    assert meta["estimator"] == "jacobian_lens" and meta["n_prompts"] == 2
    assert meta["target_layer"] == 2 and meta["skip_first_positions"] == 2
    assert meta["corpus"] == "random ids" and meta["note"] == [1, "x"]
    assert meta["fit_dtype"] == "float64" and meta["dim_batch"] == 5
    # one layer alone, any chunk size: the same rows; the parameters' flags are set back
    alone = JacobianLens.fit(model, ids[:1], layers=[-2], skip_first_positions=skip, dim_batch=24)
    assert alone.source_layers == [1]
    torch.testing.assert_close(
        alone.jacobians[1], _reference_jacobian(model, blocks, rows[0], 1, list(range(2, 8))),
        rtol=0, atol=atol,
    )  # fmt: skip
    assert all(p.requires_grad for p in model.parameters())


def test_a_row_padded_on_the_left_reads_its_real_positions(device: torch.device) -> None:
    model, parts = _family_model("llama", device=device)
    ids = torch.randint(1, V, (1, 8), device=device)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]], device=device)
    lens = JacobianLens.fit(
        model, {"input_ids": ids, "attention_mask": mask}, skip_first_positions=1
    )
    row = {"input_ids": ids, "attention_mask": mask}
    want = _reference_jacobian(model, parts["blocks"], row, 0, [3, 4, 5, 6])
    torch.testing.assert_close(lens.jacobians[0], want, rtol=0, atol=1e-6)  # RMSNorm: float32


def test_a_text_models_texts_are_its_prompts() -> None:
    """Texts of a TextModel: each its own prompt, tokenized by the model (padded on the right)."""
    tokenizers = pytest.importorskip("tokenizers")
    from multihead.text import TextModel

    model, parts = _family_model("gpt2")
    chars = (string.ascii_lowercase + string.ascii_uppercase)[:V]
    bpe = tokenizers.models.BPE({c: i for i, c in enumerate(chars)}, [], unk_token="a")
    text_model = TextModel(model, tokenizers.Tokenizer(bpe), head="lm")
    texts = ["bcdefghij", "klmnop"]  # one token a letter: "b" is 1, ...
    lens = JacobianLens.fit(text_model, texts, skip_first_positions=1)
    assert lens.n_prompts == 2
    rows = [torch.arange(1, 10)[None], torch.arange(10, 16)[None]]
    for layer in (0, 1):
        want = sum(
            _reference_jacobian(model, parts["blocks"], {"input_ids": ids}, layer,
                                list(range(1, ids.shape[1] - 1)))
            for ids in rows
        ) / 2  # fmt: skip
        torch.testing.assert_close(lens.jacobians[layer], want, rtol=0, atol=1e-10)


def test_logit_lens_through_a_jacobian_lens(device: torch.device) -> None:
    model, parts = _family_model("gpt2", device=device)
    ids = torch.randint(V, (2, 6), device=device)
    plain = multihead.logit_lens(model, ids, top_k=None)
    # the identity lens is the logit lens, exactly
    eye = JacobianLens({0: torch.eye(24), 1: torch.eye(24)}, 1, 24)
    same = multihead.logit_lens(model, ids, top_k=None, lens=eye)
    assert plain.logits is not None and same.logits is not None
    assert torch.equal(same.logits, plain.logits)
    for layer in range(3):
        assert torch.equal(same.head_logits(layer), plain.head_logits(layer))
    # a random lens: W_U final_norm(J h) by hand, the last layer the model's logits
    gen = torch.Generator().manual_seed(3)
    js = {k: (torch.randn(24, 24, generator=gen) / 5).to(device, torch.float64) for k in (0, 1)}
    lens = multihead.logit_lens(model, ids, top_k=None, lens=JacobianLens(js, 4, 24))
    assert lens.logits is not None and lens.lens is not None
    streams = _block_outputs(model, parts["blocks"], ids)
    norm, head = parts["norm"], parts["head"]
    with torch.no_grad():
        for layer in (0, 1):
            want = head(norm(streams[layer] @ js[layer].T))
            torch.testing.assert_close(lens.logits[layer], want, rtol=0, atol=1e-12)
        torch.testing.assert_close(lens.logits[2], model(ids).logits, rtol=0, atol=1e-12)
    # each head's write through J, then the final norm frozen at the run (LayerNorm: γ (c -
    # mean c) / σ of the final stream), then W_U
    final = streams[-1]
    sigma = (final.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    sigma = sigma[:, :, None]  # (B, T, 1, 1): over the heads too
    for layer in (0, 1):
        written = plain.results[layer] @ js[layer].T  # (B, T, H, E)
        centred = written - written.mean(-1, keepdim=True)
        want = (norm.weight * centred / sigma) @ head.weight.T
        torch.testing.assert_close(lens.head_logits(layer), want, rtol=0, atol=1e-12)


def _tuned_state(count: int, width: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """tuned-lens 0.2.0's params.pt: its translators' ModuleList state dict."""
    state = {}
    for i in range(count):
        state[f"{i}.weight"] = torch.randn(width, width, generator=gen) / 10
        state[f"{i}.bias"] = torch.randn(width, generator=gen) / 10
    return state


def _write_tuned(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    torch.save(state, path / "params.pt")
    return path


CONFIG = {
    "base_model_name_or_path": "", "d_model": 24, "num_hidden_layers": 3, "bias": True,
    "base_model_revision": None, "unembed_hash": None, "lens_type": "linear_tuned_lens",
}  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_tuned_lens_in_tuned_lens_layout_reads_w_u_norm_h_plus_a_h_plus_b(
    family: str, tmp_path: Path, device: torch.device
) -> None:
    model, parts = _family_model(family, device=device)
    gen = torch.Generator().manual_seed(1)
    state = _tuned_state(3, 24, gen)
    lens = TunedLens.load(_write_tuned(tmp_path / "lens", CONFIG, state))
    ids = torch.randint(V, (2, 6), device=device)
    read = multihead.logit_lens(model, ids, top_k=None, lens=lens)
    on = {name: t.to(device, torch.float64) for name, t in state.items()}
    assert read.logits is not None
    streams = _block_outputs(model, parts["blocks"], ids)
    norm, head = parts["norm"], parts["head"]
    with torch.no_grad():
        for layer in (0, 1):  # block l's output is tuned-lens's hidden_states[l + 1]
            a, b = on[f"{layer + 1}.weight"], on[f"{layer + 1}.bias"]
            h = streams[layer]
            torch.testing.assert_close(
                read.logits[layer], head(norm(h + h @ a.T + b)), rtol=0, atol=1e-6
            )
        torch.testing.assert_close(read.logits[2], model(ids).logits, rtol=0, atol=1e-6)
    # a head's write through I + A alone (the bias is no head's), then the frozen norm, W_U
    plain = multihead.logit_lens(model, ids, top_k=None)
    for layer in (0, 1):
        a = on[f"{layer + 1}.weight"]
        written = plain.results[layer]
        want = plain.head_logits(layer) + (
            plain.norm.linear(written @ a.T) @ plain.unembedding.T  # type: ignore[union-attr]
        )
        torch.testing.assert_close(read.head_logits(layer), want, rtol=0, atol=1e-6)
    # translator 0 reads the embeddings (hidden_states[0])
    h0 = torch.randn(5, 24, dtype=torch.float64, device=device)
    a0, b0 = on["0.weight"], on["0.bias"]
    torch.testing.assert_close(lens.transform_hidden(h0, 0), h0 + h0 @ a0.T + b0)

    # the same lens in tuned-lens 0.0.x's layout, and in the safetensors twin
    legacy = {
        "input_translator.weight": state["0.weight"],
        "input_translator.bias": state["0.bias"],
    }
    for i in (1, 2):
        legacy[f"layer_translators.{i - 1}.weight"] = state[f"{i}.weight"]
        legacy[f"layer_translators.{i - 1}.bias"] = state[f"{i}.bias"]
    legacy["unembedding.weight"] = torch.zeros(V, 24)  # the lens's own copy: not read
    old = {"d_model": 24, "num_layers": 3, "bias": True, "include_input": True,
           "reuse_unembedding": True, "extra_layers": 0}  # fmt: skip
    from_legacy = TunedLens.load(_write_tuned(tmp_path / "old", old, legacy))
    assert torch.equal(from_legacy.weights, lens.weights)
    assert from_legacy.biases is not None and lens.biases is not None
    assert torch.equal(from_legacy.biases, lens.biases)
    lens.save(tmp_path / "twin", ckpt="params.safetensors")
    twin = TunedLens.load(tmp_path / "twin")
    assert torch.equal(twin.weights, lens.weights) and twin.config == lens.config


def test_tuned_lens_save_writes_tuned_lens_layout(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    state = _tuned_state(3, 24, gen)
    lens = TunedLens(
        torch.stack([state[f"{i}.weight"] for i in range(3)]),
        torch.stack([state[f"{i}.bias"] for i in range(3)]),
        {"base_model_name_or_path": "org/tiny"},
    )
    lens.save(tmp_path / "lens")
    written = torch.load(tmp_path / "lens" / "params.pt", weights_only=True)
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], state[k]) for k in state)
    config = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert config == {**CONFIG, "base_model_name_or_path": "org/tiny"}


def test_tuned_lens_fit_is_the_ridge_least_squares_solution(device: torch.device) -> None:
    model, parts = _family_model("llama", device=device)
    ids = torch.randint(V, (3, 7), device=device)
    mask = torch.ones(3, 7, dtype=torch.long, device=device)
    mask[2, 5:] = 0
    ridge = 0.05
    lens = TunedLens.fit(model, {"input_ids": ids, "attention_mask": mask}, ridge=ridge,
                         skip_first_positions=1)  # fmt: skip
    assert lens.config["unembed_hash"] == unembed_hash(model.lm_head.weight)
    streams = _block_outputs(model, parts["blocks"], {"input_ids": ids, "attention_mask": mask})
    with torch.no_grad():
        embeddings = model.model.embed_tokens(ids)
    keep = mask.bool().clone()
    keep[:, 0] = False  # the first real position left out
    target = streams[-1][keep].cpu()  # (N, E); the reference solved on the CPU
    for i, h in enumerate([embeddings, *streams[:-1]]):
        x = h[keep].cpu()
        xc = x - x.mean(0)
        lam = ridge * float((xc * xc).sum()) / 24
        # min ‖(target - x) - [x, 1] [Aᵀ; bᵀ]‖² + λ‖A‖²: lstsq on the augmented rows
        design = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
        extra = torch.cat(
            [lam**0.5 * torch.eye(24, dtype=x.dtype), torch.zeros(24, 1, dtype=x.dtype)], 1
        )
        rhs = torch.cat([target - x, torch.zeros(24, 24, dtype=x.dtype)])
        solution = torch.linalg.lstsq(torch.cat([design, extra]), rhs).solution  # (E + 1, E)
        torch.testing.assert_close(lens.weights[i], solution[:24].T, rtol=0, atol=1e-8)
        assert lens.biases is not None
        torch.testing.assert_close(lens.biases[i], solution[24], rtol=0, atol=1e-8)


# -- TransformerLens 4.3's JacobianLens ------------------------------------------------------------


def _bridge(model: nn.Module, family: str, tmp_path: Path) -> Any:
    """A TransformerBridge around a copy of ``model``, with a character tokenizer (TL's fit
    takes texts): each of the first V letters one token, "a" (0) the BOS."""
    transformers = pytest.importorskip("transformers", minversion="5")
    tokenizers = pytest.importorskip("tokenizers")
    sources = pytest.importorskip("transformer_lens.model_bridge.sources")
    if not hasattr(sources, "build_bridge_from_module"):
        pytest.skip("TransformerLens before 4.0 has no TransformerBridge")
    chars = (string.ascii_lowercase + string.ascii_uppercase)[:V]
    bpe = tokenizers.models.BPE({c: i for i, c in enumerate(chars)}, [], unk_token="a")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(bpe), bos_token="a", eos_token="a", unk_token="a",
        pad_token="a",
    )  # fmt: skip
    fast.save_pretrained(tmp_path / "tokenizer")  # TransformerLens reloads it by its path
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    architecture = "GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM"
    wrapped: Any = copy.deepcopy(model)
    return sources.build_bridge_from_module(
        wrapped, architecture, hf_config=wrapped.config, tokenizer=tokenizer
    )


class Pickled:
    """An object a ``torch.load(weights_only=True)`` refuses to unpickle."""


PROMPTS = ["bcdefghijklm", "nopqrstu", "vwxyzABCDEFGHIJ", "KLM"]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_fit_equals_transformer_lens_and_files_load_in_each_other(
    family: str, tmp_path: Path
) -> None:
    analysis = pytest.importorskip("transformer_lens.tools.analysis.jacobian_lens")
    model, _ = _family_model(family, torch.float32)
    bridge = _bridge(model, family, tmp_path)
    with pytest.warns(UserWarning, match="skipping prompt"):  # "KLM": too short for both
        theirs = analysis.JacobianLens.fit(
            bridge, PROMPTS, corpus="letters", skip_first_positions=3, show_progress=False
        )
    rows = [bridge.to_tokens(p)[0] for p in PROMPTS]  # TransformerLens's own ids (BOS first)
    t = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    with pytest.warns(UserWarning, match="skipped 1 prompt"):
        ours = JacobianLens.fit(
            model, {"input_ids": ids, "attention_mask": mask}, skip_first_positions=3, dim_batch=7
        )
    assert ours.source_layers == theirs.source_layers and ours.n_prompts == theirs.n_prompts
    for layer in ours.source_layers:
        torch.testing.assert_close(
            ours.jacobians[layer], theirs.jacobians[layer], rtol=0, atol=1e-5
        )

    # multihead's .pt in TransformerLens, and its readout of it equal to logit_lens's
    ours.save(tmp_path / "ours.pt")
    loaded = analysis.JacobianLens.load(str(tmp_path / "ours.pt"))
    assert loaded.source_layers == ours.source_layers and loaded.d_model == 24
    assert loaded.n_prompts == ours.n_prompts and loaded.metadata == ours.metadata
    for layer in ours.source_layers:
        assert torch.equal(loaded.jacobians[layer], ours.jacobians[layer])
    readout = loaded.readout(bridge, rows[0][None], return_full_logits=True)
    read = multihead.logit_lens(model, rows[0][None], top_k=None, lens=ours)
    assert read.logits is not None
    for i, layer in enumerate(read.layers):
        torch.testing.assert_close(read.logits[i, 0], readout.lens_logits[layer], rtol=0, atol=1e-5)

    # TransformerLens's files in multihead: its default float16 and float32
    for dtype in (torch.float16, torch.float32):
        theirs.save(str(tmp_path / "theirs.pt"), dtype=dtype)
        back = JacobianLens.load(tmp_path / "theirs.pt")
        assert back.metadata == theirs.metadata and back.n_prompts == theirs.n_prompts
        for layer in theirs.source_layers:
            want = theirs.jacobians[layer].to(dtype).float()
            assert torch.equal(back.jacobians[layer], want)

    # the reference's fit checkpoint: multihead and TransformerLens convert it alike
    sums = {layer: 2 * theirs.jacobians[layer] for layer in theirs.source_layers}
    checkpoint = {
        "jacobian_sum": sums, "n_done": 2, "next_idx": 2, "source_layers": [0, 1],
        "target_layer": 2, "skip_first": 3, "model_name": "tiny", "corpus": "letters",
        "metadata": {"fit_dtype": "float32", "seed": 7, "probe": torch.zeros(2)},
    }  # fmt: skip
    torch.save(checkpoint, tmp_path / "checkpoint.pt")
    from_checkpoint = JacobianLens.load(tmp_path / "checkpoint.pt")
    theirs_too = analysis.JacobianLens.load(str(tmp_path / "checkpoint.pt"))
    assert from_checkpoint.metadata == theirs_too.metadata
    assert from_checkpoint.n_prompts == theirs_too.n_prompts == 2
    for layer in theirs.source_layers:
        assert torch.equal(from_checkpoint.jacobians[layer], theirs_too.jacobians[layer])


def test_the_safetensors_twin_holds_the_same(tmp_path: Path) -> None:
    model, _ = _family_model("lm")
    lens = JacobianLens.fit(model, torch.randint(V, (2, 8)), skip_first_positions=1)
    for dtype in (torch.float32, torch.float64):
        lens.save(tmp_path / "lens.safetensors", dtype=dtype)
        back = JacobianLens.load(tmp_path / "lens.safetensors")
        assert back.metadata == lens.metadata and back.n_prompts == lens.n_prompts
        for layer in lens.source_layers:
            assert torch.equal(
                back.jacobians[layer],
                lens.jacobians[layer].to(dtype).to(back.jacobians[layer].dtype),
            )
    assert back.jacobians[0].dtype == torch.float64


# -- provenance --------------------------------------------------------------------------------


def test_provenance_differences_are_one_warning(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    model, _ = _family_model("gpt2")
    model.config._name_or_path = "/somewhere/hub/models--org--tiny-gpt2/snapshots/0a1b"  # read once
    lens = JacobianLens(
        {0: torch.eye(24)}, 1, 24,
        {"model_name": "org/other-model", "transformers_version": "0.0.1"},
    )  # fmt: skip
    lens.save(tmp_path / "lens.pt")
    ids = torch.randint(V, (1, 5))
    with pytest.warns(UserWarning) as caught:
        multihead.logit_lens(model, ids, lens=lens, layers=[0, 2])
    assert len(caught) == 1 and caught[0].filename == __file__  # the caller's line
    message = str(caught[0].message)
    assert "'org/other-model'" in message and "'org/tiny-gpt2'" in message
    assert f"transformers 0.0.1, this is transformers {transformers.__version__}" in message
    with pytest.warns(UserWarning, match="may not belong to this model") as caught:
        JacobianLens.load(tmp_path / "lens.pt", model=model)
    assert len(caught) == 1 and caught[0].filename == __file__
    # the same model under another directory (its last path component), another model unknown
    same = JacobianLens({0: torch.eye(24)}, 1, 24, {"model_name": "org/tiny-gpt2"})
    tuned = TunedLens(torch.zeros(3, 24, 24), None, {
        "base_model_name_or_path": "tiny-gpt2", "unembed_hash": unembed_hash(model.lm_head.weight)
    })  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        multihead.logit_lens(model, ids, lens=same, layers=0)
        multihead.logit_lens(model, ids, lens=tuned, layers=0)
    stale = TunedLens(torch.zeros(3, 24, 24), None, {"unembed_hash": "0" * 64})
    with pytest.warns(UserWarning, match="its unembed_hash is not the model's unembedding's"):
        stale.check(model)


# -- bad inputs --------------------------------------------------------------------------------


def test_fit_refusals() -> None:
    model, _ = _family_model("lm")
    ids = torch.randint(V, (2, 6))
    cases: list[tuple[dict[str, Any], type, str]] = [
        (
            {"skip_first_positions": -1},
            ValueError,
            "skip_first_positions must be an int >= 0, got -1",
        ),
        ({"dim_batch": 0}, ValueError, "dim_batch must be a positive int, got 0"),
        ({"layers": [2]}, ValueError, r"layers must be below the last layer \(2\).*got \[2\]"),
        ({"layers": [3]}, ValueError, "layers index 3 is out of range: there are 3 layers"),
        ({"layers": "0"}, TypeError, "layers must be an int, a sequence of ints or None"),
        ({"corpus": " "}, ValueError, "corpus must be a non-empty str or None"),
        ({"metadata": {"n_prompts": 3}}, ValueError, r"may not set .*\['n_prompts'\]"),
        ({"metadata": {"x": torch.zeros(1)}}, TypeError, r"metadata\['x'\] must hold None"),
        ({"metadata": {1: "x"}}, ValueError, "metadata must have str keys, got 1"),
        ({"skip_first_positions": 5}, ValueError, "found no prompt with more than"),
    ]
    for kwargs, error, match in cases:
        with pytest.raises(error, match=match), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            JacobianLens.fit(model, ids, **kwargs)
    with pytest.raises(ValueError, match="needs the model in eval mode"):
        JacobianLens.fit(model.train(), ids)
    encoder = multihead.TransformerEncoder(
        [multihead.TransformerEncoderLayer(24, 4, 40) for _ in range(2)]
    ).eval()
    with pytest.raises(ValueError, match="JacobianLens.fit needs a causal model"):
        JacobianLens.fit(encoder, torch.randn(1, 6, 24))
    one_layer = TransformerLM(V, 24, 6, 1, 40, max_len=16).eval()
    with pytest.raises(ValueError, match="needs a model of at least 2 layers, TransformerLM has 1"):
        JacobianLens.fit(one_layer, ids)
    with pytest.raises(ValueError, match="ridge must be a finite number > 0, got 0"):
        TunedLens.fit(model.eval(), ids, ridge=0)


def test_file_and_model_refusals(tmp_path: Path) -> None:
    model, _ = _family_model("lm")
    lens = JacobianLens({0: torch.eye(24), 1: torch.eye(24)}, 1, 24)
    suffixes = r"must end in \.pt, \.pth, \.safetensors \(the format\), got '.*lens\.bin'"
    with pytest.raises(ValueError, match=suffixes):
        lens.save(tmp_path / "lens.bin")
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        lens.save(tmp_path / "lens.pt", dtype=torch.int32)
    with pytest.raises(FileNotFoundError, match="missing"):
        JacobianLens.load(tmp_path / "none.pt")

    torch.save({"J": {0: torch.eye(24)}, "extra": Pickled()}, tmp_path / "pickled.pt")
    with pytest.raises(
        ValueError,
        match=r"pickled\.pt' is not a Jacobian lens that torch\.load\(weights_only=True\) "
        r"reads.*Unsupported global",
    ) as refused:
        JacobianLens.load(tmp_path / "pickled.pt")
    assert "\n" not in str(refused.value)
    torch.save({"weights": torch.eye(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="other.pt' is not a Jacobian lens: it holds no 'J'"):
        JacobianLens.load(tmp_path / "other.pt")
    torch.save({"J": {0: torch.eye(3)}, "d_model": 24}, tmp_path / "shape.pt")
    with pytest.raises(
        ValueError,
        match=r"shape.pt' is not a Jacobian lens: jacobians\[0\] must be \(d_model, d_model\) "
        r"= \(24, 24\), got shape \(3, 3\)",
    ):
        JacobianLens.load(tmp_path / "shape.pt")
    torch.save({"J": {0: torch.eye(3)}}, tmp_path / "width.pt")
    with pytest.raises(ValueError, match="width.pt' is not a Jacobian lens: it has no 'd_model'"):
        JacobianLens.load(tmp_path / "width.pt")
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        ValueError, match="model.safetensors' is not a Jacobian lens: its metadata has no 'lens'"
    ):
        JacobianLens.load(tmp_path / "model.safetensors")

    # lenses that do not fit the model
    with pytest.raises(ValueError, match="the Jacobian lens is 16 wide .* is 24 wide"):
        JacobianLens({0: torch.eye(16)}, 1, 16).check(model)
    with pytest.raises(
        ValueError, match=r"has layers \[2\], outside the model's source layers 0..1"
    ):
        JacobianLens({2: torch.eye(24)}, 1, 24).check(model)
    with pytest.raises(ValueError, match=r"maps to layer 5, not to the model's last \(2\)"):
        JacobianLens({0: torch.eye(24)}, 1, 24, {"target_layer": 5}).check(model)
    ids = torch.randint(V, (1, 5))
    with pytest.raises(ValueError, match=r"no matrix for layer 1: it has layers \[0\]"):
        multihead.logit_lens(model, ids, lens=JacobianLens({0: torch.eye(24)}, 1, 24))
    with pytest.raises(
        TypeError, match="lens must be a JacobianLens, a TunedLens or None, got dict"
    ):
        multihead.logit_lens(model, ids, lens={0: torch.eye(24)})  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match="the tuned lens is for 4 layers 24 wide, the model TransformerLM has 3 layers",
    ):
        multihead.logit_lens(model, ids, lens=TunedLens(torch.zeros(4, 24, 24), None))

    # tuned-lens directories
    with pytest.raises(FileNotFoundError, match="is not a directory: a tuned lens is one"):
        TunedLens.load(tmp_path / "nowhere")
    state = _tuned_state(3, 24, torch.Generator().manual_seed(0))
    both = _write_tuned(tmp_path / "both", CONFIG, state)
    (both / "params.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="params.pt and params.safetensors; name one with ckpt="):
        TunedLens.load(both)
    short = dict(state)
    del short["2.bias"]
    with pytest.raises(
        ValueError,
        match=r"not the parameters its config.json describes \(3 streams 24 wide\): missing 2.bias",
    ):
        TunedLens.load(_write_tuned(tmp_path / "short", CONFIG, short))
    with pytest.raises(ValueError, match="lens_type must be 'linear_tuned_lens', got 'other'"):
        TunedLens.load(_write_tuned(tmp_path / "type", {**CONFIG, "lens_type": "other"}, state))
    old = {"d_model": 24, "num_layers": 3, "reuse_unembedding": False}
    with pytest.raises(ValueError, match="its own unembedding .* not read"):
        TunedLens.load(_write_tuned(tmp_path / "old", old, state))
    torch.save({"0.weight": Pickled()}, tmp_path / "both" / "params.pt")
    with pytest.raises(ValueError, match="is not a tuned lens's parameters that torch.load"):
        TunedLens.load(tmp_path / "both", ckpt="params.pt")
    with pytest.raises(ValueError, match="ckpt must be a file name ending in .pt or .safetensors"):
        TunedLens(torch.zeros(3, 24, 24), None).save(tmp_path / "x", ckpt="../params.pt")


@pytest.mark.parametrize(
    ("where", "want"),
    [
        ("hub/models--org--tiny-gpt2/snapshots/0123abcd", "org/tiny-gpt2"),
        ("some/directory", None),
    ],
)
def test_a_lens_records_a_models_name_not_a_directory(
    tmp_path: Path, where: str, want: str | None
) -> None:
    """A model read from this machine's directories records its Hub name where its cache folder
    spells it, and no name for a plain directory (it names no model another machine has)."""
    transformers = pytest.importorskip("transformers")
    from multihead.circuits.decompose.lens_provenance import LensProvenance

    config = transformers.GPT2Config(vocab_size=20, n_embd=8, n_layer=2, n_head=2, n_positions=8)
    config._name_or_path = str(tmp_path / where)
    model = transformers.GPT2LMHeadModel(config).eval()
    assert LensProvenance.of(model).model_name == want
    config._name_or_path = "gpt2"  # a Hub name as given (a fresh model: its map is made anew)
    assert LensProvenance.of(transformers.GPT2LMHeadModel(config)).model_name == "gpt2"
