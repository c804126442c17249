"""Transformer layers: against torch.nn's layers, exact conversions, causality by gradients,
positional encodings against their formula, the unpadded path, and error messages.

Sizes are pairwise distinct (B=2, T=5, S=7, E=24, H=3 -> D=8, F=40) so a swapped axis fails."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import multihead
from multihead import (
    FeedForward,
    LearnedPositionalEmbedding,
    MultiHeadAttention,
    SinusoidalPositionalEncoding,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)
from multihead.packing import PackedBatch

B, T, S, E, H, FF = 2, 5, 7, 24, 3, 40
TOL = dict(atol=1e-5, rtol=1e-5)


def randomise(module: nn.Module) -> nn.Module:
    """Random values everywhere, LayerNorms and biases included, so nothing passes by being 0/1."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 and p.numel() == E else 0.0))
    return module


def key_mask(device: torch.device | str = "cpu") -> torch.Tensor:
    m = torch.ones(B, T, dtype=torch.bool, device=device)
    m[1, 3:] = False
    return m


# -- FeedForward ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("activation", "fn"),
    [
        ("gelu", F.gelu),
        ("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
        ("relu", F.relu),
        ("silu", F.silu),
    ],
)
def test_feed_forward_is_its_formula(activation: str, fn, device: torch.device) -> None:  # type: ignore[no-untyped-def]
    ff = FeedForward(E, FF, activation=activation).to(device)
    x = torch.randn(B, T, E, device=device)
    expected = ff.linear2(fn(ff.linear1(x)))
    torch.testing.assert_close(ff(x), expected, atol=0, rtol=0)
    assert ff(x).shape == (B, T, E)


def test_feed_forward_errors() -> None:
    with pytest.raises(ValueError, match=r"activation must be one of 'gelu', .* got 'tanh'"):
        FeedForward(E, FF, activation="tanh")
    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\), got 1.5"):
        FeedForward(E, FF, dropout=1.5)


# -- encoder layer vs torch.nn.TransformerEncoderLayer ----------------------------------------


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(
    norm_first: bool, activation: str, device: torch.device
) -> None:
    ref = nn.TransformerEncoderLayer(
        E, H, FF, dropout=0.0, activation=activation, batch_first=True, norm_first=norm_first
    ).to(device)
    randomise(ref)
    ours = TransformerEncoderLayer.from_torch(ref)
    assert ours.norm_first is norm_first and ours.ff.activation_name == activation
    x = torch.randn(B, T, E, device=device)
    km = key_mask(device)
    # key mask, and a causal mask (torch: float -inf above the diagonal, top-left = bottom-right
    # when T == S)
    torch.testing.assert_close(ours(x, key_mask=km), ref(x, src_key_padding_mask=~km), **TOL)
    causal = nn.Transformer.generate_square_subsequent_mask(T, device=device)
    torch.testing.assert_close(ours(x, is_causal=True), ref(x, src_mask=causal), **TOL)
    torch.testing.assert_close(ours(x, mask=causal), ref(x, src_mask=causal), **TOL)


def test_encoder_layer_key_mask_output_is_torch_on_real_tokens(device: torch.device) -> None:
    # The subscripted comparison above compares real tokens only; check the padded row's real
    # tokens equal the batch-of-one result (padding has no influence).
    layer = randomise(TransformerEncoderLayer(E, H, FF, norm_first=False).to(device))
    x = torch.randn(B, T, E, device=device)
    km = key_mask(device)
    out = layer(x, key_mask=km)
    alone = layer(x[1:, :3])
    torch.testing.assert_close(out[1:, :3], alone, **TOL)


