"""capture() and head statistics: exactness against need_weights=True, selection, known heads."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from multihead import (
    MultiHeadAttention,
    TransformerEncoder,
    TransformerEncoderLayer,
    kernels,
)
from multihead.observe import HeadStatistics, attention_modules, capture, head_statistics

# Pairwise-distinct sizes so that a swapped dimension fails loudly.
B, T, E, H = 2, 7, 24, 6


def _encoder(
    num_kv_heads: int | None = None, layers: int = 3, device: torch.device | str = "cpu"
) -> TransformerEncoder:
    return (
        TransformerEncoder(
            [TransformerEncoderLayer(E, H, 40, num_kv_heads=num_kv_heads) for _ in range(layers)]
        )
        .to(device)
        .eval()
    )


def _weights_by_need_weights(
    enc: TransformerEncoder, x: torch.Tensor, **kwargs: object
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The reference: (out, per-layer weights), each layer's weights from its attention module's
    own ``need_weights=True`` (where weights are born), the layers stepped through by hand."""
    weights = []
    for layer in enc.layers:
        h = layer.norm1(x) if layer.norm_first else x
        _, w = layer.self_attn(h, need_weights=True, **kwargs)
        weights.append(w)
        x = layer(x, **kwargs)
    return x, weights


def _key_mask(device: torch.device) -> torch.Tensor:
    km = torch.ones(B, T, dtype=torch.bool, device=device)
    km[1, 4:] = False  # the second sequence has 3 padding tokens
    return km


@pytest.mark.parametrize("num_kv_heads", [None, 3, 1])
@pytest.mark.parametrize("is_causal", [False, True])
def test_capture_equals_need_weights(
    num_kv_heads: int | None, is_causal: bool, device: torch.device
) -> None:
    enc = _encoder(num_kv_heads, device=device)
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    with torch.no_grad():
        ref_out, ref = _weights_by_need_weights(enc, x, key_mask=km, is_causal=is_causal)
        with capture(enc) as rec:
            out = enc(x, key_mask=km, is_causal=is_causal)
    torch.testing.assert_close(out, ref_out)  # capturing doesn't change the forward
    assert rec.layers == [0, 1, 2]
    assert [r.name for r in rec.records] == [f"layers.{i}.self_attn" for i in range(3)]
    for got, want in zip(rec.weights, ref, strict=True):
        assert got.shape == (B, H, T, T)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_capture_selects_layers_heads_rows(num_kv_heads: int | None, device: torch.device) -> None:
    enc = _encoder(num_kv_heads, device=device)
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    heads, rows = [5, 0, 3], [6, 1, -1]
    with torch.no_grad():
        _, ref = _weights_by_need_weights(enc, x, key_mask=km, is_causal=True)
        with capture(enc, layers=[-1, 0], heads=heads, rows=rows) as rec:
            enc(x, key_mask=km, is_causal=True)
    # records come in call (= layer) order whatever order the layers were asked in
    assert rec.layers == [0, 2]
    assert rec.heads == [(5, 0, 3)] * 2 and rec.rows == [(6, 1, 6)] * 2
    for record in rec.records:
        assert record.heads == (5, 0, 3) and record.rows == (6, 1, 6)
        assert record.weights.shape == (B, 3, 3, T)
        want = ref[record.layer][:, heads][:, :, [6, 1, 6]]
        torch.testing.assert_close(record.weights, want, rtol=1e-5, atol=1e-6)


def test_capture_float_mask_and_cross_attention_bottom_right(device: torch.device) -> None:
    # S > T (cached or cross keys): the causal mask is bottom-right aligned over the full
    # problem, so a row subset must not be re-aligned as its own (R, S) problem.
    mha = MultiHeadAttention(E, H, num_kv_heads=2, kdim=10, vdim=12).to(device).eval()
    s = 11
    q, k, v = (
        torch.randn(B, T, E, device=device),
        torch.randn(B, s, 10, device=device),
        torch.randn(B, s, 12, device=device),
    )
    float_mask = torch.randn(T, s, device=device)
    km = torch.ones(B, s, dtype=torch.bool, device=device)
    km[0, :3] = False
    with torch.no_grad():
        _, ref = mha(q, k, v, mask=float_mask, key_mask=km, is_causal=True, need_weights=True)
        with capture(mha, heads=[1, 4], rows=[0, 3]) as rec:
            mha(q, k, v, mask=float_mask, key_mask=km, is_causal=True)
    (w,) = rec.weights
    torch.testing.assert_close(w, ref[:, [1, 4]][:, :, [0, 3]], rtol=1e-5, atol=1e-6)
    # row 0 sees keys 0..4 (bottom-right: 0 + 11 - 7); beyond that nothing
    assert w[:, :, 0, 5:].abs().max() == 0


