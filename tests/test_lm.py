"""TransformerLM: causal forward, cached generation, left-padded batches, save/load, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from devices import generator

import multihead
from multihead.models import LMConfig, TransformerLM

V, E, H, L, F, MAX = 13, 24, 6, 2, 40, 20


def _lm(device: torch.device | str = "cpu", **kwargs) -> TransformerLM:
    return TransformerLM(V, E, H, L, F, MAX, **kwargs).to(device).eval()


def test_forward_is_causal_and_returns_per_layer_weights(device: torch.device) -> None:
    lm = _lm(device)
    ids = torch.randint(V, (2, 7), device=device)
    with multihead.capture(lm) as rec:
        logits = lm(ids)
    weights = rec.weights
    assert logits.shape == (2, 7, V)
    assert len(weights) == L and all(w.shape == (2, H, 7, 7) for w in weights)
    assert all(torch.all(w.triu(1) == 0) for w in weights)
    changed = ids.clone()
    changed[:, 4:] = (changed[:, 4:] + 1) % V  # the future must not change the past
    torch.testing.assert_close(lm(changed)[:, :4], logits[:, :4])
    assert not torch.allclose(lm(changed)[:, 4:], logits[:, 4:])


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_cached_forward_equals_full_forward(num_kv_heads: int | None, device: torch.device) -> None:
    lm = _lm(device, num_kv_heads=num_kv_heads)
    ids = torch.randint(V, (3, 9), device=device)
    with torch.no_grad():
        full = lm(ids)
        cache = lm.make_cache(3)
        steps = [lm(ids[:, :4], cache=cache)] + [
            lm(ids[:, t : t + 1], cache=cache) for t in range(4, 9)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_kv_heads", [None, 3])
def test_generate_with_and_without_cache_agree(
    num_kv_heads: int | None, device: torch.device
) -> None:
    lm = _lm(device, num_kv_heads=num_kv_heads)
    ids = torch.randint(V, (2, 5), device=device)
    with_cache = lm.generate(ids, 10)
    assert with_cache.shape == (2, 15) and torch.equal(with_cache[:, :5], ids)
    assert torch.equal(with_cache, lm.generate(ids, 10, use_cache=False))
    # Greedy: each generated token is the argmax of the full forward at the position before it.
    logits = lm(with_cache[:, :-1])
    assert torch.equal(logits[:, 4:].argmax(-1), with_cache[:, 5:])


@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_generates_as_each_row_alone(
    use_cache: bool, device: torch.device
) -> None:
    lm = _lm(device, num_kv_heads=2)
    prompts = [torch.randint(V, (n,), device=device) for n in (2, 6, 4)]
    width = 6
    ids = torch.zeros(3, width, dtype=torch.long, device=device)
    key_mask = torch.zeros(3, width, dtype=torch.bool, device=device)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        key_mask[i, width - len(p) :] = True
    batch = lm.generate(ids, 8, key_mask=key_mask, use_cache=use_cache)
    for i, p in enumerate(prompts):
        alone = lm.generate(p[None], 8)
        assert torch.equal(batch[i, width:], alone[0, len(p) :])


def test_sampling_top_k_and_reproducibility(device: torch.device) -> None:
    lm = _lm(device)
    ids = torch.randint(V, (4, 3), device=device)
    greedy = lm.generate(ids, 6)
    assert torch.equal(lm.generate(ids, 6, temperature=1.5, top_k=1), greedy)
    a = lm.generate(ids, 6, temperature=1.0, generator=generator(1, device))
    b = lm.generate(ids, 6, temperature=1.0, generator=generator(1, device))
    assert torch.equal(a, b)
    # With top_k=2 every sampled token is one of the two most likely at its step.
    sampled = lm.generate(ids, 6, temperature=5.0, top_k=2)
    top2 = lm(sampled[:, :-1])[:, 2:].topk(2, dim=-1).indices  # (B, 6, 2)
    assert (top2 == sampled[:, 3:, None]).any(-1).all()


def test_eos_stops_generation(device: torch.device) -> None:
    lm = _lm(device)
    ids = torch.randint(V, (2, 3), device=device)
    free = lm.generate(ids, 8)
    eos = int(free[0, 4])  # the second token row 0 generates
    out = lm.generate(ids, 8, eos_id=eos)
    for row in out:
        hits = (row[3:] == eos).nonzero()
        if len(hits):  # everything after a row's first eos is eos
            assert torch.all(row[3 + int(hits[0]) :] == eos)
    assert out.shape[1] <= 11
    assert torch.equal(out[0, :5], free[0, :5])


def test_save_load_round_trip(tmp_path: Path, device: torch.device) -> None:
    lm = _lm(device, num_kv_heads=3)
    lm.save(tmp_path, extra={"task": {"name": "sort"}})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model"] == LMConfig(V, E, H, L, F, MAX, num_kv_heads=3).to_dict()
    assert config["task"] == {"name": "sort"}
    loaded = TransformerLM.load(tmp_path, device=device)
    assert loaded.config == lm.config
    for (name, a), (_, b) in zip(lm.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ids = torch.randint(V, (2, 5), device=device)
    assert torch.equal(loaded.generate(ids, 4), lm.generate(ids, 4))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.cpu_only
def test_row12_cpu_0_loads_as_the_cpu(tmp_path: Path) -> None:
    """Issue 34 row 12: ``cpu:0``, a device torch accepts (was: "the weights file is truncated
    or corrupt?" on an intact file: safetensors names the CPU "cpu" only)."""
    from multihead._files import read_tensors

    lm = _lm("cpu")
    lm.save(tmp_path)
    loaded = TransformerLM.load(tmp_path, device="cpu:0")
    for (name, a), (_, b) in zip(lm.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b) and b.device.type == "cpu", name
    tensors = read_tensors(tmp_path / "model.safetensors", device=torch.device("cpu", 0))
    assert torch.equal(tensors["head.weight"], lm.head.weight)
    pytest.importorskip("tokenizers")
    from tiny_bert import write_dir

    from multihead.pretrained import load_text_model

    bert = write_dir(tmp_path / "bert", tokenizer=True)
    on_cpu0 = load_text_model(bert, device="cpu:0")
    on_cpu = load_text_model(bert)
    assert torch.equal(on_cpu0.encode("the cat sat"), on_cpu.encode("the cat sat"))


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TransformerLM.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json' is missing"):
        TransformerLM.load(tmp_path)
    _lm().save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model"]["embed_dim"] = 30  # a config that doesn't match the weights
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"match its config.json: .*has shape \(40, 24\), config.json needs \(40, 30\)",
    ):
        TransformerLM.load(tmp_path)
    config["model"]["embed_dim"] = E
    config["model"]["num_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"match its config.json: it has 3 layers, the file holds 2"
    ):
        TransformerLM.load(tmp_path)
    config["model"]["colour"] = "blue"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown LMConfig keys \['colour'\]"):
        TransformerLM.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        TransformerLM.load(tmp_path)
    _lm().save(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="could not be read as safetensors"):
        TransformerLM.load(tmp_path)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors' is missing"):
        TransformerLM.load(tmp_path)


