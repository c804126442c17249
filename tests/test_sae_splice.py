"""splice_sae against hand-written torch hooks on the same modules.

The reference replaces the activation the SAE reads the way SAELens's ``use_error_term``
does, ``decode(edited features) + (x - decode(features))``, in a hook written here on the
module that makes that activation (the output projection's input for z, the attention or
feed-forward module's output, the block's input or output, the second norm's input and the
feed-forward write for resid_mid), on multihead's TransformerLM and on transformers' GPT-2
and a grouped-query Llama through the bridge; SAEs built as tests/test_features.py builds
them. With the error term and no edit the logits are the model's own, bit for bit; steering
with the error term adds ``a · W_dec[i]`` to the activation, written here from ``W_dec``.
attribution_patching, patch, edge_attribution and generation run inside the splice as inside
the hand-written hook; multihead's BERT splices a padded batch it runs packed (N, E).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from test_edge_attribution import _lm, _metric, _run
from test_features import _gpt2, _llama, _sae
from torch import Tensor, nn

from multihead.circuits.edges.edge_attribution import edge_attribution
from multihead.circuits.features.sae_splice import SPLICED_SITES, splice_sae
from multihead.circuits.patching.attribution_patching import attribution_patching
from multihead.circuits.patching.patch import patch
from multihead.mapping import model_map
from multihead.models import TransformerLM
from multihead.sae import SAE, SAEConfig

Replace = Callable[[Tensor], Tensor]


def _model(family: str, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    if family == "lm":
        return _lm(dtype)
    return (_gpt2 if family == "gpt2" else _llama)(dtype)[0]


def _parts(model: nn.Module, layer: int) -> dict[str, nn.Module]:
    """Block ``layer``'s modules, found here for the reference (not from multihead's map)."""
    if isinstance(model, TransformerLM):
        block: Any = model.blocks[layer]
        attn = block.self_attn
        return dict(block=block, attn=attn, out_proj=attn.out_proj, norm2=block.norm2, mlp=block.ff)
    if hasattr(model, "transformer"):  # GPT-2
        block = model.transformer.h[layer]
        return dict(block=block, attn=block.attn, out_proj=block.attn.c_proj, norm2=block.ln_2,
                    mlp=block.mlp)  # fmt: skip
    block = model.model.layers[layer]  # type: ignore[union-attr,index]
    return dict(block=block, attn=block.self_attn, out_proj=block.self_attn.o_proj,
                norm2=block.post_attention_layernorm, mlp=block.mlp)  # fmt: skip


def _reference(
    sae: SAE,
    x: Tensor,
    *,
    error: bool = False,
    features: dict[int, float] | None = None,
    steer: dict[int, float] | None = None,
) -> Tensor:
    """SAELens's splice of ``x`` (the SAE's input shape): the edited features' reconstruction,
    plus ``x - decode(encode(x))`` with the error term; in x's dtype."""
    given = x.to(sae.dtype)
    f = sae.encode(given)
    g = f.clone()
    for i, s in (features or {}).items():
        g[..., i] = g[..., i] * s
    for i, a in (steer or {}).items():
        g[..., i] = g[..., i] + a
    out = sae.decode(g, input=given)
    if error:
        out = out + (given - sae.decode(f, input=given))
    return out.to(x.dtype)


def _first(out: Any) -> Tensor:
    return out[0] if isinstance(out, tuple) else out


def _with_first(out: Any, value: Tensor) -> Any:
    return (value, *out[1:]) if isinstance(out, tuple) else value


