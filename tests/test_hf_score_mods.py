"""The transformers families whose attention modifies its scores — attention-logit softcapping
(Gemma-2, VaultGemma, T5Gemma) and attention sinks (GPT-OSS, Granite-SWA, DeepSeek-V4, ...) —
on attn_implementation="multihead": the forward, output_attentions and capture equal
transformers' own "eager" attention (each family's eager function, its weights convention
included), and the circuit functions and direct logit attribution work on them.

Every model is a tiny random one built from its family's config class (2 layers, width 64, 4
query heads over 2 key/value heads, windows of 4 keys so that sliding windows matter), with its
sinks, softcaps and norm scales set far from their initial values so that each one changes the
result. References are transformers' own eager attention, or a hand computation in the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", minversion="5")
hf = pytest.importorskip("multihead.hf")

import multihead  # noqa: E402

VOCAB = 100
T = 9
TOL = 1e-5

SMALL: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# What each family needs besides SMALL: a small cap (random scores are small: the default cap
# of 50 would change nothing), windows shorter than the inputs, few experts.
GEMMA = dict(
    attn_logit_softcapping=1.0,
    final_logit_softcapping=3.0,
    sliding_window=4,
    query_pre_attn_scalar=16,
)
EXTRA: dict[str, dict[str, Any]] = {
    "gemma2": GEMMA,
    "vaultgemma": GEMMA,
    "deepseek_v4": dict(
        sliding_window=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        q_lora_rank=16,
        o_lora_rank=16,
        o_groups=2,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        num_key_value_heads=1,
    ),
    "flint": dict(
        sliding_window=4, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32
    ),
    "gpt_oss": dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2),
    "granite_swa": dict(sliding_window=4),
    "granitemoe_swa": dict(
        sliding_window=4, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32
    ),
    "inkling2_text": dict(
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        d_rel=8,
    ),
    "mimo_v2_flash": dict(
        sliding_window=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "openai_privacy_filter": dict(sliding_window=4, num_local_experts=4, num_experts_per_tok=2),
}
SOFTCAP = ["gemma2", "vaultgemma", "t5gemma"]
SINKS = [f for f in EXTRA if f not in SOFTCAP]


def _quiet() -> None:
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")


def _config(family: str) -> Any:
    config = transformers.AutoConfig.for_model(family)
    for name, value in {**SMALL, **EXTRA.get(family, {})}.items():
        if hasattr(config, name):
            setattr(config, name, value)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:  # one layer of each kind (sliding, full, ...)
        config.layer_types = (list(dict.fromkeys(kinds)) * 2)[: config.num_hidden_layers]
    mlp_kinds = getattr(config, "mlp_layer_types", None)
    if isinstance(mlp_kinds, list) and mlp_kinds:
        config.mlp_layer_types = mlp_kinds[: config.num_hidden_layers]
    return config


def _t5gemma_config() -> Any:
    part = {k: v for k, v in SMALL.items() if k != "moe_intermediate_size"}
    encoder = transformers.T5GemmaModuleConfig(**part, **GEMMA)
    decoder = transformers.T5GemmaModuleConfig(**part, **GEMMA)
    return transformers.T5GemmaConfig(encoder=encoder, decoder=decoder, vocab_size=VOCAB)


def _spread(model: nn.Module) -> nn.Module:
    """Sinks, norm scales and sink projections drawn far from their initial values (zeros or
    ones), so that each one changes the result."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or "sink_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5)
            elif "norm" in name and p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (0.0 if "gemma" in name else 1.0))
    return model


def build(family: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random model of ``family`` on "eager": its causal LM (T5Gemma: its
    encoder-decoder LM) where the family has one, else its base model."""
    _quiet()
    torch.manual_seed(0)
    if family == "t5gemma":
        model: Any = transformers.T5GemmaForConditionalGeneration(_t5gemma_config())
    else:
        config = _config(family)
        config._attn_implementation = "eager"
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM (OpenAI's privacy filter: a token classifier)
            model = transformers.AutoModel.from_config(config)
        model.set_attn_implementation("eager")
    return _spread(model).to(dtype).eval()


def _inputs(model: nn.Module) -> tuple[dict[str, Tensor], Tensor]:
    """A padded batch (2, T): left padding where the model is causal, right otherwise; and
    (2, T) bool, the real tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (2, T), generator=g)
    mask = torch.ones(2, T, dtype=torch.long)
    config: Any = model.config
    inputs: dict[str, Tensor] = {"input_ids": ids}
    if config.is_encoder_decoder:
        mask[1, 6:] = 0  # right padding of the encoder's input
        inputs["decoder_input_ids"] = torch.randint(4, VOCAB, (2, 5), generator=g)
    else:
        causal = any(getattr(m, "is_causal", False) for m in model.modules())
        if causal:
            mask[1, :3] = 0
        else:
            mask[1, 6:] = 0
    inputs["attention_mask"] = mask
    return inputs, mask.bool()


