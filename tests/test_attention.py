"""MultiHeadAttention against torch.nn.MultiheadAttention and the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch
from reference import reference_attention
from torch import nn

from multihead import MultiHeadAttention

# Pairwise-distinct sizes, so a swapped dimension fails loudly.
B, T, S, E, H = 2, 5, 7, 24, 3


def _torch_pair(device: torch.device, **kwargs) -> tuple[nn.MultiheadAttention, MultiHeadAttention]:
    ref = nn.MultiheadAttention(E, H, batch_first=True, **kwargs).to(device).eval()
    with torch.no_grad():  # torch zeroes biases at init: give them values worth comparing
        for name, p in ref.named_parameters():
            if "bias" in name:
                p.normal_()
    return ref, MultiHeadAttention.from_torch(ref).eval()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kv_dims", [None, (11, 13)])
def test_matches_torch_multihead_attention(
    bias: bool, kv_dims: tuple[int, int] | None, device: torch.device
) -> None:
    kdim, vdim = kv_dims or (None, None)
    ref, ours = _torch_pair(device, bias=bias, kdim=kdim, vdim=vdim)
    assert ours.packed == (kv_dims is None)
    x = torch.randn(B, T, E, device=device)
    key = torch.randn(B, S, kdim or E, device=device)
    value = torch.randn(B, S, vdim or E, device=device)
    pad = torch.zeros(B, S, dtype=torch.bool, device=device)
    pad[1, 4:] = True
    attn_mask = torch.rand(T, S, device=device) > 0.8  # torch: True = NOT allowed
    attn_mask[:, 0] = False
    expected, expected_w = ref(
        x, key, value, key_padding_mask=pad, attn_mask=attn_mask, average_attn_weights=False
    )
    out, w = ours(x, key, value, key_mask=~pad, mask=~attn_mask, need_weights=True)
    assert out.shape == (B, T, E) and w.shape == (B, H, T, S)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours(x, key, value, key_mask=~pad, mask=~attn_mask), out)


def test_self_attention_and_explicit_key_agree(device: torch.device) -> None:
    ref, ours = _torch_pair(device)
    x = torch.randn(B, T, E, device=device)
    expected, _ = ref(
        x,
        x,
        x,
        is_causal=True,
        attn_mask=nn.Transformer.generate_square_subsequent_mask(T, device=device),
    )
    torch.testing.assert_close(ours(x, is_causal=True), expected, atol=1e-5, rtol=1e-5)
    # a copy, not x itself: `key is query` is taken as self-attention, the path compared with
    y = x.clone()
    torch.testing.assert_close(ours(x, y, is_causal=True), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours(x, y, is_causal=True), ours(x, is_causal=True))
    torch.testing.assert_close(ours(x, y, y.clone()), ours(x))


def test_from_torch_sequence_first_and_to_torch_round_trip(device: torch.device) -> None:
    ref = nn.MultiheadAttention(E, H, kdim=11, vdim=13).to(device).eval()  # (T, B, E) layout
    ours = MultiHeadAttention.from_torch(ref).eval()
    x, key, value = (
        torch.randn(T, B, E, device=device),
        torch.randn(S, B, 11, device=device),
        torch.randn(S, B, 13, device=device),
    )
    expected, _ = ref(x, key, value)
    out = ours(x.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1))
    torch.testing.assert_close(out.transpose(0, 1), expected, atol=1e-5, rtol=1e-5)
    back = ours.to_torch(batch_first=False).eval()
    torch.testing.assert_close(back(x, key, value)[0], expected, atol=0, rtol=0)
    for p, r in zip(back.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, r)


def test_to_torch_refuses_what_torch_cannot_represent() -> None:
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) != num_heads \(4\)"):
        MultiHeadAttention(32, 4, num_kv_heads=1).to_torch()
    with pytest.raises(ValueError, match=r"out_dim \(8\) != embed_dim \(32\)"):
        MultiHeadAttention(32, 4, out_dim=8).to_torch()
    with pytest.raises(ValueError, match="add_bias_kv=True or add_zero_attn=True"):
        MultiHeadAttention.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="must be a torch.nn.MultiheadAttention, got Linear"):
        MultiHeadAttention.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]


def _qkv_blocks(m: MultiHeadAttention) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The (weight, bias) of the q, k and v projections, read off the documented layout:
    ``qkv_proj``'s rows are [q heads | k heads | v heads], else three projections."""
    if m.qkv_proj is None:
        assert m.q_proj is not None and m.k_proj is not None and m.v_proj is not None
        return [(p.weight, p.bias) for p in (m.q_proj, m.k_proj, m.v_proj)]
    sizes = [m.num_heads * m.head_dim] + [m.num_kv_heads * m.head_dim] * 2
    weights = m.qkv_proj.weight.split(sizes)
    bias = m.qkv_proj.bias
    biases = bias.split(sizes) if bias is not None else (None, None, None)
    return list(zip(weights, biases, strict=True))


