"""Families whose attention transformers computes inside the module (GPT-Neo, MPNet, DeBERTa-v2,
BLOOM, Falcon, XGLM, RoFormer, OpenAI-GPT, ...): their heads through the output projection and
their weights through the family's score recipe (multihead.hf.unrouted_families). A family a
newer transformers routes through its attention interface (Falcon from 5.25) is observed as a
routed one there; each test holds either way.

References are transformers' own: eager ``output_attentions=True`` for the weights, and a
pre-hook of the test's own on the output projection zeroing a head's columns of its input for
ablation. Every model is a tiny random one built from its config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("multihead.hf")

import multihead  # noqa: E402
from multihead.hf import sites, unrouted_families  # noqa: E402

VOCAB = 100
T = 11
WIDTH = 32
HEADS = 4


def _config(cls: str, **kw: Any) -> Callable[[], Any]:
    def make() -> Any:
        return getattr(transformers, cls)(**kw)

    return make


# name -> (config, base model class, causal: left padding, else right)
FAMILIES: dict[str, tuple[Callable[[], Any], str, bool]] = {
    "gpt_neo": (
        _config(
            "GPTNeoConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_layers=2, num_heads=HEADS,
            attention_types=[[["global", "local"], 1]], window_size=4,
            max_position_embeddings=64,
        ),
        "GPTNeoModel",
        True,
    ),
    "mpnet": (
        _config(
            "MPNetConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, intermediate_size=40, max_position_embeddings=64,
        ),
        "MPNetModel",
        False,
    ),
    "xglm": (
        _config(
            "XGLMConfig", vocab_size=VOCAB, d_model=WIDTH, num_layers=2, attention_heads=HEADS,
            ffn_dim=40, max_position_embeddings=64,
        ),
        "XGLMModel",
        True,
    ),
    "bloom": (
        _config("BloomConfig", vocab_size=VOCAB, hidden_size=WIDTH, n_layer=2, n_head=HEADS),
        "BloomModel",
        True,
    ),
    "falcon-rotary": (
        _config(
            "FalconConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, alibi=False, multi_query=False,
            new_decoder_architecture=False,
        ),
        "FalconModel",
        True,
    ),
    "falcon-multi-query": (
        _config(
            "FalconConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, alibi=False, multi_query=True,
            new_decoder_architecture=False,
        ),
        "FalconModel",
        True,
    ),
    "falcon-new-architecture": (
        _config(
            "FalconConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, num_kv_heads=2, alibi=False,
            new_decoder_architecture=True,
        ),
        "FalconModel",
        True,
    ),
    "falcon-alibi": (
        _config(
            "FalconConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, alibi=True, multi_query=False,
            new_decoder_architecture=False,
        ),
        "FalconModel",
        True,
    ),
    "roformer": (
        _config(
            "RoFormerConfig", vocab_size=VOCAB, hidden_size=WIDTH, embedding_size=WIDTH,
            num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=40,
            max_position_embeddings=64,
        ),
        "RoFormerModel",
        False,
    ),
    "roformer-rotary-value": (
        _config(
            "RoFormerConfig", vocab_size=VOCAB, hidden_size=WIDTH, embedding_size=WIDTH,
            num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=40,
            max_position_embeddings=64, rotary_value=True,
        ),
        "RoFormerModel",
        False,
    ),
    "openai-gpt": (
        _config("OpenAIGPTConfig", vocab_size=VOCAB, n_embd=WIDTH, n_layer=2, n_head=HEADS,
                n_positions=64),
        "OpenAIGPTModel",
        False,  # its forward has no causal padding convention: padding at the end
    ),
    "deberta-v2": (
        _config(
            "DebertaV2Config", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, intermediate_size=40, max_position_embeddings=64,
            relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=8,
            max_relative_positions=16,
        ),
        "DebertaV2Model",
        False,
    ),
    "megatron-bert": (
        _config(
            "MegatronBertConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, intermediate_size=40, max_position_embeddings=64,
        ),
        "MegatronBertModel",
        False,
    ),
    "gpt_neox_japanese": (
        _config(
            "GPTNeoXJapaneseConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=2,
            num_attention_heads=HEADS, max_position_embeddings=64,
            rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            },
        ),
        "GPTNeoXJapaneseModel",
        True,
    ),
    "xlm": (
        _config("XLMConfig", vocab_size=VOCAB, emb_dim=WIDTH, n_layers=2, n_heads=HEADS,
                max_position_embeddings=64),
        "XLMModel",
        False,
    ),
}  # fmt: skip


def _model(name: str) -> nn.Module:
    make, cls, _ = FAMILIES[name]
    torch.manual_seed(0)
    config = make()
    config._attn_implementation = "eager"
    return getattr(transformers, cls)(config).eval()


def _inputs(name: str) -> tuple[Tensor, Tensor]:
    """A padded batch of two: the second sequence has 3 padding tokens (left for a causal
    family, right else)."""
    ids = torch.randint(4, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    if FAMILIES[name][2]:
        mask[1, :3] = 0
    else:
        mask[1, -3:] = 0
    return ids, mask


def _projection(module: nn.Module, model: nn.Module) -> nn.Module:
    """The output projection of an attention module, found by the test: the module inside it,
    or in its parent, whose input width is the heads' (weights of shape (E, H·Dv))."""
    family = unrouted_families.unrouted_family(module)
    assert family is not None
    names = dict(model.named_modules())
    name = next(n for n, m in names.items() if m is module)
    path, base = family.output, name
    while path.startswith("../"):
        base, path = base.rpartition(".")[0], path[3:]
    return names[f"{base}.{path}" if base else path]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_capture_equals_eager_weights_on_a_padded_batch(name: str) -> None:
    model = _model(name)
    ids, mask = _inputs(name)
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with multihead.capture(model) as recorder:
            observed = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    module = multihead.model_map(model).sites[0].module
    if sites.routed(type(module)):
        # this transformers routes the family through its attention interface (Falcon since
        # 5.25): multihead's kernel runs the attention while it is observed, equal at the real
        # positions (a padded query row, which sees no key, is each kernel's own)
        torch.testing.assert_close(observed[real], plain[real], rtol=0, atol=1e-5)
    else:
        torch.testing.assert_close(observed, plain, rtol=0, atol=0)  # the module's own code ran
    assert len(recorder.weights) == len(eager.attentions) == 2
    for layer, (ours, theirs) in enumerate(zip(recorder.weights, eager.attentions, strict=True)):
        rows = real[:, None, :, None].expand_as(theirs)
        difference = (ours - theirs)[rows].abs().max().item()
        assert difference <= 1e-5, f"{name} layer {layer}: {difference}"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_zeroing_a_head_equals_zeroing_its_projection_columns(name: str) -> None:
    model = _model(name)
    ids, mask = _inputs(name)
    layer, head = 1, 2
    module = multihead.model_map(model).sites[layer].module
    width = multihead.model_map(model).sites[layer].head_dim

    def zero(m: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0].clone()
        x[..., head * width : (head + 1) * width] = 0
        return (x, *args[1:])

    with torch.no_grad():
        handle = _projection(module, model).register_forward_pre_hook(zero)
        try:
            reference = model(input_ids=ids, attention_mask=mask).last_hidden_state
        finally:
            handle.remove()
        with multihead.intervene(model, {(layer, head): 0.0}):
            ablated = model(input_ids=ids, attention_mask=mask).last_hidden_state
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (ablated - reference)[real].abs().max().item() <= 1e-6
    assert (again - reference)[real].abs().max().item() > 1e-4  # the head mattered
    assert not module._forward_pre_hooks  # the hooks left with the last registration


