"""The core's contract as a matrix: each mask form, dtype and backend against the float64 reference.

``multihead.functional.attention`` promises (docs/attention.md, "Conventions" and "The core"):

- any bool or float mask that broadcasts to (..., H, T, S) is accepted, rank 0 and 1 included;
- causal masking is bottom-right aligned: query i sees key j <= i + (S - T);
- a query row with no key to attend to gives zeros and zero weights, never NaN, with finite
  gradients, on every backend;
- everything else agrees with softmax(q kᵀ/√D + mask) v, computed here by the naive float64
  loops of ``tests/reference.py`` (the matrix's inputs are exact in every dtype under test, so
  one reference serves them all).

The matrix is backend × mask rank × bool/float × dtype × causal and length order × rows emptied
by the mask, with weights asked for wherever the backend can return them. Below it, the rest of
the contract: NaN inputs propagate, a float mask of -1e9 is a finite addend in every dtype,
integer inputs and empty head dims or head counts are refused, and double backward.

Sizes are pairwise distinct where they can be (B=2, H=3, D=5; T, S in {4, 7}) so a swapped axis
fails, and small so the whole file runs in seconds.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Iterator

import pytest
import torch
from reference import reference_attention
from torch import Tensor

from multihead.functional import attention

B, H, D = 2, 3, 5
# (T, S) by causal alignment: T < S, T == S and T > S with is_causal; two orders without.
ALIGNMENTS = {
    "full-T4-S7": (False, 4, 7),
    "full-T7-S4": (False, 7, 4),
    "causal-T4-S7": (True, 4, 7),
    "causal-T4-S4": (True, 4, 4),
    "causal-T7-S4": (True, 7, 4),
}
DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# (atol, rtol) against the float64 reference. The matrix's inputs are exact in every dtype, so
# this is the kernel's own error: its products, softmax and output rounding (half precision
# keeps about 3 significant digits in bfloat16, 4 in float16).
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-2),  # measured today: at most 6e-3 on outputs up to 2
    torch.float16: (2e-3, 2e-3),  # measured today: at most 7e-4
}
# (backend, need_weights): weights only where the backend can return them.
CALLS = [("sdpa", False), ("math", False), ("math", True), ("auto", False), ("auto", True)]
CALL_IDS = [f"{b}-weights" if w else b for b, w in CALLS]
RANKS = [0, 1, 2, 3, 4]


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is faster, and steadier on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mask_shape(rank: int, t: int, s: int) -> tuple[int, ...]:
    """A shape of each rank that broadcasts to (B, H, T, S)."""
    return {0: (), 1: (s,), 2: (t, s), 3: (H, t, s), 4: (B, 1, t, s)}[rank]


def _allowed_pattern(rank: int, t: int, s: int, empty: bool, g: torch.Generator) -> Tensor:
    """Where the mask allows attending, of ``_mask_shape(rank)``.

    ``empty=False``: key 0 is always allowed, so the mask alone empties no row (a causal mask
    with T > S still does). ``empty=True``: some query rows allow no key at all; a rank 0 or 1
    mask has no query axis, so there every row is emptied.
    """
    shape = _mask_shape(rank, t, s)
    if rank == 0:
        return torch.tensor(not empty)
    allowed = torch.rand(shape, generator=g) > 0.35
    allowed[..., 0] = True
    if empty:
        if rank == 1:
            allowed[:] = False
        elif rank == 2:
            allowed[1] = False  # query 1, every batch and head
        elif rank == 3:
            allowed[0, 1] = False  # head 0, query 1
            allowed[2, t - 1] = False  # head 2, the last query
        else:
            allowed[0, 0, 1] = False  # batch 0, query 1, every head
            allowed[1, 0, t - 1] = False  # batch 1, the last query
    return allowed


def _eighths(shape: tuple[int, ...], g: torch.Generator) -> Tensor:
    """Multiples of 1/8 in [-2, 2]: exact in float16 and bfloat16, so one float64 reference
    serves every dtype."""
    return torch.randint(-16, 17, shape, generator=g).double() / 8


@functools.cache
def _problem(
    rank: int, kind: str, alignment: str, empty: bool, device: torch.device
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Inputs and the float64 reference for one cell, shared by its backends and dtypes.

    Returns q, k, v and the mask in float64 (all exact in every dtype under test), the reference
    output and weights, and ``empty_rows`` (B, H, T): where no key is allowed, from the mask and
    the bottom-right causal rule alone. Drawn on the CPU, so that every device gets the same
    cells, then moved to ``device``.
    """
    causal, t, s = ALIGNMENTS[alignment]
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}{kind}{alignment}{empty}".encode()))
    q, k, v = _eighths((B, H, t, D), g), _eighths((B, H, s, D), g), _eighths((B, H, s, D), g)
    allowed = _allowed_pattern(rank, t, s, empty, g)
    if kind == "bool":
        mask = allowed
    else:
        mask = (_eighths(allowed.shape, g) * 2).masked_fill(~allowed, float("-inf"))
    ref_out, ref_w = reference_attention(q, k, v, mask, is_causal=causal)
    full = allowed.expand(B, H, t, s)
    if causal:
        i = torch.arange(t)[:, None]
        j = torch.arange(s)[None, :]
        full = full & (j <= i + (s - t))  # bottom-right: query i sees key j <= i + (S - T)
    empty_rows = ~full.any(-1)
    q, k, v, mask, ref_out, ref_w, empty_rows = (
        x.to(device) for x in (q, k, v, mask, ref_out, ref_w, empty_rows)
    )
    return q, k, v, mask, ref_out, ref_w, empty_rows


