"""Score modifications (softcap, sinks, score_mod, block_mask) against torch's FlexAttention and
a float64 reference written here; the sink cases against FlexAttention through its log-sum-exp.

Each configuration is a FlexAttention call a user could write (a ``score_mod`` and a
``BlockMask``), paired with the same modification written out densely for the reference (index
grids, not vmap). Sizes are pairwise distinct (B, H, T, S, D) where they can be, T ≠ S in most,
so that a swapped axis fails.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    and_masks,
    create_block_mask,
    flex_attention,
)

from multihead import MultiHeadAttention, capture
from multihead.functional import attention
from multihead.score_mods import ScoreMods, modified_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture(autouse=True)
def _flex_without_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uncompiled FlexAttention runs its reference math under a dynamo trace per new score_mod
    (seconds each); torch's debug switch runs the same math without the trace. (A torch
    without the switch only runs these tests slower.)"""
    monkeypatch.setattr(
        torch.nn.attention.flex_attention,
        "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG",
        True,
        raising=False,
    )


NEG = float("-inf")


def reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    softcap: float | None = None,
    bias: Tensor | None = None,
    allowed: Tensor | None = None,
    sinks: Tensor | None = None,
) -> dict[str, Tensor]:
    """Attention in float64, written out: scores · scale, softcap, + bias, −inf where not
    ``allowed`` (B|1, H|1, T, S), and the sink as one more logit with a zero value.

    Returns out (B, H, T, Dv); ``dropped`` (the keys' shares of the softmax over keys and
    sink), ``sink`` (the sink's share, (B, H, T)) and ``plain`` (the softmax over the keys
    alone); empty rows give zeros (the sink's share 1).
    """
    q, k, v = (x.detach().double() for x in (q, k, v))
    b, h, t, _ = q.shape
    s = k.shape[2]
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # (B, H, S, ·)
    scores = torch.einsum("bhtd,bhsd->bhts", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias.detach().double()
    ok = torch.ones(b, h, t, s, dtype=torch.bool)
    if allowed is not None:
        ok = ok & allowed
    scores = scores.masked_fill(~ok, NEG)
    if sinks is None:
        sink = torch.full((b, h, t, 1), NEG, dtype=torch.float64)
    else:
        sink = sinks.detach().double()
        sink = sink.view(1, h, 1, 1) if sink.dim() == 1 else sink.expand(b, h, t).unsqueeze(-1)
        sink = sink.expand(b, h, t, 1)
    empty = ~ok.any(-1, keepdim=True)
    top = torch.maximum(scores.amax(-1, keepdim=True), sink).masked_fill(empty, 0.0)
    e = torch.exp(scores - top)
    es = torch.exp(sink - top)
    z = e.sum(-1, keepdim=True) + es
    dropped = torch.where(empty, 0.0, e / z)
    share = torch.where(empty, 1.0, es / z).squeeze(-1)
    plain = torch.where(empty, 0.0, e / e.sum(-1, keepdim=True).clamp_min(1e-300))
    return {"out": dropped @ v, "dropped": dropped, "sink": share, "plain": plain}


# -- the modifications, each as FlexAttention functions and as dense tensors ---------------------


@dataclass
class Case:
    """One configuration: tensors, the call's keywords, and what flex and the reference get."""

    name: str
    q: Tensor
    k: Tensor
    v: Tensor
    kwargs: dict
    flex_score_mod: Callable | None
    flex_block_mask: BlockMask | None
    bias: Tensor | None
    allowed: Tensor | None


def _grid(b: int, h: int, t: int, s: int) -> tuple[Tensor, ...]:
    """Index grids (B,1,1,1), (1,H,1,1), (1,1,T,1), (1,1,1,S)."""
    return (
        torch.arange(b).view(b, 1, 1, 1),
        torch.arange(h).view(1, h, 1, 1),
        torch.arange(t).view(1, 1, t, 1),
        torch.arange(s).view(1, 1, 1, s),
    )


def make_case(seed: int, kinds: tuple[str, ...]) -> Case:
    g = torch.Generator().manual_seed(seed)

    def pick(*xs: int) -> int:
        return xs[int(torch.randint(len(xs), (1,), generator=g))]

    b, hk, group = pick(1, 2), pick(1, 2), pick(1, 3)
    h = hk * group
    t, s = pick(3, 5, 9, 17), pick(4, 7, 9, 20)
    d, dv = pick(4, 8), pick(6, 8)
    causal = "causal" in kinds
    q = torch.randn(b, h, t, d, generator=g)
    k = torch.randn(b, hk, s, d, generator=g)
    v = torch.randn(b, hk, s, dv, generator=g)
    bi, hi, qi, ki = _grid(b, h, t, s)
    kwargs: dict = {"is_causal": causal}
    mods: list[Callable] = []
    masks: list[Callable] = []
    bias = torch.zeros(b, h, t, s)
    allowed = torch.ones(b, h, t, s, dtype=torch.bool)
    if "softcap" in kinds:
        kwargs["softcap"] = pick(2, 5) * 1.0
    if "alibi" in kinds:
        slopes = 2.0 ** (-8.0 * (torch.arange(h) + 1) / h)
        mods.append(lambda sc, b_, h_, q_, k_: sc + slopes[h_] * (k_ - q_))
        bias = bias + slopes.view(1, h, 1, 1) * (ki - qi)
    if "relative" in kinds:
        span = t + s
        table = torch.randn(h, 2 * span + 1, generator=g)
        mods.append(lambda sc, b_, h_, q_, k_: sc + table[h_, q_ - k_ + span])
        bias = bias + table[hi, qi - ki + span]
    if "document" in kinds:
        q_doc = torch.sort(torch.randint(0, 3, (b, t), generator=g), dim=1).values
        kv_doc = torch.sort(torch.randint(0, 3, (b, s), generator=g), dim=1).values
        masks.append(lambda b_, h_, q_, k_: q_doc[b_, q_] == kv_doc[b_, k_])
        allowed = allowed & (
            q_doc[bi.view(b, 1, 1), qi.view(1, t, 1)] == kv_doc[bi.view(b, 1, 1), ki.view(1, 1, s)]
        ).unsqueeze(1)
    if "window" in kinds:
        width = pick(2, 3)
        shift = s - t
        masks.append(lambda b_, h_, q_, k_: (q_ + shift - k_ >= 0) & (q_ + shift - k_ < width))
        allowed = allowed & (qi + shift - ki >= 0) & (qi + shift - ki < width)
    if "mask" in kinds:  # a tensor mask beside the block mask
        m = torch.rand(b, 1, t, s, generator=g) > 0.25
        kwargs["mask"] = m
        allowed = allowed & m
    if "sinks" in kinds:
        kwargs["sinks"] = torch.randn(h, generator=g)
    flex_masks = list(masks)
    if causal:
        allowed = allowed & (ki <= qi + (s - t))
        flex_masks.append(lambda b_, h_, q_, k_: k_ <= q_ + (s - t))
    block = pick(2, 4, 128)
    ours_block = flex_block = None
    if masks:
        mm = and_masks(*masks) if len(masks) > 1 else masks[0]
        ours_block = create_block_mask(mm, b, None, t, s, device="cpu", BLOCK_SIZE=block)
        kwargs["block_mask"] = ours_block
    if flex_masks:
        fm = and_masks(*flex_masks) if len(flex_masks) > 1 else flex_masks[0]
        flex_block = create_block_mask(fm, b, None, t, s, device="cpu", BLOCK_SIZE=block)
    score_mod = None
    if mods:

        def score_mod(sc: Tensor, b_: Tensor, h_: Tensor, q_: Tensor, k_: Tensor) -> Tensor:
            for f in mods:
                sc = f(sc, b_, h_, q_, k_)
            return sc

        kwargs["score_mod"] = score_mod
    flex_mod = score_mod
    if "mask" in kinds:
        m4 = kwargs["mask"]
        inner = flex_mod

        def flex_mod(sc: Tensor, b_: Tensor, h_: Tensor, q_: Tensor, k_: Tensor) -> Tensor:
            sc = inner(sc, b_, h_, q_, k_) if inner is not None else sc
            return torch.where(m4[b_, 0, q_, k_], sc, NEG)

    name = f"{'+'.join(kinds)}-B{b}H{h}Hk{hk}T{t}S{s}-blk{block}"
    return Case(name, q, k, v, kwargs, flex_mod, flex_block, bias, allowed)


KINDS = [
    ("softcap",),
    ("softcap", "causal"),
    ("alibi",),
    ("alibi", "causal"),
    ("relative",),
    ("relative", "causal"),
    ("document",),
    ("document", "causal"),
    ("window",),
    ("window", "causal"),
    ("softcap", "alibi", "window"),
    ("softcap", "relative", "document", "causal"),
    ("alibi", "document", "window", "causal"),
    ("softcap", "mask"),
    ("relative", "mask", "causal"),
    ("document", "mask"),
    ("softcap", "alibi", "relative", "document", "window", "mask", "causal"),
    ("causal",),
]
SINK_KINDS = [
    ("sinks",),
    ("sinks", "causal"),
    ("sinks", "softcap", "window", "causal"),
    ("sinks", "alibi", "document"),
    ("sinks", "relative", "mask", "causal"),
    ("sinks", "softcap", "alibi", "relative", "document", "window", "causal"),
]
CASES = [make_case(100 + i, kinds) for i, kinds in enumerate(KINDS)]
SINK_CASES = [make_case(500 + i, kinds) for i, kinds in enumerate(SINK_KINDS)]


def _reference_of(case: Case) -> dict[str, Tensor]:
    return reference(
        case.q,
        case.k,
        case.v,
        scale=1 / math.sqrt(case.q.shape[-1]),
        softcap=case.kwargs.get("softcap"),
        bias=case.bias,
        allowed=case.allowed,
        sinks=case.kwargs.get("sinks"),
    )


def _flex(case: Case) -> tuple[Tensor, Tensor]:
    """torch's FlexAttention on the case: its output (B, H, T, D) and log-sum-exp (B, H, T)."""
    kw = case.kwargs

    def flex_mod(sc: Tensor, b_: Tensor, h_: Tensor, q_: Tensor, k_: Tensor) -> Tensor:
        if kw.get("softcap") is not None:
            sc = kw["softcap"] * torch.tanh(sc / kw["softcap"])
        return case.flex_score_mod(sc, b_, h_, q_, k_) if case.flex_score_mod else sc

    extra: dict[str, Any] = {}
    try:  # the log-sum-exp, asked for as this torch asks
        from torch.nn.attention.flex_attention import AuxRequest

        extra["return_aux"] = AuxRequest(lse=True)
    except ImportError:
        extra["return_lse"] = True
    out, aux = flex_attention(
        case.q,
        case.k,
        case.v,
        score_mod=flex_mod,
        block_mask=case.flex_block_mask,
        enable_gqa=case.q.shape[1] != case.k.shape[1],
        **extra,
    )
    return out, getattr(aux, "lse", aux)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_equals_flex_attention(case: Case) -> None:
    kw = case.kwargs
    expected, _ = _flex(case)
    for backend in ("auto", "math", "flex"):
        out = attention(case.q, case.k, case.v, backend=backend, **kw)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=backend)
    out, weights = attention(case.q, case.k, case.v, need_weights=True, **kw)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    ref = _reference_of(case)
    torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.double(), ref["plain"], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: c.name)