@pytest.mark.parametrize("norm_first", [True, False])
def test_from_torch_to_torch_are_exact(norm_first: bool, device: torch.device) -> None:
    ref = randomise(
        nn.TransformerEncoderLayer(E, H, FF, dropout=0.1, batch_first=True, norm_first=norm_first)
    ).to(device)
    ours = TransformerEncoderLayer.from_torch(ref)
    back = ours.to_torch()
    assert back.norm_first is norm_first and back.self_attn.batch_first
    ref_sd, back_sd = ref.state_dict(), back.state_dict()
    assert ref_sd.keys() == back_sd.keys()
    for name in ref_sd:
        assert torch.equal(ref_sd[name], back_sd[name]), name
    assert ours.self_attn.dropout == 0.1 and ours.dropout1.p == 0.1
    ref.eval(), ours.eval(), back.eval()
    x = torch.randn(B, T, E, device=device)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **TOL)
        torch.testing.assert_close(back(x), ref(x), atol=0, rtol=0)
    # Our layer -> torch -> ours keeps every parameter bit for bit.
    again = TransformerEncoderLayer.from_torch(back)
    for (n1, p1), (n2, p2) in zip(ours.named_parameters(), again.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1


@pytest.mark.parametrize(
    ("activation", "name"),
    [(nn.ReLU(), "relu"), (nn.GELU(), "gelu"), (nn.GELU(approximate="tanh"), "gelu_tanh")],
)
def test_from_torch_reads_activation_modules(
    activation: nn.Module, name: str, device: torch.device
) -> None:
    ref = randomise(
        nn.TransformerEncoderLayer(E, H, FF, dropout=0.0, activation=activation, batch_first=True)
    ).to(device)
    ours = TransformerEncoderLayer.from_torch(ref)
    assert ours.ff.activation_name == name
    x = torch.randn(B, T, E, device=device)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), **TOL)


def test_conversion_errors() -> None:
    with pytest.raises(TypeError, match="m must be a torch.nn.TransformerEncoderLayer, got Linear"):
        TransformerEncoderLayer.from_torch(nn.Linear(2, 2))  # type: ignore[arg-type]
    ref = nn.TransformerEncoderLayer(E, H, FF, activation=torch.tanh, batch_first=True)
    with pytest.raises(ValueError, match="cannot convert the activation"):
        TransformerEncoderLayer.from_torch(ref)
    with pytest.raises(
        ValueError, match="supports activation 'relu' or 'gelu' exactly, got 'silu'"
    ):
        TransformerEncoderLayer(E, H, FF, activation="silu").to_torch()
    with pytest.raises(ValueError, match=r"num_kv_heads \(1\) != num_heads \(3\)"):
        TransformerEncoderLayer(E, H, FF, num_kv_heads=1).to_torch()


def test_encoder_layer_weights_and_errors(device: torch.device) -> None:
    layer = TransformerEncoderLayer(E, H, FF, num_kv_heads=1).to(device)
    x = torch.randn(B, T, E, device=device)
    with multihead.capture(layer) as rec:
        out = layer(x, key_mask=key_mask(device))
    (weights,) = rec.weights
    assert out.shape == (B, T, E) and weights.shape == (B, H, T, T)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, T, device=device))
    assert weights[1, :, :, 3:].abs().max() == 0  # padding keys get no weight
    with pytest.raises(ValueError, match=r"x must be \(B, T, E\) or \(T, E\) with E=24, got"):
        layer(torch.randn(B, T, E + 1, device=device))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        layer([1.0])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="key_mask must be a bool tensor"):
        layer(x, key_mask=key_mask(device).long())
    with pytest.raises(ValueError, match=r"embed_dim \(24\) must be divisible by num_heads \(5\)"):
        TransformerEncoderLayer(E, 5, FF)


def test_causality_by_gradients(device: torch.device) -> None:
    """Output i depends on inputs 0..i only: d out_i / d x_j = 0 for every j > i."""
    encoder = TransformerEncoderLayer(E, H, FF, norm_first=True).to(device)
    decoder = TransformerDecoderLayer(E, H, FF, norm_first=False).to(device)
    memory = torch.randn(1, S, E, device=device)
    # A random read-out: a plain sum of a LayerNorm's output has zero gradient everywhere.
    readout = torch.randn(E, device=device)
    for name, fn in (
        ("encoder", lambda x: encoder(x, is_causal=True)),
        ("decoder", lambda x: decoder(x, memory)),
    ):
        for i in range(T):
            x = torch.randn(1, T, E, requires_grad=True, device=device)
            (fn(x)[0, i] * readout).sum().backward()
            assert x.grad is not None
            grad = x.grad[0].abs().sum(-1)  # (T,)
            if i + 1 < T:
                assert grad[i + 1 :].max().item() == 0.0, (name, i)  # nothing from the future
            assert grad[: i + 1].min().item() > 0.0, (name, i)  # and it does see the past