def _check_call(
    backend: str,
    need_weights: bool,
    rank: int,
    kind: str,
    alignment: str,
    empty: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    q64, k64, v64, mask, ref_out, ref_w, empty_rows = _problem(rank, kind, alignment, empty, device)
    causal, t, s = ALIGNMENTS[alignment]
    atol, rtol = TOLERANCES[dtype]
    q, k, v = (x.to(dtype, copy=True).requires_grad_() for x in (q64, k64, v64))
    if mask.is_floating_point():
        mask = mask.to(dtype)
    result = attention(
        q, k, v, mask=mask, is_causal=causal, need_weights=need_weights, backend=backend
    )
    out, weights = result if need_weights else (result, None)
    assert out.shape == (B, H, t, D) and out.dtype == dtype

    assert not out.isnan().any(), "NaN in the output"
    assert (out[empty_rows] == 0).all(), "a query row with no key to attend to must give zeros"
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    if weights is not None:
        assert weights.shape == (B, H, t, s) and weights.dtype == dtype
        assert not weights.isnan().any(), "NaN in the weights"
        assert (weights[empty_rows] == 0).all(), "an empty row must have zero weights"
        torch.testing.assert_close(weights.double(), ref_w, atol=atol, rtol=rtol)

    # Backward runs on the test device for every dtype here; gradients are finite, and zero for
    # the queries of empty rows (their output is the constant zero).
    loss = (out.double() * torch.linspace(-1, 1, D, dtype=torch.float64, device=device)).sum()
    if weights is not None:
        ramp = torch.linspace(1, 2, s, dtype=torch.float64, device=device)
        loss = loss + (weights.double() * ramp).sum()
    loss.backward()
    for name, x in (("q", q), ("k", k), ("v", v)):
        assert x.grad is not None and x.grad.isfinite().all(), f"non-finite gradient for {name}"
    assert q.grad is not None and (q.grad[empty_rows] == 0).all(), "gradient through an empty row"


@pytest.mark.parametrize("empty", [False, True], ids=["rows-kept", "rows-emptied"])
@pytest.mark.parametrize("alignment", list(ALIGNMENTS))
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank", RANKS, ids=[f"rank{r}" for r in RANKS])
@pytest.mark.parametrize(("backend", "need_weights"), CALLS, ids=CALL_IDS)
def test_matrix(
    backend: str,
    need_weights: bool,
    rank: int,
    kind: str,
    alignment: str,
    empty: bool,
    device: torch.device,
) -> None:
    """One cell, all four dtypes; the failure message names every dtype that failed, and why."""
    failures = []
    for name, dtype in DTYPES.items():
        try:
            _check_call(backend, need_weights, rank, kind, alignment, empty, dtype, device)
        except Exception as exc:  # report every dtype, not just the first
            first_line = (str(exc).strip().splitlines() or [""])[0]
            failures.append(f"{name}: {type(exc).__name__}: {first_line}")
    assert not failures, "\n".join(failures)


def test_matrix_covers_the_three_causal_alignments(device: torch.device) -> None:
    """The lengths above exercise bottom-right alignment where it differs from top-left."""
    # T < S: query 0 sees keys 0..3 of 7 (top-left would give key 0 only).
    *_, empty_rows = _problem(2, "bool", "causal-T4-S7", False, device)
    assert not empty_rows.any()
    # T > S: queries 0..2 of 7 see no key (top-left would give each at least key 0).
    *_, empty_rows = _problem(2, "bool", "causal-T7-S4", False, device)
    assert empty_rows[..., :3].all() and not empty_rows[..., 3:].any()
    # And the data really is exact in the half dtypes.
    q, k, v, mask, *_ = _problem(4, "float", "full-T4-S7", False, device)
    for x in (q, k, v, mask):
        for dtype in (torch.bfloat16, torch.float16):
            assert torch.equal(x.to(dtype).double(), x)


# -- the exact failure the lead reported ----------------------------------------------------------


@pytest.mark.parametrize("backend", ["math", "auto"])
def test_rank2_mask_with_causal_and_an_emptied_row_gives_zeros_not_nan(
    backend: str, device: torch.device
) -> None:
    q = torch.randn(1, 2, 3, 4, device=device)
    k, v = torch.randn(1, 2, 5, 4, device=device), torch.randn(1, 2, 5, 4, device=device)
    mask = torch.ones(3, 5, dtype=torch.bool, device=device)
    mask[0] = False  # query 0 may attend to nothing
    out, w = attention(q, k, v, mask=mask, is_causal=True, need_weights=True, backend=backend)
    assert not out.isnan().any() and not w.isnan().any()
    assert torch.equal(out[:, :, 0], torch.zeros(1, 2, 4, device=device))
    assert torch.equal(w[:, :, 0], torch.zeros(1, 2, 5, device=device))
    ref_out, ref_w = reference_attention(q, k, v, mask, is_causal=True)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref_w, atol=1e-5, rtol=1e-5)