@pytest.mark.parametrize("name", ["gpt_neo", "bloom", "deberta-v2", "falcon-new-architecture"])
def test_zeroing_a_heads_values_through_an_editor_equals_zeroing_the_head(name: str) -> None:
    # a q/k/v editor makes the heads' outputs recomputed from the edited call: a head whose
    # values are zero writes nothing, as if its columns of the projection's input were zeroed
    model = _model(name)
    ids, mask = _inputs(name)
    site = multihead.model_map(model).sites[0]
    head = 3

    def edit(call: Any) -> tuple[Tensor, Tensor, Tensor]:
        group = call.q.shape[1] // call.v.shape[1]
        v = call.v.repeat_interleave(group, dim=1).clone()  # one value head per query head
        v[:, head] = 0
        return call.q, call.k.repeat_interleave(group, dim=1), v

    with torch.no_grad():
        with site.attention.register_qkv_editor(lambda call: (call.q, call.k, call.v)):
            unchanged = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with site.attention.register_qkv_editor(edit):
            edited = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with multihead.intervene(model, {(0, head): 0.0}):
            ablated = model(input_ids=ids, attention_mask=mask).last_hidden_state
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (unchanged - plain)[real].abs().max().item() <= 1e-5
    assert (edited - ablated)[real].abs().max().item() <= 1e-5
    assert (edited - plain)[real].abs().max().item() > 1e-4


