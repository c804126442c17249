"""multihead.patch on every site, against a reference written here: one forward per patch, the
activation replaced by a plain torch hook on the module that makes it (a block, its attention
or feed-forward module, the q/k/v projections, the output projection's input), on
TransformerLM, transformers' GPT-2 and a grouped-query Llama, both directions, per position."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead.circuits.patching.patch import patch
from multihead.models import TransformerLM


@dataclass
class Parts:
    """Per layer: the block, its attention and feed-forward modules, where q, k, v come out
    (module, the slice of its output, heads) and the output projection (fed the heads)."""

    blocks: list[nn.Module]
    attention: list[nn.Module]
    mlp: list[nn.Module]
    qkv: list[dict[str, tuple[nn.Module, slice, int]]]
    out: list[nn.Module]
    heads: int
    kv_heads: int
    head_dim: int


def _model(name: str, device: torch.device) -> tuple[nn.Module, Parts]:
    torch.manual_seed(3)
    if name == "lm":
        lm = TransformerLM(30, 24, 4, 2, 40, max_len=16).to(device, torch.float64).eval()
        e = slice(0, 24), slice(24, 48), slice(48, 72)
        return lm, Parts(
            list(lm.blocks), [b.self_attn for b in lm.blocks], [b.ff for b in lm.blocks],
            [{s: (b.self_attn.qkv_proj, e[i], 4) for i, s in enumerate("qkv")} for b in lm.blocks],
            [b.self_attn.out_proj for b in lm.blocks], 4, 4, 6,
        )  # fmt: skip
    transformers = pytest.importorskip("transformers", minversion="5")
    if name == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=30, n_embd=24, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
            eos_token_id=0,
        )  # fmt: skip
        model: Any = transformers.GPT2LMHeadModel(config).to(device, torch.float64).eval()
        blocks = list(model.transformer.h)
        e = slice(0, 24), slice(24, 48), slice(48, 72)
        return model, Parts(
            blocks, [b.attn for b in blocks], [b.mlp for b in blocks],
            [{s: (b.attn.c_attn, e[i], 4) for i, s in enumerate("qkv")} for b in blocks],
            [b.attn.c_proj for b in blocks], 4, 4, 6,
        )  # fmt: skip
    config = transformers.LlamaConfig(
        vocab_size=30, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device, torch.float64).eval()
    blocks = list(model.model.layers)
    every = slice(None)
    return model, Parts(
        blocks, [b.self_attn for b in blocks], [b.mlp for b in blocks],
        [
            {"q": (b.self_attn.q_proj, every, 6), "k": (b.self_attn.k_proj, every, 2),
             "v": (b.self_attn.v_proj, every, 2)}
            for b in blocks
        ],
        [b.self_attn.o_proj for b in blocks], 6, 2, 4,
    )  # fmt: skip


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def _swap(out: Any, new: Tensor) -> Any:
    return (new, *out[1:]) if isinstance(out, tuple) else new


def _run(model: nn.Module, ids: Tensor, hooks: list[Callable[[], Any]]) -> Tensor:
    handles = [make() for make in hooks]
    try:
        with torch.no_grad():
            out = model(ids)
    finally:
        for h in handles:
            h.remove()
    return out if isinstance(out, Tensor) else out.logits


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def _record(model: nn.Module, parts: Parts, ids: Tensor) -> dict[tuple[str, int], Tensor]:
    """Every site's activation on ``ids``, from hooks (q, k, v as their projections give them:
    before rotary positions, which the same positions apply alike in both runs)."""
    seen: dict[tuple[str, int], Tensor] = {}
    hooks: list[Callable[[], Any]] = []
    for i in range(len(parts.blocks)):

        def block(m: nn.Module, a: Any, kw: Any, out: Any, i: int = i) -> None:
            seen["resid_pre", i] = a[0] if a else kw["hidden_states"]
            seen["resid_post", i] = _first(out)

        hooks.append(
            lambda i=i, f=block: parts.blocks[i].register_forward_hook(f, with_kwargs=True)
        )
        for site, module in (("attn_out", parts.attention[i]), ("mlp_out", parts.mlp[i])):
            hooks.append(
                lambda m=module, s=site, i=i: m.register_forward_hook(
                    lambda _, a, out: seen.__setitem__((s, i), _first(out))
                )
            )
        for s, (module, part, _) in parts.qkv[i].items():
            hooks.append(
                lambda m=module, s=s, p=part, i=i: m.register_forward_hook(
                    lambda _, a, out: seen.__setitem__((s, i), out[..., p])
                )
            )
    _run(model, ids, hooks)
    for i in range(len(parts.blocks)):
        seen["resid_mid", i] = seen["resid_pre", i] + seen["attn_out", i]
    return seen


def _reference(
    model: nn.Module,
    parts: Parts,
    recorded: dict[tuple[str, int], Tensor],
    target: Tensor,
    site: str,
    layer: int,
    unit: int,
    at: int | None,
) -> float:
    """metric(target with one site's activation from the source run, ``recorded``) -
    metric(target), by a hook."""
    src = recorded[site, layer]
    where = slice(None) if at is None else slice(at, at + 1)

    def put(current: Tensor, value: Tensor, width: int | None = None) -> Tensor:
        new = current.clone()
        if width is None:  # the whole width of a residual site
            new[:, where] = value[:, where]
        else:  # one head's slice of the projection's output
            cols = slice(unit * width, (unit + 1) * width)
            new[:, where, cols] = value[:, where, cols]
        return new

    block = parts.blocks[layer]
    if site == "resid_pre":

        def pre(m: nn.Module, a: Any, kw: Any) -> Any:
            if a:
                return (put(a[0], src), *a[1:]), kw
            return a, {**kw, "hidden_states": put(kw["hidden_states"], src)}

        hook = lambda: block.register_forward_pre_hook(pre, with_kwargs=True)  # noqa: E731
        hooks = [hook]
    elif site in ("resid_post", "attn_out", "mlp_out"):
        module = {"resid_post": block, "attn_out": parts.attention[layer]}.get(
            site, parts.mlp[layer]
        )
        hooks = [
            lambda: module.register_forward_hook(
                lambda m, a, out: _swap(out, put(_first(out), src))
            )
        ]
    elif site == "resid_mid":
        entering: list[Tensor] = []

        def record(m: nn.Module, a: Any, kw: Any) -> None:
            entering[:] = [a[0] if a else kw["hidden_states"]]

        def write(m: nn.Module, a: Any, out: Any) -> Any:
            return _swap(out, put(_first(out), src - entering[0]))

        hooks = [
            lambda: block.register_forward_pre_hook(record, with_kwargs=True),
            lambda: parts.attention[layer].register_forward_hook(write),
        ]
    else:  # q, k, v: one head's slice of the projection's output
        module, part, _ = parts.qkv[layer][site]

        def project(m: nn.Module, a: Any, out: Tensor) -> Tensor:
            new = out.clone()
            new[..., part] = put(out[..., part], src, parts.head_dim)
            return new

        hooks = [lambda: module.register_forward_hook(project)]
    return float(_metric(_run(model, target, hooks)).mean())


CASES = [
    ("lm", "resid_pre"), ("lm", "resid_mid"), ("lm", "attn_out"), ("lm", "mlp_out"),
    ("lm", "resid_post"), ("lm", "q"), ("lm", "k"), ("lm", "v"),
    ("gpt2", "resid_pre"), ("gpt2", "resid_mid"), ("gpt2", "mlp_out"), ("gpt2", "v"),
    ("llama", "resid_pre"), ("llama", "attn_out"), ("llama", "resid_mid"), ("llama", "q"),
    ("llama", "k"), ("llama", "v"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "site"), CASES)
def test_each_site_equals_one_hooked_forward_per_patch(
    name: str, site: str, device: torch.device
) -> None:
    model, parts = _model(name, device)
    clean = torch.randint(30, (2, 5), device=device)
    corrupt = clean.clone()
    corrupt[:, 1] = (corrupt[:, 1] + 7) % 30  # one token differs
    residual = site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
    units = 1 if residual else parts.kv_heads if site in ("k", "v") else parts.heads
    for direction, per_position in (("denoise", True), ("noise", False)):
        source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
        got = patch(
            model, clean, corrupt, _metric, site=site, direction=direction,
            per_position=per_position, batch_size=3,
        )  # fmt: skip
        spans: list[int | None] = list(range(5)) if per_position else [None]
        recorded = _record(model, parts, source)
        base = float(_metric(_run(model, target, [])).mean())
        for layer in range(2):
            for unit in range(units):
                for at in spans:
                    patched = _reference(model, parts, recorded, target, site, layer, unit, at)
                    want = patched - base
                    index = (layer,) if residual else (layer, unit)
                    index += (at,) if at is not None else ()
                    assert float(got.values[index]) == pytest.approx(want, abs=1e-9), (
                        direction,
                        layer,
                        unit,
                        at,
                    )
        if per_position:  # a position before the corrupted token changes nothing (causal)
            assert torch.all(got.values[..., 0].abs() < 1e-12)
    clean_value = float(_metric(_run(model, clean, [])).mean())
    corrupt_value = float(_metric(_run(model, corrupt, [])).mean())
    assert got.clean == pytest.approx(clean_value) and got.corrupt == pytest.approx(corrupt_value)


@pytest.mark.parametrize("name", ["lm", "gpt2"])
def test_pattern_equals_the_source_weights_times_this_runs_values(
    name: str, device: torch.device
) -> None:
    """The reference recomputes the head's output from the source run's softmax (by hand from
    its recorded q and k) and the target run's v, fed to the output projection."""
    model, parts = _model(name, device)
    clean = torch.randint(30, (2, 5), device=device)
    corrupt = clean.clone()
    corrupt[:, 2] = (corrupt[:, 2] + 11) % 30
    got = patch(model, clean, corrupt, _metric, site="pattern", per_position=True)
    src = _record(model, parts, clean)
    d, t = parts.head_dim, 5
    future = torch.ones(t, t, dtype=torch.bool, device=device).triu(1)
    for layer in range(2):
        q = src["q", layer].unflatten(-1, (parts.heads, d))
        k = src["k", layer].unflatten(-1, (parts.heads, d))
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)  # (B, H, T, S)
        values: list[Tensor] = []
        for head in range(parts.heads):
            for at in range(t):
                hooks = _pattern_hooks(parts, layer, head, at, weights, values)
                base = float(_metric(_run(model, corrupt, [])).mean())
                want = float(_metric(_run(model, corrupt, hooks)).mean()) - base
                assert float(got.values[layer, head, at]) == pytest.approx(want, abs=1e-9)


