"""Scaled dot-product attention: the math, once.

Shapes use one set of letters throughout the package: B batch, H query heads, Hk key/value heads,
T (Tq) query length, S (Tk) key length, D head dim, Dv value head dim, E width.

    attention(q, k, v) = softmax(q kᵀ · scale + mask) · v,   scale = 1 / sqrt(D)

Masks follow the convention of ``F.scaled_dot_product_attention``: a bool mask is True where a
query *may* attend to a key; a float mask is added to the scores (``-inf`` removes a key).
Causal masking is aligned bottom-right: query i sees keys j <= i + (S - T), which stays right when
cached keys make S > T. A query row that may attend to no key at all gives zeros, never NaN.

Backends share one signature:

- ``"sdpa"``: torch's fused kernel (``F.scaled_dot_product_attention``). Memory is linear in the
  sequence length, weights are never materialised.
- ``"math"``: the explicit formula the tutorials teach, written to be read. The only backend that
  returns the attention weights.
- ``"blocked"``: blocks over queries and keys with an online softmax (FlashAttention's forward),
  compiled by torch.compile; see :mod:`multihead.blocked`. CPU, forward only (no autograd, no
  dropout, no weights). Its first call per dtype compiles for about 10–20 s; later calls with
  any sequence length reuse that compile.
- ``"auto"``: ``"math"`` when weights are asked for; ``"blocked"`` for bfloat16/float16 inference
  on CPU (no gradient, no dropout) once T·S reaches :data:`BLOCKED_MIN_WORK`; else ``"sdpa"``.
  :data:`BLOCKED_MIN_WORK` is None (never) by default, because on the machine measured for
  BENCHMARKS.md (Intel Xeon with avx512_bf16, where a bfloat16 GEMM runs at half the float32
  speed) the blocked backend was at best 1.16× torch's kernel in CPU time and far less steady
  in wall-clock time on shared cores; set it to e.g. ``512 * 512`` on a CPU where
  ``benchmarks/bench_bf16.py`` shows the blocked backend clearly ahead. ``"auto"`` never fails
  because ``"blocked"`` can't run (no C++ compiler, a failed compile, inside a torch.compile
  trace): it takes ``"sdpa"`` and logs why (debug level; a failed compile at warning level) on
  the ``multihead.functional`` logger.
"""

from __future__ import annotations

import logging
import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor

from multihead import blocked as _blocked

__all__ = ["attention", "causal_mask", "BACKENDS", "BLOCKED_MIN_WORK"]

_LOG = logging.getLogger(__name__)

Backend = Literal["auto", "sdpa", "math", "blocked"]
BACKENDS: tuple[str, ...] = ("auto", "sdpa", "math", "blocked")

BLOCKED_MIN_WORK: int | None = None
"""T·S from which ``"auto"`` prefers ``"blocked"`` for half-precision CPU inference; None: never.

None by default: not reliably faster than torch's kernel on the reference machine
(BENCHMARKS.md).
"""

# Set when the blocked backend failed at run time (e.g. its compile): "auto" stops trying it.
_blocked_failure: str | None = None