# -- NaN inputs propagate; only the mask makes zeros -------------------------------------------


NAN_FORMS = {  # mask form: (mask kind, is_causal, T, S)
    "no-mask": (None, False, 4, 7),
    "bool": ("bool", False, 4, 7),
    "float": ("float", False, 4, 7),
    "causal-T4-S4": (None, True, 4, 4),
    "causal-T4-S7": (None, True, 4, 7),
}


@pytest.mark.parametrize("form", list(NAN_FORMS))
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(("backend", "need_weights"), CALLS, ids=CALL_IDS)
def test_nan_in_a_query_row_propagates_to_that_output_row(
    backend: str, need_weights: bool, dtype_name: str, form: str, device: torch.device
) -> None:
    """NaN in is NaN out, on every backend: only a row emptied by the mask gives zeros."""
    dtype = DTYPES[dtype_name]
    kind, causal, t, s = NAN_FORMS[form]
    q = torch.randn(B, H, t, D, device=device).to(dtype)
    k, v = (
        torch.randn(B, H, s, D, device=device).to(dtype),
        torch.randn(B, H, s, D, device=device).to(dtype),
    )
    mask = None
    if kind is not None:
        allowed = torch.rand(B, 1, t, s, device=device) > 0.3
        allowed[..., 0] = True  # no row emptied: a zero could only come from swallowing the NaN
        mask = (
            allowed
            if kind == "bool"
            else torch.randn(B, 1, t, s, device=device).masked_fill(~allowed, -math.inf)
        )
        mask = mask.to(dtype) if kind == "float" else mask
    ref_out, _ = reference_attention(q, k, v, mask, is_causal=causal)
    q[1, 2, 3, 0] = float("nan")  # one element of (batch 1, head 2, query 3)
    result = attention(
        q, k, v, mask=mask, is_causal=causal, need_weights=need_weights, backend=backend
    )
    out = result[0] if need_weights else result
    assert out[1, 2, 3].isnan().all(), f"expected NaN in the poisoned row, got {out[1, 2, 3]}"
    others = torch.ones(B, H, t, dtype=torch.bool, device=device)
    others[1, 2, 3] = False
    assert out[others].isfinite().all()
    atol, rtol = TOLERANCES[dtype]
    atol, rtol = max(atol, 1e-5), max(rtol, 1e-5)  # inputs rounded, not exact, here
    torch.testing.assert_close(out[others].double(), ref_out[others], atol=atol, rtol=rtol)


