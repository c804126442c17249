"""Blocked attention with an online softmax, compiled by torch.compile: the ``"blocked"`` backend.

``multihead.functional.attention(..., backend="blocked")`` (or ``"auto"`` where it pays) ends up
here; call that, not this module, unless you want to choose block sizes yourself. Inputs are
validated by ``attention()``; :func:`blocked_attention` trusts them.

The algorithm is FlashAttention's forward pass, written with torch ops. Queries are cut into
blocks of ``block_q`` rows and keys into blocks of ``block_k`` columns. For each query block a
running row maximum ``m``, a running denominator ``l`` and an unnormalised output ``acc`` (all
float32) meet the key blocks one at a time::

    s     = q_blk k_blkᵀ · scale + mask_blk          (T_b, S_b) scores of this pair of blocks
    m'    = max(m, rowmax(s))
    p     = exp(s - m')                              unnormalised weights of this key block
    l'    = l · exp(m - m') + rowsum(p)
    acc'  = acc · exp(m - m') + p v_blk
    out   = acc / l                                  after the last key block (0 where l = 0)

so the working set is a (T_b, S_b) tile whatever the sequence length, and nothing of size
(T, S) is ever stored. One call of the compiled function :func:`_block_step` does one pair of
blocks for every batch entry and head at once; a plain Python loop walks the pairs, which keeps
the compiled graph free of the sequence length.

Details that keep it exact:

- Grouped-query heads: the G = H // Hk query heads that read one key/value head are stacked into
  one (G·T_b, D) operand, so each key/value block is read once per group and never repeated.
- Causal (bottom-right, query i sees keys j <= i + S - T): key blocks wholly above the diagonal
  are never visited, blocks wholly below it take no mask, and the blocks the diagonal crosses
  add a small (G·T_b, S_b) 0 / -inf tile built for that block (no (T, S) mask is built; an
  index comparison inside the kernel measured a third slower per step).
- Masks: a key mask (broadcast over heads and queries, e.g. (B, 1, 1, S)) becomes an additive
  float32 bias of size (B·Hk, S) once; any other mask is sliced per pair of blocks. Bool masks
  become 0 / -inf biases.
- A row whose scores are all -inf keeps ``m = -inf``; ``m`` is replaced by 0 inside the
  exponentials so ``exp(-inf - -inf)`` never produces NaN, and ``l`` stays 0, which the final
  division turns into a zero row: fully masked rows give zeros, as everywhere in the package.

Precision: scores, softmax statistics and the output accumulate in float32 (float64 for float64
inputs). The two matmuls per pair run in ``matmul_dtype``: by default float32 (bfloat16 and float16
convert to it exactly, and the scale is folded into q in float32), because on the CPU measured
(Intel Xeon with avx512_bf16 but no AMX) a float32 GEMM ran about twice as fast as a bfloat16
one: 2048² matmuls on one thread, 145–154 against 82 GFLOP/s. Pass ``matmul_dtype=torch.bfloat16``
to run the bfloat16 units instead (on CPUs where they are fast), at the cost of rounding each
score tile and q·scale to bfloat16.

Compilation: the block step is compiled with ``dynamic=True`` the first time it is needed (never
on import) and cached per (matmul dtype, accumulation dtype, mask kind: key-or-none / full),
each in its own code object so that one kind's recompiles never count against another's recompile
limit. Sequence lengths, batch size, head counts and head dims are symbolic, so changing them
does not recompile; the loop pads a block of one query row or one key to two (dynamo specialises
sizes of 1), runs under ``inference_mode`` whatever the caller's grad mode, and turns duck sizing
off, so the only remaining second compile is for B·Hk = 1. Measured cost of one compile on the
2-core machine: 10–20 s wall cold (up to about 90 s while other jobs shared the cores), 1–7 s
with inductor's on-disk cache warm; it is logged at debug level on the ``multihead.blocked``
logger.

Speed (benchmarks/bench_bf16.py, B=4, H=8, D=64, bfloat16, against torch's fused kernel in
bfloat16): measured as CPU time on one thread, the blocked backend runs at 0.88–1.12× the speed
of torch's kernel without a mask and 1.11–1.16× causal (T = 512 … 8192; 70–79 GFLOP/s at
T >= 2048, 85–95% of the one-thread bf16 GEMM peak), not the 1.8× issue 7 aimed for. The premise
did not hold on this CPU: torch's bf16 kernel already reaches about 85% of the bf16 GEMM peak,
and the float32 units the blocked backend uses lose most of their 2× edge in the softmax passes
and per-block overheads that a hand-written kernel would fuse (torch's own kernel on float32
inputs does better still: 99–118 GFLOP/s). With two threads on a machine shared with other jobs,
each block's several parallel regions wait at barriers for a descheduled thread, and wall-clock
times swing between 0.06× and 2.7× torch's from run to run; torch's single parallel region per
call is far steadier. Hence ``functional.BLOCKED_MIN_WORK`` is None: ``"auto"`` does not pick this
backend unless told to.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import time
import types
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "BLOCK_Q",
    "BLOCK_K",
    "blocked_attention",
    "unavailable_reason",
]

_LOG = logging.getLogger(__name__)

BLOCK_Q = 128
"""Default number of query rows per block (per head)."""
BLOCK_K = 256
"""Default number of keys per block."""

MaskKind = Literal["key", "full"]


# -- availability ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cxx_compiler() -> str | None:
    """The C++ compiler inductor would use, or None when it finds none on PATH.

    Mirrors ``torch._inductor.cpp_builder.get_cpp_compiler`` on Linux/macOS: ``$CXX`` first, then
    ``torch._inductor.config.cpp.cxx`` (``(None, "g++")`` by default), without importing inductor.
    """
    candidates: list[str] = []
    if os.environ.get("CXX"):
        candidates.append(os.environ["CXX"])
    try:
        from torch._inductor import config as inductor_config

        configured = inductor_config.cpp.cxx
        names = configured if isinstance(configured, (list, tuple)) else (configured,)
        candidates.extend(name for name in names if name)
    except Exception:  # inductor missing or reorganised: fall back to the usual names
        candidates.extend(["g++", "clang++"])
    for name in candidates:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def unavailable_reason(q: Tensor) -> str | None:
    """Why the blocked backend cannot run for inputs like ``q`` here, or None when it can.

    The reasons are about the machine and device, not the request: torch.compile missing or
    unsupported, no C++ compiler for inductor's CPU code, or a non-CPU tensor.

    Args:
        q: any of the inputs; only its device is read.

    Returns:
        A sentence naming what is missing, or None.
    """
    if q.device.type != "cpu":
        return f"the blocked backend runs on CPU only, got tensors on {q.device}"
    if not hasattr(torch, "compile"):
        return "the blocked backend needs torch.compile, which this torch does not have"
    try:
        if not torch._dynamo.is_dynamo_supported():
            return "torch.compile (dynamo) is not supported on this Python/platform"
    except Exception as exc:  # a broken dynamo install is a reason too
        return f"torch.compile (dynamo) is unusable: {exc}"
    if _cxx_compiler() is None:
        return (
            "the blocked backend compiles its kernel with torch.compile, which needs a C++ "
            "compiler (g++ or clang++, or $CXX) on PATH, and none was found"
        )
    return None


# -- the compiled block step ----------------------------------------------------------------------


def _block_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor,
    tile: Tensor,
    m: Tensor,
    l_run: Tensor,
    acc: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One (query block, key block) pair of the online softmax, for all batch entries and heads.

    R = G·Tb rows: the Tb queries of each of the G heads that share a key/value head, stacked.
    Every shape is a plain (N, R, ·) so that dynamo sees few distinct layouts.

    Args:
        q: (N, R, D) queries, already multiplied by the scale, in the matmul dtype; N = B·Hk.
        k: (N, Sb, D) keys in the matmul dtype.
        v: (N, Sb, Dv) values in the matmul dtype.
        bias: (N, 1, Sb) or (N, R, Sb) in the accumulation dtype, added to the scores (0 / -inf
            for bool masks).
        tile: (R, Sb), added too: the causal diagonal (0 / -inf) where it crosses the block,
            zeros elsewhere. An additive tile shared by all N costs less than comparing indices
            in the kernel (measured: about a third of the step's time).
        m: (N, R, 1) running row maximum (-inf before the first key).
        l_run: (N, R, 1) running softmax denominator (the papers' l).
        acc: (N, R, Dv) running unnormalised output.

    Returns:
        The updated ``(m, l_run, acc)``.
    """
    # (N, R, D) x (N, D, Sb) -> (N, R, Sb)
    scores = torch.bmm(q, k.transpose(1, 2)).to(acc.dtype) + bias + tile
    m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
    # A row that has seen only -inf keeps m = -inf; shift by 0 there so no exp(-inf + inf).
    m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
    p = torch.exp(scores - m_safe)  # (N, R, Sb)
    alpha = torch.exp(m - m_safe)  # (N, R, 1), 0 on the first visit
    l_new = l_run * alpha + p.sum(dim=-1, keepdim=True)
    # (N, R, Sb) x (N, Sb, Dv) -> (N, R, Dv)
    acc_new = acc * alpha + torch.bmm(p.to(v.dtype), v).to(acc.dtype)
    return m_new, l_new, acc_new