def _pattern_hooks(
    parts: Parts, layer: int, head: int, at: int, weights: Tensor, values: list[Tensor]
) -> list[Callable[[], Any]]:
    """Hooks recording layer's v and feeding its output projection head ``head``'s row ``at``
    recomputed from ``weights`` (B, H, T, S) and that v."""
    d = parts.head_dim
    module, part, _ = parts.qkv[layer]["v"]

    def feed(m: nn.Module, a: Any) -> Any:
        z = a[0].clone()  # (B, T, H·D)
        v = values[-1].unflatten(-1, (parts.heads, d))[:, :, head]  # (B, S, D)
        z[:, at, head * d : head * d + d] = torch.einsum("bs,bsd->bd", weights[:, head, at], v)
        return (z, *a[1:])

    return [
        lambda: module.register_forward_hook(lambda _, a, out: values.append(out[..., part])),
        lambda: parts.out[layer].register_forward_pre_hook(feed),
    ]


def test_result_patches_as_z_and_the_result_object(device: torch.device) -> None:
    model, _ = _model("lm", device)
    clean = torch.randint(30, (2, 5), device=device)
    corrupt = torch.randint(30, (2, 5), device=device)
    z = patch(model, clean, corrupt, _metric)  # the default site
    result = patch(model, clean, corrupt, _metric, site="result")
    torch.testing.assert_close(result.values, z.values, rtol=0, atol=0)
    torch.testing.assert_close(
        z.values, multihead.patch_heads(model, clean, corrupt, _metric).values, rtol=0, atol=0
    )
    assert z.dims == ("layer", "head") and z.site == "z" and multihead.patch is patch
    gap = z.clean - z.corrupt
    torch.testing.assert_close(z.normalized(), z.values / gap)
    noise = patch(model, clean, corrupt, _metric, direction="noise")
    torch.testing.assert_close(noise.normalized(), 1 + noise.values / gap)
    top = z.top(3)
    assert [abs(v) for _, v in top] == sorted(
        (abs(v) for v in z.values.flatten().tolist()), reverse=True
    )[:3]
    label, value = top[0]
    layer, head = (int(x) for x in label[1:].split("H"))
    assert float(z.values[layer, head]) == value
    rows = z.to_rows()
    assert len(rows) == 8 and rows[0] == {
        "layer": 0, "head": 0, "label": "L0H0", "effect": float(z.values[0, 0]),
        "normalized": float(z.normalized()[0, 0]),
    }  # fmt: skip
    stream = patch(model, clean, corrupt, _metric, site="resid_pre", per_position=True, layers=[1])
    assert stream.dims == ("layer", "position") and stream.values.shape == (2, 5)
    assert torch.isnan(stream.values[0]).all() and not torch.isnan(stream.values[1]).any()
    assert stream.label((1, 3)) == "L1 resid_pre pos 3"