# -- stacks and the unpadded path ------------------------------------------------------------


def test_encoder_stack_is_its_layers_in_order(device: torch.device) -> None:
    layers = [randomise(TransformerEncoderLayer(E, H, FF).to(device)) for _ in range(3)]
    norm = randomise(nn.LayerNorm(E).to(device))
    enc = TransformerEncoder(layers, norm=norm)
    assert len(enc.layers) == 3 and all(a is b for a, b in zip(enc.layers, layers, strict=True))
    x = torch.randn(B, T, E, device=device)
    km = key_mask(device)
    expected = x
    for layer in layers:
        expected = layer(expected, key_mask=km)
    torch.testing.assert_close(enc(x, key_mask=km), norm(expected), atol=0, rtol=0)
    backwards = x
    for layer in reversed(layers):
        backwards = layer(backwards, key_mask=km)
    # the layers differ, so the order shows: run backwards, the stack would give another output
    assert not torch.allclose(norm(backwards), norm(expected), atol=1e-2)
    with multihead.capture(enc) as rec:
        out = enc(x, key_mask=km)
    assert len(rec.weights) == 3 and all(w.shape == (B, H, T, T) for w in rec.weights)
    torch.testing.assert_close(out, norm(expected), atol=0, rtol=0)  # capture changes nothing
    with pytest.raises(ValueError, match="layers must hold at least one layer"):
        TransformerEncoder([])


@pytest.mark.parametrize("norm_first", [True, False])
@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_forward_packed_equals_padded(
    norm_first: bool, num_kv_heads: int | None, device: torch.device
) -> None:
    enc = TransformerEncoder(
        [
            randomise(
                TransformerEncoderLayer(E, H, FF, norm_first=norm_first, num_kv_heads=num_kv_heads)
            )
            for _ in range(2)
        ],
        norm=nn.LayerNorm(E) if norm_first else None,
    ).to(device)
    km = torch.tensor(
        [
            [True, True, True, False, False, False],
            [True, True, True, False, False, False],
            [False, True, True, True, True, True],  # left padding
            [True, False, True, False, True, True],  # holes
            [False] * 6,  # nothing real at all
        ],
        device=device,
    )
    packing = PackedBatch(km)
    assert packing.num_tokens == 15
    assert packing.batch_index.tolist() == [0] * 3 + [1] * 3 + [2] * 5 + [3] * 4
    assert packing.position_index[6:15].tolist() == [1, 2, 3, 4, 5, 0, 2, 4, 5]
    # Sorted by effective length 6, 6, 3, 3, 0 (stable); 4 buckets over 5 rows, the empty one
    # dropped, the two full-length rows (one has holes) masked.
    assert packing.order.tolist() == [2, 3, 0, 1, 4]
    assert [(a, b, n, m is None) for a, b, n, m in packing.buckets] == [
        (0, 1, 6, False),
        (1, 2, 6, False),
        (2, 3, 3, True),
        (3, 5, 3, False),
    ]
    x = torch.randn(5, 6, E, device=device)
    torch.testing.assert_close(packing.unpack(packing.pack(x)), x * km[..., None], atol=0, rtol=0)
    padded = enc(x, key_mask=km)
    packed = enc(packing.pack(x), packing=packing)
    assert packed.shape == (15, E)
    torch.testing.assert_close(packed, packing.pack(padded), **TOL)
    # A single layer too, and gradients through the packed path.
    layer = enc.layers[0]
    xp = packing.pack(x).requires_grad_()
    layer(xp, packing=packing).sum().backward()
    assert xp.grad is not None and torch.isfinite(xp.grad).all()


