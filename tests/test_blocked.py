"""The blocked backend (multihead.blocked, backend="blocked"): exactness, compiles, choice, errors.

Accuracy is judged in bfloat16/float16 terms against the float64 formula: max abs error at most
2e-2 for unit-variance inputs, and at most 1.5 × the error of torch's own half-precision kernel
on the same inputs + 1e-3 (the slack covers the final rounding of the output to bfloat16, which
both backends do and which alone can differ by one ulp, 2^-8 relative, between them).

Compiles are slow (seconds each), so the tests share a handful: small block sizes (16 queries ×
32 keys) make short sequences cross many blocks, and the hypothesis search is capped.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import reference_attention
from torch._dynamo.utils import counters

from multihead import blocked, functional
from multihead.blocked import blocked_attention
from multihead.functional import attention

HALF = [torch.bfloat16, torch.float16]
SMALL = {"block_q": 16, "block_k": 32}


def _torch_error(q, k, v, mask, is_causal, ref) -> float:  # type: ignore[no-untyped-def]
    """Max abs error of torch's fused kernel in q's dtype (zeros on fully masked rows)."""
    out = attention(q, k, v, mask=mask, is_causal=is_causal, backend="sdpa")
    return (out.double() - ref).abs().max().item()


def _mask(kind: str, b: int, h: int, t: int, s: int, g: torch.Generator) -> torch.Tensor | None:
    if kind == "key":
        return torch.rand(b, 1, 1, s, generator=g) > 0.3
    if kind == "bool":
        return torch.rand(b, 1, t, s, generator=g) > 0.3
    if kind == "float":
        mask = torch.randn(b, h, t, s, generator=g)
        return mask.masked_fill(torch.rand(b, h, t, s, generator=g) < 0.3, float("-inf"))
    return None


@st.composite
def problems(draw: st.DrawFn) -> dict:
    b = draw(st.integers(1, 2))
    hk = draw(st.integers(1, 2))
    h = hk * draw(st.sampled_from([1, 3]))
    t = draw(st.sampled_from([1, 2, 15, 16, 17, 40]))
    s = draw(st.sampled_from([1, 2, 31, 33, 70]))
    d = draw(st.sampled_from([8, 16]))
    dv = draw(st.sampled_from([d, 5]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from(HALF))
    q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, hk, s, d, generator=g).to(dtype)
    v = torch.randn(b, hk, s, dv, generator=g).to(dtype)
    kind = draw(st.sampled_from(["none", "key", "bool", "float"]))
    mask = _mask(kind, b, h, t, s, g)
    return {"q": q, "k": k, "v": v, "mask": mask, "is_causal": draw(st.booleans())}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_matches_float64_within_half_precision_and_torch(p: dict) -> None:
    ref, _ = reference_attention(p["q"], p["k"], p["v"], p["mask"], p["is_causal"])
    out = blocked_attention(
        p["q"], p["k"], p["v"], mask=p["mask"], is_causal=p["is_causal"], **SMALL
    )
    assert out.shape == ref.shape and out.dtype == p["q"].dtype
    assert out.isfinite().all()
    error = (out.double() - ref).abs().max().item()
    torch_error = _torch_error(p["q"], p["k"], p["v"], p["mask"], p["is_causal"], ref)
    assert error <= 2e-2
    assert error <= 1.5 * torch_error + 1e-3, (error, torch_error)


@pytest.mark.parametrize("dtype", HALF)
def test_default_blocks_long_grouped_causal(dtype: torch.dtype) -> None:
    # T and S past one default block (128 × 512) and not multiples of it; S > T (a cache).
    q = torch.randn(2, 6, 300, 32).to(dtype)
    k, v = torch.randn(2, 2, 2, 700, 32).to(dtype).unbind(1)
    mask = torch.rand(2, 1, 1, 700) > 0.2
    with torch.no_grad():
        out = attention(q, k, v, mask=mask, is_causal=True, backend="blocked")
    ref = attention(q.double(), k.double(), v.double(), mask=mask, is_causal=True, backend="math")
    error = (out.double() - ref).abs().max().item()
    assert error <= 2e-2
    assert error <= 1.5 * _torch_error(q, k, v, mask, True, ref) + 1e-3


def test_bfloat16_matmuls_stay_within_tolerance() -> None:
    q, k, v = (torch.randn(2, 4, 50, 16).to(torch.bfloat16) for _ in range(3))
    ref, _ = reference_attention(q, k, v, is_causal=True)
    out = blocked_attention(q, k, v, is_causal=True, matmul_dtype=torch.bfloat16, **SMALL)
    assert (out.double() - ref).abs().max().item() <= 2e-2


@pytest.mark.parametrize("kind", ["bool", "float", "causal", "key"])
def test_fully_masked_rows_give_zeros(kind: str) -> None:
    t, s = (40, 20) if kind == "causal" else (20, 40)
    q = torch.randn(2, 2, t, 8).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, s, 8).to(torch.bfloat16) for _ in range(2))
    mask = None
    if kind == "bool":
        mask = torch.ones(2, 1, t, s, dtype=torch.bool)
        mask[0, 0, 3] = False
    elif kind == "float":
        mask = torch.zeros(2, 2, t, s)
        mask[0, :, 3] = float("-inf")
    elif kind == "key":
        mask = torch.ones(2, 1, 1, s, dtype=torch.bool)
        mask[0] = False
    out = blocked_attention(q, k, v, mask=mask, is_causal=kind == "causal", **SMALL)
    # causal with T > S: the first T - S queries see no key (bottom-right alignment)
    empty = {"bool": (0, slice(None), 3), "float": (0, slice(None), 3), "key": (0,)}.get(
        kind, (slice(None), slice(None), slice(0, t - s))
    )
    assert out.isfinite().all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    ref, _ = reference_attention(q, k, v, mask, kind == "causal")
    assert (out.double() - ref).abs().max().item() <= 2e-2


def test_causal_skips_key_blocks_above_the_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = blocked._compiled_step

    def counting(*key: object) -> object:
        step = real(*key)  # type: ignore[arg-type]

        def wrapped(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            calls.append(args[1].shape[1])
            return step(*args)

        return wrapped

    monkeypatch.setattr(blocked, "_compiled_step", counting)
    q, k, v = (torch.randn(1, 2, 64, 8).to(torch.bfloat16) for _ in range(3))
    blocked_attention(q, k, v, is_causal=True, block_q=16, block_k=16)
    assert len(calls) == 4 + 3 + 2 + 1  # a lower triangle of 4 × 4 blocks
    calls.clear()
    blocked_attention(q, k, v, is_causal=False, block_q=16, block_k=16)
    assert len(calls) == 16


def test_leading_dims_and_three_dims_match_four() -> None:
    q = torch.randn(2, 3, 2, 20, 8).to(torch.bfloat16)  # (B1, B2, H, T, D)
    out = blocked_attention(q, q, q, is_causal=True, **SMALL)
    flat = q.flatten(0, 1)
    torch.testing.assert_close(
        out, blocked_attention(flat, flat, flat, is_causal=True, **SMALL).view_as(out)
    )
    x = q[0, 0]  # (H, T, D)
    torch.testing.assert_close(
        blocked_attention(x, x, x, **SMALL),
        blocked_attention(x[None], x[None], x[None], **SMALL)[0],
    )


def test_varying_lengths_do_not_recompile() -> None:
    def run(t: int, s: int) -> None:
        q = torch.randn(2, 4, t, 16).to(torch.bfloat16)
        k, v = (torch.randn(2, 2, s, 16).to(torch.bfloat16) for _ in range(2))
        blocked_attention(q, k, v, mask=torch.rand(2, 1, 1, s) > 0.1, is_causal=True, **SMALL)

    run(50, 60)  # warm: compiles at most once here, or not at all if an earlier test did
    before = counters["stats"]["unique_graphs"]
    for t, s in ((23, 23), (100, 131), (37, 300), (64, 64)):
        run(t, s)
    with torch.no_grad():  # nor does the caller's grad mode
        run(40, 41)
    with torch.inference_mode():
        run(41, 40)
    assert counters["stats"]["unique_graphs"] == before


def test_output_is_a_normal_tensor_autograd_can_use() -> None:
    q = torch.randn(1, 2, 20, 8).to(torch.bfloat16)
    with torch.no_grad():
        out = attention(q, q, q, backend="blocked")
    assert not out.is_inference() and not out.requires_grad
    w = torch.ones(8, requires_grad=True)
    (out.float() * w).sum().backward()  # a frozen encoder's output feeding a trained head
    assert w.grad is not None
    torch.testing.assert_close(w.grad, out.float().sum((0, 1, 2)))


# -- the backend choice and its errors -------------------------------------------------------------


class _Spy:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **_: object
    ) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)


MIN_WORK = 256 * 256


@pytest.fixture(autouse=True)
def _auto_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default (None) never picks "blocked"; these tests exercise the choice itself.
    monkeypatch.setattr(functional, "BLOCKED_MIN_WORK", MIN_WORK)


def _long(dtype: torch.dtype = torch.bfloat16, **kw: bool) -> tuple[torch.Tensor, ...]:
    t = int(MIN_WORK**0.5)
    return tuple(torch.randn(1, 2, t, 8, dtype=dtype, **kw) for _ in range(3))


def test_auto_never_picks_blocked_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.undo()
    assert functional.BLOCKED_MIN_WORK is None
    spy = _Spy()
    monkeypatch.setattr(blocked, "blocked_attention", spy)
    q, k, v = (torch.randn(1, 2, 1024, 8, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert spy.calls == 0


def test_auto_picks_blocked_only_for_half_precision_inference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _Spy()
    monkeypatch.setattr(blocked, "blocked_attention", spy)
    q, k, v = _long()
    with torch.no_grad():
        attention(q, k, v)
        attention(q.half(), k.half(), v.half(), is_causal=True)
        assert spy.calls == 2
        attention(q.float(), k.float(), v.float())  # float32: torch's kernel
        attention(q[:, :, :8], k[:, :, :8], v[:, :, :8])  # short: torch's kernel
        attention(q, k, v, need_weights=True)  # weights: math
        attention(q, k, v, backend="sdpa")
    attention(q, k, v, dropout_p=0.1)  # dropout: torch's kernel
    qg, kg, vg = _long(requires_grad=True)
    attention(qg, kg, vg)  # training: torch's kernel
    assert spy.calls == 2
    with torch.no_grad():
        attention(qg, kg, vg)  # grad mode off: no gradient needed
    assert spy.calls == 3


def test_auto_result_is_the_blocked_result() -> None:
    q, k, v = _long()
    with torch.inference_mode():
        auto = attention(q, k, v, is_causal=True)
        explicit = attention(q, k, v, is_causal=True, backend="blocked")
    torch.testing.assert_close(auto, explicit, atol=0, rtol=0)


def test_auto_falls_back_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.delenv("CXX", raising=False)
    blocked._cxx_compiler.cache_clear()
    spy = _Spy()
    monkeypatch.setattr(blocked, "blocked_attention", spy)
    try:
        q, k, v = _long()
        with torch.no_grad(), caplog.at_level(logging.DEBUG, logger="multihead.functional"):
            out = attention(q, k, v)
            with pytest.raises(RuntimeError, match="'blocked' is unavailable: .* C\\+\\+ compiler"):
                attention(q, k, v, backend="blocked")
    finally:
        blocked._cxx_compiler.cache_clear()
    assert spy.calls == 0
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    assert "uses 'sdpa', not 'blocked'" in caplog.text and "C++ compiler" in caplog.text


def test_auto_falls_back_when_blocked_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(blocked, "blocked_attention", broken)
    monkeypatch.setattr(functional, "_blocked_failure", None)
    q, k, v = _long()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="multihead.functional"):
        out = attention(q, k, v)
        again = attention(q, k, v)  # no second attempt: sdpa straight away
        with pytest.raises(RuntimeError, match="inductor exploded"):
            attention(q, k, v, backend="blocked")
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))
    torch.testing.assert_close(again, out)
    assert caplog.text.count("inductor exploded") == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"need_weights": True}, ValueError, "'blocked' cannot return attention weights"),
        ({"dropout_p": 0.1}, ValueError, "'blocked' has no dropout, got dropout_p=0.1"),
        ({"grad": True}, ValueError, "'blocked' is forward-only .* require grad"),
        ({"device": "meta"}, RuntimeError, "'blocked' is unavailable: .* CPU only, got .*meta"),
    ],
)
def test_explicit_blocked_refuses_what_it_cannot_serve(
    kwargs: dict, error: type, match: str
) -> None:
    device = kwargs.pop("device", "cpu")
    grad = kwargs.pop("grad", False)
    q, k, v = (torch.randn(1, 2, 5, 8, device=device, requires_grad=grad) for _ in range(3))
    with pytest.raises(error, match=match):
        attention(q, k, v, backend="blocked", **kwargs)


def test_block_sizes_must_be_positive() -> None:
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="block_q and block_k must be >= 1, got 0 and 256"):
        blocked_attention(q, q, q, block_q=0)