def _output(out: Any) -> Tensor:
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _attentions(out: Any) -> list[Tensor]:
    if getattr(out, "encoder_attentions", None) is not None:
        pairs = zip(out.decoder_attentions, out.cross_attentions, strict=True)
        return [*out.encoder_attentions, *(w for pair in pairs for w in pair)]
    return list(out.attentions)


def _real_rows(weights: Tensor, real: Tensor) -> Tensor:
    """(B, H, T, S) -> (N, H, S): the real query rows (all rows of a decoder's 5 queries)."""
    rows = (
        real if weights.shape[2] == real.shape[1] else torch.ones(real.shape[0], weights.shape[2])
    )
    return weights.transpose(1, 2)[rows.bool()]


def _max_diff(got: list[Tensor], want: list[Tensor], real: Tensor) -> float:
    assert len(got) == len(want)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        worst = max(worst, float((_real_rows(g, real) - _real_rows(w, real)).abs().max()))
    return worst


@pytest.mark.parametrize("family", [*SOFTCAP, *SINKS])
def test_forward_weights_and_capture_equal_eager(family: str) -> None:
    model = build(family)
    inputs, real = _inputs(model)
    with torch.no_grad():
        eager = model(**inputs, output_attentions=True)
    want_out, want_weights = _output(eager), _attentions(eager)
    assert len(want_weights) >= 2

    # capture on the model as loaded (eager): it runs on "multihead" inside the block only
    with torch.no_grad(), multihead.capture(model) as rec:
        captured_out = _output(model(**inputs))
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation("multihead")
    with torch.no_grad():
        got = model(**inputs, output_attentions=True)
    query_real = real if not model.config.is_encoder_decoder else torch.ones(2, 5, dtype=torch.bool)
    for out in (_output(got), captured_out):
        diff = float((out[query_real] - want_out[query_real]).abs().max())
        assert diff <= TOL, f"{family}: the output differs from eager's by {diff:.2e}"
    assert _max_diff(_attentions(got), want_weights, real) <= TOL
    assert _max_diff(rec.weights, want_weights, real) <= TOL
    # the weights are the family's own: with sinks, the sink takes a share somewhere unless the
    # family reports the softmax over the keys alone (Granite-SWA)
    sums = torch.cat([_real_rows(w, real).sum(-1).flatten() for w in rec.weights])
    assert float(sums.max()) <= 1 + 1e-5
    plain = family in ("granite_swa", "granitemoe_swa") or family in SOFTCAP
    assert (float(sums.min()) > 1 - 1e-5) == plain


def test_sink_weights_conventions_are_one_argument_away() -> None:
    """GPT-OSS's own weights drop the sink's share; the other conventions, asked for by
    capture's sink_weights, are that share as a last column and the softmax over the keys
    alone, each read off eager's weights by hand."""
    model = build("gpt_oss")
    inputs, real = _inputs(model)
    with torch.no_grad():
        dropped = _attentions(model(**inputs, output_attentions=True))
    recorded = {}
    for convention in ("dropped", "column", "plain"):
        with torch.no_grad(), multihead.capture(model, sink_weights=convention) as rec:
            model(**inputs)
        recorded[convention] = rec.weights
    assert _max_diff(recorded["dropped"], dropped, real) <= TOL
    for column, want in zip(recorded["column"], dropped, strict=True):
        assert column.shape[-1] == want.shape[-1] + 1
        sink_share = 1 - want.sum(-1)  # what the keys leave to the sink
        assert _max_diff([column[..., :-1]], [want], real) <= TOL
        assert _max_diff([column[..., -1:]], [sink_share[..., None]], real) <= TOL
    plain = [w / w.sum(-1, keepdim=True) for w in dropped]
    assert _max_diff(recorded["plain"], plain, real) <= TOL
    # Granite-SWA's own weights are the plain ones; "dropped" is one argument away there too
    granite = build("granite_swa")
    inputs, real = _inputs(granite)
    with torch.no_grad():
        eager = _attentions(granite(**inputs, output_attentions=True))
    with torch.no_grad(), multihead.capture(granite, sink_weights="dropped") as rec:
        granite(**inputs)
    for got, want, layer in zip(rec.weights, eager, granite.model.layers, strict=True):
        q_sink = layer.self_attn.sinks.detach()[None, :, None, None]
        # eager scales the output by the keys' share, sigmoid(logsumexp(scores) - sink): here
        # that share is read back off the dropped weights, so compare the plain ones
        assert _max_diff([got / got.sum(-1, keepdim=True)], [want], real) <= TOL
        assert float(got.sum(-1).max()) < 1 and q_sink.numel() == want.shape[1]


