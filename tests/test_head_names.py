"""One head notation: ``"L0H1"`` and ``(0, 1)`` name the same head everywhere.

``parse_head`` and ``head_label`` are checked on their own; then every function that takes heads
(``intervene``, ``record_heads`` and its recording, ``patch_heads``, ``path_patching``,
``capture``) gives identical results for either notation, and, where a hand computation is
short, the result a hand computation gives: a head's output is the slice ``h·Dv:(h+1)·Dv`` of
the input of its layer's output projection, read and replaced there by forward pre-hooks on the
module reached by its known path (``lm.blocks[l].self_attn.out_proj``,
``model.model.layers[l].self_attn.o_proj``), and attention weights are transformers' own eager
``output_attentions``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from devices import generator
from torch import Tensor, nn

import multihead
from multihead.heads import head_label, is_head, parse_head
from multihead.models import TransformerLM

V = 17
L, H, HK = 3, 4, 2  # layers, query heads, key/value heads of the TransformerLM here


@pytest.fixture
def lm(device: torch.device) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(V, 24, H, L, 40, max_len=16, num_kv_heads=HK, dtype=torch.float64)
    return model.to(device).eval()


def _ids(device: torch.device, seed: int, shape: tuple[int, int] = (2, 6)) -> Tensor:
    return torch.randint(V, shape, generator=generator(seed, device), device=device)


def _metric(logits: Tensor) -> Tensor:
    return logits[:, -1, 3] - logits[:, -1, 5]


def _out_proj(lm: TransformerLM, layer: int) -> nn.Linear:
    return lm.blocks[layer].self_attn.out_proj


def _head_outputs(lm: TransformerLM, ids: Tensor) -> list[Tensor]:
    """Per layer, the input of its output projection (B, T, H·Dv): the heads side by side."""
    seen: dict[int, Tensor] = {}
    handles = [
        _out_proj(lm, layer).register_forward_pre_hook(
            lambda m, args, layer=layer: seen.__setitem__(layer, args[0].clone())
        )
        for layer in range(L)
    ]
    try:
        with torch.no_grad():
            lm(ids)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[layer] for layer in range(L)]


def _run_edited(
    lm: TransformerLM, ids: Tensor, edits: dict[tuple[int, int], Callable[[Tensor], Tensor]]
) -> Tensor:
    """The logits with head (l, h)'s output x (B, T, Dv) replaced by ``edit(x)``, by hand."""
    dv = _out_proj(lm, 0).in_features // H

    def hook(layer: int) -> Callable[[nn.Module, tuple[Any, ...]], tuple[Tensor]]:
        def pre(m: nn.Module, args: tuple[Any, ...]) -> tuple[Tensor]:
            x = args[0].clone()
            for (at, h), edit in edits.items():
                if at == layer:
                    x[..., h * dv : (h + 1) * dv] = edit(x[..., h * dv : (h + 1) * dv])
            return (x,)

        return pre

    handles = [_out_proj(lm, layer).register_forward_pre_hook(hook(layer)) for layer in range(L)]
    try:
        with torch.no_grad():
            return lm(ids)
    finally:
        for handle in handles:
            handle.remove()