def _swapped(monkeypatch: pytest.MonkeyPatch, name: str, **change: Any) -> nn.Module:
    """A model of family ``name`` built after its registry entry was changed (skip when
    transformers now routes the family through its attention interface: no entry is read)."""
    module = multihead.model_map(_model(name)).sites[0].module
    if hf.routed(type(module)):
        pytest.skip(f"{type(module).__name__} is routed by the installed transformers")
    entry = unrouted_families.unrouted_family(module)
    assert entry is not None
    key = next(k for k, v in unrouted_families.UNROUTED_FAMILIES.items() if v is entry)
    monkeypatch.setitem(
        unrouted_families.UNROUTED_FAMILIES, key, dataclasses.replace(entry, **change)
    )
    return _model(name)


def test_a_wrong_recipe_is_refused_by_the_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = _model("gpt_neo")
    right = unrouted_families.unrouted_family(multihead.model_map(fresh).sites[0].module)
    assert right is not None and right.recipe is not None
    recipe = right.recipe

    def without_window(module: nn.Module, arguments: dict[str, Any]) -> Any:
        # the local layer's window forgotten: causal only (a plausible slip)
        made = recipe(module, arguments)
        t = made.q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        given = arguments["attention_mask"]
        padding = given >= 0 if given.dtype != torch.bool else given
        return made._replace(mask=causal & padding)

    model = _swapped(monkeypatch, "gpt_neo", recipe=without_window)
    ids, mask = _inputs("gpt_neo")
    with (
        pytest.raises(ValueError, match=r"gpt_neo \(GPTNeoSelfAttention\): its score recipe does "),
        torch.no_grad(),
        multihead.capture(model, layers=[1]),  # the local layer
    ):
        model(input_ids=ids, attention_mask=mask)
    # the global layer's recipe is the same as the right one there: it passes the check
    with torch.no_grad(), multihead.capture(model, layers=[0]) as recorder:
        model(input_ids=ids, attention_mask=mask)
    assert recorder.weights[0].shape == (2, HEADS, T, T)


def test_a_family_without_recipe_is_steered_but_its_weights_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _swapped(monkeypatch, "mpnet", recipe=None)
    ids, mask = _inputs("mpnet")
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with multihead.intervene(model, {(0, 1): 0.0}):
            ablated = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert (ablated - plain).abs().max().item() > 1e-4
        with (
            pytest.raises(ValueError, match=r"mpnet \(MPNetSelfAttention\): .* not how its atte"),
            multihead.capture(model),
        ):
            model(input_ids=ids, attention_mask=mask)