def _o_proj(model: nn.Module, layer: int) -> nn.Module:
    return model.model.layers[layer].self_attn.o_proj  # type: ignore[no-any-return]


def _head_inputs(model: nn.Module, inputs: dict[str, Tensor]) -> list[Tensor]:
    """Per layer, the input of its output projection (B, T, H·Dv), by a plain forward hook."""
    seen: list[Tensor] = []
    layers = model.model.layers  # type: ignore[union-attr]
    hooks = [
        _o_proj(model, i).register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
        for i in range(len(layers))
    ]
    with torch.no_grad():
        model(**inputs)
    for hook in hooks:
        hook.remove()
    return seen


def _patched_logits(
    model: nn.Module, inputs: dict[str, Tensor], layer: int, head: int, value: Tensor
) -> Tensor:
    """The logits of a forward with head ``head`` of ``layer`` replaced by ``value`` (B, T,
    H·Dv: its columns are taken) at its output projection's input, by a plain hook."""
    dv = value.shape[-1] // model.config.num_attention_heads  # type: ignore[union-attr]
    cols = slice(head * dv, (head + 1) * dv)

    def hook(m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        x = args[0].clone()
        x[..., cols] = value[..., cols]
        return (x, *args[1:])

    handle = _o_proj(model, layer).register_forward_pre_hook(hook)
    with torch.no_grad():
        logits = model(**inputs).logits
    handle.remove()
    return logits  # type: ignore[no-any-return]


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_patching_and_steering_equal_hand_hooks(family: str) -> None:
    """patch_heads (whole heads and per position), intervene and record_heads on a softcap and
    a sink family equal forwards on eager with a plain hook at the output projection."""
    model = build(family)  # float32: GPT-OSS's experts run grouped matmuls, float32 at most
    g = torch.Generator().manual_seed(5)
    clean = {"input_ids": torch.randint(4, VOCAB, (2, 6), generator=g)}
    corrupt = {"input_ids": torch.randint(4, VOCAB, (2, 6), generator=g)}

    def metric(logits: Tensor) -> Tensor:
        return logits[:, -1, 7] - logits[:, -1, 9]

    source = _head_inputs(model, clean)
    with torch.no_grad():
        base = metric(model(**corrupt).logits).mean()
    layers, heads = len(source), model.config.num_attention_heads  # type: ignore[union-attr]
    want = torch.zeros(layers, heads)
    for layer in range(layers):
        for head in range(heads):
            patched = _patched_logits(model, corrupt, layer, head, source[layer])
            want[layer, head] = metric(patched).mean() - base
    got = multihead.patch_heads(model, clean, corrupt, metric).values
    close = dict(rtol=1e-4, atol=1e-5)  # float32 forwards, run differently stacked
    torch.testing.assert_close(got, want, **close)
    assert float(want.abs().max()) > 1e-4  # the patches change the metric

    # one position of one head: the per-position runs (windows of 4 keys < 6 tokens)
    values = multihead.patch_heads(model, clean, corrupt, metric, per_position=True).values
    at = source[1].clone()
    mixed = _head_inputs(model, corrupt)[1]
    mixed[:, 3] = at[:, 3]
    one = metric(_patched_logits(model, corrupt, 1, 2, mixed)).mean() - base
    torch.testing.assert_close(values[1, 2, 3], one, **close)

    # record_heads on clean, intervene on corrupt: the same patch; a zero ablation
    with torch.no_grad(), multihead.record_heads(model, [(1, 2)]) as rec:
        model(**clean)
    dv = source[1].shape[-1] // heads
    torch.testing.assert_close(rec[(1, 2)], source[1][..., 2 * dv : 3 * dv])
    with torch.no_grad(), multihead.intervene(model, {(1, 2): rec[(1, 2)]}):
        patched = model(**corrupt).logits
    torch.testing.assert_close(patched, _patched_logits(model, corrupt, 1, 2, source[1]), **close)
    with torch.no_grad(), multihead.intervene(model, {(0, 3): 0.0}):
        ablated = model(**corrupt).logits
    zeros = torch.zeros_like(source[0])
    torch.testing.assert_close(ablated, _patched_logits(model, corrupt, 0, 3, zeros), **close)


def _rms_frozen(x: Tensor, norm: nn.Module, offset: float) -> tuple[Tensor, Tensor]:
    """An RMSNorm's scale (offset + weight) and its rms (B, T, 1) frozen at input x."""
    eps = getattr(norm, "eps", None) or norm.variance_epsilon
    return offset + norm.weight, (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "olmo2"])
