"""The Triton kernel behind :mod:`multihead.fused_weights`: attention and its weights in one pass
over the keys to find each row's softmax statistics, and a second that writes every weight once.

Imported only by :mod:`multihead.fused_weights`, only once a CUDA call needs it: importing this
module imports triton. Shapes: B batch, H query heads, G = H / Hk query heads per key/value head,
T queries, S keys, D head dim, Dv value head dim.

For one (batch, head, block of BLOCK_M queries) a program runs

1. over the key blocks the rows can see: scores s = q kᵀ · scale · log2(e) with float32
   accumulation, the mask applied, and per row the running maximum m and the sum
   l = Σ exp2(s − m) (the online softmax);
2. over the same key blocks again: p = exp2(s − m) / l, in float32, stored once in the output
   dtype, and out += p v. Key blocks past the causal limit get their zeros stored without being
   computed.

Scores are recomputed in the second pass rather than stored: on a GPU a (T, D) x (D, S) product
costs less than writing and reading back a (T, S) float32 matrix. A row that may attend to no key
gets zero weights and a zero output; NaN in q, k or v reaches every weight of the rows it touches
(the sum l is NaN, not 0, for such a row).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["attention_weights_kernel"]


@triton.jit
def _scores(
    q,
    k_ptrs,
    mask_ptrs,
    rows,
    cols,
    T,
    S,
    D,
    causal_shift,
    qk_scale,
    mask_floor,
    offs_d,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) scores in base 2 for keys ``cols``: −inf where a key is hidden.

    With ``EVEN`` every row, key and head-dim lane of the block exists, so nothing is masked
    for bounds (the common case, and the fast one)."""
    if EVEN:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=(cols[:, None] < S) & (offs_d[None, :] < D), other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if HAS_MASK:
        if EVEN:
            m = tl.load(mask_ptrs)
        else:
            m = tl.load(mask_ptrs, mask=(rows[:, None] < T) & (cols[None, :] < S), other=0)
        if MASK_IS_BOOL:
            s = tl.where(m != 0, s, float("-inf"))
        else:
            # kernels.allowed's rule: at most half the mask dtype's lowest value hides the key
            # (eager-style masks write finfo.min), so a row hidden that way is empty, not even
            m = m.to(tl.float32)
            s = tl.where(m <= mask_floor, float("-inf"), s + m * 1.4426950408889634)  # log2(e)
    if not EVEN:
        s = tl.where((rows[:, None] < T) & (cols[None, :] < S), s, float("-inf"))
    if IS_CAUSAL:
        # bottom-right aligned: query i sees key j when j <= i + (S - T); this comes last, so a
        # hidden key is −inf whatever the mask added there
        s = tl.where(cols[None, :] <= rows[:, None] + causal_shift, s, float("-inf"))
    return s


# Lengths and head counts change from call to call: one compiled kernel serves them all.
@triton.jit(do_not_specialize=["H", "G", "T", "S", "causal_shift"])
def attention_weights_kernel(
    Q,
    K,
    V,
    MASK,
    OUT,
    W,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_ms,
    stride_ob,
    stride_oh,
    stride_ot,
    stride_wb,
    stride_wh,
    stride_wt,
    H,
    G,
    T,
    S,
    D,
    DV,
    causal_shift,
    qk_scale,
    mask_floor,
    HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    EVEN: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head). q, k, v have unit last stride.
    ``EVEN``: T and S are multiples of BLOCK_M and BLOCK_N, D == BLOCK_D and Dv == BLOCK_DV."""
    num_m = tl.cdiv(T, BLOCK_M)
    pid = tl.program_id(0)
    # consecutive programs share a (batch, head), so its keys and values stay in L2
    bh = pid // num_m
    start_m = (pid % num_m) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows = start_m + offs_m

    q_base = Q + b * stride_qb + h * stride_qh + start_m.to(tl.int64) * stride_qt
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    m_base = MASK + b * stride_mb + h * stride_mh + start_m.to(tl.int64) * stride_mt
    w_base = W + b * stride_wb + h * stride_wh + start_m.to(tl.int64) * stride_wt
    o_base = OUT + b * stride_ob + h * stride_oh + start_m.to(tl.int64) * stride_ot

    q_ptrs = q_base + offs_m[:, None] * stride_qt + offs_d[None, :]
    if EVEN:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(rows[:, None] < T) & (offs_d[None, :] < D), other=0.0)
    k_ptrs = k_base + offs_n[:, None] * stride_ks + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * stride_vs + offs_dv[None, :]
    mask_ptrs = m_base + offs_m[:, None] * stride_mt + offs_n[None, :] * stride_ms
    w_ptrs = w_base + offs_m[:, None] * stride_wt + offs_n[None, :]

    # The keys any row of this block can see: all of them, or up to the causal limit of its
    # last row.
    if IS_CAUSAL:
        end_n = tl.minimum(tl.maximum(start_m + BLOCK_M + causal_shift, 0), S)
    else:
        end_n = S

    # 1. each row's maximum and sum, online
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    for start_n in range(0, end_n, BLOCK_N):
        s = _scores(
            q,
            k_ptrs + start_n * stride_ks,
            mask_ptrs + start_n * stride_ms,
            rows,
            start_n + offs_n,
            T,
            S,
            D,
            causal_shift,
            qk_scale,
            mask_floor,
            offs_d,
            HAS_MASK,
            MASK_IS_BOOL,
            IS_CAUSAL,
            PRECISION,
            EVEN,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row with no key yet keeps m = −inf; subtracting 0 instead keeps exp2 at 0, not NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new

    # 2. the weights, written once, and the output
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    # An empty row's p are exp2(−inf) = 0 whatever it is divided by; a NaN sum stays NaN.
    inv_l = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start_n in range(0, end_n, BLOCK_N):
        cols = start_n + offs_n
        s = _scores(
            q,
            k_ptrs + start_n * stride_ks,
            mask_ptrs + start_n * stride_ms,
            rows,
            cols,
            T,
            S,
            D,
            causal_shift,
            qk_scale,
            mask_floor,
            offs_d,
            HAS_MASK,
            MASK_IS_BOOL,
            IS_CAUSAL,
            PRECISION,
            EVEN,
        )
        p = tl.exp2(s - m_safe[:, None]) * inv_l[:, None]
        if EVEN:
            tl.store(w_ptrs + start_n, p.to(W.dtype.element_ty))
            v = tl.load(v_ptrs + start_n * stride_vs)
        else:
            tl.store(
                w_ptrs + start_n,
                p.to(W.dtype.element_ty),
                mask=(rows[:, None] < T) & (cols[None, :] < S),
            )
            v = tl.load(
                v_ptrs + start_n * stride_vs,
                mask=(cols[:, None] < S) & (offs_dv[None, :] < DV),
                other=0.0,
            )
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    if IS_CAUSAL:
        zeros = tl.zeros([BLOCK_M, BLOCK_N], W.dtype.element_ty)
        first_hidden = tl.cdiv(end_n, BLOCK_N) * BLOCK_N
        for start_n in range(first_hidden, S, BLOCK_N):
            cols = start_n + offs_n
            tl.store(w_ptrs + start_n, zeros, mask=(rows[:, None] < T) & (cols[None, :] < S))
    o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_dv[None, :]
    if EVEN:
        tl.store(o_ptrs, acc.to(OUT.dtype.element_ty))
    else:
        tl.store(
            o_ptrs, acc.to(OUT.dtype.element_ty), mask=(rows[:, None] < T) & (offs_dv[None, :] < DV)
        )
