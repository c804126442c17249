"""Scaled dot-product attention: one function, one signature, three backends.

Shapes use one set of letters throughout the package: B batch, H query heads, Hk key/value heads,
T query length, S key length, D head dim, Dv value head dim, E width.

    attention(q, k, v) = softmax(q kᵀ · scale + mask) · v,   scale = 1 / sqrt(D)

Masks follow the convention of ``F.scaled_dot_product_attention``: a bool mask is True where a
query *may* attend to a key; a float mask is added to the scores (``-inf``, or at most half the
mask dtype's lowest value as in eager-style ``finfo.min`` masks, removes a key; any other finite
value, however negative, is an ordinary addend in every dtype: :func:`multihead.kernels.allowed`
is the rule). Causal masking is aligned bottom-right (:func:`multihead.kernels.causal_mask`):
query i sees keys j <= i + (S - T), which stays right when cached keys make S > T. A query row
that may attend to no key at all gives zeros (and zero weights), never NaN, with finite
gradients. NaN in the inputs propagates to the rows it touches, on every backend.

Score modifications (:mod:`multihead.score_mods`; docs/formulations.md has each formula and
the families that use it), applied in this order to s = q kᵀ · scale:

    s ← softcap · tanh(s / softcap)          ``softcap`` (Gemma-2: after the scale)
    s ← score_mod(s, b, h, q_idx, kv_idx)    ``score_mod`` (FlexAttention's signature)
    s ← s + mask, −inf where the bool mask, ``block_mask`` (a FlexAttention ``BlockMask``) or
        causality hides a key
    p = softmax over the keys and one sink logit per head (``sinks``), whose value is 0

With sinks, ``sink_weights`` says which weights come back: ``"dropped"`` (the keys' shares;
rows sum to less than 1), ``"column"`` (and the sink's share as a last column) or ``"plain"``
(the softmax without the sink); the output is the same.

- ``"sdpa"``: torch's fused kernel (``F.scaled_dot_product_attention``). Memory is linear in the
  sequence length, weights are never materialised.
- ``"math"``: the explicit formula (:func:`multihead.kernels.math_attention`). It returns the
  attention weights on every device and with autograd (the reference the fused kernel is tested
  against), and is the one to use for double backward (torch's fused CPU kernel has no second
  derivative).
- ``"fused"``: on CUDA, the fused Triton kernel of :mod:`multihead.fused_weights` (float32
  scores and softmax, each weight written once in q's dtype; forward only); a call it cannot
  serve is refused with the reason.
- ``"flex"``: torch's FlexAttention (compiled with ``torch.compile`` on CUDA; on the CPU its
  uncompiled reference, without a backward); no weights, no dropout.
- ``"auto"``: ``"sdpa"`` when no weights are asked for; with weights, ``"fused"`` where it can
  serve the call (CUDA, no graph to record, no dropout, triton installed), else ``"math"``.
  With a score modification: ``"math"`` on the CPU or with weights or dropout (the formula a
  block of query rows at a time, memory O(rows · S)), compiled ``"flex"`` on CUDA.
  ``"sdpa"`` serves a ``block_mask`` alone, as its dense mask; ``"fused"`` none of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, overload

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from multihead import fused_weights, kernels
from multihead._checks import check_choice, check_mask, check_probability
from multihead.kernels import combine_masks
from multihead.score_mods import ScoreMod, ScoreMods, flex_forward, modified_attention

__all__ = ["attention", "combine_masks", "BACKENDS"]

BACKENDS: tuple[str, ...] = ("auto", "sdpa", "math", "fused", "flex")


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, is_causal: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating point dtype, got {t.dtype}")
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
    for name, t, dim, what in (
        ("q", q, -1, "head dim D"),
        ("v", v, -1, "head dim Dv"),
        ("q", q, -3, "number of heads H"),
        ("k", k, -3, "number of key/value heads Hk"),
    ):
        if t.shape[dim] == 0:
            raise ValueError(f"{name}'s {what} must be positive, got shape {tuple(t.shape)}")
    hq, hk = q.shape[-3], k.shape[-3]
    if hq % hk != 0:
        raise ValueError(
            f"the number of query heads must be a multiple of the key/value heads, "
            f"got q with {hq} heads and k with {hk}"
        )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")


def _prepare_mask(
    mask: Tensor | None, is_causal: bool, q: Tensor, k: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """Fold ``is_causal`` into ``mask`` and make fully masked rows harmless.

    Returns ``(mask, keep)``: ``mask`` (bool, or float in q's dtype; at least 2-D, broadcastable
    to (..., H, T, S)) in which any query row that could attend to nothing has been opened up
    again, so that no kernel ever takes a softmax over an empty set (the source of NaN values and
    NaN gradients); and ``keep`` (bool, broadcastable to (..., H, T, 1)), False on exactly those
    rows, which the caller zeroes. ``keep`` is None when no row can be empty.
    """
    tq, tk = q.shape[-2], k.shape[-2]
    check_mask("mask", mask, (*q.shape[:-1], tk), "the scores' shape")
    if mask is not None and mask.dim() < 2:
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))  # kernels want (T, S)
    causal = kernels.causal_mask(tq, tk, device=q.device) if is_causal else None
    if mask is None and (causal is None or tq <= tk):
        return causal, None  # a bottom-right causal mask alone empties a row only when T > S
    mask = combine_masks(mask, causal)
    assert mask is not None
    seen = kernels.allowed(mask)
    keep = seen.any(dim=-1, keepdim=True)
    # Reopen empty rows (uniform attention), then zero their output: finite values and gradients
    # on every kernel and device, with no data-dependent branch for torch.compile to break on.
    if mask.dtype == torch.bool:
        return mask | ~keep, keep
    mask = mask.masked_fill(~keep, 0.0)
    if mask.dtype != q.dtype:
        low = torch.finfo(q.dtype).min
        if torch.finfo(mask.dtype).min < low:
            # A finite addend stays finite in q's dtype (float16 would turn -1e9 into -inf and
            # empty the row); -inf stays -inf.
            mask = torch.where(seen | ~keep, mask.clamp(min=low), float("-inf"))
        mask = mask.to(q.dtype)
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
    """torch's fused kernel; ``is_causal`` only where its top-left alignment is ours (T == S)."""
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        enable_gqa=q.shape[-3] != k.shape[-3],
    )
    if mask is None and q.device.type == "cpu":
        # torch's CPU flash kernel turns a NaN query row into zeros; NaN in the inputs propagates
        # here (one cheap pass over q, nothing over the scores).
        # (Summed in float32 at least: a float16 row of large finite values must not overflow
        # to inf, whose product with 0 would be a NaN the input never had.)
        wide = torch.promote_types(q.dtype, torch.float32)
        out = out + q.sum(-1, keepdim=True, dtype=wide).mul(0.0).to(out.dtype)
    return out


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
    softcap: float | None = ...,
    sinks: Tensor | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sink_weights: str = ...,
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
    softcap: float | None = ...,
    sinks: Tensor | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sink_weights: str = ...,
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
    softcap: float | None = ...,
    sinks: Tensor | None = ...,
    score_mod: ScoreMod | None = ...,
    block_mask: BlockMask | None = ...,
    sink_weights: str = ...,
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
    softcap: float | None = None,
    sinks: Tensor | None = None,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    sink_weights: str = "dropped",
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention, softmax(q kᵀ · scale + mask) · v.

    Args:
        q: queries (..., H, T, D), floating point.
        k: keys (..., Hk, S, D). H must be a multiple of Hk: query head h reads key/value head
            h // (H // Hk) (grouped-query attention; Hk = 1 is multi-query attention).
        v: values (..., Hk, S, Dv).
        mask: None, a bool tensor (True = this query may attend to this key) or a float tensor
            added to the scores; any shape that broadcasts to (..., H, T, S).
        is_causal: query i sees keys j <= i + (S - T) (bottom-right aligned). Combined with
            ``mask`` by AND.
        scale: the factor on the scores; default 1 / sqrt(D).
        dropout_p: dropout on the attention weights. Applied whenever it is > 0: pass 0 in eval.
        need_weights: also return the attention weights (softmax probabilities, before dropout).
        backend: ``"auto"`` (``"sdpa"`` without weights; with weights ``"fused"`` where it
            can serve the call, else ``"math"``),
            ``"sdpa"`` (torch's fused kernel: linear memory, no weights), ``"math"`` (the
            explicit formula) or ``"fused"`` (CUDA: the fused weights kernel of
            :mod:`multihead.fused_weights`, forward only). Double backward (a second
            derivative, e.g. for a gradient penalty) needs ``backend="math"``: torch's fused
            CPU kernel has no second derivative, and torch raises when one is asked of it.
            ``"flex"``: torch's FlexAttention (see the module docstring).
        softcap: c > 0: scores → c · tanh(scores / c), after the scale and before the mask
            (Gemma-2's attention-logit softcapping); None for none.
        sinks: one learned logit per query head, (H,), or per query, broadcastable to
            (..., H, T): an extra key with value 0 that takes a share of the softmax
            (GPT-OSS); None for none. Gradients flow to it.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, FlexAttention's: called
            under ``torch.vmap`` with 0-d index tensors (b the index over q's flattened leading
            dims, h the query head), after the softcap and before the masks.
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask`` made for (T, S), with
            batch 1 or B and heads 1 or H; ANDed with ``mask`` and ``is_causal``.
        sink_weights: with sinks and ``need_weights``, ``"dropped"`` (the keys' shares of the
            softmax over keys and sink, (..., H, T, S)), ``"column"`` (those and the sink's as
            a last column, (..., H, T, S + 1)) or ``"plain"`` (the softmax over the keys alone).

    Returns:
        ``out`` (..., H, T, Dv), or ``(out, weights)`` with weights (..., H, T, S) when
        ``need_weights``. A query row with no key to attend to gives zeros (and zero weights).

    Raises:
        TypeError: a tensor argument of the wrong type or dtype, a non-bool ``is_causal``.
        ValueError: shapes that disagree or are empty, a mask that doesn't broadcast,
            ``dropout_p`` outside [0, 1), an unknown backend, need_weights with
            ``backend="sdpa"`` or ``"flex"``, a modification a backend cannot apply, sinks or a
            block mask of the wrong shape, a non-positive softcap.

    Example:
        >>> q = k = v = torch.randn(2, 4, 5, 8)  # (B, H, T, D)
        >>> attention(q, k, v, is_causal=True).shape
        torch.Size([2, 4, 5, 8])
    """
    _check_inputs(q, k, v, is_causal)
    dropout_p = check_probability("dropout_p", dropout_p)
    check_choice("backend", backend, BACKENDS)
    mods = ScoreMods(
        softcap=softcap,
        sinks=sinks,
        score_mod=score_mod,
        block_mask=block_mask,
        sink_weights=sink_weights,
    )
    if need_weights and backend in ("sdpa", "flex"):
        raise ValueError(
            f"backend={backend!r} cannot return attention weights (torch's fused kernels never "
            f"materialise them): use backend='math' or 'auto' with need_weights=True"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if mods or backend == "flex":
        check_mask("mask", mask, (*q.shape[:-1], k.shape[-2]), "the scores' shape")
        mods.check(q, k)
        return _attend_modified(
            q, k, v, mods, mask, is_causal, scale, dropout_p, need_weights, backend
        )
    use_math = backend == "math" or (backend == "auto" and need_weights)
    tq, tk = q.shape[-2], k.shape[-2]
    if tk == 0:  # no key at all: every row is empty
        out = q.new_zeros((*q.shape[:-1], v.shape[-1]))
        return (out, q.new_zeros((*q.shape[:-1], 0))) if need_weights else out

    if backend == "auto" and need_weights and q.is_cuda:
        if fused_weights.unsupported(q, k, v, mask, dropout_p) is None:
            backend = "fused"
    if backend == "fused":
        why = fused_weights.unsupported(q, k, v, mask, dropout_p)
        if why is not None:
            raise ValueError(
                f"backend='fused' cannot serve this call ({why}): use backend='math' or 'auto'"
            )
        check_mask("mask", mask, (*q.shape[:-1], tk), "the scores' shape")
        out, weights = fused_weights.fused_attention(
            q, k, v, mask=mask, is_causal=is_causal, scale=scale
        )
        return (out, weights) if need_weights else out
    if not use_math and mask is None and (not is_causal or tq == tk):
        # torch's own causal flag (top-left) is ours when T == S: no mask is built at all.
        return _sdpa(q, k, v, None, is_causal, scale, dropout_p)
    mask, keep = _prepare_mask(mask, is_causal, q, k)
    # Empty rows are zeroed with where, not masked_fill: where keeps the kernel's memory layout
    # when keep is the same for every head (a key, causal or (T, S) mask; torch's fused kernels
    # write (..., T, H, Dv) memory), so that the caller's move of the heads back beside each
    # other stays a view; masked_fill always copies to (..., H, T, Dv).
    if use_math:
        out, weights = kernels.math_attention(q, k, v, mask, scale, dropout_p)
        if keep is not None:
            out = torch.where(keep, out, 0.0)
            weights = torch.where(keep, weights, 0.0)
        return (out, weights) if need_weights else out
    out = _sdpa(q, k, v, mask, False, scale, dropout_p)
    if keep is not None:
        out = torch.where(keep, out, 0.0)
    return out


def _attend_modified(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mods: ScoreMods,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    dropout_p: float,
    need_weights: bool,
    backend: str,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`attention` under score modifications (checked), on the backend that can serve
    them; q's leading dims are flattened into one batch dim for them."""
    if backend == "fused":
        raise ValueError(
            "backend='fused' cannot apply score modifications (softcap, sinks, score_mod, "
            "block_mask): use backend='auto', 'math' or 'flex'"
        )
    only_blocks = mods.softcap is None and mods.sinks is None and mods.score_mod is None
    if backend == "sdpa":
        if not only_blocks:
            raise ValueError(
                "backend='sdpa' cannot apply softcap, sinks or a score_mod (torch's fused kernel "
                "takes a mask only): use backend='auto', 'math' or 'flex'"
            )
        # the block mask as a dense (B, H, T, S) bool mask: asked for by name, memory O(T·S)
        return attention(
            q,
            k,
            v,
            mask=combine_masks(mask, _dense_block_mask(mods, q, k)),
            is_causal=is_causal,
            scale=scale,
            dropout_p=dropout_p,
            backend="sdpa",
        )
    *lead, h, t, d = q.shape
    s, dv = k.shape[-2], v.shape[-1]
    batch = math.prod(lead)
    q4 = q.reshape(batch, h, t, d)  # (B, H, T, D)
    k4, v4 = k.reshape(batch, -1, s, d), v.reshape(batch, -1, s, dv)  # (B, Hk, S, D|Dv)
    if len(lead) != 1:
        mask = _flat_mask(mask, tuple(lead))
        if mods.sinks is not None and mods.sinks.dim() > 1:
            flat = mods.sinks.expand(*lead, h, t).reshape(batch, h, t)  # (B, H, T)
            mods = dataclasses.replace(mods, sinks=flat)
    if backend == "flex" or (
        backend == "auto" and q.is_cuda and not need_weights and dropout_p == 0
    ):
        if dropout_p > 0:
            raise ValueError(
                "backend='flex' has no dropout (FlexAttention has none): use backend='math' "
                "or 'auto', or dropout_p=0"
            )
        if (
            q.device.type == "cpu"
            and torch.is_grad_enabled()
            and any(x.requires_grad for x in (q, k, v))
        ):
            raise ValueError(
                "backend='flex' has no backward on the CPU (torch's FlexAttention has none "
                "there): use backend='math' or 'auto' for gradients"
            )
        compiled = q.is_cuda and not torch.compiler.is_compiling()
        fused = flex_forward(
            q4, k4, v4, mods, mask=mask, is_causal=is_causal, scale=scale, compiled=compiled
        )
        return fused.reshape(*lead, h, t, dv)
    out, weights = modified_attention(
        q4,
        k4,
        v4,
        mods,
        mask=mask,
        is_causal=is_causal,
        scale=scale,
        need_weights=need_weights,
        dropout_p=dropout_p,
    )
    assert out is not None
    out = out.reshape(*lead, h, t, dv)
    if not need_weights:
        return out
    assert weights is not None
    return out, weights.reshape(*lead, h, t, weights.shape[-1])


def _flat_mask(mask: Tensor | None, lead: tuple[int, ...]) -> Tensor | None:
    """A mask broadcastable to (*lead, H, T, S) as one broadcastable to (B, H, T, S), with
    B = prod(lead)."""
    if mask is None:
        return None
    tail = mask.shape[-3:] if mask.dim() >= 3 else (1,) * (3 - mask.dim()) + tuple(mask.shape)
    return mask.expand(*lead, *tail).reshape(math.prod(lead), *tail)


def _dense_block_mask(mods: ScoreMods, q: Tensor, k: Tensor) -> Tensor:
    """The block mask as a bool mask (B, H, T, S), q's leading dims restored."""
    *lead, h, t, _ = q.shape
    batch = math.prod(lead)
    device = q.device
    at = [torch.arange(n, device=device) for n in (batch, h, t, k.shape[-2])]
    allowed = mods.allowed(*at)
    assert allowed is not None
    return allowed.expand(batch, h, t, k.shape[-2]).reshape(*lead, h, t, k.shape[-2])
