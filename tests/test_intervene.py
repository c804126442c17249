"""Head interventions (intervene, record_heads, head_importance) against independent references.

The reference for an edit of head h in layer l is the unedited model with the columns
h·Dv:(h+1)·Dv of that layer's ``out_proj.weight`` zeroed or scaled: the per-head output before
``out_proj`` is exactly what those columns multiply.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead import MultiHeadAttention, TransformerEncoder, TransformerEncoderLayer
from multihead.circuits import HeadRecording
from multihead.models import TransformerLM
from multihead.models.bert import BertModel
from multihead.models.bert_config import BertConfig
from multihead.observe import attention_modules, capture

intervene = multihead.intervene
record_heads = multihead.record_heads
head_importance = multihead.head_importance

# Pairwise-distinct sizes so that a swapped dimension fails loudly.
B, T, E, H, D = 3, 7, 24, 6, 4
LAYERS = 3


def _key_mask(device: torch.device) -> Tensor:
    km = torch.ones(B, T, dtype=torch.bool, device=device)
    km[1, 4:] = False
    km[2, 6:] = False
    return km


def _encoder(
    num_kv_heads: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> nn.Module:
    return (
        TransformerEncoder(
            [
                TransformerEncoderLayer(E, H, 40, num_kv_heads=num_kv_heads, dtype=dtype)
                for _ in range(LAYERS)
            ]
        )
        .to(device)
        .eval()
    )


def _bert(device: torch.device) -> BertModel:
    config = BertConfig(
        vocab_size=50,
        hidden_size=E,
        num_hidden_layers=LAYERS,
        num_attention_heads=H,
        intermediate_size=40,
        max_position_embeddings=16,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
        activation="gelu",
    )
    return BertModel(config).to(device).eval()


def _lm(num_kv_heads: int | None = None, device: torch.device | str = "cpu") -> TransformerLM:
    lm = TransformerLM(14, E, H, LAYERS, 40, max_len=16, num_kv_heads=num_kv_heads)
    return lm.to(device).eval()


# kind -> (model, run(model) -> output on real tokens)
Case = tuple[nn.Module, Callable[[nn.Module], Tensor]]


def _case(kind: str, device: torch.device) -> Case:
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    if kind == "mha":
        return MultiHeadAttention(E, H).to(device).eval(), lambda m: m(x, key_mask=km)
    if kind == "encoder":
        return _encoder(device=device), lambda m: m(x, key_mask=km)
    if kind == "gqa":
        return _encoder(num_kv_heads=2, device=device), lambda m: m(x, key_mask=km, is_causal=True)
    if kind == "lm":
        ids = torch.randint(14, (B, T), device=device)
        return _lm(num_kv_heads=3, device=device), lambda m: m(ids)
    ids, mask = torch.randint(1, 50, (B, T), device=device), km.long()
    model = _bert(device)
    model.unpad = kind == "bert-unpadded"

    def run(m: nn.Module) -> Tensor:
        return m(ids, mask).last_hidden_state[km]  # (N, E): real tokens only

    return model, run


KINDS = ["mha", "encoder", "gqa", "lm", "bert-padded", "bert-unpadded"]


def _reference(model: nn.Module, edits: dict[tuple[int, int], float]) -> nn.Module:
    """A copy of the model with each edited head's out_proj columns scaled."""
    ref = copy.deepcopy(model)
    found = attention_modules(ref)
    with torch.no_grad():
        for (layer, head), a in edits.items():
            mha = found[layer][1]
            dv = mha.head_dim
            mha.out_proj.weight[:, head * dv : (head + 1) * dv] *= a
    return ref


def _observers(model: nn.Module) -> int:
    return sum(len(mha.observers) for _, mha in attention_modules(model))


