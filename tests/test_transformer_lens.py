"""multihead.cache against TransformerLens's ``run_with_cache``, where TransformerLens installs.

TransformerLens 4 wraps a transformers model in a ``TransformerBridge`` whose forward is the
model's own (no weight processing unless ``enable_compatibility_mode`` is called), so its cache and
multihead's are of the same weights: every site multihead has must equal TransformerLens's hook of
the same name to 1e-5 in float32. Built from a randomly initialised model with
``build_bridge_from_module``: nothing is downloaded. On the CPU whatever the test device: the
bridge is an outside reference, not the code under test.

One difference of naming: on a rotary model TransformerLens's ``hook_q`` / ``hook_k`` are the
projections before rotary (``hook_rot_q`` / ``hook_rot_k`` after), while multihead's ``q`` and
``k`` are what the attention kernel reads, after rotary.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import multihead
from multihead.circuits.activation_cache import SITES, hook_name

transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("transformer_lens")
bridge_sources = pytest.importorskip("transformer_lens.model_bridge.sources")
if not hasattr(bridge_sources, "build_bridge_from_module"):
    pytest.skip("TransformerLens before 4.0 has no TransformerBridge", allow_module_level=True)

ATOL = 1e-5


def _model(family: str) -> tuple[nn.Module, str]:
    """A tiny transformers model of ``family`` with every weight, bias and norm gain perturbed
    (transformers' initialisation zeroes biases, which would hide a bias mistake), in float32."""
    if family == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=50, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(config)
        architecture = "GPT2LMHeadModel"
    else:
        config = transformers.LlamaConfig(
            vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
            attention_bias=True,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        architecture = "LlamaForCausalLM"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.to(torch.float32).eval(), architecture


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cache_equals_transformer_lens_run_with_cache(family: str) -> None:
    model, architecture = _model(family)
    # the bridge swaps the model's submodules for its own: give it a copy
    wrapped = copy.deepcopy(model)
    bridge = bridge_sources.build_bridge_from_module(
        wrapped, architecture, hf_config=wrapped.config
    )
    bridge.set_use_attn_result(True)  # hook_result, as in HookedTransformer
    ids = torch.randint(50, (2, 7))
    logits, theirs = bridge.run_with_cache(ids)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=ATOL)
    ours = multihead.cache(model, {"input_ids": ids}, names=lambda site, layer: True)

    rotary = family == "llama"
    layers = range(model.config.num_hidden_layers)
    names = {hook_name(site, layer) for site in SITES for layer in layers}
    assert names <= set(theirs.keys())  # TransformerLens names every site multihead has
    assert {hook_name(site, layer) for site, layer in ours} == names
    b, t = ids.shape
    heads = model.config.num_attention_heads
    for layer in layers:
        for site in SITES:
            name = hook_name(site, layer)
            reference = name
            if rotary and site in ("q", "k"):
                reference = name.replace("hook_", "hook_rot_")  # after rotary, as multihead's
            got, expected = ours[name], theirs[reference]
            assert got.shape == expected.shape, name
            torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=name)
        assert ours["pattern", layer].shape == theirs[hook_name("pattern", layer)].shape
        assert ours["pattern", layer].shape == (b, heads, t, t)
    if rotary:  # TransformerLens's names after rotary read multihead's q and k
        assert ours["blocks.1.attn.hook_rot_q"] is ours["q", 1]
        assert ours["blocks.0.attn.hook_rot_k"] is ours["k", 0]
        # grouped-query: keys and values with the key/value heads in both
        assert ours["k", 0].shape[2] == theirs["blocks.0.attn.hook_k"].shape[2] == 2
        assert ours["v", 0].shape[2] == theirs["blocks.0.attn.hook_v"].shape[2] == 2

    # positions cut before storing: the same rows of TransformerLens's full tensors
    cut = multihead.cache(
        model, {"input_ids": ids}, names=["resid_post", "z", "pattern"], positions=[-1, 2]
    )
    for layer in layers:
        for site in ("resid_post", "z"):
            torch.testing.assert_close(
                cut[site, layer], theirs[hook_name(site, layer)][:, [t - 1, 2]], rtol=0, atol=ATOL
            )
        torch.testing.assert_close(
            cut["pattern", layer],
            theirs[hook_name("pattern", layer)][:, :, [t - 1, 2]],
            rtol=0,
            atol=ATOL,
        )