def test_a_kv_cache_holding_earlier_tokens_is_named() -> None:
    model = _model("gpt_neo")
    ids, _ = _inputs("gpt_neo")
    with torch.no_grad():
        past = model(input_ids=ids[:, :6], use_cache=True).past_key_values
        with (
            pytest.raises(ValueError, match="a KV cache holding earlier tokens"),
            multihead.capture(model),
        ):
            model(input_ids=ids[:, 6:], past_key_values=past, use_cache=True)


def test_gpt_neo_local_layers_carry_their_window() -> None:
    sites = multihead.model_map(_model("gpt_neo")).sites
    assert [s.window for s in sites] == [None, 4]


def test_key_value_heads_are_the_modules_own() -> None:
    # Falcon's config says multi_query=True by default; its new decoder architecture ignores it
    # and keeps num_kv_heads key/value heads (the module's own count)
    counts = {
        name: multihead.model_map(_model(name)).sites[0].num_kv_heads
        for name in ("falcon-new-architecture", "falcon-multi-query", "falcon-rotary")
    }
    assert counts == {"falcon-new-architecture": 2, "falcon-multi-query": 1, "falcon-rotary": 4}


def test_a_bloom_config_bypassing_its_projection_is_refused() -> None:
    config = FAMILIES["bloom"][0]()
    config.pretraining_tp, config.slow_but_exact = 2, True
    model = transformers.BloomModel(config).eval()
    with pytest.raises(ValueError, match="slow_but_exact"):
        multihead.model_map(model)


def _lm(name: str) -> nn.Module:
    """The causal LM of a family in FAMILIES (GPT-Neo, Falcon), float32, eager."""
    make, cls, _ = FAMILIES[name]
    torch.manual_seed(0)
    config = make()
    config._attn_implementation = "eager"
    return getattr(transformers, cls.replace("Model", "ForCausalLM"))(config).eval()


def _head_inputs(model: nn.Module, ids: Tensor) -> list[Tensor]:
    """Per layer, its output projection's input (B, T, H·Dv), by plain hooks of the test."""
    seen: list[Tensor] = []
    hooks = [
        _projection(s.module, model).register_forward_pre_hook(
            lambda m, a: seen.append(a[0].clone())
        )
        for s in multihead.model_map(model).sites
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    return seen


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1, 7] - logits[:, -1, 9]