def test_packed_batch_and_packing_errors() -> None:
    with pytest.raises(TypeError, match=r"key_mask must have dtype torch.bool, got torch.int64"):
        PackedBatch(torch.ones(2, 3, dtype=torch.int64))
    packing = PackedBatch(key_mask())
    attn = MultiHeadAttention(E, H)
    with pytest.raises(ValueError, match=r"query must be the packed tokens \(N, E\) = \(8, 24\)"):
        attn(torch.randn(8 + 1, E), packing=packing)
    with pytest.raises(TypeError, match="packing must be a PackedBatch or None, got Tensor"):
        attn(torch.randn(8, E), packing=key_mask())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be combined with key_mask, need_weights"):
        attn(torch.randn(8, E), key_mask=key_mask(), need_weights=True, packing=packing)
    cross = MultiHeadAttention(E, H, kdim=S)
    with pytest.raises(ValueError, match="packing= needs the packed self-attention projection"):
        cross(torch.randn(8, E), packing=packing)
    with pytest.raises(ValueError, match=r"x must be the packed tokens \(N, E\) with E=24"):
        TransformerEncoderLayer(E, H, FF)(torch.randn(B, T, E), packing=packing)


def test_packed_path_shows_observers_heads_in_batch_order(device: torch.device) -> None:
    """Observers see the packed call as the padded one: (B, H, T, D) heads in batch order."""
    attn = randomise(MultiHeadAttention(E, H).to(device)).eval()
    km = torch.tensor(
        [[True, True, False, False, False], [True, True, True, True, False]], device=device
    )
    x = torch.randn(B, T, E, device=device)
    seen = []

    def observer(call, out):  # type: ignore[no-untyped-def]
        seen.append((call.q.clone(), call.k.clone(), call.mask, call.query_mask, out.clone()))

    attn.register_observer(observer)
    packing = PackedBatch(km)
    assert packing.order.tolist() == [1, 0]  # the rows are sorted: batch order must be restored
    attn(packing.pack(x), packing=packing)
    attn(x, key_mask=km)
    (q_p, k_p, mask_p, qm_p, out_p), (q_d, k_d, mask_d, qm_d, out_d) = seen
    assert q_p.shape == (B, H, T, 8) and mask_p.shape == (B, 1, 1, T)
    assert torch.equal(mask_p, mask_d) and torch.equal(qm_p, km) and torch.equal(qm_d, km)
    real = km[:, None, :, None]  # (B, 1, T, 1): the padding's heads are zeros on the packed path
    torch.testing.assert_close(q_p, q_d * real, **TOL)
    torch.testing.assert_close(k_p, k_d * real, **TOL)
    torch.testing.assert_close(out_p * real.transpose(1, 2), out_d * real.transpose(1, 2), **TOL)


# -- decoder layer vs torch.nn.TransformerDecoderLayer ---------------------------------------


def decoder_from_torch(ref: nn.TransformerDecoderLayer) -> TransformerDecoderLayer:
    ours = TransformerDecoderLayer(
        E, H, FF, dropout=0.0, norm_first=ref.norm_first, activation="relu", norm_eps=ref.norm1.eps
    )
    ours.self_attn = MultiHeadAttention.from_torch(ref.self_attn)
    ours.cross_attn = MultiHeadAttention.from_torch(ref.multihead_attn)
    for mine, theirs in (
        (ours.ff.linear1, ref.linear1),
        (ours.ff.linear2, ref.linear2),
        (ours.norm1, ref.norm1),
        (ours.norm2, ref.norm2),
        (ours.norm3, ref.norm3),
    ):
        mine.load_state_dict(theirs.state_dict())
    return ours