# -- a float mask is an addend: -1e9 is very negative, not -inf, in every dtype -----------------


# (q dtype, mask dtype): a float32 mask with every dtype, and a mask in q's own dtype where -1e9
# is representable (in float16 it is not: such a mask would itself hold -inf).
MINUS_1E9_DTYPES = [(name, "float32") for name in DTYPES] + [
    (name, name) for name in ("float64", "bfloat16")
]


@pytest.mark.parametrize(
    ("dtype_name", "mask_dtype_name"),
    MINUS_1E9_DTYPES,
    ids=[f"{q}-mask-{m}" for q, m in MINUS_1E9_DTYPES],
)
@pytest.mark.parametrize(("backend", "need_weights"), CALLS, ids=CALL_IDS)
def test_float_mask_of_minus_1e9_is_finite_in_every_dtype(
    backend: str, need_weights: bool, dtype_name: str, mask_dtype_name: str, device: torch.device
) -> None:
    """-1e9 is a very negative addend, not -inf: a row whose every key gets it keeps uniform
    weights (the mean of v), in float16 too; only -inf removes a key."""
    dtype, mask_dtype = DTYPES[dtype_name], DTYPES[mask_dtype_name]
    assert torch.tensor(-1e9, dtype=mask_dtype, device=device).isfinite()
    t, s = 4, 7
    q = torch.randn(B, H, t, D, device=device).to(dtype)
    k, v = (
        torch.randn(B, H, s, D, device=device).to(dtype),
        torch.randn(B, H, s, D, device=device).to(dtype),
    )
    q[:, :, 0] = 0  # query 0 scores 0 against every key: softmax(c, c, ...) is uniform for any c
    mask = torch.zeros(t, s, dtype=torch.float64, device=device)
    mask[0] = -1e9  # query 0: every key gets -1e9, so its weights stay uniform
    mask[1, 2:] = -1e9  # query 1: keys 2.. are pushed out, keys 0 and 1 remain
    mask[2, 1] = float("-inf")  # query 2: -inf removes key 1
    mask = mask.to(mask_dtype)
    result = attention(q, k, v, mask=mask, need_weights=need_weights, backend=backend)
    out, w = result if need_weights else (result, None)
    atol, rtol = TOLERANCES[dtype]
    mean_v = v.double().mean(-2)  # (B, H, D): uniform weights 1/S over the 7 keys
    torch.testing.assert_close(out[:, :, 0].double(), mean_v, atol=atol, rtol=rtol)
    ref_out, ref_w = reference_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref_out, atol=atol, rtol=rtol)
    if w is not None:
        torch.testing.assert_close(
            w[:, :, 0].double(),
            torch.full((B, H, s), 1 / s, dtype=torch.float64, device=device),
            atol=atol,
            rtol=0,
        )
        torch.testing.assert_close(w.double(), ref_w, atol=atol, rtol=rtol)


# -- inputs the core refuses ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("backend", ["sdpa", "math", "auto"])
def test_integer_or_bool_inputs_raise_type_error(backend: str, dtype: torch.dtype) -> None:
    q = torch.randint(0, 2, (B, H, 4, D)).to(dtype)
    k = v = torch.randint(0, 2, (B, H, 7, D)).to(dtype)
    with pytest.raises(TypeError, match=r"\bq\b"):
        attention(q, k, v, backend=backend)


@pytest.mark.parametrize("backend", ["sdpa", "math", "auto"])
@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "match"),
    [
        ((B, H, 4, 0), (B, H, 7, 0), r"\b[qk]\b"),  # head dim D = 0
        ((B, 0, 4, D), (B, 0, 7, D), r"\b[qk]\b"),  # no heads at all
        ((B, 0, 4, D), (B, 1, 7, D), r"\bq\b"),  # no query heads over one key/value head
    ],
    ids=["D=0", "H=Hk=0", "H=0"],
)
def test_empty_head_dim_or_no_heads_raise_value_error(
    backend: str, q_shape: tuple[int, ...], kv_shape: tuple[int, ...], match: str
) -> None:
    q, k, v = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, backend=backend)