def _manual(m: MultiHeadAttention, x: torch.Tensor, y: torch.Tensor, **kw) -> torch.Tensor:
    """The module's output recomputed from its weights with the float64 reference."""
    (wq, bq), (wk, bk), (wv, bv) = _qkv_blocks(m)
    d = m.head_dim

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], n, d).transpose(1, 2)

    q = heads(nn.functional.linear(x, wq, bq), m.num_heads)
    k = heads(nn.functional.linear(y, wk, bk), m.num_kv_heads)
    v = heads(nn.functional.linear(y, wv, bv), m.num_kv_heads)
    out, _ = reference_attention(q, k, v, **kw)
    out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1).float()
    return m.out_proj(out)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_heads": 1},  # multi-query
        {"num_heads": 6, "num_kv_heads": 2},  # grouped-query
        {"head_dim": E},  # seed 004's wide heads
        {"head_dim": 5, "out_dim": 9},
    ],
)
def test_head_layouts_match_reference(kwargs: dict, device: torch.device) -> None:
    kwargs = {"num_heads": H, **kwargs}
    m = MultiHeadAttention(E, kwargs.pop("num_heads"), **kwargs).to(device)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_()
    x = torch.randn(B, T, E, device=device)
    key_mask = torch.ones(B, T, dtype=torch.bool, device=device)
    key_mask[0, 3:] = False
    out, w = m(x, key_mask=key_mask, is_causal=True, need_weights=True)
    assert w.shape == (B, m.num_heads, T, T)
    expected = _manual(m, x, x, mask=key_mask[:, None, None, :], is_causal=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_unbatched_input_matches_batched(device: torch.device) -> None:
    m = MultiHeadAttention(E, H).to(device).eval()
    x, mem = torch.randn(T, E, device=device), torch.randn(S, E, device=device)
    key_mask = torch.tensor([True] * 5 + [False] * 2, device=device)
    head_mask = torch.rand(H, T, S, device=device) > 0.2
    out, w = m(x, mem, key_mask=key_mask, mask=head_mask, need_weights=True)
    assert out.shape == (T, E) and w.shape == (H, T, S)
    out_b, w_b = m(
        x[None], mem[None], key_mask=key_mask[None], mask=head_mask[None], need_weights=True
    )
    torch.testing.assert_close(out, out_b[0])
    torch.testing.assert_close(w, w_b[0])


def test_mask_shapes_are_equivalent(device: torch.device) -> None:
    m = MultiHeadAttention(E, H).to(device).eval()
    x = torch.randn(B, T, E, device=device)
    mask = torch.rand(T, T, device=device) > 0.3
    mask.fill_diagonal_(True)
    out = m(x, mask=mask)
    torch.testing.assert_close(m(x, mask=mask.expand(B, T, T)), out)
    torch.testing.assert_close(m(x, mask=mask.expand(B, H, T, T)), out)
    float_mask = torch.zeros(T, T, device=device).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(m(x, mask=float_mask), out)


def test_padding_rows_are_zero_not_nan_with_weights(device: torch.device) -> None:
    # torch.nn.MultiheadAttention gives NaN here with need_weights=True; we give zeros.
    m = MultiHeadAttention(E, H).to(device).eval()
    x = torch.randn(B, T, E, requires_grad=True, device=device)
    mask = torch.ones(T, T, dtype=torch.bool, device=device)
    mask[2] = False
    out, w = m(x, mask=mask, need_weights=True)
    assert not out.isnan().any() and not w.isnan().any()
    assert torch.equal(w[:, :, 2], torch.zeros_like(w[:, :, 2]))
    out.sum().backward()
    assert x.grad is not None and x.grad.isfinite().all()


def test_dropout_only_in_training(device: torch.device) -> None:
    m = MultiHeadAttention(E, H, dropout=0.5).to(device)
    x = torch.randn(B, T, E, device=device)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    m.train()
    assert not torch.allclose(m(x), m(x))


def test_device_dtype_and_reset_parameters(device: torch.device) -> None:
    m = MultiHeadAttention(E, H, dtype=torch.float64, device=device)
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert m(torch.randn(B, T, E, dtype=torch.float64, device=device)).dtype == torch.float64
    for w, b in _qkv_blocks(m):
        bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))  # Xavier-uniform, per block
        assert w.abs().max() <= bound and w.abs().max() > 0.5 * bound
        assert b is not None and torch.equal(b, torch.zeros_like(b))
    assert m.out_proj.bias is not None and not m.out_proj.bias.any()


def test_parameter_layout_is_packed_q_k_v() -> None:
    m = MultiHeadAttention(E, 6, num_kv_heads=2)
    assert m.qkv_proj is not None and m.qkv_proj.weight.shape == ((6 + 2 * 2) * 4, E)
    assert {n for n, _ in m.named_parameters()} == {
        "qkv_proj.weight",
        "qkv_proj.bias",
        "out_proj.weight",
        "out_proj.bias",
    }
    cross = MultiHeadAttention(E, H, kdim=11)
    assert {n.split(".")[0] for n, _ in cross.named_parameters()} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "out_proj",
    }