@pytest.mark.parametrize("norm_first", [True, False])
def test_decoder_layer_matches_torch(norm_first: bool, device: torch.device) -> None:
    ref = randomise(
        nn.TransformerDecoderLayer(E, H, FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    ).to(device)
    ours = decoder_from_torch(ref).to(device)
    x, memory = torch.randn(B, T, E, device=device), torch.randn(B, S, E, device=device)
    memory_mask = torch.ones(B, S, dtype=torch.bool, device=device)
    memory_mask[0, 4:] = False
    causal = nn.Transformer.generate_square_subsequent_mask(T, device=device)
    expected = ref(
        x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=~memory_mask
    )
    torch.testing.assert_close(ours(x, memory, memory_key_mask=memory_mask), expected, **TOL)
    with multihead.capture(ours) as rec:
        out = ours(x, memory, memory_key_mask=memory_mask)
    self_w, cross_w = rec.weights
    assert rec.layers == [0, 1]  # self_attn, then cross_attn: module order
    torch.testing.assert_close(out, expected, **TOL)
    assert self_w.shape == (B, H, T, T) and cross_w.shape == (B, H, T, S)
    assert self_w.triu(1).abs().max() == 0  # causal
    assert cross_w[0, :, :, 4:].abs().max() == 0  # masked memory
    # Not causal: equals torch without a target mask.
    torch.testing.assert_close(ours(x, memory, is_causal=False), ref(x, memory), **TOL)


def test_decoder_layer_memory_width(device: torch.device) -> None:
    layer = TransformerDecoderLayer(E, H, FF, memory_dim=S).to(device)
    assert layer(
        torch.randn(B, T, E, device=device), torch.randn(B, 4, S, device=device)
    ).shape == (B, T, E)
    with pytest.raises(ValueError, match=r"key's last dimension must be kdim=7"):
        layer(torch.randn(B, T, E, device=device), torch.randn(B, 4, E, device=device))
    with pytest.raises(ValueError, match=r"memory must be \(B, S, memory_dim\) like x"):
        layer(torch.randn(B, T, E, device=device), torch.randn(4, S, device=device))


# -- positional encodings ---------------------------------------------------------------------


@pytest.mark.parametrize("embed_dim", [24, 7])
def test_sinusoidal_is_the_formula(embed_dim: int, device: torch.device) -> None:
    max_len = 2000
    pe = SinusoidalPositionalEncoding(embed_dim, max_len).to(device)
    expected = torch.zeros(max_len, embed_dim, dtype=torch.float64, device=device)
    for p in (0, 1, 17, 1999):
        for j in range(embed_dim):
            i = j // 2
            angle = p / 10000 ** (2 * i / embed_dim)
            expected[p, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
        torch.testing.assert_close(pe.pe[p].double(), expected[p], atol=1e-6, rtol=0)
    x = torch.randn(B, T, embed_dim, device=device)
    torch.testing.assert_close(pe(x), x + pe.pe[:T], atol=0, rtol=0)
    positions = torch.tensor([[3, 4, 5, 6, 7], [0, 0, 1, 1, 2]], device=device)
    torch.testing.assert_close(pe(x, positions), x + pe.pe[positions], atol=0, rtol=0)
    assert "pe" not in pe.state_dict()  # a function of the arguments, not a weight


def test_learned_positions(device: torch.device) -> None:
    emb = LearnedPositionalEmbedding(10, E).to(device)
    x = torch.randn(B, T, E, device=device)
    torch.testing.assert_close(emb(x), x + emb.embedding.weight[:T], atol=0, rtol=0)
    positions = torch.tensor([9, 8, 7, 6, 5], device=device)
    torch.testing.assert_close(emb(x, positions), x + emb.embedding.weight[positions])
    emb(x).sum().backward()
    assert emb.embedding.weight.grad is not None
    assert emb.embedding.weight.grad[T:].abs().max() == 0  # positions past T untouched


def test_positional_errors() -> None:
    pe = SinusoidalPositionalEncoding(E, 4)
    with pytest.raises(ValueError, match="sequence length 5 exceeds max_len=4"):
        pe(torch.randn(B, T, E))
    learned = LearnedPositionalEmbedding(8, E)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., T, E\) with E=24, got \(2, 5, 3\)"):
        learned(torch.randn(B, T, 3))
    with pytest.raises(
        TypeError, match="positions must be an int32/int64 tensor, got torch.float32"
    ):
        learned(torch.randn(B, T, E), torch.zeros(T))
    with pytest.raises(ValueError, match=r"positions must end in the sequence length T=5"):
        learned(torch.randn(B, T, E), torch.arange(4))
    with pytest.raises(ValueError, match=r"positions must be in \[0, max_len=8\), got values in"):
        learned(torch.randn(B, T, E), torch.arange(5) + 4)
    with pytest.raises(ValueError, match="max_len must be a positive int, got 0"):
        LearnedPositionalEmbedding(0, E)
    with pytest.raises(ValueError, match="embed_dim must be a positive int, got -1"):
        SinusoidalPositionalEncoding(-1)