StepFn = Callable[..., tuple[Tensor, Tensor, Tensor]]


@functools.cache
def _compiled_step(matmul_dtype: torch.dtype, acc_dtype: torch.dtype, kind: MaskKind) -> StepFn:
    """torch.compile'd :func:`_block_step`, one per (dtypes, mask kind), created on first use.

    Each gets a copy of the function's code object: dynamo keeps its cache and its recompile
    count per code object, so the kinds never evict each other or share one recompile limit.
    """
    del acc_dtype  # part of the cache key only
    name = f"_block_step_{str(matmul_dtype).removeprefix('torch.')}_{kind}"
    code = _block_step.__code__.replace(co_name=name, co_qualname=name)
    fn = types.FunctionType(code, _block_step.__globals__, name)
    compiled = torch.compile(fn, dynamic=True)
    first = [True]

    def step(*args: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not first[0]:
            return compiled(*args)
        start = time.perf_counter()
        result = compiled(*args)
        first[0] = False
        _LOG.debug("compiled %s in %.1f s", name, time.perf_counter() - start)
        return result

    return step


# -- the loop over blocks -------------------------------------------------------------------------


def _as_batched(t: Tensor, lead: tuple[int, ...], rest: tuple[int, ...]) -> Tensor:
    """``t`` (broadcastable to (*lead, *rest)) as a (B, *rest) view, B = prod(lead)."""
    t = t.expand(*lead, *rest)
    if len(lead) == 1:
        return t
    if len(lead) == 0:
        return t.unsqueeze(0)
    return t.reshape(-1, *rest)  # copies only when several broadcast leading dims can't merge


def _is_key_mask(mask: Tensor) -> bool:
    """True when ``mask`` broadcasts over heads and queries: shape (..., 1, 1, S) or (S,)."""
    return mask.dim() == 1 or (mask.shape[-2] == 1 and (mask.dim() == 2 or mask.shape[-3] == 1))


def _shape_config() -> contextlib.AbstractContextManager[object]:
    """Dynamo's shape settings while the compiled step runs (and compiles): no duck sizing."""
    from torch.fx.experimental import _config as fx_config

    return fx_config.patch(use_duck_shape=False)  # type: ignore[attr-defined]


def _padded(t: Tensor, dim: int, value: float) -> Tensor:
    """A contiguous copy of ``t``, no view of anything, with size >= 2 along ``dim``.

    The rows added (at most one) hold ``value``.
    """
    if t.shape[dim] >= 2:
        return t.clone(memory_format=torch.contiguous_format)
    shape = list(t.shape)
    shape[dim] = 2
    out = torch.full(shape, value, dtype=t.dtype, device=t.device)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def _fill_bias(bias: Tensor, mask: Tensor) -> None:
    """Write ``mask`` into ``bias`` (same shape) as an additive bias: bool as 0 / -inf."""
    if mask.dtype == torch.bool:
        bias.zero_().masked_fill_(~mask, float("-inf"))
    else:
        bias.copy_(mask)


def blocked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    matmul_dtype: torch.dtype | None = None,
) -> Tensor:
    """softmax(q kᵀ · scale + mask) · v by blocks over queries and keys (forward only).

    Args:
        q: (..., H, T, D) queries.
        k: (..., Hk, S, D) keys; H a multiple of Hk (grouped-query heads).
        v: (..., Hk, S, Dv) values.
        mask: None, bool (True = may attend) or float (added to the scores), broadcastable to
            (..., H, T, S).
        is_causal: bottom-right causal, query i sees keys j <= i + S - T; combined with ``mask``.
        scale: the factor on the scores; default 1 / sqrt(D).
        block_q: query rows per block (per head).
        block_k: keys per block.
        matmul_dtype: dtype of the two matmuls; default float32 (float64 for float64 inputs).

    Returns:
        (..., H, T, Dv) in q's dtype; rows with no visible key are zero.

    Raises:
        ValueError: block sizes below 1.
    """
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be >= 1, got {block_q} and {block_k}")
    *lead_list, h, t, d = q.shape
    lead = tuple(lead_list)
    hk, s, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    g = h // hk
    b = math.prod(lead)
    n = b * hk
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    mm_dtype = acc_dtype if matmul_dtype is None else matmul_dtype
    device = q.device
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    out = torch.zeros(b, hk, g, t, dv, dtype=q.dtype, device=device)
    if t == 0 or s == 0 or n == 0:
        return out.reshape(*lead, h, t, dv)

    # Everything from here runs without autograd and on tensors of our own making, so dynamo
    # sees one grad mode and one kind of tensor (an inference tensor) whatever the caller uses:
    # no recompile between no_grad, inference_mode and plain calls. ``out`` stays a normal tensor.
    # Duck sizing would add guards like Sb == G·Tb whenever two sizes happen to be equal.
    with torch.inference_mode(), _shape_config():
        # Query head h reads key/value head h // G: split H into (Hk, G).
        q5 = _as_batched(q, lead, (h, t, d)).view(b, hk, g, t, d)
        k3 = _as_batched(k, lead, (hk, s, d)).reshape(n, s, d).to(mm_dtype)  # (N, S, D)
        v3 = _as_batched(v, lead, (hk, s, dv)).reshape(n, s, dv).to(mm_dtype)  # (N, S, Dv)

        # Key blocks are fixed, aligned chunks, copied once into standalone tensors: the compiled
        # step then never sees a view (dynamo guards on a view's base and storage offset). A block
        # of one key gets a second, masked-out key: dynamo specialises sizes of 1, and one padded
        # key costs less than one more compile.
        starts = range(0, s, block_k)
        widths = [min(block_k, s - ks) for ks in starts]
        k_blocks = [
            _padded(k3[:, ks : ks + w], 1, 0.0) for ks, w in zip(starts, widths, strict=True)
        ]
        v_blocks = [
            _padded(v3[:, ks : ks + w], 1, 0.0) for ks, w in zip(starts, widths, strict=True)
        ]

        kind: MaskKind = "key"
        key_bias: list[Tensor] = []
        full_mask: Tensor | None = None
        if mask is None or _is_key_mask(mask):
            if mask is None:
                row = torch.zeros(n, 1, s, dtype=acc_dtype, device=device)
            else:
                row = mask.reshape(*mask.shape[:-3], 1, mask.shape[-1]) if mask.dim() >= 3 else mask
                row = _as_batched(row, lead, (1, s)).expand(b, hk, s).reshape(n, 1, s)  # (N, 1, S)
            for ks, w in zip(starts, widths, strict=True):
                bias = torch.full((n, 1, max(w, 2)), float("-inf"), dtype=acc_dtype, device=device)
                _fill_bias(bias[..., :w], row[..., ks : ks + w])
                key_bias.append(bias)  # (N, 1, Sb)
        else:
            kind = "full"
            full_mask = _as_batched(mask, lead, (h, t, s)).view(b, hk, g, t, s)

        step = _compiled_step(mm_dtype, acc_dtype, kind)
        offset = s - t  # bottom-right alignment
        for qs in range(0, t, block_q):
            qe = min(qs + block_q, t)
            tb = qe - qs
            r = g * tb
            r_pad = max(r, 2)  # one query row (T = 1, G = 1) gets a throw-away twin, as above
            # Causal: the block's last row sees keys < qe + offset; later key blocks are skipped.
            k_end = min(s, qe + offset) if is_causal else s
            if k_end <= 0:
                continue  # no row of this block sees any key: zeros
            # (B, Hk, G, Tb, D) -> (N, R, D), R = G·Tb: the group's heads stacked as one operand
            q_blk = q5[:, :, :, qs:qe].reshape(n, r, d).to(acc_dtype) * scale
            q_blk = _padded(q_blk.to(mm_dtype), 1, 0.0)
            rows = _padded((torch.arange(tb, device=device) + qs).repeat(g).view(1, r), 1, qs)
            no_tile: Tensor | None = None
            m = torch.full((n, r_pad, 1), float("-inf"), dtype=acc_dtype, device=device)
            l_run = torch.zeros(n, r_pad, 1, dtype=acc_dtype, device=device)
            acc = torch.zeros(n, r_pad, dv, dtype=acc_dtype, device=device)
            for i, ks in enumerate(range(0, k_end, block_k)):
                kb, vb = k_blocks[i], v_blocks[i]
                width = kb.shape[1]
                if is_causal and ks + width - 1 > qs + offset:
                    # The diagonal crosses this block: query i sees key j iff j <= i + offset.
                    cols = torch.arange(ks, ks + width, device=device).view(1, width)
                    tile = torch.zeros(r_pad, width, dtype=acc_dtype, device=device)
                    tile.masked_fill_(cols > rows.view(r_pad, 1) + offset, float("-inf"))
                else:
                    if no_tile is None or no_tile.shape[1] != width:
                        no_tile = torch.zeros(r_pad, width, dtype=acc_dtype, device=device)
                    tile = no_tile
                if full_mask is not None:
                    tile_mask = full_mask[..., qs:qe, ks : ks + widths[i]]  # (B, Hk, G, Tb, Sb)
                    bias = torch.zeros(n, r_pad, width, dtype=acc_dtype, device=device)
                    bias[:, :, widths[i] :] = float("-inf")  # the padded key
                    _fill_bias(bias[:, :r, : widths[i]].view(b, hk, g, tb, widths[i]), tile_mask)
                else:
                    bias = key_bias[i]
                m, l_run, acc = step(q_blk, kb, vb, bias, tile, m, l_run, acc)
            seen = l_run[:, :r] > 0
            o = torch.where(seen, acc[:, :r] / torch.where(seen, l_run[:, :r], 1.0), 0.0)
            out[:, :, :, qs:qe] = o.view(b, hk, g, tb, dv)  # (N, R, Dv) -> (B, Hk, G, Tb, Dv)
    return out.reshape(*lead, h, t, dv)