def _constant(value: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda x: value


# -- the notation ----------------------------------------------------------------------------------


def test_parse_head_reads_labels_and_pairs() -> None:
    assert parse_head("heads item", "L0H1") == (0, 1)
    assert parse_head("heads item", "l2h3") == (2, 3)
    assert parse_head("heads item", "L-1H-1") == (-1, -1)
    assert parse_head("heads item", "L12H30") == (12, 30)
    assert parse_head("heads item", (0, 1)) == (0, 1)
    assert parse_head("heads item", (-2, 5)) == (-2, 5)
    for value in ("L0H1", "l2h3", "L-1H-1", (0, 1)):
        assert is_head(value)
    assert head_label(3, 4) == "L3H4" and head_label(0, 11) == "L0H11"
    for layer, head in [(0, 0), (3, 4), (11, 7), (-1, -2)]:
        assert parse_head("x", head_label(layer, head)) == (layer, head)


@pytest.mark.parametrize(
    "bad", ["L0", "H1", "0:1", "L0H1x", "", (0,), (0, 1.0), (0, 1, 2), (True, 1), True, None, 1]
)
def test_parse_head_refuses_anything_else_naming_the_argument(bad: object) -> None:
    assert not is_head(bad)
    with pytest.raises(TypeError, match=r"^senders item must be a \(layer, head\) pair") as caught:
        parse_head("senders item", bad)
    message = str(caught.value)
    assert f"got {bad!r} (" in message and "'L0H1'" in message


# -- multihead's own model: the same heads either way, and as by hand --------------------------


def test_intervene_takes_labels_as_pairs(lm: TransformerLM, device: torch.device) -> None:
    ids = _ids(device, 1)
    with torch.no_grad():
        plain = lm(ids)
        with multihead.intervene(lm, {"L0H1": 0.0, "L-1H-1": 2.0, "l1h2": "mean"}):
            labelled = lm(ids)
        with multihead.intervene(lm, {(0, 1): 0.0, (2, 3): 2.0, (1, 2): "mean"}):
            paired = lm(ids)
    assert torch.equal(labelled, paired)
    assert not torch.allclose(labelled, plain)
    want = _run_edited(
        lm,
        ids,
        {
            (0, 1): torch.zeros_like,
            (2, 3): lambda x: 2.0 * x,
            (1, 2): lambda x: x.mean(dim=(0, 1)).expand_as(x),
        },
    )
    torch.testing.assert_close(labelled, want, rtol=0, atol=1e-12)
    with torch.no_grad():
        assert torch.equal(lm(ids), plain)  # left as it was


def test_intervene_refuses_one_head_named_twice(lm: TransformerLM) -> None:
    with pytest.raises(ValueError, match="a second time"):
        with multihead.intervene(lm, {"L2H3": 0.0, (-1, -1): 0.5}):
            pass


def test_record_heads_takes_labels_and_its_recording_is_indexed_either_way(
    lm: TransformerLM, device: torch.device
) -> None:
    ids = _ids(device, 2)
    dv = _out_proj(lm, 0).in_features // H
    with torch.no_grad(), multihead.record_heads(lm, ["L0H1", "L-1H-1", (1, 0)]) as rec:
        lm(ids)
    with torch.no_grad(), multihead.record_heads(lm, [(0, 1), (2, 3), (1, 0)]) as paired:
        lm(ids)
    assert rec.heads == paired.heads == [(0, 1), (2, 3), (1, 0)]  # counted from 0
    by_hand = _head_outputs(lm, ids)
    for layer, head in rec.heads:
        want = by_hand[layer][..., head * dv : (head + 1) * dv]
        for key in (head_label(layer, head), (layer, head)):
            torch.testing.assert_close(rec[key], want, rtol=0, atol=0)
            torch.testing.assert_close(paired[key], want, rtol=0, atol=0)
        assert (layer, head) in rec
    with pytest.raises(KeyError, match="was not recorded"):
        rec["L0H0"]
    with pytest.raises(TypeError, match="key"):
        rec["0:1"]


def test_a_recording_contains_a_head_named_by_its_label(
    lm: TransformerLM, device: torch.device
) -> None:
    with torch.no_grad(), multihead.record_heads(lm, ["L0H1"]) as rec:
        lm(_ids(device, 2))
    assert rec["L0H1"] is rec[(0, 1)]
    assert "L0H1" in rec


def test_patch_heads_takes_labels_and_equals_patching_by_hand(
    lm: TransformerLM, device: torch.device
) -> None:
    clean, corrupt = _ids(device, 3), _ids(device, 4)
    labels: Any = ["L0H1", "L-1H-1", "l1h0"]
    got = multihead.patch_heads(lm, clean, corrupt, _metric, heads=labels).values
    paired = multihead.patch_heads(
        lm, clean, corrupt, _metric, heads=[(0, 1), (2, 3), (1, 0)]
    ).values
    torch.testing.assert_close(got, paired, rtol=0, atol=0, equal_nan=True)
    chosen = [(0, 1), (2, 3), (1, 0)]
    assert got.shape == (L, H)
    assert [(i, j) for i in range(L) for j in range(H) if not got[i, j].isnan()] == sorted(chosen)
    dv = _out_proj(lm, 0).in_features // H
    source = _head_outputs(lm, clean)
    with torch.no_grad():
        base = _metric(lm(corrupt)).mean()
    for layer, head in chosen:
        patch = source[layer][..., head * dv : (head + 1) * dv]
        logits = _run_edited(lm, corrupt, {(layer, head): _constant(patch)})
        want = _metric(logits).mean() - base
        torch.testing.assert_close(got[layer, head], want, rtol=0, atol=1e-10)
    assert float(got.nan_to_num().abs().max()) > 1e-6


def test_path_patching_takes_labels(lm: TransformerLM, device: torch.device) -> None:
    clean, corrupt = _ids(device, 5), _ids(device, 6)
    senders: Any = ["L0H1", (0, 3), "L1H2"]
    receivers: Any = ["L-1H-1", "L2H0"]
    got = multihead.path_patching(lm, clean, corrupt, _metric, senders, receivers)
    want = multihead.path_patching(
        lm, clean, corrupt, _metric, [(0, 1), (0, 3), (1, 2)], [(2, 3), (2, 0)]
    )
    assert got.values.shape == (3, 2, 3)
    torch.testing.assert_close(got.values, want.values, rtol=0, atol=0)
    assert float(got.values.abs().max()) > 1e-8
    # the result writes the heads in the one notation, whichever way they were given
    assert got.names == (("L0H1", "L0H3", "L1H2"), ("L2H3", "L2H0"), ("q", "k", "v"))


def test_capture_of_heads_named_with_their_layers(lm: TransformerLM, device: torch.device) -> None:
    ids = _ids(device, 7)
    with torch.no_grad(), multihead.capture(lm) as every:
        lm(ids)
    full = every.weights  # per layer (B, H, T, T)
    heads: Any = ["L2H3", "L0H1", "l2h0", (0, 1), (-1, 0)]  # repeats are recorded once
    with torch.no_grad(), multihead.capture(lm, heads=heads) as rec:
        lm(ids)
    pairs: Any = [(2, 3), (0, 1), (2, 0)]
    with torch.no_grad(), multihead.capture(lm, heads=pairs) as paired:
        lm(ids)
    # a subset of heads is recomputed in smaller batches than every head: equal to float
    # rounding (which kernel a shape gets differs between CPUs), not bit for bit
    for got in (rec, paired):
        assert got.layers == [0, 2]  # only the named layers, in layer order
        assert got.heads == [(1,), (0, 3)]  # each with its own heads
        assert got.weights[0].shape == (2, 1, 6, 6)
        torch.testing.assert_close(got.weights[0], full[0][:, [1]])
        torch.testing.assert_close(got.weights[1], full[2][:, [0, 3]])
    # one label alone names one head
    with torch.no_grad(), multihead.capture(lm, heads="L1H2") as one:
        lm(ids)
    assert one.layers == [1] and one.heads == [(2,)]
    torch.testing.assert_close(one.weights[0], full[1][:, [2]])
    # plain ints still mean those heads in every layer
    with torch.no_grad(), multihead.capture(lm, heads=[1, 2]) as plain:
        lm(ids)
    assert plain.layers == [0, 1, 2] and plain.heads == [(1, 2)] * 3


def test_capture_refuses_layers_beside_heads_with_layers(lm: TransformerLM) -> None:
    heads: Any = ["L0H1"]
    with pytest.raises(ValueError, match="layers must be None"):
        with multihead.capture(lm, heads=heads, layers=[0]):
            pass


def _enter(context: Any) -> None:
    with context:
        pass


def _naming(lm: TransformerLM, ids: Tensor, label: str) -> dict[str, Callable[[], Any]]:
    """Every function that takes heads, given the head ``label``."""
    return {
        "intervene": lambda: _enter(multihead.intervene(lm, {label: 0.0})),
        "record_heads": lambda: _enter(multihead.record_heads(lm, [label])),
        "capture": lambda: _enter(multihead.capture(lm, heads=[label])),
        "patch_heads": lambda: multihead.patch_heads(lm, ids, ids, _metric, heads=[label]).values,
        "path_patching": lambda: multihead.path_patching(lm, ids, ids, _metric, [label], ["L2H0"]),
    }


FUNCTIONS = ["intervene", "record_heads", "capture", "patch_heads", "path_patching"]


@pytest.mark.parametrize("name", FUNCTIONS)
@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("L9H0", r"L9H0'?: layer index 9 is out of range: there are 3 "),
        ("L-4H0", r"L-4H0'?: layer index -4 is out of range: there are 3 "),
        ("L0H9", r"L0H9'?: head index 9 is out of range: there are 4 heads"),
    ],
)
def test_a_head_out_of_range_is_a_value_error_naming_it(
    name: str, label: str, message: str, lm: TransformerLM, device: torch.device
) -> None:
    with pytest.raises(ValueError, match=message):
        _naming(lm, _ids(device, 8), label)[name]()