def test_input_errors() -> None:
    lm = _lm()
    with pytest.raises(ValueError, match=r"ids must lie in \[0, vocab_size=13\), got values in"):
        lm(torch.tensor([[1, 13]]))
    with pytest.raises(ValueError, match="sequence is 21 positions long, more than the model's"):
        lm(torch.zeros(1, MAX + 1, dtype=torch.long))
    with pytest.raises(
        ValueError, match=r"prompt \(21 tokens\) plus max_new_tokens \(0\) is longer"
    ):
        lm.generate(torch.zeros(1, MAX + 1, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"prompt \(15 tokens\) plus max_new_tokens \(6\)"):
        lm.generate(torch.zeros(1, 15, dtype=torch.long), 6)
    right_padded = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="key_mask must describe left padding"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, key_mask=right_padded)
    with pytest.raises(TypeError, match="ids must be an integer tensor"):
        lm(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="top_k must be a positive int or None, got 0"):
        lm.generate(torch.zeros(1, 3, dtype=torch.long), 2, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match=r"embed_dim \(24\) must be divisible by num_heads \(5\)"):
        TransformerLM(V, E, 5, L, F, MAX)


def test_weights_saved_under_the_old_encoder_names_still_load(
    tmp_path: Path, device: torch.device
) -> None:
    """Before 'blocks'/'norm' the LM's stack was a TransformerEncoder named 'layers'."""
    from multihead._files import checksummed_safetensors

    lm = _lm(device)
    lm.save(tmp_path)
    old = {}
    for name, value in lm.state_dict().items():
        if name.startswith("blocks."):
            name = "layers.layers." + name[len("blocks.") :]
        elif name.startswith("norm."):
            name = "layers." + name
        old[name] = value.contiguous()
    assert "layers.layers.1.ff.linear1.weight" in old and "layers.norm.weight" in old
    (tmp_path / "model.safetensors").write_bytes(checksummed_safetensors(old, {"format": "pt"}))
    loaded = TransformerLM.load(tmp_path, device=device)
    ids = torch.randint(V, (2, 6), device=device)
    torch.testing.assert_close(loaded(ids), lm(ids), rtol=0, atol=0)