def test_sinks_equal_the_float64_reference_in_each_convention(case: Case) -> None:
    ref = _reference_of(case)
    s = case.k.shape[2]
    # FlexAttention has no sinks, but its log-sum-exp gives them: a sink adds exp(sink) to each
    # row's denominator, so the output is flex's times exp(lse) / (exp(lse) + exp(sink))
    flex_out, lse = _flex(case)
    sinks = case.kwargs["sinks"].view(1, -1, 1)  # (1, H, 1)
    expected = flex_out * torch.sigmoid(lse - sinks).unsqueeze(-1)
    for backend in ("auto", "math", "flex"):
        out = attention(case.q, case.k, case.v, backend=backend, **case.kwargs)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=backend)
        torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5, msg=backend)
    kwargs = {k: v for k, v in case.kwargs.items()}
    got = {}
    for convention in ("dropped", "column", "plain"):
        kwargs["sink_weights"] = convention
        out, got[convention] = attention(case.q, case.k, case.v, need_weights=True, **kwargs)
        torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got["dropped"].double(), ref["dropped"], atol=1e-6, rtol=0)
    torch.testing.assert_close(got["plain"].double(), ref["plain"], atol=1e-6, rtol=0)
    column = got["column"].double()
    assert column.shape[-1] == s + 1
    torch.testing.assert_close(column[..., :s], ref["dropped"], atol=1e-6, rtol=0)
    torch.testing.assert_close(column[..., s], ref["sink"], atol=1e-6, rtol=0)
    # the default is "dropped", what GPT-OSS's eager attention returns
    _, default = attention(case.q, case.k, case.v, need_weights=True, **case.kwargs)
    torch.testing.assert_close(default, got["dropped"])