@pytest.mark.parametrize("name", ["gpt_neo", "falcon-new-architecture"])
def test_patching_and_attribution_equal_hand_hooks_on_an_unrouted_lm(name: str) -> None:
    """patch_heads equals forwards with a head's columns of the projection's input replaced by
    the clean run's (a plain hook); attribution_patching equals the metric's gradient there
    times clean - corrupt (a plain backward); path patching, statistics and edge attribution
    (each query head's key and value edges summing to its group's) run on the recipes."""
    model = _lm(name)
    g = torch.Generator().manual_seed(5)
    clean = torch.randint(4, VOCAB, (2, 6), generator=g)
    corrupt = torch.randint(4, VOCAB, (2, 6), generator=g)
    sites = multihead.model_map(model).sites
    source = _head_inputs(model, clean)
    with torch.no_grad():
        base = _metric(model(input_ids=corrupt).logits).mean()
    want = torch.zeros(len(sites), HEADS)
    for layer, site in enumerate(sites):
        for head in range(HEADS):
            cols = slice(head * site.head_dim, (head + 1) * site.head_dim)

            def put(
                m: nn.Module, args: tuple[Any, ...], cols: slice = cols, layer: int = layer
            ) -> tuple[Any, ...]:
                x = args[0].clone()
                x[..., cols] = source[layer][..., cols]
                return (x, *args[1:])

            handle = _projection(site.module, model).register_forward_pre_hook(put)
            with torch.no_grad():
                want[layer, head] = _metric(model(input_ids=corrupt).logits).mean() - base
            handle.remove()
    got = multihead.patch_heads(model, {"input_ids": clean}, {"input_ids": corrupt}, _metric)
    torch.testing.assert_close(got.values, want, rtol=1e-4, atol=1e-5)
    assert float(want.abs().max()) > 1e-4

    target: list[Tensor] = []

    def keep(m: nn.Module, args: tuple[Any, ...]) -> None:
        args[0].retain_grad()
        target.append(args[0])

    hooks = [_projection(s.module, model).register_forward_pre_hook(keep) for s in sites]
    _metric(model(input_ids=corrupt).logits).mean().backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad()
    first_order = torch.stack(
        [
            ((s - t.detach()) * t.grad).unflatten(-1, (HEADS, -1)).sum((0, 1, 3))
            for s, t in zip(source, target, strict=True)
            if t.grad is not None
        ]
    )
    attributed = multihead.attribution_patching(
        model, {"input_ids": clean}, {"input_ids": corrupt}, _metric
    )
    torch.testing.assert_close(attributed.values, first_order, rtol=1e-4, atol=1e-5)

    pair = ({"input_ids": clean}, {"input_ids": corrupt})
    paths = multihead.path_patching(model, *pair, _metric, [(0, 1)], ["logits"])
    assert torch.isfinite(paths.values).all()
    stats = multihead.head_statistics(model, clean)
    assert torch.isfinite(stats.entropy).all() and stats.entropy.shape[:2] == (2, HEADS)
    per_head = multihead.edge_attribution(model, *pair, _metric, kv="query_head")
    shared = multihead.edge_attribution(model, *pair, _metric, kv="shared")
    group = HEADS // sites[0].num_kv_heads
    checked = 0
    for j, receiver in enumerate(shared.receivers):
        layer_name, _, rest = receiver.partition("KV")
        if not rest:
            continue
        kv_head, kind = rest.split(".")
        heads = range(group * int(kv_head), group * (int(kv_head) + 1))
        names = [f"{layer_name}H{h}.{kind}" for h in heads]
        summed = sum(per_head.values[:, per_head.receivers.index(r)] for r in names)
        torch.testing.assert_close(
            summed, shared.values[:, j], rtol=1e-4, atol=1e-6, equal_nan=True
        )
        checked += int(shared.values[:, j].isfinite().sum())
    assert checked > 0


def test_bench_gpt_neo_script_quick(tmp_path: Path) -> None:
    """benchmarks/bench_hf_gpt_neo.py runs end to end (--quick) and writes its JSON; no timing."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_hf_gpt_neo.py"
    env = dict(os.environ, PYTHONPATH=str(Path(multihead.__file__).resolve().parent.parent))
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "hf_gpt_neo_quick.json").read_text(encoding="utf-8"))
    modes = {row["mode"]: row for row in payload["rows"]}
    assert set(modes) == {"plain", "capture"}
    # one row of every head of every layer: 4 layers x 4 heads x 128 keys, nothing more
    assert modes["capture"]["recorded_elements"] == 4 * 4 * 128
    assert payload["check"]["max_diff"] <= 1e-5


def test_a_forward_that_raised_leaves_no_call_behind() -> None:
    # the module's forward raised before its projection ran: a later call of the projection
    # alone (no module call) is no call of the module, and no observer sees it
    model = _model("gpt_neo")
    ids, mask = _inputs("gpt_neo")
    site = multihead.model_map(model).sites[0]
    seen: list[Tensor] = []

    def fail(m: nn.Module, args: tuple[Any, ...]) -> None:
        raise RuntimeError("the query projection failed")

    with torch.no_grad(), site.attention.register_observer(lambda c, out: seen.append(out)):
        handle = site.module.q_proj.register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="the query projection failed"):
            model(input_ids=ids, attention_mask=mask)
        handle.remove()
        site.module.out_proj(torch.zeros(3, 7, WIDTH))
        assert not seen
        model(input_ids=ids, attention_mask=mask)
    assert len(seen) == 1 and seen[0].shape == (2, T, HEADS, WIDTH // HEADS)
