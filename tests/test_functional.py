"""multihead.functional.attention against the float64 reference, on both backends."""

from __future__ import annotations

import pytest
import torch
from devices import chosen_device, generator
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference_attention

from multihead.functional import attention
from multihead.kernels import causal_mask

BACKENDS = ["sdpa", "math"]


@st.composite
def problems(draw: st.DrawFn) -> dict:
    b = draw(st.integers(1, 3))
    hk = draw(st.integers(1, 3))
    h = hk * draw(st.integers(1, 3))
    t = draw(st.integers(1, 9))
    s = draw(st.integers(1, 9))
    d = draw(st.sampled_from([1, 4, 8]))
    dv = draw(st.sampled_from([d, 3]))
    mask_kind = draw(st.sampled_from(["none", "bool", "key", "float"]))
    causal = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    device = chosen_device()
    g = generator(seed, device)
    q = torch.randn(b, h, t, d, generator=g, device=device)
    k = torch.randn(b, hk, s, d, generator=g, device=device)
    v = torch.randn(b, hk, s, dv, generator=g, device=device)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(b, 1, t, s, generator=g, device=device) > 0.3
    elif mask_kind == "key":
        mask = torch.rand(b, 1, 1, s, generator=g, device=device) > 0.3
    elif mask_kind == "float":
        mask = torch.randn(b, h, t, s, generator=g, device=device)
        mask = mask.masked_fill(
            torch.rand(b, h, t, s, generator=g, device=device) < 0.3, float("-inf")
        )
    return {"q": q, "k": k, "v": v, "mask": mask, "is_causal": causal}


@settings(max_examples=120, deadline=None)
@given(problems(), st.sampled_from(BACKENDS))
def test_matches_float64_reference(p: dict, backend: str) -> None:
    ref_out, ref_w = reference_attention(p["q"], p["k"], p["v"], p["mask"], p["is_causal"])
    kwargs = {"mask": p["mask"], "is_causal": p["is_causal"], "backend": backend}
    out = attention(p["q"], p["k"], p["v"], **kwargs)
    assert out.shape == ref_out.shape
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    if backend == "math":
        out2, w = attention(p["q"], p["k"], p["v"], need_weights=True, **kwargs)
        torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out2, out)


def test_causal_is_bottom_right(device: torch.device) -> None:
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_mask(3, 2).tolist() == [[False, False], [True, False], [True, True]]
    # The last query of a cached decode step sees every key.
    q, k = torch.randn(1, 1, 1, 4, device=device), torch.randn(1, 1, 5, 4, device=device)
    v = torch.randn(1, 1, 5, 4, device=device)
    torch.testing.assert_close(attention(q, k, v, is_causal=True), attention(q, k, v))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["bool", "float", "causal"])
def test_fully_masked_rows_give_zeros_and_finite_gradients(
    backend: str, kind: str, device: torch.device
) -> None:
    q = torch.randn(2, 3, 4, 8, requires_grad=True, device=device)
    k = torch.randn(2, 3, 3 if kind == "causal" else 6, 8, requires_grad=True, device=device)
    v = torch.randn_like(k, requires_grad=True)
    mask = None
    if kind == "bool":
        mask = torch.ones(2, 1, 4, 6, dtype=torch.bool, device=device)
        mask[0, 0, 1] = False
    elif kind == "float":
        mask = torch.zeros(2, 1, 4, 6, device=device)
        mask[0, 0, 1] = float("-inf")
    out = attention(q, k, v, mask=mask, is_causal=kind == "causal", backend=backend)
    empty = (0, slice(None), 1) if kind != "causal" else (slice(None), slice(None), 0)
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert out.isfinite().all()
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and t.grad.isfinite().all()
    assert torch.equal(q.grad[empty], torch.zeros_like(q.grad[empty]))
    if backend == "math":
        _, w = attention(q, k, v, mask=mask, is_causal=kind == "causal", need_weights=True)
        assert torch.equal(w[empty], torch.zeros_like(w[empty]))
        assert not w.isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_softmax_in_float32(dtype: torch.dtype, device: torch.device) -> None:
    q, k, v = (torch.randn(2, 4, 16, 32, device=device) for _ in range(3))
    ref_out, ref_w = reference_attention(q, k, v, is_causal=True)
    for backend in BACKENDS:
        out = attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, backend=backend)
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), ref_out, atol=3e-2, rtol=0)
    _, w = attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True, need_weights=True)
    assert w.dtype == dtype
    torch.testing.assert_close(w.double(), ref_w, atol=1e-2, rtol=0)


