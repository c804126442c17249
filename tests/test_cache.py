"""KVCache: decoding step by step with the cache equals the full causal forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import KVCache, MultiHeadAttention
from multihead.layers import TransformerEncoder, TransformerEncoderLayer
from multihead.positions import LearnedPositionalEmbedding

# Pairwise-distinct sizes, so a swapped dimension fails loudly.
B, T, E, H = 2, 7, 24, 6


def _decode_in_chunks(run, x: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Feed x (B, T, E) through ``run(piece)`` in pieces of the given lengths; concatenate."""
    outs, start = [], 0
    for n in chunks:
        outs.append(run(x[:, start : start + n]))
        start += n
    assert start == x.shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("num_kv_heads", [None, 3, 1])
@pytest.mark.parametrize("chunks", [[1] * T, [3, 1, 1, 2]])
def test_attention_step_by_step_equals_full_forward(
    num_kv_heads: int | None, chunks: list[int], device: torch.device
) -> None:
    mha = MultiHeadAttention(E, H, num_kv_heads=num_kv_heads).to(device).eval()
    hk = num_kv_heads or H
    x = torch.randn(B, T, E, device=device)
    with torch.no_grad():
        full = mha(x, is_causal=True)
        cache = KVCache(1, B, hk, E // H, max_len=T + 3, device=device)
        steps = _decode_in_chunks(lambda p: mha(p, is_causal=True, cache=cache[0]), x, chunks)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=0)
    assert cache.length == T and cache.lengths == [T]


@pytest.mark.parametrize("num_kv_heads", [None, 2])
@pytest.mark.parametrize("norm_first", [True, False])
def test_layer_stack_step_by_step_equals_full_forward(
    num_kv_heads: int | None, norm_first: bool, device: torch.device
) -> None:
    layers = [
        TransformerEncoderLayer(E, H, 40, num_kv_heads=num_kv_heads, norm_first=norm_first)
        for _ in range(3)
    ]
    stack = TransformerEncoder(layers, norm=nn.LayerNorm(E)).to(device).eval()
    x = torch.randn(B, T, E, device=device)
    with torch.no_grad():
        full = stack(x, is_causal=True)
        cache = KVCache(3, B, num_kv_heads or H, E // H, max_len=T, device=device)
        steps = _decode_in_chunks(lambda p: stack(p, is_causal=True, cache=cache), x, [2] + [1] * 5)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=0)
    assert cache.lengths == [T, T, T]


