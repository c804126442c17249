"""MultiHeadAttention under torch.compile (no graph breaks) and torch.export.

Compiling is slow on a small CPU, so one compiled module serves every case: each new combination
of arguments recompiles under the same ``fullgraph=True`` (any graph break raises), and the count
of compilations is kept to the cases that matter: with and without weights, with and without a
key mask and causal masking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from multihead import MultiHeadAttention

# Pairwise-distinct sizes, so a swapped dimension fails loudly.
B, T, E, H = 2, 5, 12, 3


def _module(device: torch.device) -> MultiHeadAttention:
    mha = MultiHeadAttention(E, H).to(device).eval()
    with torch.no_grad():  # biases start at zero: give them values worth comparing
        for name, p in mha.named_parameters():
            if "bias" in name:
                p.normal_()
    return mha


def _key_mask(device: torch.device) -> torch.Tensor:
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[1, 3:] = False  # padding at the end of the second example
    key_mask[0, 0] = False  # with is_causal, query 0 of example 0 sees no key: a fully masked row
    return key_mask


CASES = [
    pytest.param({"need_weights": False}, id="plain"),
    pytest.param({"need_weights": True}, id="weights"),
    pytest.param({"need_weights": False, "key_mask": True, "is_causal": True}, id="masked"),
    pytest.param({"need_weights": True, "key_mask": True, "is_causal": True}, id="masked-weights"),
]


def _kwargs(case: dict, device: torch.device) -> dict:
    return {**case, "key_mask": _key_mask(device)} if case.get("key_mask") else dict(case)


def _assert_same(got: object, expected: object) -> None:
    if isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    else:
        assert isinstance(got, torch.Tensor)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def compiled(device: torch.device) -> tuple[MultiHeadAttention, Callable[..., Any]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    mha = _module(device)
    return mha, torch.compile(mha, fullgraph=True)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_compile_fullgraph_matches_eager(
    compiled: tuple[MultiHeadAttention, Callable[..., Any]], case: dict, device: torch.device
) -> None:
    mha, compiled_mha = compiled
    x = torch.randn(B, T, E, device=device)
    kwargs = _kwargs(case, device)
    with torch.no_grad():
        expected = mha(x, **kwargs)
        got = compiled_mha(x, **kwargs)
    _assert_same(got, expected)
    if case.get("key_mask"):
        out = got[0] if isinstance(got, tuple) else got
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out[0, 0], mha.out_proj.bias)  # the empty row: bias only


def test_compile_fullgraph_backward_matches_eager(device: torch.device) -> None:
    """Training-mode forward and backward compile as one graph too (aot_eager: no codegen)."""
    torch._dynamo.reset()
    mha = _module(device).train()
    compiled_mha = torch.compile(mha, fullgraph=True, backend="aot_eager")
    x = torch.randn(B, T, E, requires_grad=True, device=device)
    kwargs = {"key_mask": _key_mask(device), "is_causal": True}
    expected = mha(x, **kwargs)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    got = compiled_mha(x, **kwargs)
    (got_grad,) = torch.autograd.grad(got.sum(), x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_grad, expected_grad, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got_grad).all()


@pytest.mark.parametrize("case", CASES)
def test_export_matches_eager(case: dict, device: torch.device) -> None:
    mha = _module(device)
    x = torch.randn(B, T, E, device=device)
    kwargs = _kwargs(case, device)
    program = torch.export.export(mha, (x,), kwargs=kwargs)
    x2 = torch.randn(B, T, E, device=device)  # new data, same shapes
    with torch.no_grad():
        expected = mha(x2, **kwargs)
    _assert_same(program.module()(x2, **kwargs), expected)


def test_export_with_dynamic_batch_and_length(device: torch.device) -> None:
    mha = _module(device)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", min=2, max=64)
    x = torch.randn(B, T, E, device=device)
    program = torch.export.export(mha, (x,), dynamic_shapes=({0: batch, 1: length},))
    x2 = torch.randn(B + 1, T + 6, E, device=device)  # another batch size and length than traced
    with torch.no_grad():
        expected = mha(x2)
    _assert_same(program.module()(x2), expected)