def test_scale_and_value_dim(device: torch.device) -> None:
    q, k = torch.randn(1, 2, 3, 4, device=device), torch.randn(1, 2, 5, 4, device=device)
    v = torch.randn(1, 2, 5, 7, device=device)
    ref, _ = reference_attention(q, k, v, scale=0.3)
    for backend in BACKENDS:
        out = attention(q, k, v, scale=0.3, backend=backend)
        assert out.shape == (1, 2, 3, 7)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_extra_leading_dims_and_three_dims(device: torch.device) -> None:
    q = torch.randn(2, 3, 2, 5, 4, device=device)  # (B1, B2, H, T, D)
    out = attention(q, q, q)
    flat = attention(q.flatten(0, 1), q.flatten(0, 1), q.flatten(0, 1))
    torch.testing.assert_close(out, flat.view_as(out))
    x = torch.randn(2, 5, 4, device=device)  # (H, T, D), no batch
    torch.testing.assert_close(attention(x, x, x), attention(x[None], x[None], x[None])[0])


def test_dropout_applies_to_weights_after_they_are_returned(device: torch.device) -> None:
    q, k, v = (torch.randn(1, 2, 6, 8, device=device) for _ in range(3))
    out, w = attention(q, k, v, dropout_p=0.5, need_weights=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 2, 6, device=device))  # before dropout
    clean = attention(q, k, v)
    assert not torch.allclose(out, clean)
    assert not torch.allclose(attention(q, k, v, dropout_p=0.5), clean)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64_with_masks(backend: str, device: torch.device) -> None:
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True, device=device)
    k = torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True, device=device)
    v = torch.randn(1, 1, 5, 2, dtype=torch.float64, requires_grad=True, device=device)
    bool_mask = torch.rand(1, 2, 4, 5, device=device) > 0.3
    bool_mask[0, 1, 2] = False  # a fully masked row
    float_mask = torch.randn(1, 2, 4, 5, dtype=torch.float64, device=device)
    for mask, causal in ((bool_mask, False), (float_mask, True), (None, True)):
        assert torch.autograd.gradcheck(
            lambda q, k, v, m=mask, c=causal: attention(
                q, k, v, mask=m, is_causal=c, backend=backend
            ),
            (q, k, v),
        )


def test_gradcheck_weights_float64(device: torch.device) -> None:
    q = torch.randn(1, 2, 3, 3, dtype=torch.float64, requires_grad=True, device=device)
    k = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True, device=device)
    v = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True, device=device)
    mask = torch.ones(1, 1, 3, 4, dtype=torch.bool, device=device)
    mask[..., 0, :] = False
    assert torch.autograd.gradcheck(
        lambda q, k, v: attention(q, k, v, mask=mask, need_weights=True)[1], (q, k, v)
    )


# -- bad input ------------------------------------------------------------------------------------


def _qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4, 5, 8), torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"q": torch.randn(5, 8)}, ValueError, r"q must have at least 3 dimensions.*\(5, 8\)"),
        ({"q": [1.0]}, TypeError, "q must be a torch.Tensor, got list"),
        ({"k": torch.randn(2, 2, 7, 6)}, ValueError, "q and k must have the same head dim"),
        ({"v": torch.randn(2, 2, 6, 8)}, ValueError, "k and v must have the same heads and length"),
        (
            {"k": torch.randn(2, 3, 7, 8), "v": torch.randn(2, 3, 7, 8)},
            ValueError,
            "multiple of the key/value heads, got q with 4 heads and k with 3",
        ),
        (
            {"k": torch.randn(3, 2, 7, 8), "v": torch.randn(3, 2, 7, 8)},
            ValueError,
            "must share their leading",
        ),
        ({"v": torch.randn(2, 2, 7, 8, dtype=torch.float64)}, TypeError, "one dtype"),
        (
            {"mask": torch.ones(5, 6, dtype=torch.bool)},
            ValueError,
            r"mask of shape \(5, 6\) does not broadcast to the scores' shape \(2, 4, 5, 7\)",
        ),
        (
            {"mask": torch.ones(5, 7, dtype=torch.int64)},
            TypeError,
            "mask must be bool .* or floating point .*, got dtype torch.int64",
        ),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
        ({"backend": "flash"}, ValueError, "backend must be one of .*, got 'flash'"),
        ({"backend": "sdpa", "need_weights": True}, ValueError, "cannot return attention weights"),
    ],
)
def test_bad_input_messages(change: dict, error: type, match: str) -> None:
    q, k, v = _qkv()
    args = {"q": q, "k": k, "v": v}
    kwargs: dict = {}
    for key, value in change.items():
        (args if key in args else kwargs)[key] = value
    with pytest.raises(error, match=match):
        attention(args["q"], args["k"], args["v"], **kwargs)