def test_enough_configurations() -> None:
    # every case, the sink cases included, is checked against flex_attention
    assert len(CASES) + len(SINK_CASES) >= 20
    assert any(c.q.shape[2] != c.k.shape[2] for c in CASES)
    assert any(c.q.shape[1] != c.k.shape[1] for c in CASES + SINK_CASES)  # grouped heads


def test_per_query_sinks_broadcast_like_inkling() -> None:
    """Sinks per query (B, H, T), as a sink projection of the hidden states gives them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g), None
    v = torch.randn(2, 2, 6, 3, generator=g)
    sinks = torch.randn(2, 4, 5, generator=g)
    ref = reference(q, k, v, scale=8**-0.5, sinks=sinks)
    out, w = attention(q, k, v, sinks=sinks, need_weights=True)
    torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref["dropped"], atol=1e-6, rtol=0)


def test_gemma2_softcap_order_scale_then_cap_then_mask() -> None:
    """transformers' Gemma-2 eager: (q kᵀ)·scale, then the cap, then the additive mask."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) * 4 for _ in range(3))
    mask = torch.randn(1, 1, 6, 6, generator=g)
    scale, cap = 0.3, 1.5
    scores = torch.matmul(q.double(), k.double().transpose(2, 3)) * scale
    scores = torch.tanh(scores / cap) * cap + mask.double()
    w = torch.softmax(scores, -1)
    out, weights = attention(q, k, v, mask=mask, scale=scale, softcap=cap, need_weights=True)
    torch.testing.assert_close(weights.double(), w, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.double(), w @ v.double(), atol=1e-5, rtol=1e-5)