# -- double backward ----------------------------------------------------------------------------


def _small_problem(device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    q = torch.randn(1, 2, 3, 2, dtype=torch.float64, requires_grad=True, device=device)
    k = torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True, device=device)
    v = torch.randn(1, 1, 4, 3, dtype=torch.float64, requires_grad=True, device=device)
    mask = torch.rand(1, 2, 3, 4, device=device) > 0.3
    mask[..., 0] = True
    mask[0, 1, 2] = False  # head 1, query 2: an emptied row
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_double_backward_math(causal: bool, device: torch.device) -> None:
    q, k, v, mask = _small_problem(device)

    def f(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return attention(q, k, v, mask=mask, is_causal=causal, backend="math")

    assert torch.autograd.gradgradcheck(f, (q, k, v))
    # And with the weights as the output.
    assert torch.autograd.gradgradcheck(
        lambda q, k, v: attention(
            q, k, v, mask=mask, is_causal=causal, need_weights=True, backend="math"
        )[1],
        (q, k, v),
    )


@pytest.mark.parametrize(
    "case",
    ["float64-mask", "float32-no-mask", "float32-causal"],
)
def test_double_backward_default_works_or_points_to_math(case: str, device: torch.device) -> None:
    """The default path may not support a second derivative (torch's fused CPU kernels don't):
    then torch raises, and attention()'s documentation says to use backend='math' (torch's error
    cannot be reworded from inside a forward that can't know a second derivative will come);
    where it works, it must be right."""
    q, k, v, mask = _small_problem(device)
    causal = case.endswith("causal")
    if case.startswith("float32"):  # what torch's fused kernel takes: H == Hk, Dv == D
        s = 3 if causal else 4  # the plain causal case has T == S
        q, k, v = (
            torch.randn(1, 2, 3, 2, device=device),
            torch.randn(1, 2, s, 2, device=device),
            torch.randn(1, 2, s, 2, device=device),
        )
        mask = None

    def second_derivative(backend: str) -> tuple[Tensor, ...]:
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = attention(q2, k2, v2, mask=mask, is_causal=causal, backend=backend)
        (gq,) = torch.autograd.grad(out.square().sum(), q2, create_graph=True)
        return torch.autograd.grad(gq.square().sum(), (q2, k2, v2))

    try:
        got = second_derivative("auto")
    except RuntimeError as exc:  # torch's kernel has no second derivative
        assert "derivative for" in str(exc) and "not implemented" in str(exc), exc
        doc = " ".join((attention.__doc__ or "").split())
        assert "double backward" in doc.lower() and "backend='math'" in doc.replace('"', "'"), doc
        return
    expected = second_derivative("math")
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_large_finite_float16_queries_give_no_nan(device: torch.device) -> None:
    """A float16 query row whose sum overflows float16 (here 128 × 600 = 76,800 > 65,504) is
    still finite input: the output must be finite (the NaN guard must not invent a NaN)."""
    q = torch.full((1, 1, 2, 128), 600.0, dtype=torch.float16, device=device)
    k = torch.randn(1, 1, 3, 128, device=device).half() * 0.01
    v = torch.randn(1, 1, 3, 128, device=device).half()
    out = attention(q, k, v)
    assert torch.isfinite(out).all()
    ref, _ = reference_attention(q, k, v)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_combined_masks_broadcast_either_way() -> None:
    # a bias per key (1, 2, 1, 4) under a wider causal bool mask (3, 4): each allowed cell has
    # its key's bias, each other -inf, whichever of the two is given first
    from multihead.kernels import combine_masks

    bias = torch.arange(8.0).reshape(1, 2, 1, 4)
    causal = torch.ones(3, 4, dtype=torch.bool).tril(1)
    for got in (combine_masks(bias, causal), combine_masks(causal, bias)):
        assert got is not None and got.shape == (1, 2, 3, 4)
        for h in range(2):
            for i in range(3):
                for j in range(4):
                    want = float(bias[0, h, 0, j]) if j <= i + 1 else float("-inf")
                    assert float(got[0, h, i, j]) == want
