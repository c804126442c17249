"""Score modifications: attention-logit softcapping, attention sinks, and FlexAttention's
``score_mod`` and ``block_mask``, applied to the scores of chosen heads and query rows.

Shapes: B batch (q's leading dims, flattened), H query heads, H' the chosen ones, Hk key/value
heads, T queries, R chosen query rows, S keys, D head dim, Dv value head dim.

For query i, key j of head h in batch b, with s = q_i · k_j · scale:

    s ← softcap · tanh(s / softcap)               softcap (Gemma-2: scale, then cap, then mask)
    s ← score_mod(s, b, h, i, j)                  score_mod (FlexAttention's signature)
    s ← s + mask, or −inf where a bool mask, the block mask or causality hides key j
    p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h))   sinks: one more key, whose value is 0

``score_mod`` and the block mask's ``mask_mod`` are called as FlexAttention calls them: mapped
with ``torch.vmap`` over (b, h, i, j), each index a 0-d int tensor, so a user's FlexAttention
functions work unchanged. A key in a block the block mask lists as full is allowed without
calling ``mask_mod``, one in a partial block where ``mask_mod`` says so, any other hidden:
FlexAttention's own rule.

The weights with sinks come in three conventions (``sink_weights``), all from the same
softmax over the keys and the sink:

- ``"dropped"``: the keys' shares p_j, the sink's dropped; rows sum to less than 1 (GPT-OSS,
  DeepSeek-V4, Flint, MiMo-V2-Flash, ...: what their eager attention returns);
- ``"column"``: the keys' shares and the sink's as a last column (S + 1 columns, rows sum to 1);
- ``"plain"``: the softmax over the keys alone, as if there were no sink (Granite-SWA's eager
  weights); the output is still the sink's: out = Σ_j p_j v_j.

:func:`modified_attention` computes out and weights a block of query rows at a time (memory
O(B · H' · rows · S)), for :func:`multihead.functional.attention` and for the rows that
:mod:`multihead.observe` recomputes under capture.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from multihead import kernels
from multihead._checks import check_choice, describe

__all__ = ["ScoreMods", "ScoreMod", "SINK_WEIGHTS", "modified_attention", "flex_forward"]

# score_mod(score, b, h, q_idx, kv_idx) -> score, FlexAttention's signature
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]

SINK_WEIGHTS: tuple[str, ...] = ("dropped", "column", "plain")

# Scores held per block of query rows: B · H' · rows · S float32 values at most (4 MiB).
_BLOCK_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class ScoreMods:
    """What changes the scores of one attention call (see the module docstring's formula).

    Attributes:
        softcap: c > 0: scores → c · tanh(scores / c), after the scale; None for none.
        sinks: one learned logit per query head, (H,), or per query, broadcastable to
            (..., H, T); None for none.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (FlexAttention's), or
            None.
        block_mask: a ``torch.nn.attention.flex_attention.BlockMask`` made for (T, S), or None.
        sink_weights: which weights a call with sinks reports: ``"dropped"``, ``"column"`` or
            ``"plain"`` (see the module docstring).

    Raises:
        TypeError, ValueError: an argument of the wrong type or value (named).
    """

    softcap: float | None = None
    sinks: Tensor | None = None
    score_mod: ScoreMod | None = None
    block_mask: BlockMask | None = None
    sink_weights: str = "dropped"

    def __post_init__(self) -> None:
        cap = self.softcap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise TypeError(f"softcap must be a positive float or None, got {describe(cap)}")
            if not (math.isfinite(cap) and cap > 0):
                raise ValueError(f"softcap must be a positive finite float, got {cap}")
            object.__setattr__(self, "softcap", float(cap))
        if self.sinks is not None:
            if not isinstance(self.sinks, Tensor) or not self.sinks.is_floating_point():
                raise TypeError(
                    f"sinks must be a floating point tensor (one logit per query head, (H,)) "
                    f"or None, got {describe(self.sinks)}"
                )
        if self.score_mod is not None and not callable(self.score_mod):
            raise TypeError(
                f"score_mod must be callable as score_mod(score, b, h, q_idx, kv_idx) or None, "
                f"got {describe(self.score_mod)}"
            )
        if self.block_mask is not None and not isinstance(self.block_mask, BlockMask):
            raise TypeError(
                f"block_mask must be a torch.nn.attention.flex_attention.BlockMask or None, "
                f"got {describe(self.block_mask)}"
            )
        check_choice("sink_weights", self.sink_weights, SINK_WEIGHTS)

    def __bool__(self) -> bool:
        """Whether anything changes the scores."""
        return any(
            x is not None for x in (self.softcap, self.sinks, self.score_mod, self.block_mask)
        )

    def check(self, q: Tensor, k: Tensor) -> None:
        """Check the modifications against q (..., H, T, D) and k (..., Hk, S, D).

        Raises:
            ValueError: sinks that do not broadcast to (..., H, T), a block mask made for
                other lengths, batch or heads, or on another device.
        """
        *lead, h, t, _ = q.shape
        s = k.shape[-2]
        if self.sinks is not None:
            sinks = self.sinks
            ok = sinks.dim() >= 1 and sinks.device == q.device
            if ok and sinks.dim() == 1:
                ok = sinks.shape[0] == h
            elif ok:
                try:
                    ok = torch.broadcast_shapes(sinks.shape, (*lead, h, t)) == (*lead, h, t)
                except RuntimeError:
                    ok = False
            if not ok:
                raise ValueError(
                    f"sinks must be one logit per query head, shape (H,) = ({h},), or broadcast "
                    f"to (..., H, T) = {(*lead, h, t)}, on q's device {q.device}; got shape "
                    f"{tuple(sinks.shape)} on {sinks.device}"
                )
        bm = self.block_mask
        if bm is not None:
            batch = math.prod(lead)
            mb, mh = bm.kv_num_blocks.shape[:2]
            if tuple(bm.seq_lengths) != (t, s):
                raise ValueError(
                    f"block_mask was made for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)}, but the "
                    f"call has T = {t} queries and S = {s} keys: make it for ({t}, {s})"
                )
            if mb not in (1, batch) or mh not in (1, h):
                raise ValueError(
                    f"block_mask has batch {mb} and heads {mh}; the call has B = {batch} and "
                    f"H = {h} (a block mask's batch and heads must be 1 or the call's)"
                )
            if bm.kv_num_blocks.device != q.device:
                raise ValueError(
                    f"block_mask is on {bm.kv_num_blocks.device}, q on {q.device}: one device"
                )

    def capped(self, scores: Tensor) -> Tensor:
        """``softcap · tanh(scores / softcap)`` (the module docstring's formula; the fused path
        of :func:`modified_attention` computes it through a sigmoid), or ``scores`` without a
        softcap."""
        return scores if self.softcap is None else self.softcap * torch.tanh(scores / self.softcap)

    def modify(self, scores: Tensor, b: Tensor, h: Tensor, rows: Tensor, keys: Tensor) -> Tensor:
        """score_mod applied to (softcapped) scores (B, H', R, S') of batches ``b`` (B,), heads
        ``h`` (H',), query rows ``rows`` (R,) and keys ``keys`` (S',), all int64."""
        if self.score_mod is not None:
            mapped = self.score_mod
            for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
                mapped = torch.vmap(mapped, in_dims=(0, *dims))
            mapped = torch.vmap(mapped, in_dims=(0, 0, None, None, None))
            modified = mapped(scores, b, h, rows, keys)
            if not isinstance(modified, Tensor) or modified.shape != scores.shape:
                got = (
                    f"a score of shape {tuple(modified.shape[scores.dim() :])}"
                    if isinstance(modified, Tensor)
                    else describe(modified)
                )
                raise ValueError(
                    f"score_mod must return one score (a 0-d tensor) for each score it is given, "
                    f"as FlexAttention calls it; it returned {got}"
                )
            # a broadcast view (s.expand(...)) shares memory between scores: the softmax
            # after works in place, so it gets scores of its own
            scores = modified if modified.is_contiguous() else modified.contiguous()
        return scores

    def allowed(self, b: Tensor, h: Tensor, rows: Tensor, keys: Tensor) -> Tensor | None:
        """(B or 1, H' or 1, R, S') bool: where the block mask lets query ``rows`` see
        ``keys`` (indices as for :meth:`modify`; ``keys`` = 0 .. S' − 1); None without a block
        mask."""
        bm = self.block_mask
        if bm is None:
            return None
        q_block, kv_block = bm.BLOCK_SIZE
        partial = _dense_blocks(bm.kv_num_blocks, bm.kv_indices, _blocks(keys, kv_block))
        qb, kb = rows // q_block, keys // kv_block
        bsel = b if partial.shape[0] != 1 else b[:1] * 0
        hsel = h if partial.shape[1] != 1 else h[:1] * 0

        def pick(table: Tensor) -> Tensor:  # (Bm, Hm, QB, KB) -> (B|1, H'|1, R, S')
            return table[bsel][:, hsel][:, :, qb][:, :, :, kb]

        mask_mod = bm.mask_mod
        mapped = mask_mod
        for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None)):
            mapped = torch.vmap(mapped, in_dims=dims)
        mapped = torch.vmap(mapped, in_dims=(0, None, None, None))
        seen = pick(partial) & mapped(b, h, rows, keys)  # (B, H', R, S')
        if bm.full_kv_num_blocks is not None:
            assert bm.full_kv_indices is not None
            full = _dense_blocks(bm.full_kv_num_blocks, bm.full_kv_indices, partial.shape[-1])
            seen = seen | pick(full)
        return seen

    def sink_logits(self, shape: tuple[int, int, int], h: Tensor, rows: Tensor) -> Tensor | None:
        """(B or 1, H', R, 1): the sink logits of heads ``h`` (H',) and query ``rows`` (R,) of a
        call whose scores are ``shape`` = (B, H, T) by query; None without sinks."""
        sinks = self.sinks
        if sinks is None:
            return None
        if sinks.dim() == 1:
            return sinks.index_select(0, h)[None, :, None, None]  # (1, H', 1, 1)
        full = sinks.expand(shape)  # (B, H, T), a view
        return full.index_select(1, h).index_select(2, rows).unsqueeze(-1)  # (B, H', R, 1)


def _blocks(keys: Tensor, size: int) -> int:
    """The number of key blocks of ``size`` that cover ``keys`` = 0 .. S' − 1 (read from its
    length: no value is read back from the device)."""
    return -(-len(keys) // size)


def _dense_blocks(num: Tensor, indices: Tensor, width: int) -> Tensor:
    """A block mask's (num_blocks, indices) as a dense (Bm, Hm, QB, width) bool table."""
    bm, hm, qb, n = indices.shape
    listed = torch.arange(n, device=num.device) < num[..., None]  # (Bm, Hm, QB, n)
    table = torch.zeros(bm, hm, qb, max(width, n) + 1, dtype=torch.bool, device=num.device)
    # unlisted slots point at the spare last column, which is dropped
    target = torch.where(listed, indices.long().clamp(max=max(width, n)), max(width, n))
    table.scatter_(-1, target, True)
    return table[..., :width]


def modified_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor | None,
    mods: ScoreMods,
    *,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    rows: Tensor | None = None,
    heads: Tensor | None = None,
    need_weights: bool = False,
    sink_weights: str | None = None,
    dropout_p: float = 0.0,
    block_rows: int | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """Attention under ``mods`` for chosen heads and query rows, a block of rows at a time.

    The module docstring's formula, in float32 at least, with autograd. A row that may attend to
    no key (by the mask, causality, the block mask or a score_mod that hides every key) gives
    zeros (with sinks: the whole row's share is the sink's). Causal blocks of rows skip the keys
    no row of theirs can see.

    Args:
        q: (B, H, T, D). k: (B, Hk, S, D); query head h reads key/value head h // (H // Hk).
        v: (B, Hk, S, Dv), or None for the weights alone.
        mods: the modifications, checked against q and k (:meth:`ScoreMods.check`); sinks
            (H,) or broadcastable to (B, H, T).
        mask: None, bool (True = may attend) or float (added), broadcastable to (B, H, T, S).
        is_causal: query i sees keys j <= i + (S − T) (bottom-right), ANDed with the masks.
        scale: the factor on the scores.
        rows: (R,) int64 query rows, default all T.
        heads: (H',) int64 query heads, default all H.
        need_weights: also return the weights.
        sink_weights: ``"dropped"``, ``"column"`` or ``"plain"``; default ``mods.sink_weights``.
        dropout_p: dropout on the weights the output is made of (the returned ones have none).
        block_rows: query rows per block; default as many as keep B · H' · rows · S near 1M.

    Returns:
        ``(out, weights)``: out (B, H', R, Dv), None when ``v`` is None; weights (B, H', R, S)
        (S + 1 with sinks and ``"column"``), None unless ``need_weights``; in q's dtype.
    """
    b, h, t, d = q.shape
    hk, s = k.shape[1], k.shape[2]
    device, dtype = q.device, q.dtype
    compute = torch.promote_types(dtype, torch.float32)
    convention = mods.sink_weights if sink_weights is None else sink_weights
    column = mods.sinks is not None and convention == "column"
    head_ids = torch.arange(h, device=device) if heads is None else heads
    row_ids = torch.arange(t, device=device) if rows is None else rows
    batch_ids = torch.arange(b, device=device)
    group = h // hk
    if heads is not None:  # each chosen head beside its own key/value head
        kv_heads = torch.div(heads, group, rounding_mode="floor")
        q, k = q.index_select(1, heads), k.index_select(1, kv_heads)
        v = v.index_select(1, kv_heads) if v is not None else None
        group = 1
    k = k.to(compute)
    v = v.to(compute) if v is not None else None
    m4 = mask
    if m4 is not None:
        m4 = m4.reshape((1,) * (4 - m4.dim()) + tuple(m4.shape))  # (B|1, H|1, T|1, S|1)
        if heads is not None and m4.shape[1] != 1:
            m4 = m4.index_select(1, heads)
    hq, r = len(head_ids), len(row_ids)
    step = block_rows or max(1, _BLOCK_ELEMENTS // max(1, b * hq * s))
    cap = mods.softcap if mods.softcap is not None else 1.0
    shifted = mods.score_mod is not None or mods.sinks is not None
    # all rows in order, causal and nothing else hiding keys, no row empty
    causal_only = is_causal and rows is None and m4 is None and mods.block_mask is None and t <= s
    outs: list[Tensor] = []
    # outside autograd, several blocks' outputs go straight into one buffer
    filled = None
    if v is not None and r > step and not (torch.is_grad_enabled() and _any_grad(q, k, v, mods)):
        filled = torch.empty(b, hq, r, v.shape[-1], dtype=dtype, device=device)
    weights: list[Tensor] = []
    for start in range(0, r, step):
        rc = row_ids[start : start + step]  # (Rc,)
        # a causal block of all rows in order sees no key past its last row's
        end = s if not (is_causal and rows is None) else min(s, max(1, start + len(rc) + s - t))
        if m4 is not None and m4.shape[3] != 1 and device.type == "cpu":
            # nor the keys past the last one the mask lets any row of the block see (an eager
            # model's causal or sliding-window float mask): read back on the CPU only
            seen = kernels.allowed(m4.index_select(2, rc) if m4.shape[2] != 1 else m4)
            last = seen.flatten(0, -2)[:, :end].any(0).nonzero()
            end = max(1, int(last[-1]) + 1) if len(last) else 1
        keys = torch.arange(end, device=device)
        # softcap · tanh(x) = 2 · softcap · sigmoid(2x) − softcap, and sigmoid costs a third of
        # tanh on the CPU; the 2/softcap rides on q's scale (one pass less)
        picked = q[:, :, start : start + len(rc)] if rows is None else q.index_select(2, rc)
        qc = picked.to(compute) * (scale * 2 / cap if mods.softcap is not None else scale)
        kc = k[:, :, :end]
        if group > 1:  # the query heads of one key head, stacked as rows, share its keys
            grouped = qc.reshape(b, hk, group * len(rc), d)  # (B, Hk, G·Rc, D)
            scores = torch.matmul(grouped, kc.transpose(-2, -1)).view(b, hq, len(rc), end)
        else:
            scores = torch.matmul(qc, kc.transpose(-2, -1))  # (B, H', Rc, S')
        if mods.softcap is not None:
            if _free(scores):
                scores = scores.sigmoid_().mul_(2 * cap)
            else:
                scores = torch.sigmoid(scores) * (2 * cap)
            if shifted:  # a softmax ignores the − softcap, a score_mod or a sink does not
                scores = scores.sub_(cap) if _free(scores) else scores - cap
        scores = mods.modify(scores, batch_ids, head_ids, rc, keys)
        m = None
        if causal_only and _free(scores):
            # every row of the block sees the keys before its first row's limit: only the keys
            # after it, a (Rc, Rc) triangle, are masked (no row is empty: T <= S)
            lo = min(end, start + s - t + 1)
            kernels.add_mask(scores[..., lo:end], kernels.causal_mask(t, s, rows=rc)[:, lo:end])
        elif is_causal:
            m = kernels.causal_mask(t, s, rows=rc)[:, :end]
        if m4 is not None:
            part = m4.index_select(2, rc) if m4.shape[2] != 1 else m4
            m = kernels.combine_masks(part[..., :end] if part.shape[3] != 1 else part, m)
        m = kernels.combine_masks(m, mods.allowed(batch_ids, head_ids, rc, keys))
        keep = None
        if m is not None:
            keep = kernels.allowed(m).any(-1, keepdim=True)  # (B|1, H'|1, Rc, 1)
            # an empty row is opened up (uniform), then zeroed: no softmax over nothing
            m = m | ~keep if m.dtype == torch.bool else m.masked_fill(~keep, 0.0)
            scores = kernels.add_mask(scores, m)
        if mods.score_mod is not None:  # a score_mod may hide every key of a row itself
            some = (scores != float("-inf")).any(-1, keepdim=True)
            scores = (
                scores.masked_fill_(~some, 0.0) if _free(scores) else scores.masked_fill(~some, 0.0)
            )
            keep = some if keep is None else keep & some
        lse = torch.logsumexp(scores, -1, keepdim=True) if mods.sinks is not None else None
        w = kernels.softmax_(scores)  # (B, H', Rc, S')
        if keep is not None:
            w = w.masked_fill_(~keep, 0.0) if _free(w) else torch.where(keep, w, 0.0)
        share = sink = None
        if lse is not None:
            sink = mods.sink_logits((b, h, t), head_ids, rc)
            assert sink is not None
            sink = sink.to(compute)
            share = torch.sigmoid(lse - sink)  # (B, H', Rc, 1): the keys' share, the sink's 1 − it
        if v is not None:
            used = F.dropout(w, p=dropout_p) if dropout_p > 0 else w
            vc = v[:, :, :end]
            if group > 1:
                o = torch.matmul(used.reshape(b, hk, group * len(rc), end), vc)
                o = o.view(b, hq, len(rc), vc.shape[-1])  # (B, H', Rc, Dv)
            else:
                o = torch.matmul(used, vc)  # (B, H', Rc, Dv)
            o = (o * share if share is not None else o).to(dtype)
            if filled is not None:  # written in place: no concatenation at the end
                filled[:, :, start : start + len(rc)] = o
            else:
                outs.append(o)
        if need_weights:
            wc = w * share if share is not None and convention != "plain" else w
            if end < s:
                wc = F.pad(wc, (0, s - end))  # the keys past causality: zero weight
            if column:
                assert sink is not None and lse is not None
                last = torch.sigmoid(sink - lse).expand(b, hq, len(rc), 1)
                wc = torch.cat([wc, last if keep is None else torch.where(keep, last, 1.0)], -1)
            weights.append(wc.to(dtype))
    width = s + 1 if column else s
    out = filled
    if v is not None and filled is None:
        out = _joined(outs, (b, hq, r, v.shape[-1]), dtype, device)
    weight = _joined(weights, (b, hq, r, width), dtype, device) if need_weights else None
    return out, weight


def _any_grad(q: Tensor, k: Tensor, v: Tensor, mods: ScoreMods) -> bool:
    """Whether a graph may be recorded: an input, the sinks or a score_mod's captures need one
    (a score_mod is opaque: assume it may)."""
    tensors = (q, k, v, mods.sinks)
    return mods.score_mod is not None or any(x is not None and x.requires_grad for x in tensors)


def _free(x: Tensor) -> bool:
    """Whether ``x`` may be overwritten: no autograd graph records it."""
    return not (torch.is_grad_enabled() and x.requires_grad)


def _joined(
    parts: list[Tensor], shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Blocks of rows (dim 2) as one tensor of ``shape``."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.cat(parts, dim=2)


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    """torch.compile'd FlexAttention, made once (each new shape or score_mod still compiles)."""
    return cast("Callable[..., Any]", torch.compile(flex_attention))


def flex_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mods: ScoreMods,
    *,
    mask: Tensor | None,
    is_causal: bool,
    scale: float,
    compiled: bool,
) -> Tensor:
    """Attention under ``mods`` by torch's FlexAttention, forward and backward, no weights.

    The mask and causality join the score_mod (FlexAttention's own masks are the block
    mask's); sinks rescale its output by the keys' share, exp(lse) / (exp(lse) + exp(sink)),
    from the log-sum-exp it returns.

    Args:
        q: (B, H, T, D). k: (B, Hk, S, D). v: (B, Hk, S, Dv). mods, mask, is_causal, scale: as
            for :func:`modified_attention`.
        compiled: run ``torch.compile(flex_attention)`` (FlexAttention's fused kernel) rather
            than its unfused reference.

    Returns:
        out (B, H, T, Dv) in q's dtype.
    """
    b, h, t, _ = q.shape
    s = k.shape[2]
    m4 = mask
    if m4 is not None:
        m4 = m4.reshape((1,) * (4 - m4.dim()) + tuple(m4.shape))  # (B|1, H|1, T|1, S|1)
        if m4.dtype != torch.bool:  # kernels.allowed's rule: what it hides is −inf here
            m4 = torch.where(kernels.allowed(m4), m4, float("-inf"))
    cap, user = mods.softcap, mods.score_mod

    def score_mod(score: Tensor, bi: Tensor, hi: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
        if cap is not None:
            score = torch.tanh(score / cap) * cap
        if user is not None:
            score = user(score, bi, hi, qi, ki)
        if m4 is not None:
            at = [i if n > 1 else 0 for i, n in zip((bi, hi, qi, ki), m4.shape, strict=True)]
            value = m4[at[0], at[1], at[2], at[3]]
            if value.dtype == torch.bool:
                score = torch.where(value, score, float("-inf"))
            else:
                score = score + value
        if is_causal:
            score = torch.where(ki <= qi + (s - t), score, float("-inf"))
        return score

    run = _compiled_flex() if compiled else cast("Callable[..., Any]", flex_attention)
    with warnings.catch_warnings():
        # the unfused reference is asked for by name: its warning that it is unfused is noise
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        result = run(
            q,
            k,
            v,
            score_mod=score_mod,
            block_mask=mods.block_mask,
            scale=scale,
            enable_gqa=h != k.shape[1],
            return_aux=AuxRequest(lse=True) if mods.sinks is not None else None,
        )
    if mods.sinks is None:
        return cast(Tensor, result)
    out, aux = result
    every = torch.arange(h, device=q.device)
    sink = mods.sink_logits((b, h, t), every, torch.arange(t, device=q.device))
    assert sink is not None and aux.lse is not None
    share = torch.sigmoid(aux.lse.unsqueeze(-1) - sink.to(aux.lse.dtype))  # (B, H, T, 1)
    return (out * share).to(q.dtype)