def test_empty_rows_give_zeros_and_the_sink_takes_the_whole_share() -> None:
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 4, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), None
    v = torch.randn(1, 2, 5, 8, generator=g)
    hidden = create_block_mask(lambda b, h, i, j: i >= 2, None, None, 4, 5, device="cpu")
    hides = lambda sc, b, h, i, j: torch.where(i >= 2, sc, NEG)  # noqa: E731
    for kw in ({"block_mask": hidden}, {"score_mod": hides}):
        out, w = attention(q, k, v, need_weights=True, sinks=torch.zeros(2), **kw)
        assert not out.isnan().any() and not w.isnan().any()
        assert out[:, :, :2].eq(0).all() and w[:, :, :2].eq(0).all()
        _, col = attention(
            q, k, v, need_weights=True, sinks=torch.zeros(2), sink_weights="column", **kw
        )
        assert col[:, :, :2, -1].eq(1).all()
        x = q.clone().requires_grad_()
        attention(x, k, v, **kw).sum().backward()
        assert x.grad is not None and x.grad.isfinite().all() and x.grad[:, :, :2].eq(0).all()


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("float_mask", [False, True])
def test_masks_hiding_the_last_keys_of_row_blocks(window: int | None, float_mask: bool) -> None:
    """An eager-style mask (causal, bottom-right with T < S, optionally a sliding window, one
    row hiding every key) over blocks of rows that do not divide T: the keys the mask hides
    from a whole block are skipped, and out and the weights (zero there) equal the reference."""
    g = torch.Generator().manual_seed(11)
    t, s = 7, 9
    q = torch.randn(2, 4, t, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, s, 8, generator=g, dtype=torch.float64) for _ in range(2))
    i, j = torch.arange(t)[:, None] + (s - t), torch.arange(s)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (j > i - window)
    ok[5] = False
    ok4 = ok.expand(2, 1, t, s)
    mask = ok4
    if float_mask:
        mask = torch.zeros(2, 1, t, s, dtype=torch.float64)
        mask = mask.masked_fill(~ok4, torch.finfo(torch.float64).min)
    want = reference(q, k, v, scale=0.3, softcap=2.0, allowed=ok4)
    for block_rows in (1, 3, 4, 7):
        out, w = modified_attention(
            q,
            k,
            v,
            ScoreMods(softcap=2.0),
            mask=mask,
            is_causal=False,
            scale=0.3,
            need_weights=True,
            block_rows=block_rows,
        )
        assert out is not None and w is not None
        assert (out - want["out"]).abs().max() < 1e-12
        assert (w - want["dropped"]).abs().max() < 1e-12