def test_logit_attribution_by_hand(family: str) -> None:
    """Each head's direct term is its columns of the output projection, through the
    post-attention norm (Gemma-2's sandwich norm, OLMo-2's post-norm) and the final norm, both
    RMSNorms frozen at the run (Gemma's scale 1 + γ), read along the unembedding rows; the
    terms add up to the logit before Gemma-2's final softcap, read off a plain forward."""
    if family == "olmo2":
        _quiet()
        torch.manual_seed(0)
        config = transformers.Olmo2Config(**{k: v for k, v in SMALL.items() if k != "head_dim"})
        model: Any = _spread(transformers.Olmo2ForCausalLM(config)).eval()
    else:
        model = build(family)
    offset = 1.0 if family == "gemma2" else 0.0
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(4, VOCAB, (2, 7), generator=g)
    got = multihead.logit_attribution(model, {"input_ids": ids}, 7, wrong=9)

    seen: dict[Any, Tensor] = {}
    body = model.model
    watched = [body.norm] + [_o_proj(model, i) for i in range(len(body.layers))]
    posts = [getattr(layer, "post_attention_layernorm", None) for layer in body.layers]
    has_post = family in ("gemma2", "olmo2")
    if has_post:
        watched += posts
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.__setitem__(m, a[0])) for m in watched]
    with torch.no_grad():
        raw = model.lm_head(body(ids).last_hidden_state)  # before any final softcap
    for hook in hooks:
        hook.remove()
    logit = (raw[..., 7] - raw[..., 9]).mean(0)
    torch.testing.assert_close(got.logit, logit, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.total(), logit, rtol=1e-5, atol=1e-5)

    direction = model.lm_head.weight[7] - model.lm_head.weight[9]  # (E,)
    gamma_f, sigma_f = _rms_frozen(seen[body.norm], body.norm, offset)
    heads = model.config.num_attention_heads
    want = torch.zeros_like(got.heads)
    for layer in range(len(body.layers)):
        o_proj = _o_proj(model, layer)
        z = seen[o_proj]
        dv = z.shape[-1] // heads
        for head in range(heads):
            cols = slice(head * dv, (head + 1) * dv)
            c = z[..., cols] @ o_proj.weight[:, cols].T  # (B, T, E): the head's write
            if has_post:
                post = posts[layer]
                gamma_p, sigma_p = _rms_frozen(seen[post], post, offset)
                c = gamma_p * c / sigma_p
            want[layer, head] = ((gamma_f * c / sigma_f) * direction).sum(-1).mean(0)
    torch.testing.assert_close(got.heads, want, rtol=1e-4, atol=1e-6)
    assert float(want.abs().max()) > 1e-3


