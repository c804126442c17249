"""Attribution patching against finite differences, in float64.

The reference is a central difference of the metric along the patch's direction, computed with
forward pre-hooks on each layer's output projection (they move head h's slice of its input,
at one position, by ±ε·(source - target)): nothing of ``multihead.observe``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import multihead
from multihead import MultiHeadAttention
from multihead.circuits.patching.attribution_patching import attribution_patching
from multihead.models import TransformerLM


def _run(model: nn.Module, inputs: Tensor) -> Any:
    return model(inputs)


def _shift(delta: Tensor, cols: slice, t: int, eps: float) -> Callable[..., Any]:
    def pre(module: nn.Module, args: tuple[Any, ...]) -> Any:
        x = args[0].clone()
        x[:, t, cols] += eps * delta[:, t, cols]
        return (x, *args[1:])

    return pre


def finite_differences(
    model: nn.Module,
    projections: list[tuple[nn.Module, int]],
    source: Tensor,
    target: Tensor,
    metric: Callable[[Any], Tensor],
    step: float,
) -> Tensor:
    """(L, H, T): d metric / d s at s = 0 of target with z[l, h, t] += s · (source - target),
    a central difference with step ``step``."""
    heads = max(proj.in_features // dv for proj, dv in projections)
    out = torch.full((len(projections), heads, source.shape[1]), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        for layer, (proj, dv) in enumerate(projections):
            seen: list[Tensor] = []
            hook = proj.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(a[0]))
            _run(model, source)
            _run(model, target)
            hook.remove()
            delta = seen[0] - seen[1]  # (B, T, H·Dv)
            for h in range(proj.in_features // dv):
                cols = slice(h * dv, (h + 1) * dv)
                for t in range(source.shape[1]):
                    values = []
                    for eps in (step, -step):
                        hook = proj.register_forward_pre_hook(_shift(delta, cols, t, eps))
                        values.append(metric(_run(model, target)).mean())
                        hook.remove()
                    out[layer, h, t] = (values[0] - values[1]) / (2 * step)
    return out


def _metric(out: Tensor) -> Tensor:
    return out[:, -1].log_softmax(-1)[:, 3] - out[:, -2].log_softmax(-1)[:, 5]  # (B,)


@pytest.mark.parametrize("direction", ["denoise", "noise"])
def test_equals_finite_differences(direction: str, device: torch.device) -> None:
    torch.manual_seed(0)
    lm = TransformerLM(20, 24, 6, 3, 40, max_len=16, num_kv_heads=2, dtype=torch.float64)
    lm = lm.to(device).eval()
    clean = torch.randint(20, (3, 7), device=device)
    corrupt = torch.randint(20, (3, 7), device=device)
    source, target = (clean, corrupt) if direction == "denoise" else (corrupt, clean)
    projections = [
        (m.out_proj, m.head_dim) for m in lm.modules() if isinstance(m, MultiHeadAttention)
    ]
    want = finite_differences(lm, projections, source, target, _metric, 1e-5).to(device)

    result = attribution_patching(
        lm, clean, corrupt, _metric, per_position=True, direction=direction
    )
    got = result.values
    assert got.shape == (3, 6, 7) and got.dtype == torch.float64
    assert result.dims == ("layer", "head", "position") and result.direction == direction
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    # the two runs' metrics, each from a plain forward
    with torch.no_grad():
        assert result.clean == pytest.approx(float(_metric(lm(clean)).mean()), abs=1e-12)
        assert result.corrupt == pytest.approx(float(_metric(lm(corrupt)).mean()), abs=1e-12)
    whole = attribution_patching(lm, clean, corrupt, _metric, direction=direction)
    assert whole.dims == ("layer", "head")
    torch.testing.assert_close(whole.values, want.sum(-1), rtol=1e-6, atol=1e-8)
    # the parameters get no gradient; nothing stays registered
    assert all(p.grad is None for p in lm.parameters())
    assert not any(m._observers for m in lm.modules() if isinstance(m, MultiHeadAttention))


def test_grouped_query_llama_equals_finite_differences(device: torch.device) -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=30, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).to(device, torch.float64).eval()
    clean = torch.randint(30, (2, 5), device=device)
    corrupt = torch.randint(30, (2, 5), device=device)

    def metric(out: Any) -> Tensor:
        return _metric(out.logits)

    projections = [(layer.self_attn.o_proj, 4) for layer in model.model.layers]
    # Llama's RMSNorm computes in float32 whatever the model's dtype: a coarser step
    want = finite_differences(model, projections, clean, corrupt, metric, 1e-3).to(device)
    # the metric is given the logits by default, the whole output when asked
    got = attribution_patching(model, clean, corrupt, _metric, per_position=True).values
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    whole = attribution_patching(
        model, clean, corrupt, metric, per_position=True, metric_input="output"
    ).values
    torch.testing.assert_close(whole, got, rtol=0, atol=0)


class _SecondLayerUnread(nn.Module):
    """Two attention layers over the embeddings; only the first reaches the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 16)
        self.first = MultiHeadAttention(16, 4)
        self.second = MultiHeadAttention(16, 4)
        self.head = nn.Linear(16, 20)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids)
        self.second(x)  # called, never read
        return self.head(self.first(x))


def test_a_layer_the_metric_does_not_read_scores_zero(device: torch.device) -> None:
    torch.manual_seed(0)
    model = _SecondLayerUnread().to(device, torch.float64)
    clean = torch.randint(20, (2, 5), device=device)
    corrupt = torch.randint(20, (2, 5), device=device)
    got = attribution_patching(
        model, clean, corrupt, lambda out: _metric(out), per_position=True
    ).values
    assert got.shape == (2, 4, 5)
    assert torch.equal(got[1], torch.zeros_like(got[1]))  # no gradient reaches it
    projections = [(model.first.out_proj, 4), (model.second.out_proj, 4)]
    want = finite_differences(model, projections, clean, corrupt, _metric, 1e-6).to(device)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-8)
    assert got[0].abs().max() > 1e-3  # the first layer does matter


def test_errors() -> None:
    lm = TransformerLM(20, 24, 6, 2, 40, max_len=16).eval()
    ids = torch.randint(20, (2, 5))
    with pytest.raises(ValueError, match=r"depend on the heads through autograd"):
        attribution_patching(lm, ids, ids, lambda out: _metric(out.detach()))
    with pytest.raises(ValueError, match=r"direction must be one of"):
        attribution_patching(lm, ids, ids, _metric, direction="up")
    with pytest.raises(ValueError, match=r"clean and corrupt must have the same shape"):
        attribution_patching(lm, ids, ids[:1], _metric)
    with pytest.raises(ValueError, match=r"metric must return a scalar"):
        attribution_patching(lm, ids, ids, lambda out: out)
    assert not any(m._observers for m in lm.modules() if isinstance(m, MultiHeadAttention))
    assert multihead.attribution_patching is attribution_patching
