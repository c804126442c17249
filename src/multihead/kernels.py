"""The attention math, once: the readable formula and block attention with its log-sum-exp.

Shapes: B batch, H query heads, Hk key/value heads (H a multiple of Hk), T queries, S keys,
D head dim, Dv value head dim.

- :func:`causal_mask` (bottom-right) and :func:`allowed` (which keys a mask lets a query see) are
  the two mask rules, each spelled once here and read everywhere else.
- :func:`math_attention` is the formula the tutorials teach, softmax(q kᵀ · scale + mask) · v,
  written to be read; it is the only place attention weights are made.
- :func:`block_attention` (section below) computes one block of keys with the log-sum-exp of its
  scores, :func:`merge_block` folds blocks together, and :func:`block_attention_backward` gives
  a block's gradients: ring attention is built from these three.

This module imports nothing from multihead: it sits below :mod:`multihead.functional`. It is the
only module of the package allowed a private torch API; each use says why on the line above it,
and has a public fallback (the explicit formula) that the tests run too.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "allowed",
    "causal_mask",
    "combine_masks",
    "add_mask",
    "scaled_weights",
    "scaled_scores",
    "math_attention",
    "softmax_",
    "block_attention",
    "block_attention_backward",
    "merge_block",
]


def allowed(mask: Tensor) -> Tensor:
    """Where a mask lets a query see a key: the one rule by which every mask is read.

    A bool mask is True where allowed. A float mask (added to the scores) hides a key where it
    is -inf or at most half its dtype's lowest value: eager-style masks write
    ``torch.finfo(dtype).min`` there, which gives the key exactly zero weight beside any key
    the rule allows. Other finite values, however negative (-1e9), are ordinary addends, and NaN
    is allowed (it propagates). A row with no allowed key is empty
    (:func:`multihead.functional.attention` gives it zeros).

    Args:
        mask: bool or floating point, any shape.

    Returns:
        A bool tensor of ``mask``'s shape.
    """
    if mask.dtype == torch.bool:
        return mask
    return ~(mask <= torch.finfo(mask.dtype).min / 2)


def causal_mask(
    query_len: int,
    key_len: int,
    *,
    rows: Tensor | None = None,
    device: torch.device | str | None = None,
) -> Tensor:
    """The causal rule, bottom-right aligned: the one place it is spelled.

    Query i may attend to key j when j <= i + (key_len - query_len): the last query sees every
    key, as it does when the first ``key_len - query_len`` keys come from a cache.

    Args:
        query_len: T, the number of queries.
        key_len: S, the number of keys.
        rows: (R,) int64 query positions (of T) to build the mask for; default all T of them.
            Observers that recompute a few rows use it: never a (T, S) buffer for them.
        device: where to build the mask (default: ``rows``'s device, else the CPU).

    Returns:
        A bool tensor (T, S), or (R, S) for ``rows``, True where attending is allowed.

    Example:
        >>> causal_mask(2, 3).int()
        tensor([[1, 1, 0],
                [1, 1, 1]], dtype=torch.int32)
    """
    if rows is None:
        rows = torch.arange(query_len, device=device)
    keys = torch.arange(key_len, device=rows.device)
    return keys <= (rows + (key_len - query_len))[:, None]  # (R, S)


def combine_masks(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Both masks at once: a key is allowed when both allow it.

    Bool masks are ANDed; a bool mask on a float one puts -inf where the bool mask is False; two
    float masks add. Shapes broadcast.

    Args:
        a, b: None, bool (True = may attend) or float (added to the scores) masks.

    Returns:
        The combined mask, or None when both are None.
    """
    if a is None:
        return b
    if b is None:
        return a
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        if torch.broadcast_shapes(a.shape, b.shape) == a.shape:
            return a.masked_fill(~b, float("-inf"))
        # the bool mask is the wider one (a bias per key (B, H, 1, S), a causal (T, S) mask)
        return torch.where(b, a, float("-inf"))
    return a + b


def softmax_(scores: Tensor) -> Tensor:
    """Softmax over the last dimension, in place when no autograd graph is recorded.

    At long sequence lengths a fresh (T, S) buffer per step costs more (allocation, page faults)
    than its arithmetic, so outside autograd the probabilities overwrite the scores.

    Args:
        scores: (..., T, S), floating point.

    Returns:
        The softmax probabilities, (..., T, S): ``scores`` itself when written in place.
    """
    if torch.is_grad_enabled() and scores.requires_grad:
        return torch.softmax(scores, dim=-1)
    try:
        # Private: aten's softmax with out= is torch.softmax's own fused kernel writing in place;
        # torch has no public in-place softmax.
        return torch._softmax(scores, -1, False, out=scores)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - another torch
        return torch.softmax(scores, dim=-1)


def add_mask(scores: Tensor, mask: Tensor) -> Tensor:
    """scores (..., T, S) with ``mask`` applied: -inf where a bool mask is False, a float mask
    added. In place when no graph is recorded (see :func:`softmax_`)."""
    in_place = not (torch.is_grad_enabled() and scores.requires_grad)
    if mask.dtype == torch.bool:
        if in_place:
            return scores.masked_fill_(~mask, float("-inf"))
        return scores.masked_fill(~mask, float("-inf"))
    if in_place and not mask.requires_grad:
        return scores.add_(mask.to(scores.dtype))
    return scores + mask.to(scores.dtype)


def scaled_weights(q: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q kᵀ + mask) over the keys: the formula's weights, for a q that already carries
    the scale (in place outside autograd, see :func:`softmax_`).

    The one spelling of the weights: :func:`math_attention` computes its own with it, and
    :mod:`multihead.observe` the rows it recomputes beside a fused forward.

    Args:
        q: (..., H, T, D), scaled, in the dtype the scores are to be computed in (float32 at
            least for an exact softmax).
        k: (..., Hk, S, D), the same dtype; query head h reads key head h // (H // Hk).
        mask: None, bool (True = may attend) or float (added), broadcastable to (..., H, T, S).

    Returns:
        The weights (..., H, T, S), in q's dtype. A row the mask empties is NaN (bool) or even
        (float): the caller decides what an empty row gives.
    """
    scores = scaled_scores(q, k)
    if mask is not None:
        scores = add_mask(scores, mask)
    return softmax_(scores)


def scaled_scores(q: Tensor, k: Tensor) -> Tensor:
    """q kᵀ (..., H, T, S), for a q that already carries the scale: the scores before any mask,
    with q and k as for :func:`scaled_weights` (query head h reads key head h // (H // Hk))."""
    h, hk = q.shape[-3], k.shape[-3]
    if hk != h:
        # The query heads of one key head, stacked as rows, multiply its keys once: no copy of
        # the keys per query head.
        *lead, _, t, d = q.shape
        grouped = q.reshape(*lead, hk, (h // hk) * t, d)  # (..., Hk, G·T, D)
        return torch.matmul(grouped, k.transpose(-2, -1)).view(*lead, h, t, k.shape[-2])
    return torch.matmul(q, k.transpose(-2, -1))  # (..., H, T, S)


def _dense(x: Tensor, dtype: torch.dtype, copy: bool = False) -> Tensor:
    """``x`` in ``dtype``, laid out densely in its own dim order; copied only where needed, or
    always with ``copy``. (A same-dtype ``clone`` copies a strided view much faster than
    ``to(memory_format=...)`` does.)"""
    if x.dtype != dtype:
        return x.to(dtype, memory_format=torch.contiguous_format)
    return x.clone(memory_format=torch.contiguous_format) if copy else x.contiguous()


def math_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    scale: float,
    dropout_p: float = 0.0,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + mask) · v, spelled out.

    Scores and softmax run in float32 at least, so half-precision inputs keep an exact softmax.
    The caller has checked the arguments and made sure no row is fully masked (see
    :func:`multihead.functional.attention`).

    Args:
        q: (..., H, T, D). k: (..., Hk, S, D). v: (..., Hk, S, Dv); query head h reads key/value
            head h // (H // Hk).
        mask: None, bool (True = may attend) or float (added to the scores), broadcastable to
            (..., H, T, S).
        scale: the factor on the scores.
        dropout_p: dropout on the weights (applied when > 0).

    Returns:
        ``(out, weights)``: out (..., H, T, Dv) and the softmax weights (..., H, T, S) before
        dropout, both in q's dtype.
    """
    dtype = q.dtype
    h, hk = q.shape[-3], k.shape[-3]
    compute = torch.promote_types(q.dtype, torch.float32)
    # Batched matmul merges the leading dims into one batch dim. Heads split off a projection,
    # (..., T, H, D) seen as (..., H, T, D), cannot merge, so matmul would copy each operand
    # itself, k through a slow transposing copy: one dense copy of each, made here, is cheaper.
    # The scale rides on q's copy (always a copy), a (T, D) pass rather than one over (T, S).
    graph_q = torch.is_grad_enabled() and q.requires_grad
    if q.dtype == compute and not graph_q:  # the scale written with the copy: one pass, not two
        q = torch.mul(q, scale, out=torch.empty(q.shape, dtype=compute, device=q.device))
    else:  # half q: converted first, so that the scale is applied in float32
        q = _dense(q, compute, copy=True).mul_(scale)  # (..., H, T, D)
    k, v = _dense(k, compute), _dense(v, compute)  # grouped heads keep their Hk heads
    weights = scaled_weights(q, k, mask)  # (..., H, T, S)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    # (..., H, T, S) x (..., Hk, S, Dv) -> (..., H, T, Dv): the query heads of one key/value
    # head, stacked as rows, multiply its values once (no copy of the values per query head)
    *lead, _, t, s = dropped.shape
    grouped = dropped.reshape(*lead, hk, (h // hk) * t, s)  # (..., Hk, G·T, S)
    graph = torch.is_grad_enabled() and (dropped.requires_grad or v.requires_grad)
    if (*dropped.shape[:-1], v.shape[-1]) == q.shape and not graph:
        # Outside autograd the output takes q's copy, done with: one large buffer fewer.
        out = torch.matmul(grouped, v, out=q.view(*lead, hk, (h // hk) * t, q.shape[-1]))
    else:
        out = torch.matmul(grouped, v)
    return out.view(*lead, h, t, v.shape[-1]).to(dtype), weights.to(dtype)


# -- blocks with log-sum-exp (ring attention) -----------------------------------------------------

# True: blocks run torch's CPU flash kernels where they can; tests set it False to run the
# explicit formula (the public fallback) on CPU as well.
_USE_CPU_FLASH = True

_NEG_INF = float("-inf")


def _use_cpu_flash(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether torch's CPU flash kernels can serve this block; if not, the formula does."""
    return (
        _USE_CPU_FLASH
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and q.shape[-1] == v.shape[-1]  # the kernels take one head dim for keys and values
        and k.shape[-2] > 0
        # their causal mask is top-left aligned, which agrees with ours only when T == S
        and (not causal or q.shape[-2] == k.shape[-2])
        and _cpu_flash_available()
    )


@functools.cache
def _cpu_flash_available() -> bool:
    """Whether this torch has the CPU flash kernels (private: they may go, the formula stays)."""
    forward = "_scaled_dot_product_flash_attention_for_cpu"
    return all(hasattr(torch.ops.aten, name) for name in (forward, forward + "_backward"))


@functools.cache
def _cpu_flash_groups_heads() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads."""
    q = torch.zeros(1, 2, 1, 1)
    # One key/value head viewed out of two: a kernel that ignores the head count (torch 2.5 does,
    # with no error) reads the second from memory that exists, and shows it by its value.
    kv = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1)
    try:
        # private API: only a call tells if this torch's kernel groups heads; fallback: repeat k, v
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv[:, :1], kv[:, :1])[0]
    except RuntimeError:
        return False
    return bool(out.eq(1.0).all())  # both query heads read key/value head 0


def _unit_last_stride(x: Tensor) -> Tensor:
    """``x``, copied only when its last dimension is not dense (stride 1).

    The CPU flash kernels read every row of q, k, v and out as a dense vector and, given another
    stride, silently read the wrong memory (public SDPA makes rows dense before calling them).
    Strides of the other dimensions, expanded ones (stride 0) included, they honour.
    """
    return x if x.stride(-1) == 1 else x.contiguous()


def _no_empty_rows(lse: Tensor) -> Tensor:
    """``lse`` with −inf (a row that sees no key) replaced by 0, to subtract from scores: then
    exp(−inf − 0) = 0 gives the row zero weights where exp(−inf − (−inf)) would give NaN."""
    return lse.masked_fill(lse == _NEG_INF, 0.0)


def _grouped(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One block's scores, with the query heads grouped by the key/value head they read.

    Returns q5 (B, Hk, G, T, D), k5 (B, Hk, 1, S, D), v5 (B, Hk, 1, S, Dv) and scores
    (B, Hk, G, T, S), G = H / Hk, −inf where ``causal`` hides a key; all in float32 at least.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    compute = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(b, hk, h // hk, t, d).to(compute)  # (B, Hk, G, T, D)
    k5 = k.to(compute).unsqueeze(2)  # (B, Hk, 1, S, D): shared by the group without a copy
    v5 = v.to(compute).unsqueeze(2)  # (B, Hk, 1, S, Dv)
    scores = torch.matmul(q5, k5.transpose(-2, -1)) * scale  # (B, Hk, G, T, S)
    if causal:
        scores.masked_fill_(~causal_mask(t, s, device=q.device), _NEG_INF)
    return q5, k5, v5, scores


def block_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention over one block of keys, with the log-sum-exp of its scores.

    With scores S = q kᵀ·scale (−inf where ``causal`` hides a key):

        lse = log Σ_j exp(S_j),   out = Σ_j exp(S_j − lse) · v_j

    so that blocks computed apart merge exactly (:func:`merge_block`). A query row that sees no
    key (``causal`` with T > S) gives out = 0 and lse = −inf.

    Args:
        q: (B, H, T, D).
        k: (B, Hk, S, D); H must be a multiple of Hk.
        v: (B, Hk, S, Dv). q, k, v: one floating dtype, one device, any strides.
        causal: query i sees keys j <= i + (S − T) (bottom-right aligned).
        scale: the factor on the scores, e.g. 1 / sqrt(D).

    Returns:
        out (B, H, T, Dv) in q's dtype, and lse (B, H, T) in float32 (float64 for float64 input).
    """
    if _use_cpu_flash(q, k, v, causal):
        group = q.shape[1] // k.shape[1]
        if group > 1 and not _cpu_flash_groups_heads():
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q, k, v = _unit_last_stride(q), _unit_last_stride(k), _unit_last_stride(v)
        # private API: the one CPU kernel that returns lse beside out; fallback: the formula below
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse
    b, h, t, _ = q.shape
    _, _, v5, scores = _grouped(q, k, v, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hk, G, T)
    probs = torch.exp(scores - _no_empty_rows(lse).unsqueeze(-1))  # (B, Hk, G, T, S)
    out = torch.matmul(probs, v5)  # (B, Hk, G, T, S) x (B, Hk, 1, S, Dv) -> (B, Hk, G, T, Dv)
    return out.reshape(b, h, t, v.shape[-1]).to(q.dtype), lse.reshape(b, h, t)


def block_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the gradients, given the output and log-sum-exp over *all* keys.

    Flash-attention-2's backward. With out and lse over all keys (this block's and others'),
    P = exp(q kᵀ·scale − lse) is this block's columns of the softmax over all keys, and

        Δ = rowsum(dout ⊙ out),   dv = Pᵀ dout,   dS = P ⊙ (dout vᵀ − Δ),
        dq = dS k · scale,        dk = dSᵀ q · scale.

    Summed over all key blocks, dq is exact; each block's dk and dv are exact for its keys' share
    of these queries. Given a single block's own (out, lse), this is its plain gradient.

    Args:
        dout: (B, H, T, Dv), the gradient of the loss with respect to out.
        q, k, v: as in :func:`block_attention`.
        out: (B, H, T, Dv), the attention output over all keys, in q's dtype.
        lse: (B, H, T), the log-sum-exp of the scores over all keys (float32 at least).
        causal, scale: as in :func:`block_attention`.

    Returns:
        dq (B, H, T, D), dk (B, Hk, S, D), dv (B, Hk, S, Dv) in the dtypes of q, k and v.
    """
    hk = k.shape[1]
    group = q.shape[1] // hk
    if _use_cpu_flash(q, k, v, causal):
        expand = group > 1 and not _cpu_flash_groups_heads()
        ke, ve = (
            (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if expand else (k, v)
        )
        dout, q, ke, ve, out = (_unit_last_stride(x) for x in (dout, q, ke, ve, out))
        # private API: the only CPU backward that starts from a given (out, lse); fallback: below
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse.contiguous(), 0.0, causal, scale=scale
        )
        if expand:
            dk = dk.unflatten(1, (hk, group)).sum(2)  # (B, H, S, D) -> (B, Hk, S, D)
            dv = dv.unflatten(1, (hk, group)).sum(2)
        return dq, dk, dv
    b, h, t, d = q.shape
    dv_dim = v.shape[-1]
    q5, k5, v5, scores = _grouped(q, k, v, scale, causal)
    do5 = dout.reshape(b, hk, group, t, dv_dim).to(q5.dtype)  # (B, Hk, G, T, Dv)
    o5 = out.reshape(b, hk, group, t, dv_dim).to(q5.dtype)  # (B, Hk, G, T, Dv)
    l5 = _no_empty_rows(lse.reshape(b, hk, group, t, 1).to(q5.dtype))  # (B, Hk, G, T, 1)
    probs = torch.exp(scores - l5)  # (B, Hk, G, T, S)
    grad_v = torch.matmul(probs.transpose(-2, -1), do5).sum(2)  # (B, Hk, S, Dv)
    delta = (do5 * o5).sum(-1, keepdim=True)  # (B, Hk, G, T, 1)
    ds = probs * (torch.matmul(do5, v5.transpose(-2, -1)) - delta)  # (B, Hk, G, T, S)
    grad_q = torch.matmul(ds, k5) * scale  # (B, Hk, G, T, D)
    grad_k = torch.matmul(ds.transpose(-2, -1), q5).sum(2) * scale  # (B, Hk, S, D)
    return grad_q.reshape(b, h, t, d).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def merge_block(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """Fold one block's (out, lse) into a running (out, lse), in place: the log-sum-exp rule.

        m = logaddexp(lse_acc, lse_blk)
        out_acc ← out_acc · exp(lse_acc − m) + out_blk · exp(lse_blk − m),   lse_acc ← m

    (Liu et al., 2023, "Ring Attention with Blockwise Transformers"). An empty accumulator
    (out = 0, lse = −inf) takes the block as it is; a row that neither side has a key for stays
    empty (out = 0, lse = −inf) instead of turning NaN.

    Args:
        out_acc: (..., T, Dv), updated in place; keep it in float32 at least.
        lse_acc: (..., T), updated in place, in out_acc's dtype.
        out_blk: (..., T, Dv), from :func:`block_attention` (any floating dtype).
        lse_blk: (..., T), from :func:`block_attention`.
    """
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    base = _no_empty_rows(lse_new)
    out_acc.mul_(torch.exp(lse_acc - base).unsqueeze(-1).to(out_acc.dtype))
    out_acc.addcmul_(out_blk, torch.exp(lse_blk - base).unsqueeze(-1).to(out_acc.dtype))
    lse_acc.copy_(lse_new)