def test_gradcheck_module_float64(device: torch.device) -> None:
    m = MultiHeadAttention(6, 2, num_kv_heads=1, dtype=torch.float64).to(device)
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True, device=device)
    # The second batch row is fully masked.
    key_mask = torch.tensor([[True, True, True], [False, False, False]], device=device)
    assert torch.autograd.gradcheck(lambda x: m(x, key_mask=key_mask, is_causal=True), (x,))
    assert torch.autograd.gradcheck(lambda x: m(x, key_mask=key_mask, need_weights=True)[1], (x,))


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"embed_dim": 10, "num_heads": 3},
            r"embed_dim \(10\) must be divisible by num_heads \(3\)",
        ),
        (
            {"embed_dim": 12, "num_heads": 4, "num_kv_heads": 3},
            r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)",
        ),
        (
            {"embed_dim": 12, "num_heads": 4, "dropout": 1.5},
            r"dropout must be a float in \[0, 1\), got 1.5",
        ),
        ({"embed_dim": 0, "num_heads": 4}, "embed_dim must be a positive int, got 0"),
        (
            {"embed_dim": 12, "num_heads": 4, "head_dim": -1},
            "head_dim must be a positive int or None, got -1",
        ),
    ],
)
def test_constructor_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MultiHeadAttention(kwargs.pop("embed_dim"), kwargs.pop("num_heads"), **kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (
            (torch.randn(E),),
            {},
            ValueError,
            r"query must be 2-D \(T, E\) or 3-D \(B, T, E\), got 1-D",
        ),
        ((torch.randn(1, B, T, E),), {}, ValueError, "got 4-D shape"),
        (
            (torch.randn(B, T, E + 1),),
            {},
            ValueError,
            rf"query's last dimension must be embed_dim={E}, got shape \({B}, {T}, {E + 1}\)",
        ),
        ((torch.randn(B, T, E), torch.randn(B + 1, S, E)), {}, ValueError, "batch sizes disagree"),
        (
            (torch.randn(B, T, E), torch.randn(B, S, E), torch.randn(B, S + 1, E)),
            {},
            ValueError,
            "key and value must have the same length",
        ),
        ((torch.randn(B, T, E), torch.randn(S, E)), {}, ValueError, "key must be 3-D like query"),
        (
            (torch.randn(B, T, E),),
            {"key_mask": torch.ones(B, T + 1, dtype=torch.bool)},
            ValueError,
            rf"key_mask must have shape \(B, S\) = \({B}, {T}\) .* got \({B}, {T + 1}\)",
        ),
        (
            (torch.randn(B, T, E),),
            {"key_mask": torch.ones(B, T)},
            TypeError,
            "key_mask must be a bool tensor .*pass ~key_padding_mask",
        ),
        (
            (torch.randn(B, T, E),),
            {"mask": torch.ones(T + 1, T, dtype=torch.bool)},
            ValueError,
            rf"mask of shape \({T + 1}, {T}\) does not broadcast to \(B, H, T, S\)",
        ),
        (
            (torch.randn(B, T, E),),
            {"mask": torch.ones(T, T, dtype=torch.int32)},
            TypeError,
            "mask must be bool",
        ),
    ],
)
def test_forward_errors(args: tuple, kwargs: dict, error: type, match: str) -> None:
    m = MultiHeadAttention(E, H)
    with pytest.raises(error, match=match):
        m(*args, **kwargs)


def test_the_names_deprecated_in_0_1_are_gone_in_0_2() -> None:
    """0.2.0 removed the paths that warned for one release (CHANGELOG.md lists them)."""
    import importlib

    import multihead.functional
    import multihead.layers
    import multihead.observers
    import multihead.text.tokenization
    import multihead.training.ddp
    from multihead.models import generation, lm_io

    for module, name in [
        (multihead.functional, "causal_mask"),
        (multihead.layers, "ACTIVATIONS"),
        (multihead.observers, "run_observers"),
        (multihead.text.tokenization, "BertBatch"),
        (multihead.training.ddp, "check_device"),
        (multihead.training.ddp, "resolve_device"),
        (generation, "generate"),
        (lm_io, "save_lm"),
        (lm_io, "load_lm"),
        (lm_io, "check_weights"),
    ]:
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(module, name)
    for gone in ("multihead.interop", "multihead.models.text", "multihead.tokenization"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)


def test_a_deprecation_warning_from_multihead_s_own_code_fails_the_suite() -> None:
    """pyproject's filterwarnings turns a DeprecationWarning attributed to a multihead module
    into an error (one from another package's code stays a warning)."""
    import warnings

    with pytest.raises(DeprecationWarning, match="old api"):
        warnings.warn_explicit("old api", DeprecationWarning, "x.py", 1, module="multihead.kernels")
    with warnings.catch_warnings(record=True):
        warnings.warn_explicit("old api", DeprecationWarning, "x.py", 1, module="somebody.else")
