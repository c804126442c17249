"""multihead.cache against TransformerLens's ``run_with_cache``, where TransformerLens installs.

TransformerLens 4 wraps a transformers model in a ``TransformerBridge`` whose forward is the
model's own (no weight processing unless ``enable_compatibility_mode`` is called), so its cache and
multihead's are of the same weights: every site multihead has must equal TransformerLens's hook of
the same name to 1e-5 in float32. Built from a randomly initialised model with
``build_bridge_from_module``: nothing is downloaded. On the CPU whatever the test device: the
bridge is an outside reference, not the code under test.

One difference of naming: on a rotary model TransformerLens's ``hook_q`` / ``hook_k`` are the
projections before rotary (``hook_rot_q`` / ``hook_rot_k`` after), while multihead's ``q`` and
``k`` are what the attention kernel reads, after rotary: there multihead refuses the names
before the turn.

Then activation patching (``multihead.patch`` against ``transformer_lens.patching``'s
``get_act_patch_*``) and direct logit attribution per example (``multihead.logit_attribution``
against the cache's ``stack_head_results`` and ``logit_attrs``), to the same 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import multihead
from multihead.circuits.runs.site_names import HEAD_SITES, RESIDUAL_SITES, hook_name

# the residual stream's and the heads' sites; the others are test_the_other_sites_...'s
SITES = (*RESIDUAL_SITES, *HEAD_SITES, "pattern")

transformers = pytest.importorskip("transformers", minversion="5")
pytest.importorskip("transformer_lens")
bridge_sources = pytest.importorskip("transformer_lens.model_bridge.sources")
tl_patching = pytest.importorskip("transformer_lens.patching")
if not hasattr(bridge_sources, "build_bridge_from_module"):
    pytest.skip("TransformerLens before 4.0 has no TransformerBridge", allow_module_level=True)

ATOL = 1e-5


def _model(family: str) -> tuple[Any, str]:
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


def _bridge(model: nn.Module, architecture: str, **processing: Any) -> Any:
    """A TransformerBridge around a copy of ``model`` (the bridge swaps the model's submodules
    for its own), with hook_result on; with ``processing``, TransformerLens's weight processing
    (``enable_compatibility_mode``'s arguments) on the copy's weights."""
    wrapped: Any = copy.deepcopy(model)
    bridge = bridge_sources.build_bridge_from_module(
        wrapped, architecture, hf_config=wrapped.config
    )
    if processing:
        bridge.enable_compatibility_mode(disable_warnings=True, **processing)
    bridge.set_use_attn_result(True)  # hook_result, as in HookedTransformer
    return bridge


# per example: the token whose logit is explained and the one it is measured against
ANSWER, WRONG = torch.tensor([3, 7, 11]), torch.tensor([5, 2, 9])


def _logit_diff(logits: torch.Tensor) -> torch.Tensor:
    """The mean over the batch of logit(ANSWER) - logit(WRONG) at the last position, from the
    logits (B, T, V): the metric both libraries are given."""
    last = logits[:, -1]
    rows = torch.arange(last.shape[0])
    return (last[rows, ANSWER] - last[rows, WRONG]).mean()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cache_equals_transformer_lens_run_with_cache(family: str) -> None:
    model, architecture = _model(family)
    bridge = _bridge(model, architecture)
    ids = torch.randint(50, (2, 7))
    logits, theirs = bridge.run_with_cache(ids)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=ATOL)
    ours = multihead.cache(model, {"input_ids": ids}, names=lambda site, layer: site in SITES)

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
            got, expected = ours[site, layer], theirs[reference]
            if rotary and site in ("q", "k"):  # TransformerLens's name before the turn: refused
                with pytest.raises(KeyError, match="before the turn"):
                    ours[name]
            else:
                assert ours[name] is got
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


@pytest.mark.parametrize(
    ("family", "site"),
    [("gpt2", "resid_pre"), ("llama", "resid_pre"), ("gpt2", "attn_out"), ("llama", "mlp_out")],
)
def test_patch_equals_transformer_lens_get_act_patch(family: str, site: str) -> None:
    """``patch(site=..., per_position=True)`` (denoising: clean activations into the corrupt
    run) against ``get_act_patch_resid_pre`` / ``_attn_out`` / ``_mlp_out`` on the same,
    unprocessed weights. TransformerLens's cells are the patched run's metric; multihead's are
    its change from the corrupt run's, which ``PatchResult.corrupt`` holds."""
    model, architecture = _model(family)
    bridge = _bridge(model, architecture)
    clean, corrupt = torch.randint(50, (3, 6)), torch.randint(50, (3, 6))
    _, clean_cache = bridge.run_with_cache(clean)
    with torch.no_grad():
        corrupt_metric = float(_logit_diff(bridge(corrupt)))
    reference = getattr(tl_patching, f"get_act_patch_{site}")
    theirs = reference(bridge, corrupt, clean_cache, _logit_diff)  # (L, T)
    ours = multihead.patch(
        model, clean, corrupt, _logit_diff, site=site, per_position=True, direction="denoise"
    )
    assert ours.values.shape == theirs.shape == (model.config.num_hidden_layers, 6)
    assert ours.corrupt == pytest.approx(corrupt_metric, abs=ATOL)
    # effects far above the tolerance: the comparison below is not of zeros
    assert float(ours.values.abs().max()) > 1000 * ATOL
    torch.testing.assert_close(ours.values, theirs - corrupt_metric, rtol=0, atol=ATOL)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logit_attribution_equals_transformer_lens_per_example(family: str) -> None:
    """Each head's direct contribution at the last position, per example (B = 3 prompts and
    per-example answers), against TransformerLens's stacked head results through the final
    norm's scale at the run.

    TransformerLens's ``apply_ln=True`` centres the stack (LayerNorm) and divides by the cached
    ``ln_final.hook_scale``, but does not multiply by the final norm's gain γ: on
    HookedTransformer's processed weights γ lives in W_U (``fold_ln``), while the unprocessed
    bridge's ``W_U`` is the model's bare ``lm_head`` (its docstring warns DLA is misleading
    there). So (1) on the unprocessed bridge the applied stack is projected onto γ ⊙ W_U[a] here,
    for the answer's logit alone; (2) on a bridge with TransformerLens's processing (fold_ln,
    centred writing weights and unembedding) its own ``logit_attrs`` gives the logit difference
    answer - wrong: ``center_unembed`` shifts every logit of a position by the same amount, which
    a difference cancels, and which a single logit would not.

    ``fold_value_biases`` stays off: it moves each head's value bias term b_V^h W_O^h (constant
    over positions, the pattern's rows summing to 1) out of the head into the layer's output
    bias, while multihead's heads keep it (a head's output is what its z writes, value bias
    included): a difference of convention, not of the sum. (TransformerLens 4.3's
    fold_value_biases also fails on the grouped-query Llama: it reshapes the key/value heads'
    b_V as if there were one per query head.)"""
    model, architecture = _model(family)
    ids = torch.randint(50, (3, 6))
    assert all(not torch.equal(ids[0], row) for row in ids[1:])  # different prompts
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    final_norm: Any = model.transformer.ln_f if family == "gpt2" else model.model.norm
    unembedding: Any = model.lm_head.weight  # (V, E), no bias in either family
    assert model.lm_head.bias is None

    # (1) the unprocessed weights, as the cache test: the answer's logit
    bridge = _bridge(model, architecture)
    _, cache = bridge.run_with_cache(ids)
    stack = cache.stack_head_results(layer=-1, pos_slice=-1, apply_ln=True)  # (L·H, B, E)
    direction = (final_norm.weight * unembedding[ANSWER]).detach()  # (B, E): γ ⊙ W_U[a]
    theirs = (stack * direction).sum(-1).unflatten(0, (layers, heads))  # (L, H, B)
    ours = multihead.logit_attribution(model, ids, ANSWER, reduce="none", position=-1)
    assert ours.heads.shape == (layers, heads, 3, 1)
    torch.testing.assert_close(ours.heads[..., 0], theirs, rtol=0, atol=ATOL)
    # per example indeed: the rows differ (a batch mean broadcast would fail the comparison)
    assert float((theirs[..., 0] - theirs[..., 1]).abs().max()) > 1000 * ATOL

    # (2) TransformerLens's processed weights and its own logit_attrs: the logit difference
    processed = _bridge(model, architecture, fold_value_biases=False)
    logits, cache = processed.run_with_cache(ids)
    with torch.no_grad():  # the processing keeps the logit differences
        expected = model(ids).logits
    rows = torch.arange(3)
    torch.testing.assert_close(
        logits[rows, -1, ANSWER] - logits[rows, -1, WRONG],
        expected[rows, -1, ANSWER] - expected[rows, -1, WRONG],
        rtol=0,
        atol=ATOL,
    )
    stack = cache.stack_head_results(layer=-1, pos_slice=-1)  # logit_attrs applies the norm
    with torch.no_grad():  # its W_U is a parameter
        theirs = cache.logit_attrs(stack, ANSWER, WRONG, pos_slice=-1)
    theirs = theirs.unflatten(0, (layers, heads))
    ours = multihead.logit_attribution(model, ids, ANSWER, WRONG, reduce="none", position=-1)
    torch.testing.assert_close(ours.heads[..., 0], theirs, rtol=0, atol=ATOL)
    assert float((theirs[..., 0] - theirs[..., 2]).abs().max()) > 1000 * ATOL


# the sites TransformerLens users reach for beyond the stream and the heads (issue 51)
OTHER_SITES = (
    "embed", "pos_embed", "ln1_scale", "ln2_scale", "final_scale", "mlp_pre", "mlp_post",
    "attn_scores",
)  # fmt: skip


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_other_sites_equal_transformer_lens_hooks(family: str) -> None:
    """hook_embed, hook_pos_embed, the norms' hook_scale (ln1, ln2, ln_final), mlp.hook_pre /
    hook_post and attn.hook_attn_scores (chosen rows), cached by multihead, against
    TransformerLens's hooks of the same names on the same weights. TransformerLens's bridge
    writes transformers' mask value (the dtype's lowest) at hidden keys, multihead -inf (as
    HookedTransformer does): every other score is compared."""
    model, architecture = _model(family)
    bridge = _bridge(model, architecture)
    ids = torch.randint(50, (2, 7))
    _, theirs = bridge.run_with_cache(ids)
    rotary = family == "llama"
    names = [site for site in OTHER_SITES if not (rotary and site == "pos_embed")]
    ours = multihead.cache(model, {"input_ids": ids}, names=names)
    layers = range(model.config.num_hidden_layers)
    compared = 0
    for site, layer in ours:
        name = hook_name(site, layer)
        got, expected = ours[name], theirs[name]
        assert got.shape == expected.shape, name
        if site == "attn_scores":
            hidden = expected <= torch.finfo(expected.dtype).min / 2
            assert bool(hidden.any()) and bool((got[hidden] == float("-inf")).all()), name
            got, expected = got[~hidden], expected[~hidden]
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL, msg=name)
        compared += 1
    per_layer = len([s for s in names if s not in ("embed", "pos_embed", "final_scale")])
    assert compared == len(layers) * per_layer + len(names) - per_layer
    # the positions kept: the same rows of the scores (every key)
    cut = multihead.cache(model, {"input_ids": ids}, names=["attn_scores"], positions=[-1, 2])
    full = ours["attn_scores", 1][:, :, [6, 2]]
    torch.testing.assert_close(cut["attn_scores", 1], full, rtol=0, atol=1e-6)
    if rotary:  # a model whose positions are in its attention has no position table
        with pytest.raises(ValueError, match="pos_embed: llama has no position table"):
            multihead.cache(model, {"input_ids": ids}, names=["hook_pos_embed"])
        with pytest.raises(KeyError, match="no position table"):
            multihead.cache(model, {"input_ids": ids})["hook_pos_embed"]