def test_capture_fully_masked_row_gives_zeros(device: torch.device) -> None:
    mha = MultiHeadAttention(E, H).to(device).eval()
    mask = torch.ones(T, T, dtype=torch.bool, device=device)
    mask[2] = False
    with capture(mha, rows=[2, 3]) as rec:
        mha(torch.randn(B, T, E, device=device), mask=mask)
    w = rec.weights[0]
    assert torch.isfinite(w).all()
    assert w[:, :, 0].abs().max() == 0
    torch.testing.assert_close(w[:, :, 1].sum(-1), torch.ones(B, H, device=device))


def test_one_row_of_a_long_input_stays_linear(
    monkeypatch: pytest.MonkeyPatch, device: torch.device
) -> None:
    mha = MultiHeadAttention(32, 4).to(device).eval()
    computed: list[tuple[int, ...]] = []
    real = kernels.scaled_weights  # every weight matrix of the formula is made here

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = real(*args, **kwargs)
        computed.append(tuple(result.shape))
        return result

    monkeypatch.setattr(kernels, "scaled_weights", spy)
    with torch.no_grad(), capture(mha, rows=[1000]) as rec:
        mha(torch.randn(1, 4096, 32, device=device))
    assert rec.weights[0].shape == (1, 4, 1, 4096)
    assert computed == [(1, 4, 1, 4096)]  # no (4096, 4096) matrix anywhere
    torch.testing.assert_close(rec.weights[0].sum(-1), torch.ones(1, 4, 1, device=device))

    # the same row on a smaller input equals the full weights' row
    monkeypatch.setattr(kernels, "scaled_weights", real)
    x = torch.randn(1, 300, 32, device=device)
    with torch.no_grad():
        _, full = mha(x, is_causal=True, need_weights=True)
        with capture(mha, rows=[123]) as rec:
            mha(x, is_causal=True)
    torch.testing.assert_close(rec.weights[0], full[:, :, 123:124], rtol=1e-5, atol=1e-6)


def test_capture_chunked_rows_device_and_detached(device: torch.device) -> None:
    mha = MultiHeadAttention(E, H).to(device)
    x = torch.randn(B, T, E, requires_grad=True, device=device)
    _, ref = mha(x, need_weights=True)
    with capture(mha, rows=slice(1, None), chunk_size=2, device="cpu") as rec:
        mha(x).sum().backward()  # the forward still trains
    (record,) = rec.records
    assert record.rows == tuple(range(1, T))
    assert not record.weights.requires_grad
    assert record.weights.device == torch.device("cpu")
    torch.testing.assert_close(record.weights, ref[:, :, 1:].detach().cpu(), rtol=1e-5, atol=1e-6)
    assert x.grad is not None


def test_capture_records_every_call_and_stacks(device: torch.device) -> None:
    enc = _encoder(layers=2, device=device)
    with torch.no_grad(), capture(enc, heads=0, rows=0) as rec:
        enc(torch.randn(B, T, E, device=device))
        enc(torch.randn(B, T, E, device=device))
    assert rec.layers == [0, 1, 0, 1]
    assert rec.stack().shape == (4, B, 1, 1, T)
    with torch.no_grad(), capture(enc, layers=[1, 1, -1]) as twice:
        enc(torch.randn(B, T, E, device=device))
    assert twice.layers == [1]  # a layer named twice is recorded once
    rec.clear()
    with pytest.raises(ValueError, match="nothing was recorded"):
        rec.stack()


