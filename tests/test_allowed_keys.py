"""One rule reads every mask as allowed or hidden keys (``multihead.kernels.allowed``).

An eager-style additive mask writes ``torch.finfo(dtype).min`` where a key is hidden: softmax
gives such a key exactly zero weight, so the head statistics' chance levels (the keys each query
may see) and roles must be those of the same mask written as bool. References are counted by
hand from the window's shape.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from multihead import TransformerEncoder, TransformerEncoderLayer, functional, kernels
from multihead.observe import HeadStatistics, capture, head_statistics

B, T, E, H = 2, 9, 24, 6
WINDOW = 3  # query i sees keys i - 2 .. i


def _window(t: int, window: int) -> Tensor:
    """(T, T) bool: causal within a sliding window."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    return (j <= i) & (j > i - window)


def _additive(allowed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The same mask as eager's: 0 where allowed, the dtype's minimum where hidden."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _chance_by_hand(allowed: Tensor, real: Tensor) -> dict[str, float]:
    """Per batch the identity and previous-token chance levels: a head spreading its weight
    evenly over the keys each real query may see, averaged over the real queries (those with a
    real key before them, for previous_token). allowed (B, T, T), real (B, T)."""
    identity, previous, n_id, n_prev = 0.0, 0.0, 0, 0
    for b in range(allowed.shape[0]):
        for i in range(allowed.shape[1]):
            if not real[b, i]:
                continue
            seen = [j for j in range(allowed.shape[2]) if allowed[b, i, j] and real[b, j]]
            identity += (i in seen) / len(seen)
            n_id += 1
            if i > 0 and real[b, i - 1]:
                previous += (i - 1 in seen) / len(seen)
                n_prev += 1
    return {"identity": identity / n_id, "previous_token": previous / n_prev}


def _check_same_roles(
    additive: HeadStatistics, boolean: HeadStatistics, want: dict[str, float]
) -> None:
    assert additive.chance is not None and boolean.chance is not None
    for metric, value in want.items():
        expected = torch.full_like(boolean.chance[metric], value)
        torch.testing.assert_close(boolean.chance[metric], expected)
        torch.testing.assert_close(additive.chance[metric], expected)
    assert additive.chance.keys() == boolean.chance.keys()
    for metric in additive.chance:
        torch.testing.assert_close(additive.chance[metric], boolean.chance[metric], equal_nan=True)
    torch.testing.assert_close(additive.identity, boolean.identity)
    torch.testing.assert_close(additive.previous_token, boolean.previous_token)
    assert additive.roles() == boolean.roles()


def test_allowed_reads_bool_and_additive_masks_alike() -> None:
    allowed = _window(T, WINDOW)
    assert torch.equal(kernels.allowed(allowed), allowed)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert torch.equal(kernels.allowed(_additive(allowed, dtype)), allowed)
        # -inf hides, NaN propagates (allowed), any other finite value is an addend
        values = torch.tensor([float("-inf"), float("nan"), -1e4, 0.0, 3.0], dtype=dtype)
        assert kernels.allowed(values).tolist() == [False, True, True, True, True]


def test_a_row_hidden_by_finfo_min_is_empty_as_under_a_bool_mask() -> None:
    q, k, v = torch.randn(B, H, T, 4), torch.randn(B, H, T, 4), torch.randn(B, H, T, 5)
    allowed = _window(T, WINDOW)
    allowed[0] = False  # query 0 sees nothing
    want_out, want_w = functional.attention(q, k, v, mask=allowed, need_weights=True)
    got_out, got_w = functional.attention(q, k, v, mask=_additive(allowed), need_weights=True)
    assert not got_out[:, :, 0].any() and not got_w[:, :, 0].any()  # zeros, as documented
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_w, want_w)
    torch.testing.assert_close(functional.attention(q, k, v, mask=_additive(allowed)), want_out)


def test_roles_under_an_additive_window_equal_those_under_the_bool_window() -> None:
    enc = TransformerEncoder([TransformerEncoderLayer(E, H, 40) for _ in range(2)]).eval()
    x = torch.randn(B, T, E)
    allowed = _window(T, WINDOW)
    with torch.no_grad(), capture(enc) as rec:
        enc(x, mask=allowed)
        enc(x, mask=_additive(allowed))
    for w_bool, w_add in zip(rec.weights[:2], rec.weights[2:], strict=True):
        torch.testing.assert_close(w_add, w_bool)  # softmax makes finfo.min exactly hidden
    boolean = head_statistics(enc, x, mask=allowed)
    additive = head_statistics(enc, x, mask=_additive(allowed))
    real = torch.ones(B, T, dtype=torch.bool)
    want = _chance_by_hand(allowed.expand(B, T, T), real)
    _check_same_roles(additive, boolean, want)


def test_roles_of_a_transformers_model_under_an_additive_mask() -> None:
    transformers = pytest.importorskip("transformers", minversion="5")
    pytest.importorskip("multihead.hf")
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaModel(config).eval()
    model.set_attn_implementation("multihead")
    pad = 3
    ids = torch.randint(4, 100, (B, T))
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, :pad] = False  # left padding: hidden as keys from every query, itself included
    allowed = _window(T, WINDOW)[None] & real[:, None, :]  # (B, T, T)
    # a 4-D mask reaches the attention function as it is: bool, or eager's additive floats
    boolean = head_statistics(model, ids, valid_mask=real, attention_mask=allowed[:, None])
    additive = head_statistics(
        model, ids, valid_mask=real, attention_mask=_additive(allowed[:, None])
    )
    _check_same_roles(additive, boolean, _chance_by_hand(allowed, real))