def test_left_padded_prompts_with_key_mask_and_per_row_positions(device: torch.device) -> None:
    """Rows of different lengths, left-padded, decoded together: each row as if alone."""
    vocab, max_len = 11, 16
    embed = nn.Embedding(vocab, E).to(device)
    pos = LearnedPositionalEmbedding(max_len, E).to(device)
    stack = (
        TransformerEncoder([TransformerEncoderLayer(E, H, 40, num_kv_heads=2) for _ in range(2)])
        .to(device)
        .eval()
    )

    def forward(ids, positions, key_mask=None, cache=None):
        return stack(pos(embed(ids), positions), key_mask=key_mask, is_causal=True, cache=cache)

    lengths = [3, 6]  # prompt lengths; both rows then receive the same 4 new tokens
    prompts = [torch.randint(vocab, (n,), device=device) for n in lengths]
    new = torch.randint(vocab, (B, 4), device=device)
    width = max(lengths)
    with torch.no_grad():
        # Reference: each row alone, unpadded, full causal forward over prompt + new tokens.
        alone = [torch.cat([p, n])[None] for p, n in zip(prompts, new, strict=True)]
        expected = [forward(ids, None)[0, -4:] for ids in alone]
        ids = torch.zeros(B, width, dtype=torch.long, device=device)
        key_mask = torch.zeros(B, width, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = p
            key_mask[i, width - len(p) :] = True
        # Per-row positions: a left-padded row's first real token is position 0.
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = KVCache(2, B, 2, E // H, max_len=width + 4, device=device)
        forward(ids, positions, key_mask, cache)
        outs = []
        for t in range(4):
            key_mask = torch.cat(
                [key_mask, torch.ones(B, 1, dtype=torch.bool, device=device)], dim=1
            )
            positions = positions[:, -1:] + 1
            outs.append(forward(new[:, t : t + 1], positions, key_mask, cache))
        got = torch.cat(outs, dim=1)
    for i in range(B):
        torch.testing.assert_close(got[i], expected[i], atol=1e-5, rtol=0)


def test_writes_in_place_without_reallocating(device: torch.device) -> None:
    cache = KVCache(2, 1, 2, 4, max_len=5, device=device)
    keys_ptr = cache.keys.data_ptr()
    k = torch.randn(1, 2, 3, 4, device=device)
    v = torch.randn(1, 2, 3, 4, device=device)
    got_k, got_v = cache[1].update(k, v)
    assert got_k.shape == (1, 2, 3, 4)
    assert got_k.data_ptr() == cache.keys[1].data_ptr()  # a view of the buffer, not a copy
    torch.testing.assert_close(cache.keys[1, :, :, :3], k)
    torch.testing.assert_close(cache.values[1, :, :, :3], v)
    assert cache.lengths == [0, 3] and cache.length == 0
    k2 = torch.randn(1, 2, 1, 4, device=device)
    got_k, _ = cache[1].update(k2, k2)
    torch.testing.assert_close(got_k, torch.cat([k, k2], dim=2))
    assert cache.keys.data_ptr() == keys_ptr


def test_reset_starts_over(device: torch.device) -> None:
    cache = KVCache(1, 1, 1, 2, max_len=3, device=device)
    cache[0].update(torch.ones(1, 1, 3, 2, device=device), torch.ones(1, 1, 3, 2, device=device))
    cache.reset()
    assert cache.length == 0
    k, _ = cache[0].update(
        torch.zeros(1, 1, 1, 2, device=device), torch.zeros(1, 1, 1, 2, device=device)
    )
    assert k.shape == (1, 1, 1, 2) and k.abs().sum() == 0


def test_errors() -> None:
    cache = KVCache(2, 1, 2, 4, max_len=3)
    with pytest.raises(ValueError, match=r"at most max_len=3 positions: layer 0 has 2 and got 2"):
        cache[0].update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
        cache[0].update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    assert cache.lengths[0] == 2  # a refused update stores nothing
    with pytest.raises(ValueError, match=r"k must have shape \(B, Hk, T, D\) = \(1, 2, T, 4\)"):
        cache[1].update(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4))
    with pytest.raises(ValueError, match="same number of positions"):
        cache[1].update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 2, 4))
    with pytest.raises(TypeError, match="dtype torch.float64 but the cache holds torch.float32"):
        cache[1].update(torch.zeros(1, 2, 1, 4).double(), torch.zeros(1, 2, 1, 4).double())
    with pytest.raises(IndexError, match=r"int in \[0, 2\), got 2"):
        cache[2]
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        KVCache(1, 1, 1, 1, max_len=0)


def test_a_call_that_raises_leaves_the_cache_untouched(device: torch.device) -> None:
    """Every argument is checked before the cache is written: a failed step, then a corrected
    retry, gives what the corrected step alone gives."""
    mha = MultiHeadAttention(E, H).to(device).eval()
    x = torch.randn(B, 4, E, device=device)
    clean, broken = (
        KVCache(1, B, H, E // H, 16, device=device),
        KVCache(1, B, H, E // H, 16, device=device),
    )
    with torch.no_grad():
        mha(x[:, :3], cache=clean[0], is_causal=True)
        mha(x[:, :3], cache=broken[0], is_causal=True)
        bad_calls = [
            {
                "key_mask": torch.ones(B, 3, dtype=torch.bool, device=device)
            },  # S is 4 with the cache, not 3
            {
                "mask": torch.ones(1, 5, dtype=torch.bool, device=device)
            },  # does not broadcast to (T, S)
            {"key_mask": torch.ones(B, 4, device=device)},  # not bool
            {"is_causal": torch.tensor([True, False], device=device)},  # not a bool
        ]
        for kwargs in bad_calls:
            with pytest.raises((TypeError, ValueError)):
                mha(x[:, 3:], cache=broken[0], **kwargs)
            assert broken.length == 3
        want = mha(x[:, 3:], cache=clean[0], is_causal=True)
        got = mha(x[:, 3:], cache=broken[0], is_causal=True)
    assert broken.length == clean.length == 4
    torch.testing.assert_close(got, want, atol=0, rtol=0)