@contextmanager
def _hooked(
    model: nn.Module, sae: SAE, replace: Replace, layer: int | None = None
) -> Iterator[None]:
    """The hand-written hooks replacing the SAE's site (at ``layer``, default its hook's) by
    ``replace`` of it (in the SAE's input shape)."""
    assert sae.site is not None
    site, own = sae.site
    layer = own if layer is None else layer
    parts = _parts(model, layer)
    handles: list[Any] = []
    if site == "z":  # the output projection's input (B, T, H·Dv), head-major
        dv = model_map(model).sites[layer].head_dim
        head = sae.hook_head_index

        def z(m: nn.Module, args: tuple[Any, ...]) -> Any:
            x = args[0]
            if head is not None:
                cols = slice(head * dv, (head + 1) * dv)
                new = x.clone()
                new[..., cols] = replace(x[..., cols][..., None, :])[..., 0, :]
                return (new, *args[1:])
            if sae.reshape_activations == "hook_z":
                return (replace(x.unflatten(-1, (-1, dv))).flatten(-2), *args[1:])
            return (replace(x), *args[1:])

        handles.append(parts["out_proj"].register_forward_pre_hook(z))
    elif site in ("attn_out", "mlp_out"):
        module = parts["attn" if site == "attn_out" else "mlp"]
        handles.append(
            module.register_forward_hook(lambda m, a, out: _with_first(out, replace(_first(out))))
        )
    elif site == "resid_pre":

        def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args:
                return (replace(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": replace(kwargs["hidden_states"])}

        handles.append(parts["block"].register_forward_pre_hook(pre, with_kwargs=True))
    elif site == "resid_post":
        handles.append(
            parts["block"].register_forward_hook(
                lambda m, a, out: _with_first(out, replace(_first(out)))
            )
        )
    else:  # resid_mid: the second norm reads the replacement, and the stream after the MLP
        mid: dict[str, Tensor] = {}

        def norm_in(m: nn.Module, args: tuple[Any, ...]) -> Any:
            mid["x"], mid["new"] = args[0], replace(args[0])
            return (mid["new"], *args[1:])

        def mlp_out(m: nn.Module, a: Any, out: Any) -> Any:
            return _with_first(out, _first(out) + (mid["new"] - mid["x"]))

        handles.append(parts["norm2"].register_forward_pre_hook(norm_in))
        handles.append(parts["mlp"].register_forward_hook(mlp_out))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _registered(model: nn.Module) -> int:
    """Every forward hook, pre-hook and observer on the model."""
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return hooks + sum(len(s.attention.observers) for s in model_map(model).sites)


# (hook, the SAE's keyword arguments): d_in 24, the width (H·Dv for z), or Dv for one head
CASES = [
    ("blocks.1.attn.hook_z", {"reshape": "hook_z"}),
    ("blocks.1.attn.hook_z", {"normalize": "layer_norm"}),  # flattened by multihead
    ("blocks.1.attn.hook_z", {"reshape": "hook_z", "head_index": 2}),
    ("blocks.0.hook_resid_pre", {"normalize": "constant_norm_rescale"}),
    ("blocks.1.hook_resid_mid", {}),
    ("blocks.0.hook_resid_post", {"architecture": "jumprelu"}),
    ("blocks.0.hook_attn_out", {"normalize": "layer_norm"}),
    ("blocks.1.hook_mlp_out", {}),
]
FAMILIES = ["lm", "gpt2", "llama"]


def _case_sae(model: nn.Module, hook: str, kwargs: dict[str, Any], **more: Any) -> SAE:
    d_in = model_map(model).sites[1].head_dim if "head_index" in kwargs else 24
    return _sae(d_in, hook, **{**kwargs, **more})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("hook", "kwargs"), CASES)
def test_splice_equals_a_hand_written_hook(family: str, hook: str, kwargs: dict[str, Any]) -> None:
    model = _model(family)
    sae = _case_sae(model, hook, kwargs)
    ids = torch.randint(20, (2, 9))
    with torch.no_grad():
        base = _run(model, ids)
        edits: dict[str, Any] = {"features": {3: 0.0, -1: 2.5}, "steer": {4: 1.5}}
        for error in (False, True):
            for edit in ({}, edits):
                with _hooked(
                    model, sae, lambda x, e=error, k=edit: _reference(sae, x, error=e, **k)
                ):
                    want = _run(model, ids)
                with splice_sae(model, sae, error=error, **edit):
                    got = _run(model, ids)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
                if error and not edit:  # the error term: the model itself, bit for bit
                    assert torch.equal(got, base)
                else:  # the splice changed the logits (the comparison above can fail)
                    assert float((got - base).abs().max()) > 1e-3
        assert torch.equal(_run(model, ids), base)  # itself after


@pytest.mark.parametrize("family", FAMILIES)
def test_the_error_term_changes_nothing_in_float32(family: str) -> None:
    model = _model(family, torch.float32)
    ids = torch.randint(20, (2, 9))
    with torch.no_grad():
        base = _run(model, ids)
        for hook, kwargs in CASES:
            sae = _case_sae(model, hook, kwargs, dtype=torch.float32)
            with splice_sae(model, sae, error=True):
                assert torch.equal(_run(model, ids), base), hook
            with _hooked(model, sae, lambda x, s=sae: _reference(s, x)):
                want = _run(model, ids)
            with splice_sae(model, sae):
                got = _run(model, ids)
            # float32 rounding of two orders of the same products, at the logits' scale
            scale = max(1.0, float(base.abs().max()))
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * scale)


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"])
def test_steering_adds_the_decoder_direction(hook: str) -> None:
    """With the error term, steer={i: a} is x + a · W_dec[i] and features={i: 0.0} is
    x - f_i · W_dec[i], for an SAE that does not normalise its input."""
    model = _model("gpt2")
    sae = _sae(24, hook)
    ids = torch.randint(20, (2, 9))
    i, a = 6, 2.0

    def steered(x: Tensor) -> Tensor:  # x (B, T, E)
        return x + a * sae.W_dec[i]

    def ablated(x: Tensor) -> Tensor:
        return x - sae.encode(x)[..., i : i + 1] * sae.W_dec[i]

    with torch.no_grad():
        for edit, replace in (({"steer": {i: a}}, steered), ({"features": {i: 0.0}}, ablated)):
            with _hooked(model, sae, replace):
                want = _run(model, ids)
            with splice_sae(model, sae, error=True, **edit):
                got = _run(model, ids)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            assert float((got - _run(model, ids)).abs().max()) > 1e-3


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"])
def test_gradients_flow_through_the_splice(hook: str) -> None:
    model = _model("gpt2")
    sae = _sae(24, hook, reshape="hook_z" if "hook_z" in hook else "none")
    clean, corrupt = torch.randint(20, (2, 8)), torch.randint(20, (2, 8))
    edit = {"features": {2: 0.0}, "steer": {5: 0.5}}

    def reference(x: Tensor) -> Tensor:
        return _reference(sae, x, **edit)  # type: ignore[arg-type]

    with _hooked(model, sae, reference):
        want = attribution_patching(model, clean, corrupt, _metric, per_position=True).values
    with splice_sae(model, sae, **edit):
        got = attribution_patching(model, clean, corrupt, _metric, per_position=True).values
    plain = attribution_patching(model, clean, corrupt, _metric, per_position=True).values
    assert bool(got.isfinite().all())
    # a z splice: the heads of its layer are attributed after the splice here (their output
    # is the observer's), before it in the hand-written hook; the other layer's agree
    rows = slice(1, None) if hook.endswith("hook_z") else slice(None)
    torch.testing.assert_close(got[rows], want[rows], rtol=0, atol=1e-6)
    if hook.endswith("resid_pre"):  # the heads of layer 1 read the spliced stream
        assert float((got - plain).abs().max()) > 1e-3
    # a parameter's gradient through the spliced site, as the hand-written hook gives it
    grads = []
    for context in (_hooked(model, sae, reference), splice_sae(model, sae, **edit)):
        model.zero_grad()
        with context:
            _metric(_run(model, clean)).sum().backward()
        grads.append(model.transformer.wte.weight.grad.clone())  # type: ignore[union-attr]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)
    assert float(grads[1].abs().max()) > 0
    model.zero_grad()