def test_observer_removed_after_exit_and_after_error(device: torch.device) -> None:
    enc = _encoder(layers=2, device=device)
    modules = [m for _, m in attention_modules(enc)]
    with capture(enc):
        assert all(len(m.observers) == 1 for m in modules)
    assert all(len(m.observers) == 0 for m in modules)

    with pytest.raises(RuntimeError, match="boom"), capture(enc):
        raise RuntimeError("boom")
    assert all(len(m.observers) == 0 for m in modules)

    # an error raised inside the observer (a row past the end) also leaves nothing behind
    with pytest.raises(ValueError, match=r"rows: row 50 is out of range for a query length of 7"):
        with capture(enc, rows=[50]):
            enc(torch.randn(B, T, E, device=device))
    assert all(len(m.observers) == 0 for m in modules)


def test_nested_captures_both_record_and_restore(device: torch.device) -> None:
    mha = MultiHeadAttention(E, H).to(device)
    with capture(mha, heads=[0]) as outer:
        with capture(mha, heads=[1]) as inner:
            mha(torch.randn(B, T, E, device=device))
        assert len(mha.observers) == 1  # the outer one stays
        mha(torch.randn(B, T, E, device=device))
    assert len(mha.observers) == 0
    assert len(inner.records) == 1 and len(outer.records) == 2


def test_capture_errors() -> None:
    enc = _encoder(layers=2)
    with pytest.raises(ValueError, match="contains no multihead.MultiHeadAttention"):
        with capture(nn.Linear(3, 3)):
            pass
    with pytest.raises(ValueError, match=r"layers index 2 is out of range: there are 2"):
        with capture(enc, layers=[2]):
            pass
    with pytest.raises(ValueError, match=r"heads index -7 is out of range: there are 6"):
        with capture(enc, heads=[-7]):
            pass
    with pytest.raises(TypeError, match="heads must be ints, got 1.5"):
        with capture(enc, heads=[1.5]):  # type: ignore[list-item]
            pass
    with pytest.raises(TypeError, match="rows must be None, an int"):
        with capture(enc, rows="0"):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError, match="chunk_size must be a positive int or None, got 0"):
        with capture(enc, chunk_size=0):
            pass
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        with capture("model"):  # type: ignore[arg-type]
            pass


# -- statistics on heads whose answer is known ----------------------------------------------------


def _positional_head(
    kind: str, device: torch.device, t: int = 8
) -> tuple[MultiHeadAttention, torch.Tensor]:
    """A one-head MHA on one-hot inputs whose keys are shifted so that query i reads key
    i (identity), i - 1 (previous) or i + 1 (next), with softmax weight ~1."""
    mha = MultiHeadAttention(t, 1, bias=False).eval()
    eye = torch.eye(t)
    shift = {"identity": 0, "previous": 1, "next": -1}[kind]
    # key j is the one-hot of j + shift: query i matches it when i = j + shift
    wk = torch.roll(eye, shifts=shift, dims=0)
    if shift == 1:
        wk[0] = 0  # no wrap-around
    elif shift == -1:
        wk[-1] = 0
    assert mha.qkv_proj is not None
    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.cat([eye, wk, eye]))
    x = 10.0 * eye[None]  # (1, T, E): scores 100/sqrt(T) on the match
    return mha.to(device), x.to(device)


@pytest.mark.parametrize(
    ("kind", "metric"),
    [("identity", "identity"), ("previous", "previous_token"), ("next", "next_token")],
)
def test_statistics_of_known_heads(kind: str, metric: str, device: torch.device) -> None:
    mha, x = _positional_head(kind, device)
    stats = head_statistics(mha, x, chunk_size=3)
    assert stats.layers == [0] and stats.heads == [0]
    others = {"identity", "previous_token", "next_token"} - {metric}
    assert getattr(stats, metric)[0, 0] == pytest.approx(1.0, abs=1e-6)
    for other in others:
        assert getattr(stats, other)[0, 0] < 0.2
    assert stats.top(metric, k=1) == [(0, 0, pytest.approx(1.0, abs=1e-6))]
    if kind == "identity":
        assert stats.entropy[0, 0] == pytest.approx(0.0, abs=1e-6)