def _pair() -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A clean and a corrupt batch (2, 6) of random tokens, for :func:`_metric`."""
    g = torch.Generator().manual_seed(7)
    clean = {"input_ids": torch.randint(4, VOCAB, (2, 6), generator=g)}
    return clean, {"input_ids": torch.randint(4, VOCAB, (2, 6), generator=g)}


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1, 7] - logits[:, -1, 9]


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_site_patching_attribution_paths_and_statistics_run(family: str) -> None:
    """patch (the residual stream before layer 0: the whole clean run), attribution_patching
    (the metric's gradient at the corrupt run times each head's clean - corrupt output, by a
    plain backward on eager), path_patching and head_statistics on a softcap and a sink family."""
    model = build(family)
    clean, corrupt = _pair()
    with torch.no_grad():
        whole = _metric(model(**clean).logits).mean() - _metric(model(**corrupt).logits).mean()
    resid = multihead.patch(model, clean, corrupt, _metric, site="resid_pre")
    torch.testing.assert_close(resid.values[0], whole, rtol=1e-4, atol=1e-5)

    source = _head_inputs(model, clean)
    target: list[Tensor] = []
    layers = model.model.layers  # type: ignore[union-attr]

    def keep(m: nn.Module, args: tuple[Tensor, ...]) -> None:
        args[0].retain_grad()  # the gradient through every later layer, as it flows
        target.append(args[0])

    hooks = [_o_proj(model, i).register_forward_pre_hook(keep) for i in range(len(layers))]
    _metric(model(**corrupt).logits).mean().backward()
    for hook in hooks:
        hook.remove()
    model.zero_grad()
    heads = model.config.num_attention_heads  # type: ignore[union-attr]
    want = torch.stack(
        [
            ((s - t.detach()) * t.grad).unflatten(-1, (heads, -1)).sum((0, 1, 3))
            for s, t in zip(source, target, strict=True)
            if t.grad is not None
        ]
    )  # (L, H): each head's first-order effect on the batch mean
    got = multihead.attribution_patching(model, clean, corrupt, _metric)
    torch.testing.assert_close(got.values, want, rtol=1e-4, atol=1e-5)

    paths = multihead.path_patching(model, clean, corrupt, _metric, [(0, 1)], ["logits"])
    assert torch.isfinite(paths.values).all()
    stats = multihead.head_statistics(model, clean["input_ids"])
    assert torch.isfinite(stats.entropy).all() and stats.entropy.shape[:2] == (2, heads)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_edge_attribution_keys_and_values_per_query_head(family: str) -> None:
    """EAP on a softcap and a sink family (4 query heads over 2 key/value heads): each query
    head's own key and value edges (kv="query_head", its attention recomputed under the call's
    softcap or sinks) sum, over the query heads of a group, to the key/value head's edges
    (kv="shared": the gradient by autograd through the model's own attention)."""
    model = build(family)
    clean, corrupt = _pair()
    per_head = multihead.edge_attribution(model, clean, corrupt, _metric, kv="query_head")
    shared = multihead.edge_attribution(model, clean, corrupt, _metric, kv="shared")
    checked = 0
    for j, receiver in enumerate(shared.receivers):
        layer, _, rest = receiver.partition("KV")
        if not rest:
            continue
        kv_head, kind = rest.split(".")
        group = [f"{layer}H{h}.{kind}" for h in (2 * int(kv_head), 2 * int(kv_head) + 1)]
        summed = sum(per_head.values[:, per_head.receivers.index(r)] for r in group)
        want = shared.values[:, j]
        torch.testing.assert_close(summed, want, rtol=1e-4, atol=1e-6, equal_nan=True)
        checked += int(want.isfinite().sum())
    assert checked > 0 and float(shared.values.nan_to_num().abs().max()) > 1e-3


def test_bench_gemma2_script_quick(tmp_path: Path) -> None:
    """benchmarks/bench_hf_gemma2.py runs end to end (--quick) and writes its JSON; no timing."""
    bench = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_hf_gemma2.py"
    env = dict(os.environ, PYTHONPATH=str(Path(multihead.__file__).resolve().parent.parent))
    done = subprocess.run(
        [sys.executable, str(bench), "--quick", "--results-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "hf_gemma2_quick.json").read_text(encoding="utf-8"))
    modes = {row["mode"]: row for row in payload["rows"]}
    assert set(modes) == {"multihead", "capture", "eager"}
    # one row of every head of every layer: 2 layers x 8 heads x 256 keys, nothing more
    assert modes["capture"]["recorded_elements"] == 2 * 8 * 256
    assert all(row["seconds"] > 0 and row["peak_rss"] > 0 for row in payload["rows"])


@pytest.mark.parametrize("family", ["granite_swa", "granitemoe_swa", "gpt_oss"])
def test_row3_patching_a_sink_familys_pattern_from_itself_changes_nothing(family: str) -> None:
    """patch(site="pattern") with clean == corrupt: every head's pattern replaced by the one it
    had leaves the metric where it was, whatever the family's weights convention (Granite-SWA
    reports the softmax over the keys alone and scales its output by the keys' share; GPT-OSS
    drops the sink's share), whole rows and per position; with another input the patches move
    it (the comparison is not of a patch that does nothing)."""
    model = build(family)
    clean, corrupt = _pair()
    for per_position in (False, True):
        same = multihead.patch(
            model, clean, clean, _metric, site="pattern", per_position=per_position
        )
        assert same.values.shape[:2] == (2, 4)
        assert float(same.values.abs().max()) <= TOL, f"{family}: {same.values.abs().max():.2e}"
    moved = multihead.patch(model, clean, corrupt, _metric, site="pattern")
    assert float(moved.values.abs().max()) > 100 * TOL