def test_a_score_mod_sees_the_softcapped_score_itself() -> None:
    # a score_mod that is not a shift (|s|): it must get c · tanh(s / c), not the same up to a
    # constant (which a softmax alone could not tell apart)
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) * 3 for _ in range(3))
    cap, scale = 2.0, 0.5
    scores = cap * torch.tanh(torch.einsum("bhtd,bhsd->bhts", q, k) * scale / cap)
    want = torch.softmax(scores.abs(), -1)

    def folded(sc: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return sc.abs()

    out, w = attention(q, k, v, softcap=cap, score_mod=folded, scale=scale, need_weights=True)
    torch.testing.assert_close(w, want, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, want @ v, atol=1e-12, rtol=0)


def test_leading_dims_and_unbatched() -> None:
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 3, 4, 5, 8, generator=g), torch.randn(2, 3, 2, 7, 8, generator=g), None
    v = torch.randn(2, 3, 2, 7, 4, generator=g)
    alibi = lambda sc, b, h, i, j: sc - 0.5 * h * (i - j).abs()  # noqa: E731
    out = attention(q, k, v, score_mod=alibi, softcap=3.0, is_causal=True)
    per = [
        attention(
            q[i, j][None],
            k[i, j][None],
            v[i, j][None],
            softcap=3.0,
            is_causal=True,
            score_mod=alibi,
        )[0]
        for i in range(2)
        for j in range(3)
    ]
    # score_mod's b is the flattened batch index: unused here, so each slice is its own call
    torch.testing.assert_close(out, torch.stack(per).view_as(out), atol=1e-6, rtol=1e-6)
    three = attention(q[0, 0], k[0, 0], v[0, 0], softcap=3.0, sinks=torch.zeros(4))
    four = attention(q[0, 0][None], k[0, 0][None], v[0, 0][None], softcap=3.0, sinks=torch.zeros(4))
    torch.testing.assert_close(three, four[0])