# -- a transformers model: intervene and capture ---------------------------------------------------


@pytest.fixture
def llama(device: torch.device) -> Any:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=40,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device).eval()


def test_intervene_on_a_transformers_model_takes_labels(llama: Any, device: torch.device) -> None:
    ids = torch.randint(50, (2, 7), generator=generator(9, device), device=device)
    zeroed = copy.deepcopy(llama)
    d = llama.config.hidden_size // llama.config.num_attention_heads
    with torch.no_grad():
        for layer, head in [(1, 2), (0, 5)]:  # zero those heads' columns of o_proj
            zeroed.model.layers[layer].self_attn.o_proj.weight[:, head * d : (head + 1) * d] = 0
        want = zeroed(ids).logits
        plain = llama(ids).logits
        with multihead.intervene(llama, {"L1H2": 0.0, "L-2H-1": 0.0}):
            labelled = llama(ids).logits
        with multihead.intervene(llama, {(1, 2): 0.0, (0, 5): 0.0}):
            paired = llama(ids).logits
    torch.testing.assert_close(labelled, paired, rtol=0, atol=0)
    torch.testing.assert_close(labelled, want, rtol=0, atol=1e-5)
    assert not torch.allclose(labelled, plain, rtol=0, atol=1e-4)


def test_capture_on_a_transformers_model_takes_labels(llama: Any, device: torch.device) -> None:
    ids = torch.randint(50, (2, 7), generator=generator(10, device), device=device)
    eager = copy.deepcopy(llama)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        reference = eager(ids, output_attentions=True).attentions  # per layer (B, H, T, T)
    heads: Any = ["L1H4", "L0H1", (1, 0), "l0h5"]
    with torch.no_grad(), multihead.capture(llama, heads=heads) as rec:
        llama(ids)
    pairs: Any = [(1, 4), (0, 1), (1, 0), (0, 5)]
    with torch.no_grad(), multihead.capture(llama, heads=pairs) as paired:
        llama(ids)
    with torch.no_grad(), multihead.capture(llama) as every:
        llama(ids)
    for got in (rec, paired):
        assert got.layers == [0, 1] and got.heads == [(1, 5), (0, 4)]
        torch.testing.assert_close(got.weights[0], every.weights[0][:, [1, 5]])
        torch.testing.assert_close(got.weights[1], every.weights[1][:, [0, 4]])
        torch.testing.assert_close(got.weights[0], reference[0][:, [1, 5]], rtol=0, atol=1e-5)
        torch.testing.assert_close(got.weights[1], reference[1][:, [0, 4]], rtol=0, atol=1e-5)