@pytest.mark.parametrize("hook", ["blocks.1.hook_resid_pre", "blocks.0.attn.hook_z"])
def test_activation_patching_runs_with_the_features_in_place(hook: str) -> None:
    """patch (stacked variants, the blocks before the patched one reused) inside the splice
    equals patch inside the hand-written hook."""
    model = _model("lm")
    sae = _sae(24, hook, reshape="hook_z" if "hook_z" in hook else "none")
    clean, corrupt = torch.randint(20, (2, 8)), torch.randint(20, (2, 8))

    def reference(x: Tensor) -> Tensor:
        return _reference(sae, x, features={1: 0.0})

    with _hooked(model, sae, reference):
        want = patch(model, clean, corrupt, _metric, site="resid_post", per_position=True)
    with splice_sae(model, sae, features={1: 0.0}):
        got = patch(model, clean, corrupt, _metric, site="resid_post", per_position=True)
    plain = patch(model, clean, corrupt, _metric, site="resid_post", per_position=True)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=1e-6)
    assert got.clean == pytest.approx(want.clean, abs=1e-6)
    assert abs(got.clean - plain.clean) > 1e-3


def test_edge_attribution_runs_with_the_features_in_place() -> None:
    model = _model("lm")
    sae = _sae(24, "blocks.1.hook_resid_pre", normalize="layer_norm")
    clean, corrupt = torch.randint(20, (2, 8)), torch.randint(20, (2, 8))
    edit = {"steer": {3: 1.0}}

    def reference(x: Tensor) -> Tensor:
        return _reference(sae, x, **edit)  # type: ignore[arg-type]

    with _hooked(model, sae, reference):
        want = edge_attribution(model, clean, corrupt, _metric).values
    with splice_sae(model, sae, **edit):
        got = edge_attribution(model, clean, corrupt, _metric).values
    plain = edge_attribution(model, clean, corrupt, _metric).values
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6, equal_nan=True)
    assert float((got - plain).nan_to_num().abs().max()) > 1e-3


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_steps_are_spliced(use_cache: bool) -> None:
    model = _model("lm")
    assert isinstance(model, TransformerLM)
    sae = _sae(24, "blocks.0.hook_resid_post")
    ids = torch.randint(20, (2, 4))
    with _hooked(model, sae, lambda x: _reference(sae, x)):
        want = model.generate(ids, 6, use_cache=use_cache)
    with splice_sae(model, sae):
        got = model.generate(ids, 6, use_cache=use_cache)
    assert torch.equal(got, want)
    assert not torch.equal(got, model.generate(ids, 6, use_cache=use_cache))