def test_statistics_hand_made_weights(device: torch.device) -> None:
    t = 5
    uniform = torch.full((1, 1, t, t), 1.0 / t)
    identity = torch.eye(t).expand(1, 1, t, t)
    column = torch.zeros(1, 1, t, t)
    column[..., 3] = 1.0  # everyone reads token 3
    weights = torch.cat([uniform, identity, column], dim=1).to(device)  # (B=1, H=3, T, T)
    special = torch.tensor([[True, False, False, False, True]], device=device)
    stats = HeadStatistics.from_weights(
        [weights, weights.flip(1)],
        special_mask=special,
        tokens=[["[CLS]", "a", "b", "c", "[SEP]"]],
        chunk_size=2,
    )
    assert stats.entropy.shape == (2, 3)
    torch.testing.assert_close(stats.entropy[0], torch.tensor([math.log(t), 0.0, 0.0]))
    torch.testing.assert_close(stats.identity[0], torch.tensor([1 / t, 1.0, 1 / t]))
    torch.testing.assert_close(stats.special[0], torch.tensor([2 / t, 2 / t, 0.0]))
    # previous-token: queries 1..4 only; for the column head only query 4 reads token 3
    torch.testing.assert_close(stats.previous_token[0], torch.tensor([1 / t, 0.0, 1 / 4]))
    assert stats.most_attended[0, 0, 2] == 3 and stats.most_attended_weight[0, 0, 2] == 1.0
    assert stats.most_attended[0, 1, 0] == 3  # layer 1 has the heads reversed
    assert stats.num_queries == t
    assert "c (1.00)" in str(stats)  # the table names the most-attended token
    assert stats.to_dict()["identity"][0] == [0.2, 1.0, 0.2]


def test_statistics_exclude_padding(device: torch.device) -> None:
    t = 6
    # real queries (0..3) read the previous token; padding queries (4, 5) read themselves
    w = torch.zeros(1, 1, t, t)
    for i in range(1, 4):
        w[0, 0, i, i - 1] = 1.0
    w[0, 0, 0, 0] = 1.0
    w[0, 0, 4, 4] = w[0, 0, 5, 5] = 1.0
    valid = torch.tensor([[True] * 4 + [False] * 2], device=device)
    stats = HeadStatistics.from_weights([w.to(device)], valid_mask=valid)
    assert stats.num_queries == 4
    assert stats.identity[0, 0] == pytest.approx(0.25)  # only query 0's self-attention counts
    assert stats.previous_token[0, 0] == pytest.approx(1.0)  # queries 1..3
    assert stats.next_token[0, 0] == pytest.approx(0.0)  # query 3's next is padding: excluded
    assert stats.most_attended[0, 0, 0] < 4