def test_sdpa_takes_a_block_mask_alone_as_its_dense_mask() -> None:
    case = make_case(7, ("document", "window", "causal"))
    ref = _reference_of(case)
    out = attention(case.q, case.k, case.v, backend="sdpa", **case.kwargs)
    torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)


def test_blocks_listed_without_a_mask_mod_follow_flex_kernel() -> None:
    """A BlockMask made from block tables alone (its mask_mod the default): FlexAttention's
    kernel rule, a key in a listed block allowed, any other hidden. (Uncompiled
    ``flex_attention`` reads only the mask_mod and would let every key through.)"""
    t, s, blk = 8, 12, 4
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, s, 8, generator=g)
    v = torch.randn(1, 2, s, 8, generator=g)
    num = torch.tensor([[[1, 2]]], dtype=torch.int32).expand(1, 2, 2).contiguous()
    idx = torch.tensor([[[[2, 0, 0], [0, 1, 0]]]], dtype=torch.int32).expand(1, 2, 2, 3)
    full_num = torch.tensor([[[0, 1]]], dtype=torch.int32).expand(1, 2, 2).contiguous()
    full_idx = torch.tensor([[[[0, 0, 0], [2, 0, 0]]]], dtype=torch.int32).expand(1, 2, 2, 3)
    allowed = torch.zeros(t, s, dtype=torch.bool)
    allowed[:4, 8:12] = True  # query block 0: key block 2
    allowed[4:8, 0:12] = True  # query block 1: key blocks 0, 1 and (full) 2
    bm = BlockMask.from_kv_blocks(
        num,
        idx.contiguous(),
        full_num,
        full_idx.contiguous(),
        BLOCK_SIZE=blk,
        seq_lengths=(t, s),
    )
    ref = reference(q, k, v, scale=8**-0.5, allowed=allowed)
    out, w = attention(q, k, v, block_mask=bm, need_weights=True)
    torch.testing.assert_close(out.double(), ref["out"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref["plain"], atol=1e-6, rtol=0)
    # a mask_mod is read in partial blocks only: one hiding every key leaves the full block
    odd = BlockMask.from_kv_blocks(
        num,
        idx.contiguous(),
        full_num,
        full_idx.contiguous(),
        BLOCK_SIZE=blk,
        mask_mod=lambda b, h, i, j: j < 0,
        seq_lengths=(t, s),
    )
    only_full = torch.zeros(t, s, dtype=torch.bool)
    only_full[4:8, 8:12] = True
    _, w = attention(q, k, v, block_mask=odd, need_weights=True)
    ref = reference(q, k, v, scale=8**-0.5, allowed=only_full)
    torch.testing.assert_close(w.double(), ref["plain"], atol=1e-6, rtol=0)


# -- gradients -----------------------------------------------------------------------------------


def test_gradcheck_every_modification_float64() -> None:
    g = torch.Generator().manual_seed(9)
    b, h, hk, t, s, d = 1, 4, 2, 3, 5, 4
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, s, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, s, 3, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.randn(h, generator=g, dtype=torch.float64, requires_grad=True)
    table = torch.randn(h, 2 * (t + s) + 1, generator=g, dtype=torch.float64, requires_grad=True)
    bm = create_block_mask(lambda b_, h_, i, j: (i + s - t - j) < 3, None, None, t, s, "cpu")

    def fn(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, table: Tensor) -> Tensor:
        def mod(sc: Tensor, b_: Tensor, h_: Tensor, i: Tensor, j: Tensor) -> Tensor:
            return sc + table[h_, i - j + t + s]

        return attention(
            q, k, v, softcap=2.0, sinks=sinks, score_mod=mod, block_mask=bm, is_causal=True
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, sinks, table), fast_mode=True)

    def weights(q: Tensor, k: Tensor, sinks: Tensor) -> Tensor:
        return attention(
            q, k, v.detach(), softcap=2.0, sinks=sinks, need_weights=True, sink_weights="column"
        )[1]

    assert torch.autograd.gradcheck(weights, (q, k, sinks), fast_mode=True)