def test_errors() -> None:
    model = TransformerLM(30, 24, 4, 2, 40, max_len=16).eval()
    ids = torch.randint(30, (2, 5))
    with pytest.raises(ValueError, match="site must be one of 'resid_pre', .*got 'resid'"):
        patch(model, ids, ids, _metric, site="resid")
    with pytest.raises(ValueError, match="give heads or layers, not both"):
        patch(model, ids, ids, _metric, heads=[(0, 0)], layers=[0])
    with pytest.raises(ValueError, match="heads: resid_post is one activation per layer"):
        patch(model, ids, ids, _metric, site="resid_post", heads=[(0, 0)])
    with pytest.raises(ValueError, match="layers index 5 is out of range"):
        patch(model, ids, ids, _metric, site="resid_post", layers=[5])
    attn_only = TransformerLM(30, 24, 4, 2, 40, max_len=16, attn_only=True).eval()
    with pytest.raises(ValueError, match="mlp_out of layer 0: TransformerLM's blocks are"):
        patch(attn_only, ids, ids, _metric, site="mlp_out")
    same = patch(model, ids, ids, _metric, site="resid_post")
    with pytest.raises(ValueError, match="normalized\\(\\) divides by clean - corrupt, which is 0"):
        same.normalized()


def _directional(
    model: nn.Module,
    parts: Parts,
    source: Tensor,
    target: Tensor,
    site: str,
    layer: int,
    unit: int,
    at: int,
    step: float = 1e-4,
) -> float:
    """d/ds metric(target with the site's activation + s·(source - target) at one cell), a
    central difference: attribution patching's estimate for that cell, by hooks."""
    src, tgt = _record(model, parts, source), _record(model, parts, target)
    if site == "pattern":  # z = A v: moving A moves z by (ΔA) v, with this run's v
        d, h = parts.head_dim, parts.heads
        weights = []
        for rec in (src, tgt):
            q = rec["q", layer].unflatten(-1, (h, d))
            k = rec["k", layer].unflatten(-1, (h, d))
            t = q.shape[1]
            future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
            scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
            weights.append(scores.masked_fill(future, float("-inf")).softmax(-1))
        moved = weights[0] - weights[1]
        v = tgt["v", layer].unflatten(-1, (h, d))[:, :, unit]  # (B, S, D)
        shift = torch.einsum("bs,bsd->bd", moved[:, unit, at], v)
    else:
        delta = src[site, layer] - tgt[site, layer]
    values = []
    for s in (step, -step):
        if site == "pattern":

            def feed(m: nn.Module, a: Any, s: float = s) -> Any:
                z = a[0].clone()
                z[:, at, unit * parts.head_dim : (unit + 1) * parts.head_dim] += s * shift
                return (z, *a[1:])

            hooks = [lambda f=feed: parts.out[layer].register_forward_pre_hook(f)]
        elif site in ("q", "k", "v"):
            module, part, _ = parts.qkv[layer][site]
            cols = slice(unit * parts.head_dim, (unit + 1) * parts.head_dim)

            def project(
                m: nn.Module,
                a: Any,
                out: Tensor,
                s: float = s,
                part: slice = part,
                cols: slice = cols,
            ) -> Tensor:
                new = out.clone()
                moved = new[..., part]
                moved[:, at, cols] += s * delta[:, at, cols]
                new[..., part] = moved
                return new

            hooks = [lambda f=project, m=module: m.register_forward_hook(f)]
        elif site == "resid_pre":

            def pre(m: nn.Module, a: Any, kw: Any, s: float = s) -> Any:
                x = (a[0] if a else kw["hidden_states"]).clone()
                x[:, at] += s * delta[:, at]
                return ((x, *a[1:]), kw) if a else (a, {**kw, "hidden_states": x})

            hooks = [
                lambda f=pre: parts.blocks[layer].register_forward_pre_hook(f, with_kwargs=True)
            ]
        else:
            module = {"resid_post": parts.blocks[layer], "mlp_out": parts.mlp[layer]}.get(
                site, parts.attention[layer]
            )  # attn_out and resid_mid move with the attention's write

            def post(m: nn.Module, a: Any, out: Any, s: float = s) -> Any:
                y = _first(out).clone()
                y[:, at] += s * delta[:, at]
                return _swap(out, y)

            hooks = [lambda f=post, m=module: m.register_forward_hook(f)]
        values.append(float(_metric(_run(model, target, hooks)).mean()))
    return (values[0] - values[1]) / (2 * step)