def test_blocks_and_final_norm_are_named_as_what_they_are() -> None:
    lm = _lm()
    names = set(lm.state_dict())
    assert any(n.startswith("blocks.1.self_attn.") for n in names)
    assert {"norm.weight", "norm.bias"} <= names
    assert not any(n.startswith("layers.") for n in names)
    assert _lm(norm_first=False).norm is None


def test_attn_only_has_no_feed_forward_and_decodes_like_its_forward(device: torch.device) -> None:
    lm = _lm(device, attn_only=True)
    names = [n for n, _ in lm.named_parameters()]
    assert not any(".ff." in n or ".norm2." in n for n in names)
    full = _lm(device)
    per_block = (E * F + F) + (F * E + E) + 2 * E  # ff.linear1, ff.linear2 and norm2
    assert full.num_parameters() - lm.num_parameters() == L * per_block
    ids = torch.randint(V, (2, 8), device=device)
    with multihead.capture(lm) as rec:
        logits = lm(ids)
    assert len(rec.weights) == L and all(torch.all(w.triu(1) == 0) for w in rec.weights)
    cache = lm.make_cache(2)
    steps = [lm(ids[:, :5], cache=cache), lm(ids[:, 5:], cache=cache)]
    torch.testing.assert_close(torch.cat(steps, 1), logits, rtol=1e-5, atol=1e-5)


def test_embedding_std_sets_the_initial_embeddings() -> None:
    torch.manual_seed(0)
    lm = TransformerLM(64, 128, 4, 1, 8, 64, embedding_std=1.0)
    assert 0.9 < float(lm.token_embedding.weight.detach().std()) < 1.1
    assert float(lm.head.weight.detach().std()) < 0.03  # the output head keeps GPT-2's 0.02
    with pytest.raises(ValueError, match="embedding_std must be a finite float > 0, got 0"):
        LMConfig(64, 128, 4, 1, 8, 64, embedding_std=0)
    with pytest.raises(ValueError, match="attn_only must be a bool, got 'yes'"):
        LMConfig(64, 128, 4, 1, 8, 64, attn_only="yes")  # type: ignore[arg-type]


def test_generate_refuses_non_finite_temperature_and_bad_sampling_arguments() -> None:
    lm = _lm()
    ids = torch.randint(V, (1, 3))
    for kwargs, match in (
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
        ({"temperature": -1.0}, "temperature must be >= 0.0, got -1.0"),
        ({"top_k": 0}, "top_k must be a positive int or None, got 0"),
        ({"eos_id": V}, f"eos_id index {V} is out of range"),
        ({"eos_id": -1}, r"eos_id must be in \[0, 13\), got -1"),
    ):
        with pytest.raises(ValueError, match=match):
            lm.generate(ids, 2, **kwargs)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0, got -1"):
        lm.generate(ids, -1)


def test_attention_only_blocks_are_the_encoder_layer_without_its_feed_forward() -> None:
    from multihead.layers import TransformerEncoderLayer

    torch.manual_seed(0)
    only = TransformerLM(V, E, H, 1, F, MAX, attn_only=True).blocks[0]
    full = TransformerEncoderLayer(E, H, F)
    kept = {k: v for k, v in full.state_dict().items() if not k.startswith(("ff.", "norm2."))}
    assert list(only.state_dict()) == list(kept)  # the names a checkpoint holds, in order
    only.load_state_dict(kept)
    x = torch.randn(2, 5, E)
    # x + attn(norm1(x)), computed from the full layer's own parts
    expected = x + full.self_attn(full.norm1(x), is_causal=True)
    torch.testing.assert_close(only(x, is_causal=True), expected, rtol=0, atol=0)
