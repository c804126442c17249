"""Attention weights on the GPU at the cost of writing them: one fused Triton kernel.

Shapes: B batch, H query heads, Hk key/value heads, T queries, S keys, D head dim, Dv value
head dim.

:func:`fused_attention` returns what :func:`multihead.kernels.math_attention` returns,
``softmax(q kᵀ · scale + mask) · v`` and the weights, without materialising the float32 score
matrix: scores are accumulated in float32 (``tl.dot``), the softmax is taken in float32, and each
weight is written once, in q's dtype (see :mod:`multihead.weights_kernel`). The weights are at
least as accurate as those of the math path, which rounds nothing before the softmax either.

:func:`multihead.functional.attention` runs it for ``backend="fused"``, and for ``"auto"``
with weights wherever :func:`unsupported` finds nothing in the way. It serves forward passes
only, and :func:`unsupported` names why it cannot serve a call; the math path (the reference,
and the path on every other device) is the one for

- a gradient is to flow (autograd is on and q, k, v or a float mask requires grad): the math
  path's weights have a graph, this kernel's have none;
- ``dropout_p > 0``, or the dtype is not float16, bfloat16 or float32, or D or Dv > 256;
- torch.compile or torch.export is tracing (the math path is what they trace);

and where triton cannot be imported (CUDA builds of torch on Linux bring it).
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["fused_attention", "unsupported", "triton_available", "default_blocks"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


@functools.cache
def triton_available() -> bool:
    """Whether triton imports (checked once; importing it takes a moment)."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        "need_weights=True on CUDA runs the math path (a float32 score matrix per head): "
        "triton, which the fused weights kernel needs, could not be imported",
        RuntimeWarning,
        stacklevel=4,
    )


def unsupported(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float
) -> str | None:
    """Why :func:`fused_attention` cannot serve this call, or None when it can.

    Args:
        q: (..., H, T, D). k: (..., Hk, S, D). v: (..., Hk, S, Dv). mask: None, bool or float.
        dropout_p: the dropout on the weights.

    Returns:
        None, or a short reason ("not a CUDA tensor", "autograd", ...).
    """
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if any(t is not None and t.device != q.device for t in (k, v, mask)):
        return "tensors on different devices"
    if dropout_p > 0:
        return "dropout"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask)):
        return "autograd: the weights need a graph"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}"
    if max(q.shape[-1], v.shape[-1]) > _MAX_HEAD_DIM:
        return f"a head dim above {_MAX_HEAD_DIM}"
    if torch.compiler.is_compiling():
        return "torch.compile or torch.export is tracing"
    if not triton_available():
        _warn_no_triton()
        return "triton is not installed"
    return None


def default_blocks(dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """The kernel's tile sizes (powers of two, at least 16) and launch settings for a dtype and
    the larger of D and Dv: ``BLOCK_M`` queries by ``BLOCK_N`` keys per step, ``num_warps``,
    ``num_stages``."""
    if dtype == torch.float32:  # full float32 products: no tensor cores, smaller tiles
        block_m = 64 if head_dim <= 64 else 32
        return {"BLOCK_M": block_m, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if head_dim <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    if head_dim <= 128:
        return {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}


def _unit_last_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    blocks: Mapping[str, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + mask) · v and its weights, in one Triton kernel (no autograd).

    The caller has checked the arguments (:func:`multihead.functional.attention` does). Rows
    that may attend to no key give zero weights and zero output; NaN propagates.

    Args:
        q: (..., H, T, D). k: (..., Hk, S, D). v: (..., Hk, S, Dv); query head h reads
            key/value head h // (H // Hk). One dtype (float16, bfloat16 or float32), one device.
        mask: None, bool (True = may attend) or float (added to the scores), broadcastable to
            (..., H, T, S).
        is_causal: query i sees keys j <= i + (S − T) (bottom-right), ANDed with ``mask``.
        scale: the factor on the scores; default 1 / sqrt(D).
        blocks: tile sizes and launch settings, as :func:`default_blocks` returns them (its
            choice by default; for tuning on a new GPU).

    Returns:
        ``(out, weights)``: out (..., H, T, Dv) and weights (..., H, T, S), in q's dtype.
    """
    # Here, not at the top: the kernel's module imports triton, an optional package.
    from multihead.weights_kernel import attention_weights_kernel

    *lead, h, t, d = q.shape
    hk, s, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    b = math.prod(lead)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = q.new_empty((b, h, t, dv))
    weights = q.new_empty((b, h, t, s))
    if out.numel() == 0 or weights.numel() == 0:
        return out.reshape(*lead, h, t, dv), weights.reshape(*lead, h, t, s)
    q4 = _unit_last_stride(q.reshape(b, h, t, d))  # (B, H, T, D), a view for 4-D input
    k4 = _unit_last_stride(k.reshape(b, hk, s, d))  # (B, Hk, S, D)
    v4 = _unit_last_stride(v.reshape(b, hk, s, dv))  # (B, Hk, S, Dv)
    mask_strides: tuple[int, ...] = (0, 0, 0, 0)
    if mask is None:
        mask4 = q4  # never read
    else:
        # Broadcast dims get stride 0: a key mask (B, 1, 1, S) is read as one row per batch.
        mask4 = mask.expand(*lead, h, t, s).reshape(b, h, t, s)
        if mask4.dtype == torch.bool:
            mask4 = mask4.view(torch.uint8)  # same bytes; triton reads bytes, not bools
        mask_strides = mask4.stride()
    config = dict(default_blocks(q.dtype, max(d, dv)) if blocks is None else blocks)
    num_m = _cdiv(t, config["BLOCK_M"])
    args: list[Any] = [q4, k4, v4, mask4, out, weights]
    args += [*q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *mask_strides]
    args += [*out.stride()[:3], *weights.stride()[:3]]
    floor = 0.0  # the float mask's hiding value (kernels.allowed): half its lowest
    if mask is not None and mask.dtype.is_floating_point:
        floor = torch.finfo(mask.dtype).min / 2
    args += [h, h // hk, t, s, d, dv, s - t, scale * _LOG2E, floor]
    block_d, block_dv = max(16, _next_power_of_2(d)), max(16, _next_power_of_2(dv))
    even = (
        t % config["BLOCK_M"] == 0 and s % config["BLOCK_N"] == 0 and (d, dv) == (block_d, block_dv)
    )
    attention_weights_kernel[(b * h * num_m,)](
        *args,
        HAS_MASK=mask is not None,
        MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
        IS_CAUSAL=is_causal,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        EVEN=even,
        **config,
    )
    return out.reshape(*lead, h, t, dv), weights.reshape(*lead, h, t, s)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