@pytest.mark.parametrize(
    ("name", "site"),
    [("lm", "resid_pre"), ("lm", "resid_mid"), ("lm", "mlp_out"), ("lm", "q"), ("lm", "v"),
     ("lm", "pattern"), ("llama", "resid_post"), ("llama", "k"), ("llama", "attn_out")],
)  # fmt: skip
def test_attribution_of_each_site_equals_finite_differences(
    name: str, site: str, device: torch.device
) -> None:
    model, parts = _model(name, device)
    clean = torch.randint(30, (2, 4), device=device)
    corrupt = clean.clone()
    corrupt[:, 1] = (corrupt[:, 1] + 7) % 30
    estimate = multihead.attribution_patching(
        model, clean, corrupt, _metric, site=site, per_position=True
    )
    got = estimate.values
    residual = site in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
    # patch's axes, and the two runs' metrics, each from a plain forward
    dims = ("layer", "position") if residual else ("layer", "head", "position")
    assert estimate.dims == dims and estimate.site == site
    assert estimate.clean == pytest.approx(float(_metric(_run(model, clean, [])).mean()))
    assert estimate.corrupt == pytest.approx(float(_metric(_run(model, corrupt, [])).mean()))
    units = 1 if residual else parts.kv_heads if site in ("k", "v") else parts.heads
    # Llama's RMSNorm computes in float32 whatever the model's dtype: its rounding (~6e-8 of
    # the metric) over the step bounds the difference's error, a longer step, looser
    step, rel, abs_ = (1e-4, 1e-4, 1e-7) if name == "lm" else (1e-2, 2e-3, 2e-5)
    for layer in range(2):
        for unit in range(units):
            for at in range(4):
                want = _directional(model, parts, clean, corrupt, site, layer, unit, at, step)
                cell = (layer, at) if residual else (layer, unit, at)
                assert float(got[cell]) == pytest.approx(want, rel=rel, abs=abs_), cell
    whole = multihead.attribution_patching(model, clean, corrupt, _metric, site=site)
    torch.testing.assert_close(whole.values, got.sum(-1))