def causal_mask(
    query_len: int, key_len: int, *, device: torch.device | str | None = None
) -> Tensor:
    """The bottom-right aligned causal mask.

    Query i may attend to key j when j <= i + (key_len - query_len): the last query sees every key,
    as it does when the first ``key_len - query_len`` keys come from a cache.

    Args:
        query_len: T, the number of queries.
        key_len: S, the number of keys.
        device: where to build the mask.

    Returns:
        A bool tensor (T, S), True where attending is allowed.

    Example:
        >>> causal_mask(2, 3).int()
        tensor([[1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    return torch.ones(query_len, key_len, dtype=torch.bool, device=device).tril(key_len - query_len)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 3:
            raise ValueError(
                f"{name} must have at least 3 dimensions (..., heads, length, head_dim), "
                f"got shape {tuple(t.shape)}"
            )
    if not (q.dim() == k.dim() == v.dim()):
        raise ValueError(
            f"q, k and v must have the same number of dimensions, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[:-3] != k.shape[:-3] or k.shape[:-3] != v.shape[:-3]:
        raise ValueError(
            f"q, k and v must share their leading (batch) dimensions, got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head dim, got q {tuple(q.shape)} (D={q.shape[-1]}) "
            f"and k {tuple(k.shape)} (D={k.shape[-1]})"
        )
    if k.shape[-3:-1] != v.shape[-3:-1]:
        raise ValueError(
            f"k and v must have the same heads and length, got k {tuple(k.shape)} "
            f"and v {tuple(v.shape)}"
        )
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % hk != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the key/value heads, "
            f"got q with {hq} heads and k with {hk}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")


def _check_mask(mask: Tensor | None, q: Tensor, k: Tensor) -> None:
    """Raise unless ``mask`` is None or a bool/float tensor broadcastable to (..., H, T, S)."""
    if mask is None:
        return
    target = (*q.shape[:-1], k.shape[-2])
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"mask must be bool (True = may attend) or floating point (added to the "
            f"scores), got dtype {mask.dtype}"
        )
    try:
        shape = torch.broadcast_shapes(mask.shape, target)
    except RuntimeError:
        shape = None
    if shape != torch.Size(target):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the scores' shape "
            f"{tuple(target)} (..., H, T, S)"
        )


def _prepare_mask(
    mask: Tensor | None, is_causal: bool, q: Tensor, k: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Fold ``is_causal`` into ``mask`` and make fully masked rows harmless.

    Returns ``(mask, keep)``: ``mask`` (bool or float, broadcastable to (..., H, T, S)) in which any
    query row that could attend to nothing has been opened up again, so that no kernel ever takes a
    softmax over an empty set (the source of NaN values and NaN gradients); and ``keep`` (bool,
    broadcastable to (..., H, T, 1)), False on exactly those rows, which the caller zeroes. ``keep``
    is None when no row can be empty.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    _check_mask(mask, q, k)
    if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
        mask = mask.to(q.dtype)
    if is_causal:
        causal = causal_mask(tq, tk, device=q.device)
        if mask is None:
            mask = causal
        elif mask.dtype == torch.bool:
            mask = mask & causal
        else:
            mask = mask.masked_fill(~causal, float("-inf"))
    if mask is None:
        return None, None
    allowed = mask if mask.dtype == torch.bool else mask != float("-inf")
    keep = allowed.any(dim=-1, keepdim=True)
    if is_causal and mask.dim() == 2 and tq <= tk:
        # A bottom-right causal mask alone never empties a row when T <= S.
        return mask, None
    # Reopen empty rows (uniform attention), then zero their output: finite values and gradients
    # on every kernel and device, with no data-dependent branch for torch.compile to break on.
    if mask.dtype == torch.bool:
        mask = mask | ~keep
    else:
        mask = mask.masked_fill(~keep, 0.0)
    return mask, keep


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    grouped = q.shape[-3] != k.shape[-3]
    if is_causal and mask is None:
        # Bottom-right and torch's top-left alignment coincide when T == S.
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=grouped
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=grouped
    )


def _math(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + mask) · v, spelled out. Returns (out, weights)."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        # Query head h reads key/value head h // group, as F.scaled_dot_product_attention does.
        k = k.repeat_interleave(group, dim=-3)  # (..., H, S, D)
        v = v.repeat_interleave(group, dim=-3)  # (..., H, S, Dv)
    # Scores and softmax in float32 at least, so half-precision inputs don't lose the softmax.
    compute = torch.promote_types(q.dtype, torch.float32)
    # The scale goes on q, a (T, D) pass, rather than on the (T, S) scores.
    scores = torch.matmul(q.to(compute) * scale, k.to(compute).transpose(-2, -1))  # (..., H, T, S)
    if torch.is_grad_enabled() and (
        scores.requires_grad or (mask is not None and mask.requires_grad)
    ):
        if mask is not None:
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.to(compute)
        weights = torch.softmax(scores, dim=-1)  # (..., H, T, S)
    else:
        # No graph is recorded: the same formula, in place in the one (T, S) buffer. At T=2048
        # each fresh T×S buffer costs more (allocation and page faults) than its arithmetic.
        if mask is not None:
            if mask.dtype == torch.bool:
                scores.masked_fill_(~mask, float("-inf"))
            else:
                scores.add_(mask.to(compute))
        # aten's softmax with out= is torch.softmax's own kernel writing in place (one fused pass;
        # torch has no public in-place softmax).
        weights = torch._softmax(scores, -1, False, out=scores)  # (..., H, T, S)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    # (..., H, T, S) x (..., H, S, Dv) -> (..., H, T, Dv)
    out = torch.matmul(dropped, v.to(compute))
    return out.to(q.dtype), weights.to(q.dtype)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _check_blocked_request(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, need_weights: bool
) -> None:
    """Raise with the reason when ``backend="blocked"`` cannot serve this request."""
    if need_weights:
        raise ValueError(
            "backend='blocked' cannot return attention weights (it never materialises them): "
            "use backend='math' or 'auto' with need_weights=True"
        )
    if dropout_p > 0:
        raise ValueError(
            f"backend='blocked' has no dropout, got dropout_p={dropout_p}: use backend='sdpa' "
            f"or 'auto' for training"
        )
    if _needs_grad(q, k, v):
        raise ValueError(
            "backend='blocked' is forward-only (no autograd), got inputs that require grad with "
            "grad mode on: use backend='sdpa' or 'auto' for training, or call it under "
            "torch.no_grad() / torch.inference_mode()"
        )
    reason = _blocked.unavailable_reason(q)
    if reason is not None:
        raise RuntimeError(f"backend='blocked' is unavailable: {reason}")


def _remember_blocked_failure(exc: Exception) -> None:
    global _blocked_failure
    _blocked_failure = f"{type(exc).__name__}: {exc}"
    _LOG.warning("the blocked backend failed; backend='auto' uses 'sdpa' from now on: %s", exc)


def _auto_picks_blocked(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> bool:
    """Whether ``"auto"`` takes the blocked backend (weights were not asked for)."""
    if torch.compiler.is_compiling():
        return False  # inside someone's torch.compile trace: a Python loop of blocks won't do
    if q.device.type != "cpu" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    min_work = BLOCKED_MIN_WORK
    if min_work is None or q.shape[-2] * k.shape[-2] < min_work:
        return False
    if dropout_p > 0 or _needs_grad(q, k, v):
        return False
    reason = _blocked_failure or _blocked.unavailable_reason(q)
    if reason is not None:
        _LOG.debug("backend='auto' uses 'sdpa', not 'blocked': %s", reason)
        return False
    return True


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[False] = ...,
    backend: str = ...,
) -> Tensor: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: Literal[True],
    backend: str = ...,
) -> tuple[Tensor, Tensor]: ...


@overload
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = ...,
    is_causal: bool = ...,
    scale: float | None = ...,
    dropout_p: float = ...,
    need_weights: bool = ...,
    backend: str = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, softmax(q kᵀ · scale + mask) · v.

    Args:
        q: queries (..., H, T, D).
        k: keys (..., Hk, S, D). H must be a multiple of Hk: query head h reads key/value head
            h // (H // Hk) (grouped-query attention; Hk = 1 is multi-query attention).
        v: values (..., Hk, S, Dv).
        mask: None, a bool tensor (True = this query may attend to this key) or a float tensor
            added to the scores; broadcastable to (..., H, T, S).
        is_causal: query i sees keys j <= i + (S - T) (bottom-right aligned). Combined with
            ``mask`` by AND.
        scale: the factor on the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention weights. Applied whenever it is > 0: pass 0 in eval.
        need_weights: also return the attention weights (softmax probabilities, before dropout).
        backend: ``"auto"``, ``"sdpa"`` (torch's fused kernel, no weights), ``"math"`` (the
            explicit formula) or ``"blocked"`` (blocked online softmax compiled by torch.compile:
            CPU inference only, no weights, no dropout, no autograd; the first call per dtype
            compiles for about 10–20 s). ``"auto"`` takes ``"math"`` when weights are asked
            for; ``"blocked"`` for bfloat16/float16 CPU tensors when no gradient is needed, no
            dropout is asked for and T·S >= :data:`BLOCKED_MIN_WORK` (None, never, by
            default); else ``"sdpa"``.

    Returns:
        ``out`` (..., H, T, Dv), or ``(out, weights)`` with weights (..., H, T, S) when
        ``need_weights``. A query row with no key to attend to gives zeros (and zero weights).

    Raises:
        TypeError: a tensor argument of the wrong type or dtype.
        ValueError: shapes that disagree, a mask that doesn't broadcast, dropout_p outside
            [0, 1), an unknown backend, need_weights with ``backend="sdpa"`` or
            ``"blocked"``, or dropout or inputs that require grad with ``backend="blocked"``.
        RuntimeError: ``backend="blocked"`` where it cannot run: not on CPU, or no
            torch.compile or C++ compiler (``"auto"`` falls back to ``"sdpa"`` instead).

    Example:
        >>> q = k = v = torch.randn(2, 4, 5, 8)  # (B, H, T, D)
        >>> attention(q, k, v, is_causal=True).shape
        torch.Size([2, 4, 5, 8])
    """
    _check_inputs(q, k, v)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if need_weights and backend == "sdpa":
        raise ValueError(
            "backend='sdpa' cannot return attention weights (torch's fused kernel never "
            "materialises them): use backend='math' or 'auto' with need_weights=True"
        )
    if backend == "blocked":
        _check_blocked_request(q, k, v, dropout_p, need_weights)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    use_math = backend == "math" or (backend == "auto" and need_weights)

    if backend == "blocked" or (
        backend == "auto" and not need_weights and _auto_picks_blocked(q, k, v, dropout_p)
    ):
        _check_mask(mask, q, k)
        try:
            return _blocked.blocked_attention(q, k, v, mask=mask, is_causal=is_causal, scale=scale)
        except Exception as exc:
            if backend == "blocked":
                raise
            # "auto" never fails because of "blocked": remember, say why, and take torch's kernel.
            _remember_blocked_failure(exc)

    plain_causal = is_causal and mask is None and q.shape[-2] == k.shape[-2]
    if plain_causal and not use_math:
        return _sdpa(q, k, v, None, True, scale, dropout_p)
    mask, keep = _prepare_mask(mask, is_causal, q, k)

    if use_math:
        out, weights = _math(q, k, v, mask, scale, dropout_p)
        if keep is not None:
            out = out.masked_fill(~keep, 0.0)
            weights = weights.masked_fill(~keep, 0.0)
        return (out, weights) if need_weights else out

    out = _sdpa(q, k, v, mask, False, scale, dropout_p)
    if keep is not None:
        out = out.masked_fill(~keep, 0.0)
    return out