def test_flex_backend_refuses_gradients_on_the_cpu() -> None:
    case = make_case(10, ("sinks", "softcap", "causal"))
    q = case.q.clone().requires_grad_()
    with pytest.raises(ValueError, match="backend='flex' has no backward on the CPU"):
        attention(q, case.k, case.v, backend="flex", **case.kwargs)
    out = attention(q, case.k, case.v, **case.kwargs)  # auto: the math path, with gradients
    out.sum().backward()
    assert q.grad is not None and q.grad.isfinite().all()


# -- through MultiHeadAttention and capture --------------------------------------------------------


def _module_call(sinks: bool) -> tuple[MultiHeadAttention, Tensor, dict, dict[str, Tensor]]:
    torch.manual_seed(11)
    mha = MultiHeadAttention(24, num_heads=6, num_kv_heads=2, head_dim=4)
    x = torch.randn(2, 9, 24)
    table = torch.randn(6, 19)
    kwargs: dict = {
        "softcap": 3.0,
        "score_mod": lambda sc, b, h, i, j: sc + table[h, i - j + 9],
        "block_mask": create_block_mask(
            lambda b, h, i, j: (i - j) < 4, None, None, 9, 9, device="cpu", BLOCK_SIZE=4
        ),
        "is_causal": True,
    }
    if sinks:
        kwargs["sinks"] = torch.randn(6)
    q, k, v = mha.project(x)
    bi, hi, qi, ki = _grid(2, 6, 9, 9)
    ref = reference(
        q,
        k,
        v,
        scale=0.5,
        softcap=3.0,
        bias=table[hi, qi - ki + 9].expand(2, 6, 9, 9),
        allowed=(qi - ki < 4) & (ki <= qi),
        sinks=kwargs.get("sinks"),
    )
    return mha, x, kwargs, ref


def test_multihead_attention_passes_them_through() -> None:
    mha, x, kwargs, ref = _module_call(sinks=True)
    out, w = mha(x, need_weights=True, **kwargs)
    expected = mha.out_proj(ref["out"].float().transpose(1, 2).flatten(2))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.double(), ref["dropped"], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="packing= cannot be combined with softcap"):
        from multihead.packing import PackedBatch

        packing = PackedBatch(torch.ones(2, 9, dtype=torch.bool))
        mha(x.flatten(0, 1), packing=packing, softcap=3.0)


@pytest.mark.parametrize("convention", [None, "dropped", "column", "plain"])
def test_capture_recomputes_chosen_rows_under_the_modifications(convention: str | None) -> None:
    mha, x, kwargs, ref = _module_call(sinks=True)
    rows, heads = [0, 4, 8], [1, 5]
    with capture(mha, rows=rows, heads=heads, sink_weights=convention, chunk_size=2) as rec:
        mha(x, **kwargs)
    (w,) = rec.weights
    want = ref[convention or "dropped"] if convention != "column" else ref["dropped"]
    want = want[:, heads][:, :, rows]
    if convention == "column":
        assert w.shape == (2, 2, 3, 10)
        torch.testing.assert_close(
            w[..., 9].double(), ref["sink"][:, heads][:, :, rows], atol=1e-6, rtol=0
        )
        w = w[..., :9]
    torch.testing.assert_close(w.double(), want, atol=1e-6, rtol=0)


def test_capture_received_is_the_column_sums_over_the_rows() -> None:
    mha, x, kwargs, ref = _module_call(sinks=False)
    with capture(mha, rows=slice(2, None), received=True, chunk_size=3) as rec:
        mha(x, **kwargs)
    (got,) = rec.weights
    assert got.shape == (2, 6, 9)
    torch.testing.assert_close(got.double(), ref["plain"][:, :, 2:].sum(2), atol=1e-5, rtol=0)
    assert rec.records[0].rows == tuple(range(2, 9))


