"""The fused weights kernel (multihead.fused_weights) against the float64 math reference.

On CUDA (skipped without CUDA or triton) the kernel runs compiled; under the Triton interpreter
(TRITON_INTERPRET=1, skipped where triton is not installed) the same kernel runs with numpy on
the CPU, in a subprocess (the interpreter is chosen when the kernel module is imported).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from multihead import MultiHeadAttention, fused_weights, kernels
from multihead.functional import attention

HAS_TRITON = importlib.util.find_spec("triton") is not None
CUDA = torch.cuda.is_available() and HAS_TRITON
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA and triton")

# (B, H, Hk, T, S, D, Dv): pairwise-distinct sizes, ragged lengths (not multiples of any block),
# grouped and multi-query heads, head dims that are not powers of two, T > S.
SHAPES = [
    (2, 3, 3, 5, 7, 4, 6),
    (2, 4, 2, 19, 33, 24, 40),
    (3, 4, 1, 70, 130, 80, 64),
    (1, 2, 2, 129, 65, 64, 64),
    (2, 4, 2, 64, 128, 64, 64),  # every tile full: the kernel's unmasked ("EVEN") variant
]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> tuple[Tensor, ...]:
    b, h, hk, t, s, d, dv = shape
    g = torch.Generator(device=device).manual_seed(0)
    # q as MultiHeadAttention makes it: heads split off a (B, T, H·D) projection
    q = torch.randn(b, t, h, d, generator=g, device=device).transpose(1, 2)
    k = torch.randn(b, hk, s, d, generator=g, device=device)
    v = torch.randn(b, hk, s, dv, generator=g, device=device)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _masks(shape: tuple[int, ...], device: str) -> dict[str, Tensor | None]:
    """A key mask with a fully padded example, a float mask with a -inf row and column and
    finite addends, and a per-head bool mask."""
    b, h, _, t, s, _, _ = shape
    g = torch.Generator(device=device).manual_seed(1)
    keys = torch.rand(b, 1, 1, s, generator=g, device=device) > 0.3
    keys[0] = False
    added = torch.randn(t, s, generator=g, device=device)
    added[t // 2] = float("-inf")
    added[:, s // 2] = float("-inf")
    per_head = torch.rand(b, h, t, s, generator=g, device=device) > 0.5
    # eager-style: finfo.min where hidden, a whole row of it included (an empty row, not even)
    # (in float16, whose lowest value scaled to the kernel's base 2 is still finite)
    eager = torch.zeros(t, s, dtype=torch.float16, device=device)
    eager[:, s // 3] = torch.finfo(torch.float16).min
    eager[t // 3] = torch.finfo(torch.float16).min
    return {"none": None, "keys": keys, "float": added, "per-head": per_head, "eager": eager}


def _reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool
) -> tuple[Tensor, Tensor]:
    """The math backend in float64: the reference the fused kernel must meet (a float mask's
    hidden keys, read in its own dtype, stay hidden in float64)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double().masked_fill(~kernels.allowed(mask), float("-inf"))
    return attention(
        q.double(),
        k.double(),
        v.double(),
        mask=mask,
        is_causal=is_causal,
        need_weights=True,
        backend="math",
    )


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # One rounding of a float32-exact value to dtype (half an ulp), plus float32's own error.
    return {"rtol": torch.finfo(dtype).eps, "atol": 1e-6 if dtype == torch.float32 else 1e-5}