@pytest.mark.parametrize("num_kv_heads", [None, 2])
def test_head_statistics_chunked_equals_full(
    num_kv_heads: int | None, device: torch.device
) -> None:
    enc = _encoder(num_kv_heads, device=device)
    x, km = torch.randn(B, T, E, device=device), _key_mask(device)
    with torch.no_grad():
        _, ref = _weights_by_need_weights(enc, x, key_mask=km, is_causal=True)
    want = HeadStatistics.from_weights(ref, valid_mask=km)
    got = head_statistics(enc, x, key_mask=km, is_causal=True, chunk_size=2)
    for name in ("entropy", "identity", "previous_token", "next_token", "special"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    assert torch.equal(got.most_attended, want.most_attended)
    part = head_statistics(enc, x, key_mask=km, is_causal=True, layers=[1], heads=[4, 2])
    assert part.layers == [1] and part.heads == [4, 2]
    torch.testing.assert_close(part.identity[0], want.identity[1, [4, 2]])


def test_statistics_table_without_rich_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = HeadStatistics.from_weights([torch.full((1, 1, 3, 3), 1 / 3)])
    monkeypatch.setitem(sys.modules, "rich.table", None)
    with pytest.raises(ImportError, match=r"needs rich: pip install 'multihead\[viz\]'"):
        stats.table()


def test_head_statistics_errors() -> None:
    enc = _encoder(layers=1)
    x = torch.randn(B, T, E)
    with pytest.raises(ValueError, match="chunk_size must be a positive int, got 0"):
        head_statistics(enc, x, chunk_size=0)
    with pytest.raises(TypeError, match="inputs must be a tensor or a tokenized batch"):
        head_statistics(enc, [1, 2, 3])
    with pytest.raises(ValueError, match=r"valid_mask must have shape \(B, T\) = \(2, 7\)"):
        head_statistics(enc, x, valid_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="metric must be one of entropy"):
        head_statistics(enc, x).top("loudness")


def test_no_module_shadows_a_public_function() -> None:
    """Importing every module of multihead.observe and multihead.circuits leaves their public
    names the functions (a submodule named like a function would replace it on the package once
    imported)."""
    import importlib
    import pkgutil

    import multihead.circuits as circuits
    import multihead.observe as observe

    for package, names in (
        (observe, ("capture", "head_statistics")),
        (circuits, ("intervene", "record_heads", "head_importance", "patch_heads")),
    ):
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{info.name}")
        for name in names:
            assert callable(getattr(package, name)) and not isinstance(
                getattr(package, name), type(package)
            ), name


# -- token-identity and Clark et al.'s metrics -------------------------------------------------


def _repeated_ids() -> torch.Tensor:
    """(1, 10): 7 distinct tokens, then the first 3 again (positions 7, 8, 9 repeat 0, 1, 2)."""
    return torch.tensor([[5, 9, 2, 7, 3, 8, 1, 5, 9, 2]])


def _head(kind: str, ids: torch.Tensor) -> torch.Tensor:
    """Hand-built causal weights (1, 1, T, T) of a named head; queries without an earlier
    occurrence of their token read themselves."""
    t = ids.shape[1]
    w = torch.zeros(1, 1, t, t)
    for q in range(t):
        earlier = [p for p in range(q) if ids[0, p] == ids[0, q]]
        if kind == "previous":
            w[0, 0, q, max(q - 1, 0)] = 1.0
        elif earlier and kind == "induction":
            w[0, 0, q, earlier[-1] + 1] = 1.0
        elif earlier and kind == "duplicate":
            w[0, 0, q, earlier[-1]] = 1.0
        else:
            w[0, 0, q, q] = 1.0
    return w


def test_induction_and_duplicate_token_scores_of_hand_built_heads(device: torch.device) -> None:
    ids = _repeated_ids()
    heads = torch.cat([_head(k, ids) for k in ("induction", "duplicate", "previous")], dim=1)
    ids, heads = ids.to(device), heads.to(device)
    stats = HeadStatistics.from_weights([heads], token_ids=ids, chunk_size=3)
    # three queries (7, 8, 9) have a token that occurred before
    torch.testing.assert_close(stats.induction[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(stats.duplicate_token[0], torch.tensor([0.0, 1.0, 0.0]))
    assert stats.top("induction", 1) == [(0, 0, 1.0)]
    assert stats.top("duplicate_token", 1) == [(0, 1, 1.0)]
    # a token repeated twice: the induction target is after *each* earlier occurrence
    ids2 = torch.tensor([[4, 6, 4, 6, 4]], device=device)
    uniform = torch.tril(torch.ones(5, 5, device=device))
    uniform = (uniform / uniform.sum(-1, keepdim=True))[None, None]
    got = HeadStatistics.from_weights([uniform], token_ids=ids2).induction[0, 0]
    # queries 2, 3, 4 (weights 1/3, 1/4, 1/5) on positions {1}, {2}, {1, 3}
    assert float(got) == pytest.approx((1 / 3 + 1 / 4 + 2 / 5) / 3)


def test_token_metrics_are_nan_without_ids_and_top_says_why(device: torch.device) -> None:
    heads = _head("induction", _repeated_ids()).to(device)
    stats = HeadStatistics.from_weights([heads])
    assert bool(stats.induction.isnan().all()) and bool(stats.to_sep.isnan().all())
    assert stats.to_dict()["induction"] == [[None]]
    with pytest.raises(
        ValueError, match="'induction' is NaN for every head: it needs the inputs' token ids"
    ):
        stats.top("induction")
    with pytest.raises(
        ValueError, match=r"token_ids must be an integer tensor \(B, T\) = \(1, 10\)"
    ):
        HeadStatistics.from_weights([heads], token_ids=torch.zeros(1, 10, device=device))


def test_head_statistics_takes_ids_from_an_integer_input_chunked(device: torch.device) -> None:
    """head_statistics on a model run on ids equals from_weights on the captured weights."""
    from multihead.models import TransformerLM

    lm = TransformerLM(11, E, H, 2, 40, max_len=16).to(device).eval()
    ids = torch.randint(11, (B, 12), device=device)
    with torch.no_grad(), capture(lm) as rec:
        lm(ids)
    want = HeadStatistics.from_weights(rec.weights, token_ids=ids)
    got = head_statistics(lm, ids, chunk_size=5)
    for name in ("induction", "duplicate_token", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    assert not bool(got.induction.isnan().any())
    # a float input (embeddings) has no token ids: NaN, as documented
    enc = _encoder(layers=1, device=device)
    assert bool(head_statistics(enc, torch.randn(B, T, E, device=device)).induction.isnan().all())


def test_clark_metrics_of_hand_made_weights(device: torch.device) -> None:
    tokens = [["[CLS]", "the", ",", "cat", ".", "[SEP]"]]
    t = len(tokens[0])
    w = torch.zeros(1, 2, t, t)
    w[0, 0, :, 5] = 1.0  # head 0: everyone reads [SEP]
    w[0, 1] = torch.full((t, t), 1 / t)  # head 1: uniform
    w = w.to(device)
    stats = HeadStatistics.from_weights([w], tokens=tokens)
    torch.testing.assert_close(stats.to_sep[0], torch.tensor([1.0, 1 / t]))
    torch.testing.assert_close(stats.to_cls[0], torch.tensor([0.0, 1 / t]))
    torch.testing.assert_close(stats.to_punctuation[0], torch.tensor([0.0, 2 / t]))
    torch.testing.assert_close(stats.sep_to_sep[0], torch.tensor([1.0, 1 / t]))
    torch.testing.assert_close(stats.cls_entropy[0], torch.tensor([0.0, math.log(t)]))
    assert stats.top("to_sep", 1) == [(0, 0, 1.0)]
    # padding queries and keys are left out; a batch without [SEP] has NaN sep_to_sep
    no_sep = HeadStatistics.from_weights([w], tokens=[["[CLS]", "a", "b", "c", "d", "e"]])
    assert bool(no_sep.sep_to_sep.isnan().all()) and not bool(no_sep.to_cls.isnan().any())


def test_a_tokenized_batch_gives_ids_and_tokens_chunked_equals_full(device: torch.device) -> None:
    """input_ids feed the token-identity metrics, tokens the [CLS]/[SEP]/punctuation ones."""
    from types import SimpleNamespace

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, E)
            self.enc = _encoder(layers=2)

        def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return self.enc(self.embed(ids), key_mask=attention_mask.bool())

    tokens = [["[CLS]", "a", "b", ",", "a", "b", "[SEP]"], ["[CLS]", "c", ".", "[SEP]"]]
    ids = torch.tensor([[1, 5, 6, 2, 5, 6, 3], [1, 7, 4, 3, 0, 0, 0]], device=device)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], device=device)
    batch = SimpleNamespace(input_ids=ids, attention_mask=mask, tokens=tokens)
    model = Tiny().to(device).eval()
    got = head_statistics(model, batch, chunk_size=3)
    with torch.no_grad(), capture(model) as rec:
        model(ids, mask)
    want = HeadStatistics.from_weights(
        rec.weights, valid_mask=mask.bool(), token_ids=ids, tokens=tokens
    )
    for name in ("induction", "duplicate_token", "to_cls", "to_sep", "to_punctuation"):
        assert not bool(getattr(got, name).isnan().any()), name
        torch.testing.assert_close(getattr(got, name), getattr(want, name))
    for name in ("sep_to_sep", "cls_entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name))


def previous_token_map(t: int) -> torch.Tensor:
    """(T, T) one-hot: each query reads the token before it, the first reads itself."""
    prev = torch.zeros(t, t)
    prev[0, 0] = 1.0
    prev[torch.arange(1, t), torch.arange(t - 1)] = 1.0
    return prev


def last_key_map(t: int) -> torch.Tensor:
    """(T, T) one-hot: every query reads the last key ([SEP] in the tests' tokens)."""
    sep = torch.zeros(t, t)
    sep[:, t - 1] = 1.0
    return sep


def test_roles_of_hand_built_heads(device: torch.device) -> None:
    # head 0 reads the token before (the first reads itself), head 1 reads [SEP], head 2 is
    # uniform over 10 keys (no place gets 0.3): the labels follow from the patterns alone.
    t = 10
    prev = previous_token_map(t)
    sep = last_key_map(t)
    uniform = torch.full((t, t), 1.0 / t)
    weights = torch.stack([prev, sep, uniform])[None, None].to(device)  # (L=1, B=1, H=3, T, T)
    tokens = [["[CLS]", *"abcdefgh", "[SEP]"]]
    stats = HeadStatistics.from_weights(weights, tokens=tokens)
    assert stats.roles() == [["previous token", "[SEP]", "broad"]]
    assert stats.to_dict()["role"] == stats.roles()
    # without tokens the [SEP] score is unknown and can't win: head 1 reads the last key,
    # which is the next token only for the query before it, so nothing reaches 0.3; but it
    # reads one key (entropy 0): "other", not "broad", which is for heads that spread
    assert HeadStatistics.from_weights(weights).roles() == [["previous token", "other", "broad"]]
    assert "previous token" in str(stats)


def test_roles_measure_heads_above_chance_in_a_causal_model(device: torch.device) -> None:
    # A causal head that reads every visible key alike: query i gives 1/(i+1) to each of its
    # i+1 keys. Its raw identity, mean over i of 1/(i+1), is 0.41 at T=6 (above the 0.3 floor),
    # yet it does nothing but spread: it must be "broad". A causal previous-token head (query 0
    # reads itself) stays "previous token".
    t = 6
    even = torch.tril(torch.ones(t, t))
    even = even / even.sum(-1, keepdim=True)
    prev = previous_token_map(t)
    weights = torch.stack([even, prev])[None, None].to(device)  # (L=1, B=1, H=2, T, T)
    stats = HeadStatistics.from_weights(weights, causal=True)
    harmonic = sum(1 / (i + 1) for i in range(t)) / t  # the reference, by hand
    assert stats.identity[0, 0].item() == pytest.approx(harmonic)
    assert stats.identity[0, 0].item() > 0.3
    assert stats.chance is not None
    assert stats.chance["identity"][0, 0].item() == pytest.approx(harmonic)
    assert stats.roles() == [["broad", "previous token"]]


def _causal_uniform(t: int) -> torch.Tensor:
    """(T, T) a causal head reading every visible key alike: query i gives 1/(i+1) to each."""
    even = torch.tril(torch.ones(t, t))
    return even / even.sum(-1, keepdim=True)


def test_a_decoder_s_sink_head_is_sink_and_broad_means_high_entropy(device: torch.device) -> None:
    # A causal model's four heads, hand-built: all weight on token 0 (the attention sink), every
    # visible key alike, the token before (sharp), and two tokens back (sharp, a place no role
    # names). References by hand: the sink's first_token is 1, its chance the mean of 1/(i+1);
    # the uniform head's entropy is its chance level, the mean of log(i+1).
    t = 12
    sink = torch.zeros(t, t)
    sink[:, 0] = 1.0
    two_back = torch.zeros(t, t)
    two_back[torch.arange(t), (torch.arange(t) - 2).clamp(min=0)] = 1.0
    heads = [sink, _causal_uniform(t), previous_token_map(t), two_back]
    weights = torch.stack(heads)[None, None].to(device)  # (L=1, B=1, H=4, T, T)
    tokens = [["The", *"abcdefghij", "."]]  # a decoder's text: no [CLS]
    stats = HeadStatistics.from_weights(weights, tokens=tokens, causal=True)
    assert stats.roles() == [["sink", "broad", "previous token", "other"]]
    assert stats.first_token[0, 0].item() == pytest.approx(1.0)
    assert stats.chance is not None
    harmonic = sum(1 / (i + 1) for i in range(t)) / t
    assert stats.chance["first_token"][0, 0].item() == pytest.approx(harmonic)
    mean_log = sum(math.log(i + 1) for i in range(t)) / t
    assert stats.chance["entropy"][0, 0].item() == pytest.approx(mean_log)
    assert stats.entropy[0, 1].item() == pytest.approx(mean_log, abs=1e-5)
    assert stats.spread()[0].tolist() == pytest.approx([0.0, 1.0, 0.0, 0.0], abs=1e-5)
    # "broad" is not where the sharpest heads go: every broad head spreads
    broad = [j for j, role in enumerate(stats.roles()[0]) if role == "broad"]
    assert all(stats.entropy[0, j].item() >= 0.5 * mean_log for j in broad)


def test_bert_s_first_token_is_cls_not_a_sink(device: torch.device) -> None:
    # BERT's first token is [CLS]: to_cls measures it, first_token leaves such texts out (NaN),
    # so a head reading [CLS] is "[CLS]"; without the tokens, it is the first token: "sink"
    t = 10
    cls = torch.zeros(t, t)
    cls[:, 0] = 1.0
    weights = cls[None, None, None].to(device)  # (1, 1, 1, T, T)
    stats = HeadStatistics.from_weights(weights, tokens=[["[CLS]", *"abcdefgh", "[SEP]"]])
    assert math.isnan(stats.first_token[0, 0].item())
    assert stats.roles() == [["[CLS]"]]
    assert HeadStatistics.from_weights(weights).roles() == [["sink"]]


def test_weight_on_a_token_the_text_lacks_is_unknown(device: torch.device) -> None:
    # a text with [CLS] but no [SEP] and no punctuation: to_sep and to_punctuation are NaN,
    # not 0; to_cls is measured
    t = 4
    weights = torch.full((1, 1, 1, t, t), 1.0 / t, device=device)
    stats = HeadStatistics.from_weights(weights, tokens=[["[CLS]", "a", "b", "c"]])
    assert stats.to_cls[0, 0].item() == pytest.approx(1 / t)
    assert math.isnan(stats.to_sep[0, 0].item()) and math.isnan(stats.to_punctuation[0, 0].item())


def test_chance_does_not_depend_on_the_heads_chosen(device: torch.device) -> None:
    # head 0 reads the token before (one-hot: every other key gets exactly 0); alone or beside
    # other heads, its chance level is 1/T over the T keys it may see, and its role the same
    t = 10
    prev = previous_token_map(t)
    sep = last_key_map(t)
    both = torch.stack([prev, sep])[None, None].to(device)  # (1, 1, 2, T, T)
    tokens = [["[CLS]", *"abcdefgh", "[SEP]"]]
    alone = HeadStatistics.from_weights(both[:, :, :1], tokens=tokens)
    pair = HeadStatistics.from_weights(both, tokens=tokens)
    assert alone.chance is not None and pair.chance is not None
    assert alone.chance["previous_token"][0, 0].item() == pytest.approx(1 / t)
    assert pair.chance["previous_token"][0, 0].item() == pytest.approx(1 / t)
    assert alone.roles() == [["previous token"]]
    assert pair.roles() == [["previous token", "[SEP]"]]


def test_chance_of_a_model_counts_the_keys_its_mask_allows(device: torch.device) -> None:
    # a causal encoder through head_statistics: the chance level of identity is the mean over
    # queries of 1/(i+1), whichever heads are chosen (the reference, by hand)
    torch.manual_seed(0)
    t = 7
    layer = TransformerEncoderLayer(16, 4, 32).to(device)
    x = torch.randn(2, t, 16, device=device)
    expected = sum(1 / (i + 1) for i in range(t)) / t
    for heads in (None, [2], [0, 3]):
        stats = head_statistics(layer, x, heads=heads, is_causal=True)
        assert stats.chance is not None
        got = stats.chance["identity"]
        torch.testing.assert_close(got, torch.full_like(got, expected))