def test_capture_received_without_modifications() -> None:
    torch.manual_seed(12)
    mha = MultiHeadAttention(16, num_heads=4)
    x = torch.randn(1, 7, 16)
    _, w = mha(x, need_weights=True, is_causal=True)
    with capture(mha, received=True) as rec:
        mha(x, is_causal=True)
    torch.testing.assert_close(rec.weights[0], w.sum(2), atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match="received must be a bool"):
        with capture(mha, received="yes"):  # type: ignore[arg-type]
            pass


# -- bad inputs ------------------------------------------------------------------------------------


def test_bad_arguments_are_named() -> None:
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="softcap must be a positive finite float, got 0"):
        attention(q, k, v, softcap=0)
    with pytest.raises(TypeError, match="softcap must be a positive float or None"):
        attention(q, k, v, softcap=True)
    with pytest.raises(ValueError, match=r"sinks must be one logit per query head, shape \(H,\)"):
        attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="score_mod must be callable"):
        attention(q, k, v, score_mod=3)
    with pytest.raises(TypeError, match="block_mask must be a torch.nn.attention"):
        attention(q, k, v, block_mask=torch.ones(4, 4, dtype=torch.bool))
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 4, 5, device="cpu")
    with pytest.raises(ValueError, match=r"block_mask was made for \(Q_LEN, KV_LEN\) = \(4, 5\)"):
        attention(q, k, v, block_mask=bm)
    with pytest.raises(ValueError, match="sink_weights"):
        attention(q, k, v, sinks=torch.zeros(2), sink_weights="kept")
    with pytest.raises(ValueError, match="backend='sdpa' cannot apply softcap"):
        attention(q, k, v, softcap=2.0, backend="sdpa")
    with pytest.raises(ValueError, match="backend='fused' cannot apply score modifications"):
        attention(q, k, v, softcap=2.0, backend="fused")
    with pytest.raises(ValueError, match="backend='flex' cannot return attention weights"):
        attention(q, k, v, softcap=2.0, backend="flex", need_weights=True)
    with pytest.raises(ValueError, match="backend='flex' has no dropout"):
        attention(q, k, v, softcap=2.0, backend="flex", dropout_p=0.1)


@pytest.mark.parametrize(
    ("returned", "shape"),
    [(lambda s: s.expand(3), "(3,)"), (lambda s: torch.stack([s, s]), "(2,)")],
    ids=["broadcast view", "two scores"],
)
def test_row7_a_score_mod_returning_another_shape_is_named(
    returned: Callable[[Tensor], Tensor], shape: str
) -> None:
    """Issue 51 row 7: a score_mod returning a broadcast view (``s.expand(3)``) or more than one
    score killed the process (an in-place softmax writing into a stride-0 view)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))

    def score_mod(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return returned(s)

    expected = r"score_mod must return one score \(a 0-d tensor\).*a score of shape "
    expected += re.escape(shape)
    with pytest.raises(ValueError, match=expected):
        attention(q, k, v, score_mod=score_mod)
    mha = MultiHeadAttention(16, 2).eval()
    with pytest.raises(ValueError, match=expected), torch.no_grad():
        mha(torch.randn(1, 4, 16, generator=g), score_mod=score_mod)


def test_row7_a_score_mod_returning_a_0d_broadcast_view_works() -> None:
    """A view that still holds one score each (``s.expand(())``) is taken as the scores."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(3))

    def doubled(s: Tensor, b: Tensor, h: Tensor, i: Tensor, j: Tensor) -> Tensor:
        return (2 * s).expand(())

    want = torch.softmax(2 * (q @ k.mT) / math.sqrt(8), -1) @ v
    torch.testing.assert_close(attention(q, k, v, score_mod=doubled), want)