def test_everything_is_removed_on_exit_and_on_an_exception() -> None:
    model = _model("llama")
    ids = torch.randint(20, (2, 9))
    before = _registered(model)
    with torch.no_grad():
        base = _run(model, ids)
        for hook, kwargs in CASES:
            sae = _case_sae(model, hook, kwargs)
            with splice_sae(model, sae, features={1: 0.0}):
                assert _registered(model) > before
                _run(model, ids)
            assert _registered(model) == before
            with pytest.raises(RuntimeError, match="inside"):
                with splice_sae(model, sae, error=True, steer={0: 1.0}):
                    _run(model, ids)
                    raise RuntimeError("inside")
            assert _registered(model) == before
        assert torch.equal(_run(model, ids), base)


def test_an_sae_on_its_own_dtype_and_a_negative_layer() -> None:
    """A float64 SAE spliced into a float32 model (its activations cast there and back), at
    layer=-1 instead of its hook's."""
    model = _model("lm", torch.float32)
    sae = _sae(24, "blocks.0.hook_resid_post", normalize="layer_norm")  # float64
    ids = torch.randint(20, (2, 9))
    with torch.no_grad():
        with _hooked(model, sae, lambda x: _reference(sae, x), layer=1):
            want = _run(model, ids)
        with splice_sae(model, sae, layer=-1):
            got = _run(model, ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


# -- bad inputs: one clear error each, naming the argument, nothing registered --------------------


def _transcoder() -> SAE:
    config = SAEConfig(
        architecture="transcoder", d_in=24, d_sae=10, d_out=24, dtype=torch.float64,
        hook_name="blocks.0.hook_resid_mid", hook_name_out="blocks.0.hook_mlp_out",
    ).check("test")  # fmt: skip
    shapes = config.tensor_shapes()
    return SAE(config, {n: torch.randn(s, dtype=torch.float64) for n, s in shapes.items()})


Z = "blocks.1.attn.hook_z"
RESID = "blocks.1.hook_resid_pre"
# (SAE, keyword arguments, error, message): splice_sae(gpt2 (2 layers, 4 heads of 6), sae, ...)
BAD = [
    ("not an sae", {}, TypeError, r"splice_sae: sae must be a multihead\.sae\.SAE"),
    (
        _sae(24, "blocks.1.ln2.hook_normalized"),
        {},
        ValueError,
        r"splice_sae: sae: this SAE reads 'bl",
    ),
    (_sae(24, None), {}, ValueError, r"splice_sae: sae: this SAE's files name no hook"),
    # its copy of resid_mid: replacing resid_mid would change the stream too
    (_sae(24, "blocks.1.hook_mlp_in"), {}, ValueError, r"copy of resid_mid that only the feed-"),
    (_sae(24, "blocks.0.attn.hook_q"), {}, ValueError, r"q of layer 0\); splice_sae splices an"),
    (_sae(24, "hook_embed"), {}, ValueError, r"\(embed\); splice_sae splices an SAE of z, at"),
    (_transcoder(), {}, ValueError, r"sae is a transcoder: .*a transcoder is not supported"),
    (_sae(24, "blocks.5.hook_resid_pre"), {}, ValueError, r"layer 5, and the model has 2 att"),
    (_sae(24, RESID), {"layer": 2}, ValueError, r"splice_sae: layer index 2 is out of range"),
    (_sae(24, RESID), {"layer": "1"}, TypeError, r"splice_sae: layer must be an int or None"),
    (
        _sae(20, Z, reshape="hook_z"),
        {},
        ValueError,
        r"splice_sae: the SAE reads 20 values per position \(d_in\), and z of layer 1 of the "
        r"model has 24",
    ),
    (_sae(20, RESID), {}, ValueError, r"reads 20 values .*and resid_pre of layer 1 of the model"),
    (
        _sae(6, Z, reshape="hook_z", head_index=4),
        {},
        ValueError,
        r"splice_sae: sae\.hook_head_index index 4 is out of range: there are 4 heads",
    ),
    (
        _sae(24, RESID),
        {"features": {10: 0.0}},
        ValueError,
        r"splice_sae: features key index 10 is out of range: there are 10 features \(d_sae\)",
    ),
    (_sae(24, RESID), {"steer": {-11: 1.0}}, ValueError, r"steer key index -11 is out of range"),
    (_sae(24, RESID), {"features": {"3": 0.0}}, TypeError, r"features key must be an int"),
    (_sae(24, RESID), {"features": {9: 0.0, -1: 1.0}}, ValueError, r"feature 9 a second time"),
    (_sae(24, RESID), {"features": {1: float("nan")}}, ValueError, r"features\[1\] must be a f"),
    (_sae(24, RESID), {"steer": {1: float("inf")}}, ValueError, r"steer\[1\] must be a finite"),
    (_sae(24, RESID), {"steer": {1: 10**400}}, ValueError, r"steer\[1\] must be a finite num"),
    (
        _sae(24, RESID, dtype=torch.float16),
        {"steer": {1: 1e5}},
        ValueError,
        r"steer\[1\] must be a finite number \(and finite in the SAE's dtype torch\.float16\)",
    ),
    (_sae(24, RESID), {"features": {1: True}}, TypeError, r"features\[1\] must be a number"),
    (_sae(24, RESID), {"features": {1: "0"}}, TypeError, r"features\[1\] must be a number"),
    (_sae(24, RESID), {"features": [1, 2]}, TypeError, r"features must be a mapping \{featur"),
    (_sae(24, RESID), {"error": "yes"}, TypeError, r"splice_sae: error must be a bool"),
]


@pytest.fixture(scope="module")
def gpt2() -> nn.Module:
    return _model("gpt2")


@pytest.mark.parametrize(("sae", "kwargs", "error", "match"), BAD)
def test_bad_inputs(
    gpt2: nn.Module, sae: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    before = _registered(gpt2)
    with pytest.raises(error, match=match):
        with splice_sae(gpt2, sae, **kwargs):
            pytest.fail("the block ran")
    assert _registered(gpt2) == before


def test_an_attention_only_block_has_no_mlp_out_to_splice() -> None:
    lm = TransformerLM(20, 24, 4, 2, 32, max_len=16, attn_only=True)
    before = _registered(lm)
    with pytest.raises(ValueError, match=r"does not know block 1's feed-forward module"):
        with splice_sae(lm, _sae(24, "blocks.1.hook_mlp_out")):
            pytest.fail("the block ran")
    assert _registered(lm) == before
    assert set(SPLICED_SITES) == {"z", "attn_out", "resid_pre", "resid_mid", "mlp_out",
                                  "resid_post"}  # fmt: skip


@pytest.mark.parametrize("hook", ["blocks.0.hook_resid_post", "blocks.1.attn.hook_z"])
def test_a_packed_batch_is_spliced_at_its_real_tokens(hook: str) -> None:
    """multihead's BERT runs a padded batch packed, its blocks on (N, E): the splice replaces
    each real token's activation as the hook on the packed tensors does."""
    from multihead.models.bert import BertModel
    from multihead.models.bert_config import BertConfig

    config = BertConfig(
        vocab_size=20, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=32, max_position_embeddings=16, type_vocab_size=2,
        layer_norm_eps=1e-12, activation="gelu",
    )  # fmt: skip
    bert = BertModel(config).double().eval()
    sae = _sae(24, hook, normalize="layer_norm")
    ids = torch.randint(20, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    layer = bert.encoder.layers[int(hook.split(".")[1])]
    shapes: list[int] = []

    def reference(x: Tensor) -> Tensor:
        shapes.append(x.dim())
        return _reference(sae, x)

    if hook.endswith("hook_z"):
        handle = layer.self_attn.out_proj.register_forward_pre_hook(lambda m, a: (reference(a[0]),))
    else:
        handle = layer.register_forward_hook(lambda m, a, out: reference(out))
    with torch.no_grad():
        want = bert(ids, attention_mask=mask).last_hidden_state
        handle.remove()
        with splice_sae(bert, sae):
            got = bert(ids, attention_mask=mask).last_hidden_state
        base = bert(ids, attention_mask=mask).last_hidden_state
    assert shapes == [2]  # the packed (N, E) tokens
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    assert float((got - base)[real].abs().max()) > 1e-3


@pytest.mark.parametrize("site, what", [("attn_out", "attention"), ("mlp_out", "feed-forward"),
                                        ("resid_mid", "attention")])  # fmt: skip
def test_a_post_norm_block_refuses_the_parts_sites(site: str, what: str) -> None:
    """Gemma-3 normalises its attention's and feed-forward network's outputs before adding them
    (post-attention and post-feed-forward norms): the module's output is not the site there, so
    the splice is refused on the first call, naming the norm; the model is itself after."""
    from test_features import _gemma3

    model, _ = _gemma3()
    hook = "blocks.1.hook_resid_mid" if site == "resid_mid" else f"blocks.1.hook_{site}"
    sae = _sae(24, hook)
    ids = torch.randint(20, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
    hooks = _registered(model)
    with (
        pytest.raises(
            ValueError,
            match=rf"post-{what} norm.*splicing {site} of layer 1 there is not supported",
        ),
        splice_sae(model, sae),
        torch.no_grad(),
    ):
        model(ids)
    assert _registered(model) == hooks
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