def _check(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> None:
    q, k, v = _inputs(shape, dtype, device)
    for mask in _masks(shape, device).values():
        for is_causal in (False, True):
            out, weights = fused_weights.fused_attention(
                q, k, v, mask=mask, is_causal=is_causal, scale=1 / math.sqrt(q.shape[-1])
            )
            ref_out, ref_weights = _reference(q, k, v, mask, is_causal)
            assert out.dtype == weights.dtype == dtype
            torch.testing.assert_close(weights.double(), ref_weights, **_tolerance(dtype))
            # the output goes through p rounded to dtype before p·v, as in any half kernel
            rtol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
            torch.testing.assert_close(out.double(), ref_out, rtol=rtol, atol=rtol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fused_matches_the_float64_reference_on_cuda(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    _check(shape, dtype, "cuda")


@needs_cuda
def test_attention_takes_the_fused_kernel_for_weights_on_cuda() -> None:
    q, k, v = _inputs(SHAPES[1], torch.bfloat16, "cuda")
    mask = _masks(SHAPES[1], "cuda")["keys"]
    assert fused_weights.unsupported(q, k, v, mask, 0.0) is None
    got = attention(q, k, v, mask=mask, is_causal=True, need_weights=True, backend="fused")
    fused = fused_weights.fused_attention(q, k, v, mask=mask, is_causal=True)
    for a, b in zip(got, fused, strict=True):
        assert torch.equal(a, b)


@needs_cuda
def test_auto_takes_the_fused_kernel_for_weights_on_cuda() -> None:
    q, k, v = _inputs(SHAPES[1], torch.bfloat16, "cuda")
    with torch.no_grad():
        auto = attention(q, k, v, is_causal=True, need_weights=True)
    fused = fused_weights.fused_attention(q, k, v, is_causal=True)
    for a, b in zip(auto, fused, strict=True):
        assert torch.equal(a, b)


@needs_cuda
def test_autograd_and_dropout_take_the_math_path_on_cuda() -> None:
    q, k, v = _inputs(SHAPES[1], torch.float32, "cuda")
    q.requires_grad_(True)
    assert fused_weights.unsupported(q, k, v, None, 0.0) == "autograd: the weights need a graph"
    out, weights = attention(q, k, v, need_weights=True)
    assert weights.grad_fn is not None
    (out.sum() + weights.square().sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        assert fused_weights.unsupported(q, k, v, None, 0.0) is None
        assert fused_weights.unsupported(q, k, v, None, 0.1) == "dropout"


@needs_cuda
def test_nan_propagates_and_empty_rows_are_zero_on_cuda() -> None:
    q, k, v = _inputs(SHAPES[1], torch.bfloat16, "cuda")
    q[0, 1, 3, 0] = float("nan")
    keys = torch.ones(q.shape[0], 1, 1, k.shape[-2], dtype=torch.bool, device="cuda")
    keys[1] = False
    out, weights = fused_weights.fused_attention(q, k, v, mask=keys)
    assert weights[0, 1, 3].isnan().all() and out[0, 1, 3].isnan().all()
    assert weights[0, 1, 2].isfinite().all() and weights[0, 0].isfinite().all()
    assert (weights[1] == 0).all() and (out[1] == 0).all()


@needs_cuda
@pytest.mark.parametrize("length", [64, 300])
def test_weights_at_least_as_accurate_as_torch_mha_in_bfloat16(length: int) -> None:
    """Against float64, multihead's bfloat16 weights err no more than torch.nn's (on average:
    both share the rounding of inputs and projections; torch also rounds scores to bfloat16)."""
    torch.manual_seed(0)
    e, h = 256, 4
    torch_mha = torch.nn.MultiheadAttention(e, h, batch_first=True, device="cuda").eval()
    ours = MultiHeadAttention.from_torch(torch_mha).eval()
    x = torch.randn(2, length, e, device="cuda")
    with torch.no_grad():
        _, exact = ours.double()(x.double(), need_weights=True)
        _, mine = ours.bfloat16()(x.bfloat16(), need_weights=True)
        _, theirs = torch_mha.bfloat16()(
            x.bfloat16(), x.bfloat16(), x.bfloat16(), average_attn_weights=False
        )
    mine_error = (mine.double() - exact).abs().mean()
    theirs_error = (theirs.double() - exact).abs().mean()
    assert mine_error <= theirs_error, (mine_error, theirs_error)


def test_unsupported_names_why_on_cpu() -> None:
    q = k = v = torch.zeros(1, 2, 3, 4)
    assert fused_weights.unsupported(q, k, v, None, 0.0) == "not a CUDA tensor"
    with pytest.raises(ValueError, match=r"backend='fused' cannot serve this call \(not a CUDA"):
        attention(q, k, v, need_weights=True, backend="fused")


# -- the same kernel under the Triton interpreter (CPU) -------------------------------------------


def run_interpreter_cases() -> None:
    """Entry point of the interpreter subprocess: float32 and float16 (numpy has no bfloat16)."""
    for shape in (*SHAPES[:3], SHAPES[4]):
        for dtype in (torch.float32, torch.float16):
            _check(shape, dtype, "cpu")
    _check_routing_through_multihead_attention()


def _check_routing_through_multihead_attention() -> None:
    """attention(backend="fused") (allowed on the CPU here) equals the math path: masks,
    causality and grouped heads arrive intact."""
    q = torch.randn(2, 4, 9, 6)
    k, v = torch.randn(2, 2, 9, 6), torch.randn(2, 2, 9, 6)
    key_mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    key_mask[1, ..., 6:] = False
    mask = torch.randn(9, 9).masked_fill(~key_mask, float("-inf"))  # (2, 1, 9, 9)
    kw = dict(mask=mask, is_causal=True, need_weights=True)
    with torch.no_grad():
        expected = attention(q, k, v, backend="math", **kw)
        original = fused_weights.unsupported
        fused_weights.unsupported = lambda *args: None
        try:
            got = attention(q, k, v, backend="fused", **kw)
        finally:
            fused_weights.unsupported = original
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _triton_interpreter_checked() -> bool:
    """The interpreter of triton >= 3.9 (the one the kernel was checked under): older ones
    (3.1, beside torch 2.5) reject its block sizes, passed as constexpr keywords."""
    if not HAS_TRITON:
        return False
    from packaging.version import Version

    return Version(importlib.metadata.version("triton")) >= Version("3.9")


@pytest.mark.slow
@pytest.mark.skipif(not _triton_interpreter_checked(), reason="needs triton >= 3.9")
def test_fused_matches_the_float64_reference_under_the_triton_interpreter() -> None:
    tests = Path(__file__).resolve().parent
    code = "import test_fused_weights as t; t.run_interpreter_cases(); print('ok')"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tests), str(tests.parent / "src"), env.get("PYTHONPATH", "")]
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