def test_a_result_without_a_finite_gap_still_lists_its_cells() -> None:
    nan = float("nan")
    result = multihead.PatchResult(
        torch.tensor([[0.5, nan]]), ("layer", "head"), "z", "noise", nan, 0.0
    )
    assert result.to_rows() == [
        {"layer": 0, "head": 0, "label": "L0H0", "effect": 0.5, "normalized": None}
    ]
    with pytest.raises(
        ValueError, match="normalized\\(\\) divides by clean - corrupt, which is nan"
    ):
        result.normalized()


def test_named_axes_label_each_cell_by_its_names() -> None:
    result = multihead.PatchResult(
        torch.tensor([[[0.1, -0.4]], [[0.3, 0.0]]]),
        ("sender", "receiver", "via"),
        "z",
        "noise",
        1.0,
        0.0,
        names=(("L0H1", "L0H2"), ("L1H3",), ("q", "v")),
    )
    assert result.labels() == [
        "L0H1 -> L1H3.q",
        "L0H1 -> L1H3.v",
        "L0H2 -> L1H3.q",
        "L0H2 -> L1H3.v",
    ]
    assert result.top(1) == [("L0H1 -> L1H3.v", pytest.approx(-0.4))]
    with pytest.raises(ValueError, match="names has \\(2, 1, 1\\) names per axis"):
        multihead.PatchResult(
            result.values, result.dims, "z", "noise", 1.0, 0.0, names=(("a", "b"), ("c",), ("q",))
        )
    with pytest.raises(ValueError, match="dims names 2 axes"):
        multihead.PatchResult(result.values, ("layer", "head"), "z", "noise", 1.0, 0.0)