# -- edits against the out_proj reference ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "edits",
    [{(0, 1): 0.0}, {(-1, 4): 0.5}, {(0, 0): 0.0, (0, 5): -1.5, (-1, 2): 0.0}],
    ids=["zero", "scale", "several"],
)
def test_edit_equals_out_proj_columns(
    kind: str, edits: dict[tuple[int, int], float], device: torch.device
) -> None:
    model, run = _case(kind, device)
    if kind == "mha":  # one layer: (-1, h) is (0, h)
        edits = {(0, h): a for (_, h), a in edits.items()}
    resolved = {(k[0] % len(attention_modules(model)), k[1]): a for k, a in edits.items()}
    with torch.no_grad():
        clean = run(model)
        want = run(_reference(model, resolved))
        with intervene(model, edits):
            got = run(model)
        after = run(model)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got, clean)
    assert torch.equal(after, clean)  # restored bit for bit
    assert _observers(model) == 0


def test_lm_generate_with_kv_cache_equals_reference(device: torch.device) -> None:
    lm = _lm(device=device)
    edits = {(0, 2): 0.0, (2, 5): 1.7}
    ref = _reference(lm, edits)
    prompt = torch.randint(14, (2, 5), device=device)
    with intervene(lm, edits):
        tokens = lm.generate(prompt, 6, use_cache=True)
        recomputed = lm.generate(prompt, 6, use_cache=False)
        # step by step with a cache: every call of a layer is edited, T = 5 then 1, 1, ...
        cache = lm.make_cache(2)
        steps = [lm(prompt, cache=cache)] + [
            lm(tokens[:, i : i + 1], cache=cache) for i in range(5, 8)
        ]
    assert torch.equal(tokens, ref.generate(prompt, 6, use_cache=True))
    assert torch.equal(tokens, recomputed)
    with torch.no_grad():
        want = ref(tokens[:, :8])
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-5, atol=1e-5)


def test_grouped_query_edit_leaves_heads_sharing_its_kv_head(device: torch.device) -> None:
    model, run = _case("gqa", device)  # H = 6, Hk = 2: heads 0, 1, 2 share key/value head 0
    with torch.no_grad(), record_heads(model, [(1, h) for h in range(H)]) as clean:
        run(model)
    with (
        torch.no_grad(),
        intervene(model, {(1, 1): 0.0}),
        record_heads(model, [(1, h) for h in range(H)]) as edited,
    ):
        run(model)
    assert edited[(1, 1)].abs().max() == 0
    for h in (0, 2, 3, 4, 5):
        assert torch.equal(edited[(1, h)], clean[(1, h)])


def test_training_with_an_ablated_head_trains_the_others(device: torch.device) -> None:
    enc = _encoder(device=device).train()
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    with intervene(enc, {(1, 2): 0.0}):
        enc(x, key_mask=km).square().sum().backward()
    mha = enc.layers[1].self_attn
    cols = slice(2 * D, 3 * D)
    assert mha.out_proj.weight.grad[:, cols].abs().max() == 0
    assert mha.out_proj.weight.grad[:, 3 * D :].abs().min() > 0
    # head 2's own q, k and v rows get nothing; every other head's do
    grad = mha.qkv_proj.weight.grad.view(3, H, D, E)  # [q | k | v] blocks of H heads
    assert grad[:, 2].abs().max() == 0
    assert all(grad[:, h].abs().max() > 0 for h in (0, 1, 3, 4, 5))


# -- recording and patching --------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["encoder", "bert-unpadded"])
def test_patching_a_whole_layer_reproduces_the_other_input(kind: str, device: torch.device) -> None:
    km = _key_mask(device)
    if kind == "encoder":
        model: nn.Module = _encoder(device=device)
        xa, xb = torch.randn(B, T, E, device=device), torch.randn(B, T, E, device=device)

        def run(m: nn.Module, x: Tensor) -> Tensor:
            return m(x, key_mask=km)

        inputs = (xa, xb)
    else:
        model = _bert(device)
        ia, ib = (
            torch.randint(1, 50, (B, T), device=device),
            torch.randint(1, 50, (B, T), device=device),
        )

        def run(m: nn.Module, x: Tensor) -> Tensor:
            return m(x, km.long()).last_hidden_state

        inputs = (ia, ib)
    layer = 1
    out_proj = attention_modules(model)[layer][1].out_proj
    seen: list[Tensor] = []
    handle = out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
    try:
        with torch.no_grad():
            with record_heads(model, [(layer, h) for h in range(H)]) as rec:
                run(model, inputs[1])
            patches = {(layer, h): rec[(layer, h)] for h in range(H)}
            with intervene(model, patches):
                run(model, inputs[0])
    finally:
        handle.remove()
    from_b, patched_a = seen
    assert torch.equal(patched_a, from_b)  # (B, T, H·Dv), or (N, H·Dv) packed