def _tl_patched(bridge: Any, corrupt: torch.Tensor, cached: Any, name: str, at: int) -> float:
    """TransformerLens's patch by hand: the corrupt run with ``name``'s activation at index
    ``at`` of its second axis (a position; a head for attn_scores) the clean run's."""

    def hook(act: torch.Tensor, hook: Any) -> torch.Tensor:
        act = act.clone()  # a broadcast position table
        act[:, at] = cached[name][:, at]
        return act

    with torch.no_grad():
        return float(_logit_diff(bridge.run_with_hooks(corrupt, fwd_hooks=[(name, hook)])))


# TransformerLens's bridge rebuilds a norm's output from a hooked scale, and says so
@pytest.mark.filterwarnings("ignore:A forward hook edited hook_scale")
@pytest.mark.parametrize(
    ("family", "site"),
    [
        ("gpt2", "embed"), ("gpt2", "ln1_scale"), ("gpt2", "final_scale"), ("gpt2", "mlp_pre"),
        ("gpt2", "attn_scores"), ("llama", "ln2_scale"), ("llama", "mlp_post"),
        ("llama", "attn_scores"), ("llama", "ln1_scale"),
    ],
)  # fmt: skip
def test_the_other_sites_patch_equals_transformer_lens_hooks(family: str, site: str) -> None:
    """``patch(site=...)`` of the other sites (per position; attn_scores per head) against
    TransformerLens's run_with_hooks putting the clean activation in at that position (head)."""
    model, architecture = _model(family)
    bridge = _bridge(model, architecture)
    clean, corrupt = torch.randint(50, (3, 6)), torch.randint(50, (3, 6))
    _, cached = bridge.run_with_cache(clean)
    with torch.no_grad():
        corrupt_metric = float(_logit_diff(bridge(corrupt)))
    heads = site == "attn_scores"
    ours = multihead.patch(model, clean, corrupt, _logit_diff, site=site, per_position=not heads)
    whole_model = site in ("embed", "final_scale")
    assert ours.values.shape[0] == (1 if whole_model else model.config.num_hidden_layers)
    theirs = torch.zeros_like(ours.values)
    for layer in range(ours.values.shape[0]):
        for at in range(ours.values.shape[1]):
            name = hook_name(site, layer)
            theirs[layer, at] = _tl_patched(bridge, corrupt, cached, name, at) - corrupt_metric
    assert float(ours.values.abs().max()) > 1000 * ATOL
    torch.testing.assert_close(ours.values, theirs, rtol=0, atol=ATOL)