@pytest.mark.parametrize("kind", ["lm", "bert-padded", "bert-unpadded"])
def test_patching_a_head_with_its_own_output_changes_nothing(
    kind: str, device: torch.device
) -> None:
    model, run = _case(kind, device)
    with torch.no_grad():
        with record_heads(model, [(2, 3), (0, 0)]) as rec:
            clean = run(model)
        assert rec[(2, 3)].shape == (B, T, D) and rec[(2, 3)].is_contiguous()
        with intervene(model, {(2, 3): rec[(2, 3)], (0, 0): rec[(0, 0)]}):
            patched = run(model)
    assert torch.equal(patched, clean)


def test_record_heads_detached_every_call_and_after_edits(device: torch.device) -> None:
    lm = _lm(device=device)
    ids = torch.randint(14, (2, 5), device=device)
    with record_heads(lm, [(-1, 1)]) as rec:
        lm(ids).sum().backward()
    assert isinstance(rec, HeadRecording) and list(rec) == [(2, 1)] and (2, 1) in rec
    assert not rec[(2, 1)].requires_grad
    with record_heads(lm, [(0, 4)]) as rec:
        lm.generate(ids, 3)  # one call for the prompt, then one per new token
    assert [tuple(c.shape) for c in rec.calls((0, 4))] == [(2, 5, D), (2, 1, D), (2, 1, D)]
    assert rec[(0, 4)].shape == (2, 1, D)  # the latest call
    # an intervene entered first is seen by the recording; one entered later is not
    with intervene(lm, {(0, 4): 2.0}), record_heads(lm, [(0, 4)]) as inner:
        lm(ids)
    with record_heads(lm, [(0, 4)]) as outer, intervene(lm, {(0, 4): 2.0}):
        lm(ids)
    torch.testing.assert_close(inner[(0, 4)], 2 * outer[(0, 4)])


# -- "mean" ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["mha", "bert-padded", "bert-unpadded"])
def test_mean_uses_only_real_tokens(kind: str, device: torch.device) -> None:
    model, run = _case(kind, device)
    km = _key_mask(device)
    with torch.no_grad():
        with record_heads(model, [(0, 3)]) as clean:
            run(model)
        with intervene(model, {(0, 3): "mean"}), record_heads(model, [(0, 3)]) as edited:
            run(model)
    want = clean[(0, 3)][km].mean(0)  # (Dv,): by hand, over the real tokens only
    got = edited[(0, 3)]
    torch.testing.assert_close(got, want.expand(B, T, D), rtol=1e-6, atol=1e-7)
    assert not torch.allclose(want, clean[(0, 3)].mean((0, 1)))  # the padding would matter


def test_mean_without_padding_information_is_over_all_tokens(device: torch.device) -> None:
    mha = MultiHeadAttention(E, H, kdim=10, vdim=12).to(device).eval()  # cross-attention
    x, mem = torch.randn(B, T, E, device=device), torch.randn(B, 5, 10, device=device)
    with torch.no_grad():
        with record_heads(mha, [(0, 2)]) as clean:
            mha(x, mem, torch.randn(B, 5, 12, device=device))
        mean = clean[(0, 2)].mean((0, 1))
        with intervene(mha, {(0, 2): "mean"}), record_heads(mha, [(0, 2)]) as edited:
            mha(x, mem, torch.randn(B, 5, 12, device=device))
    assert not torch.equal(edited[(0, 2)][0, 0], mean)  # different values went in
    with torch.no_grad():
        v = torch.randn(B, 5, 12, device=device)
        with record_heads(mha, [(0, 2)]) as clean:
            mha(x, mem, v)
        with intervene(mha, {(0, 2): "mean"}), record_heads(mha, [(0, 2)]) as edited:
            mha(x, mem, v)
    want = clean[(0, 2)].mean((0, 1)).expand(B, T, D)
    torch.testing.assert_close(edited[(0, 2)], want, rtol=1e-6, atol=1e-7)


# -- restoration, nesting, capture -------------------------------------------------------------


def test_restored_after_an_exception_and_nested_contexts(device: torch.device) -> None:
    model, run = _case("bert-unpadded", device)
    with torch.no_grad():
        clean = run(model)
        with pytest.raises(RuntimeError, match="boom"), intervene(model, {(1, 1): 0.0}):
            raise RuntimeError("boom")
        assert _observers(model) == 0
        assert torch.equal(run(model), clean)

        both = run(_reference(model, {(0, 1): 0.0, (2, 4): 3.0}))
        outer_only = run(_reference(model, {(0, 1): 0.0}))
        with intervene(model, {(0, 1): 0.0}):
            with intervene(model, {(2, 4): 3.0}):
                torch.testing.assert_close(run(model), both, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(run(model), outer_only, rtol=1e-5, atol=1e-6)
            # the same head edited twice: the inner edit acts on the outer one's output
            with intervene(model, {(0, 1): 5.0}):
                torch.testing.assert_close(run(model), outer_only, rtol=1e-5, atol=1e-6)
        assert torch.equal(run(model), clean)
    assert _observers(model) == 0


def test_no_edits_registers_nothing() -> None:
    enc = _encoder()
    with intervene(enc, {}):
        assert _observers(enc) == 0


def test_intervene_together_with_capture(device: torch.device) -> None:
    enc = _encoder(device=device)
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    edits = {(1, 0): 0.0, (1, 3): 0.25}
    with torch.no_grad():
        with capture(enc, layers=[0, 1]) as clean:
            enc(x, key_mask=km)
        with intervene(enc, edits), capture(enc, layers=[0, 1]) as rec:
            out = enc(x, key_mask=km)
        want = _reference(enc, edits)(x, key_mask=km)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    # the weights of the edited layer (and before) are the unedited model's
    for got, ref in zip(rec.weights, clean.weights, strict=True):
        assert torch.equal(got, ref)


# -- head_importance ---------------------------------------------------------------------------


def _count_layer_runs(model: nn.Module) -> list[int]:
    """A counter of feed-forward calls, i.e. of layers that really ran."""
    count = [0]
    for m in model.modules():
        if isinstance(m, multihead.FeedForward):
            m.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


@pytest.mark.parametrize("kind", ["encoder", "lm", "bert-padded", "bert-unpadded"])
def test_ablation_importance_equals_a_loop_of_intervene(kind: str, device: torch.device) -> None:
    model, run = _case(kind, device)
    w = torch.randn_like(run(model))

    def metric() -> Tensor:
        return (run(model) * w).sum()

    with torch.no_grad():
        clean = metric()
        want = torch.empty(LAYERS, H, device=device)
        for layer in range(LAYERS):
            for head in range(H):
                with intervene(model, {(layer, head): 0.0}):
                    want[layer, head] = metric() - clean
    runs = _count_layer_runs(model)
    got = head_importance(model, metric)
    assert torch.equal(got, want)
    # one recorded clean run (3 layers), a check run (the last layer), and each layer's six
    # ablations skip the layers before it: 6 · (3 + 2 + 1); full forwards would be 3 + 18 · 3
    assert runs[0] == 3 + 1 + H * (3 + 2 + 1)
    runs[0] = 0
    assert torch.equal(head_importance(model, metric, reuse_prefix=False), want)
    assert runs[0] == 3 + H * LAYERS * 3
    assert _observers(model) == 0


class _Mixed(nn.Module):
    """Attention outside any layer, then a stack whose first and last layers share attention."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = MultiHeadAttention(E, H)
        self.enc = _encoder()
        self.enc.layers[2].self_attn = self.enc.layers[0].self_attn  # tied

    def forward(self, x: Tensor) -> Tensor:
        return self.enc(x + self.pre(x))


def test_reuse_with_attention_outside_layers_and_shared_between_layers(
    device: torch.device,
) -> None:
    model = _Mixed().to(device).eval()
    assert [name for name, _ in attention_modules(model)] == [
        "pre",
        "enc.layers.0.self_attn",
        "enc.layers.1.self_attn",
    ]
    x = torch.randn(B, T, E, device=device)

    def metric() -> Tensor:
        return model(x).square().mean()

    want = head_importance(model, metric, reuse_prefix=False)
    assert torch.equal(head_importance(model, metric), want)


def test_reused_layers_run_for_real_when_the_inputs_change(device: torch.device) -> None:
    enc = _encoder(device=device)
    x0, x1, km = (
        torch.randn(B, T, E, device=device),
        torch.randn(B, T, E, device=device),
        _key_mask(device),
    )

    def changing(first_calls: int) -> Callable[[], Tensor]:
        calls = [0]

        def metric() -> Tensor:  # x0 for the first calls, x1 after: recorded outputs are stale
            calls[0] += 1
            return enc(x0 if calls[0] <= first_calls else x1, key_mask=km).sum()

        return metric

    # with reuse: a recorded run and a check run on x0; without: one clean run on x0
    got = head_importance(enc, changing(2))
    want = head_importance(enc, changing(1), reuse_prefix=False)
    assert torch.equal(got, want)


def test_gradient_importance_against_finite_differences(device: torch.device) -> None:
    enc = _encoder(num_kv_heads=3, dtype=torch.float64, device=device)
    x = torch.randn(B, T, E, dtype=torch.float64, device=device)
    km = _key_mask(device)
    w = torch.randn(B, T, E, dtype=torch.float64, device=device)

    def metric_of(m: nn.Module) -> Tensor:
        return (m(x, key_mask=km, is_causal=True) * w).sum()

    got = head_importance(enc, lambda: metric_of(enc), method="gradient")
    assert got.shape == (LAYERS, H) and got.dtype == torch.float64
    eps = 1e-6
    want = torch.empty(LAYERS, H, dtype=torch.float64, device=device)
    with torch.no_grad():
        for layer in range(LAYERS):
            for head in range(H):
                up = metric_of(_reference(enc, {(layer, head): 1 + eps}))
                down = metric_of(_reference(enc, {(layer, head): 1 - eps}))
                want[layer, head] = ((up - down) / (2 * eps)).abs()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    # the model is left as it was: no observer, no gradient on the parameters
    assert _observers(enc) == 0
    assert all(p.grad is None for p in enc.parameters())


def test_gradient_importance_agrees_with_ablation_in_sign_of_size(device: torch.device) -> None:
    # First order: |ablation| is close to |∂m/∂ξ · (0 - 1)|. Ablation is a whole step (ξ from 1
    # to 0), so on one small random model the two agree only roughly, and one unlucky draw can
    # fall short of a high bar (one CUDA draw gave 0.76): five models, each clearly positive, and
    # high agreement typical of them (over 60 CPU draws: median 0.96, lowest 0.80).
    corrs = []
    for seed in range(5):
        torch.manual_seed(seed)
        model, run = _case("bert-unpadded", device)
        w = torch.randn_like(run(model))

        def metric() -> Tensor:
            return (run(model) * w).sum()  # noqa: B023 (used within this iteration only)

        with torch.no_grad():  # the gradient method turns gradients on for itself
            grad = head_importance(model, metric, method="gradient")
        ablation = head_importance(model, metric)
        assert grad.shape == ablation.shape == (LAYERS, H)
        assert bool((grad >= 0).all())
        corr = torch.corrcoef(torch.stack([grad.flatten(), ablation.abs().flatten()]))[0, 1]
        corrs.append(corr.item())
    assert min(corrs) > 0.5, corrs
    assert sorted(corrs)[len(corrs) // 2] > 0.85, corrs  # the median


def test_importance_falls_back_and_says_why(
    caplog: pytest.LogCaptureFixture, device: torch.device
) -> None:
    caplog.set_level(logging.INFO, logger="multihead.circuits.importance")
    lm = _lm(device=device)
    ids = torch.randint(14, (2, 4), device=device)

    def generated() -> Tensor:  # calls with a KV cache are stateful: they always run
        out = lm.generate(ids, 3)
        return lm(out).logsumexp(-1).sum()  # this call's layers may be skipped

    want = head_importance(lm, generated, reuse_prefix=False)
    assert torch.equal(head_importance(lm, generated), want)
    assert caplog.text == ""

    def cached() -> Tensor:  # only calls with a cache: nothing can be reused
        cache = lm.make_cache(2)
        lm(ids, cache=cache)
        return lm(ids[:, :1], cache=cache).sum()

    want = head_importance(lm, cached, reuse_prefix=False)
    assert torch.equal(head_importance(lm, cached), want)
    assert "no layer's arguments matched" in caplog.text

    caplog.clear()
    captured: list[Tensor] = []

    def with_capture() -> Tensor:  # an observer in a layer: that layer always runs
        with capture(lm, layers=[0]) as rec:
            out = lm(ids).sum()
        captured.append(rec.weights[0])
        return out

    want = head_importance(lm, with_capture, reuse_prefix=False)
    assert torch.equal(head_importance(lm, with_capture), want)
    assert caplog.text == ""

    caplog.clear()
    head_importance(MultiHeadAttention(E, H).to(device), lambda: torch.ones((), device=device))
    assert "no prefix to reuse" in caplog.text

    caplog.clear()
    lm_drop = TransformerLM(14, E, H, 2, 40, max_len=16, dropout=0.1).to(device).train()
    head_importance(lm_drop, lambda: lm_drop(ids).sum())
    assert "training mode with dropout" in caplog.text

    caplog.clear()
    fresh = _lm(device=device)
    head_importance(
        fresh, lambda: fresh(torch.randint(14, (2, 4), device=device)).sum()
    )  # new inputs each time
    assert "did not reproduce" in caplog.text
    assert _observers(fresh) == 0 and "forward" not in vars(fresh.blocks[0])


# -- errors ------------------------------------------------------------------------------------


def test_edit_errors_name_the_head_and_what_was_expected() -> None:
    enc = _encoder()
    patch = torch.zeros(B, T, D)
    cases: list[tuple[object, type[Exception], str]] = [
        (
            {(3, 0): 0.0},
            ValueError,
            r"edits key \(3, 0\): layer index 3 is out of range: there "
            r"are 3 attention layers \(0\.\.2\)",
        ),
        (
            {(0, 6): 0.0},
            ValueError,
            r"edits key \(0, 6\): head index 6 is out of range: there "
            r"are 6 heads in layer 0 \(layers\.0\.self_attn\)",
        ),
        ({(0,): 0.0}, TypeError, r"edits key must be a \(layer, head\) pair of ints"),
        ({(0, 1.0): 0.0}, TypeError, r"pair of ints, got \(0, 1\.0\)"),
        ({(0, 1): "median"}, ValueError, r"edits\[\(0, 1\)\] .*the only string edit is \"mean\""),
        ({(0, 1): True}, TypeError, r"edits\[\(0, 1\)\] must be 0\.0 \(zero ablation\).*bool"),
        ({(1, 2): float("nan")}, ValueError, r"edits\[\(1, 2\)\] must be .*got nan"),
        ({(1, 2): float("inf")}, ValueError, r"edits\[\(1, 2\)\] must be .*got inf"),
        ({(1, 2): None}, TypeError, r"edits\[\(1, 2\)\] must be .*got NoneType"),
        (
            {(2, 0): torch.zeros(T, D)},
            ValueError,
            r"edits\[\(2, 0\)\]: a patch must be the "
            r"head's output \(B, T, Dv\) with Dv=4, got shape \(7, 4\)",
        ),
        ({(2, 0): torch.zeros(B, T, 5)}, ValueError, r"Dv=4, got shape \(3, 7, 5\)"),
        (
            {(2, 0): patch.double()},
            TypeError,
            r"edits\[\(2, 0\)\]: a patch must have the "
            r"model's dtype torch.float32, got torch.float64",
        ),
        ({(2, 0): patch.long()}, TypeError, r"model's dtype torch.float32, got torch.int64"),
        ({(-1, 0): 0.0, (2, 0): 1.0}, ValueError, r"names head \(2, 0\) a second time"),
        ([((0, 0), 0.0)], TypeError, r"edits must be a mapping"),
    ]
    for edits, error, match in cases:
        # a good edit first: nothing may be registered before the bad one is found
        bad = {(0, 0): 0.0, **edits} if isinstance(edits, dict) and (0, 0) not in edits else edits
        with pytest.raises(error, match=match), intervene(enc, bad):  # type: ignore[arg-type]
            pass
        assert _observers(enc) == 0


def test_edits_the_head_dtype_cannot_hold_are_refused_before_anything_is_registered() -> None:
    half, single = _encoder(dtype=torch.float16), _encoder()
    where = r"edits\[\(1, 2\)\]"
    cases: list[tuple[nn.Module, object, str]] = [
        # float16's largest is 65504: the factor itself would be inf, the output NaN
        (
            half,
            1e5,
            rf"{where}: the scale 100000\.0 does not fit the model's dtype "
            r"torch\.float16 \(it would be inf there\)",
        ),
        (half, -7e4, rf"{where}: the scale -70000\.0 does not fit .*float16 \(.* -inf there"),
        (half, 1e-9, rf"{where}: the scale 1e-09 does not fit .*float16 \(it would be 0\.0"),
        (single, 1e308, rf"{where}: the scale 1e\+308 does not fit .*float32 \(.* inf there"),
        (single, 10**400, rf"{where} must be .*got an int too large for a float: 10000"),
        (
            single,
            torch.zeros(B, T, D, device="meta"),
            rf"{where}: a patch must hold values, got a tensor on the meta device \(the model "
            r"is on cpu\)",
        ),
    ]
    for model, edit, match in cases:
        with pytest.raises(ValueError, match=match):
            with intervene(model, {(0, 0): 0.5, (1, 2): edit}):  # type: ignore[dict-item]
                pass
        assert _observers(model) == 0
    # what the dtype holds is accepted: float16's large and subnormal scales, a large int
    for model, scale in ((half, 6e4), (half, 1e-6), (single, 10**30)):
        with intervene(model, {(1, 2): scale}):
            assert _observers(model) == 1
    x = torch.randn(B, T, E)
    with intervene(single, {(1, 2): 10**3}):
        by_int = single(x)
    with intervene(single, {(1, 2): 1e3}):
        torch.testing.assert_close(single(x), by_int, rtol=0, atol=0)


def test_errors_at_run_time_and_for_models_and_recordings() -> None:
    enc = _encoder()
    with pytest.raises(ValueError, match=r"contains no multihead.MultiHeadAttention"):
        with intervene(nn.Linear(3, 3), {(0, 0): 0.0}):
            pass
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module"):
        with intervene("model", {(0, 0): 0.0}):  # type: ignore[arg-type]
            pass
    with intervene(enc, {(1, 2): torch.zeros(B, T + 1, D)}):
        with pytest.raises(
            ValueError,
            match=r"edits\[\(1, 2\)\]: the patch has \(B, T\) = \(3, 8\) but this call of layer "
            r"1 has \(B, T\) = \(3, 7\)",
        ):
            enc(torch.randn(B, T, E))
    assert _observers(enc) == 0

    with pytest.raises(ValueError, match=r"heads must name at least one"):
        with record_heads(enc, []):
            pass
    with pytest.raises(ValueError, match=r"heads item \(0, 9\): head index 9 is out of range"):
        with record_heads(enc, [(0, 1), (0, 9)]):
            pass
    with record_heads(enc, [(0, 1)]) as rec:
        with pytest.raises(ValueError, match=r"head \(0, 1\) has not been called yet"):
            rec[(0, 1)]
        with pytest.raises(KeyError, match=r"head \(0, 2\) was not recorded"):
            rec[(0, 2)]
    assert _observers(enc) == 0

    x = torch.randn(B, T, E)
    with pytest.raises(ValueError, match=r"method must be one of 'ablation', 'gradient'"):
        head_importance(enc, lambda: enc(x).sum(), method="taylor")
    with pytest.raises(ValueError, match=r"metric\(\) must return a scalar floating point tensor"):
        head_importance(enc, lambda: enc(x))
    with pytest.raises(ValueError, match=r"depend on the heads through autograd"):
        head_importance(enc, lambda: enc(x).sum().detach(), method="gradient")
    with pytest.raises(ValueError, match=r"contains no multihead.MultiHeadAttention"):
        head_importance(nn.Linear(2, 2), lambda: torch.zeros(()))
    assert _observers(enc) == 0
