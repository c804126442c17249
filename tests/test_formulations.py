"""The five seeds' formulations of attention, rebuilt with their bugs fixed, against ours.

Each ``Seed...`` module below stays as close to its tutorial's code as a correct version can
(names, layer layout, order of operations); docs/formulations.md says what was fixed and why.
Each test copies the seed module's weights into a ``MultiHeadAttention`` (or calls
``functional.attention``) and asserts the same output in float32 to 1e-5. A few tests also show
that a seed's original bug changes the result, so the fix is not cosmetic.

Sizes are pairwise distinct (B=2, T=5, H=3, D=4, input width 6, ...) so a swapped axis fails.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import MultiHeadAttention, functional

B, T, H, D = 2, 5, 3, 4
E = H * D  # 12
IN = 6  # an input width different from H·D, where a seed allows one

ATOL = RTOL = 1e-5


def _load_packed(
    mha: MultiHeadAttention, weights: list[Tensor], biases: list[Tensor] | None
) -> None:
    """Copy q, k and v weights into the packed projection: rows [q heads | k heads | v heads].

    ``biases=None`` zeroes the packed bias (a bias-free seed projection).
    """
    assert mha.qkv_proj is not None and mha.qkv_proj.bias is not None
    with torch.no_grad():
        mha.qkv_proj.weight.copy_(torch.cat(weights))
        if biases is None:
            mha.qkv_proj.bias.zero_()
        else:
            mha.qkv_proj.bias.copy_(torch.cat(biases))


def _linears(*layers: nn.Linear) -> tuple[list[Tensor], list[Tensor]]:
    return [m.weight for m in layers], [m.bias for m in layers]


def _load_linear(target: nn.Linear, source: nn.Linear) -> None:
    target.load_state_dict(source.state_dict())


# -- seed 000: unbatched, separate q/k/v projections, a mixing projection ------------------------


class Seed000(nn.Module):
    """Seed 000's MultiHeadedAttention: unbatched (T, input_dim) input.

    Fixed: ``assert`` on a user error became a ValueError; the input width is no longer unpacked
    into a variable named ``hidden_dim`` (it is ``input_dim``); the weights the seed computes but
    comments out of the return are returned.
    """

    def __init__(self, input_dim: int, n_heads: int, hidden_dim: int) -> None:
        super().__init__()
        if hidden_dim % n_heads != 0:
            raise ValueError(f"hidden_dim ({hidden_dim}) must be divisible by n_heads ({n_heads})")
        self.q = nn.Linear(input_dim, hidden_dim)
        self.k = nn.Linear(input_dim, hidden_dim)
        self.v = nn.Linear(input_dim, hidden_dim)
        self.mixing_proj = nn.Linear(hidden_dim, hidden_dim)
        self.n_heads = n_heads
        self.hidden_dim = hidden_dim
        self.scaling = math.sqrt(hidden_dim / n_heads)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        seq_len, _ = x.shape
        k, q, v = self.k(x), self.q(x), self.v(x)
        head_dim = self.hidden_dim // self.n_heads
        # [n_heads, seq_len, hidden_dim // n_heads]
        k = k.reshape(seq_len, self.n_heads, head_dim).transpose(0, 1)
        q = q.reshape(seq_len, self.n_heads, head_dim).transpose(0, 1)
        v = v.reshape(seq_len, self.n_heads, head_dim).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) / self.scaling
        p = F.softmax(scores, dim=-1)
        attention = p @ v
        # [seq_len, hidden_dim]
        attention = attention.transpose(0, 1).contiguous().view(seq_len, self.hidden_dim)
        return self.mixing_proj(attention), p


def test_seed_000_unbatched_separate_projections(device: torch.device) -> None:
    seed = Seed000(IN, H, E)
    ours = MultiHeadAttention(IN, H, head_dim=E // H, out_dim=E)
    _load_packed(ours, *_linears(seed.q, seed.k, seed.v))
    _load_linear(ours.out_proj, seed.mixing_proj)
    seed.to(device)
    ours.to(device)
    x = torch.randn(T, IN, device=device)
    expected, expected_w = seed(x)
    out, w = ours(x, need_weights=True)
    assert out.shape == (T, E) and w.shape == (H, T, T)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=RTOL)
    # Batched input is the same computation per example; the seed could only do one at a time.
    xb = torch.randn(B, T, IN, device=device)
    batched = ours(xb)
    for i in range(B):
        torch.testing.assert_close(batched[i], seed(xb[i])[0], atol=ATOL, rtol=RTOL)


def test_seed_000_rejects_indivisible_hidden_dim() -> None:
    with pytest.raises(ValueError, match=r"hidden_dim \(10\) must be divisible by n_heads \(3\)"):
        Seed000(IN, 3, 10)
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(3\)"):
        MultiHeadAttention(10, 3)


# -- seed 001: a ModuleList of single heads, concatenated -----------------------------------------


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """The function seed 001's (missing) AttentionHead implies: softmax(q kᵀ / sqrt(d_k)) v."""
    dim_k = query.size(-1)
    scores = torch.bmm(query, key.transpose(1, 2)) / math.sqrt(dim_k)
    weights = F.softmax(scores, dim=-1)
    return torch.bmm(weights, value)


class AttentionHead(nn.Module):
    """Seed 001 uses ``AttentionHead(embed_dim, head_dim)`` but never defines it: one head with
    its own q/k/v projections E → head_dim."""

    def __init__(self, embed_dim: int, head_dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(embed_dim, head_dim)
        self.k = nn.Linear(embed_dim, head_dim)
        self.v = nn.Linear(embed_dim, head_dim)

    def forward(self, hidden_state: Tensor) -> Tensor:
        return scaled_dot_product_attention(
            self.q(hidden_state), self.k(hidden_state), self.v(hidden_state)
        )


class Seed001(nn.Module):
    """Seed 001's MultiHeadAttention, as written (it only lacked AttentionHead)."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        num_heads = config.num_attention_heads
        head_dim = embed_dim // num_heads
        self.heads = nn.ModuleList([AttentionHead(embed_dim, head_dim) for _ in range(num_heads)])
        self.output_linear = nn.Linear(embed_dim, embed_dim)

    def forward(self, hidden_state: Tensor) -> Tensor:
        x = torch.cat([h(hidden_state) for h in self.heads], dim=-1)
        return self.output_linear(x)


def test_seed_001_module_list_of_heads(device: torch.device) -> None:
    seed = Seed001(SimpleNamespace(hidden_size=E, num_attention_heads=H))
    ours = MultiHeadAttention(E, H)
    # Head h's projections are rows h·D:(h+1)·D of each of our q, k and v blocks.
    heads = list(seed.heads)
    weights = [torch.cat([getattr(h, part).weight for h in heads]) for part in "qkv"]
    biases = [torch.cat([getattr(h, part).bias for h in heads]) for part in "qkv"]
    _load_packed(ours, weights, biases)
    _load_linear(ours.out_proj, seed.output_linear)
    seed.to(device)
    ours.to(device)
    x = torch.randn(B, T, E, device=device)
    torch.testing.assert_close(ours(x), seed(x), atol=ATOL, rtol=RTOL)


# -- seed 002: single-head Attention, and batched MultiHeadAttention ------------------------------


class Seed002Attention(nn.Module):
    """Seed 002's single-head Attention. Fixed: ``attention_dim`` in forward is
    ``self.attention_dim`` (the bare name is undefined there: NameError on the first call)."""

    def __init__(self, embedding_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.attention_dim = attention_dim
        self.query_t = nn.Linear(embedding_dim, attention_dim)
        self.key_t = nn.Linear(embedding_dim, attention_dim)
        self.value_t = nn.Linear(embedding_dim, attention_dim)

    def forward(self, x: Tensor) -> Tensor:
        queries, keys, values = self.query_t(x), self.key_t(x), self.value_t(x)
        scores = queries @ keys.transpose(-2, -1) / self.attention_dim**0.5  # (B, T, T)
        scores = F.softmax(scores, dim=-1)
        return scores @ values  # (B, T, attention_dim)


class Seed002MultiHeadAttention(nn.Module):
    """Seed 002's batched MultiHeadAttention. Fixed: ``self.attention_dim`` as above."""

    def __init__(self, num_heads: int, model_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.model_dim = model_dim
        self.attention_dim = model_dim // num_heads
        self.query_t = nn.Linear(model_dim, model_dim)
        self.key_t = nn.Linear(model_dim, model_dim)
        self.value_t = nn.Linear(model_dim, model_dim)
        self.out = nn.Linear(model_dim, model_dim)

    def forward(self, x: Tensor) -> Tensor:
        batch_size, seq_len = x.shape[:2]
        shape = (batch_size, seq_len, self.num_heads, self.attention_dim)
        queries = self.query_t(x).view(shape).transpose(1, 2)  # (B, H, T, D)
        keys = self.key_t(x).view(shape).transpose(1, 2)
        values = self.value_t(x).view(shape).transpose(1, 2)
        scores = queries @ keys.transpose(-2, -1) / self.attention_dim**0.5  # (B, H, T, T)
        scores = F.softmax(scores, dim=-1)
        new_embedding = scores @ values  # (B, H, T, D)
        concat = new_embedding.transpose(1, 2).contiguous().view(batch_size, -1, self.model_dim)
        return self.out(concat)


def test_seed_002_single_head(device: torch.device) -> None:
    seed = Seed002Attention(IN, D)
    # One head of width attention_dim; the seed has no output projection, so ours is the identity.
    ours = MultiHeadAttention(IN, 1, head_dim=D, out_dim=D)
    _load_packed(ours, *_linears(seed.query_t, seed.key_t, seed.value_t))
    with torch.no_grad():
        ours.out_proj.weight.copy_(torch.eye(D, device=device))
        assert ours.out_proj.bias is not None
        ours.out_proj.bias.zero_()
    seed.to(device)
    ours.to(device)
    x = torch.randn(B, T, IN, device=device)
    expected = seed(x)
    torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=RTOL)
    # The same without touching out_proj: project, attend, drop the head axis.
    q, k, v = ours.project(x)
    out = functional.attention(q, k, v)  # (B, 1, T, D)
    torch.testing.assert_close(out.squeeze(1), expected, atol=ATOL, rtol=RTOL)


def test_seed_002_multi_head(device: torch.device) -> None:
    seed = Seed002MultiHeadAttention(H, E)
    ours = MultiHeadAttention(E, H)  # note the order: seed 002 takes (num_heads, model_dim)
    _load_packed(ours, *_linears(seed.query_t, seed.key_t, seed.value_t))
    _load_linear(ours.out_proj, seed.out)
    seed.to(device)
    ours.to(device)
    x = torch.randn(B, T, E, device=device)
    torch.testing.assert_close(ours(x), seed(x), atol=ATOL, rtol=RTOL)


# -- seed 003: one qkv layer packed per head, causal mask -----------------------------------------


def seed003_scaled_dot_product(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Seed 003's scaled_dot_product. Fixed: ``if mask:`` (ambiguous truth value of a tensor)
    is ``if mask is not None:``, and the in-place ``+=`` is an out-of-place add."""
    d_k = q.size()[-1]
    scaled = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scaled = scaled + mask
    attention = F.softmax(scaled, dim=-1)
    values = torch.matmul(attention, v)
    return values, attention


class Seed003(nn.Module):
    """Seed 003's MultiheadAttention. Fixed: the debug prints are gone, and the values are
    permuted back to (B, T, H, D) before being reshaped to (B, T, H·D)."""

    def __init__(self, input_dim: int, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.input_dim = input_dim
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.qkv_layer = nn.Linear(input_dim, 3 * d_model)
        self.linear_layer = nn.Linear(d_model, d_model)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        batch_size, sequence_length, _ = x.size()
        qkv = self.qkv_layer(x)  # (B, T, 3·d_model)
        # Packed per head: head h owns the 3·D consecutive outputs [q_h | k_h | v_h].
        qkv = qkv.reshape(batch_size, sequence_length, self.num_heads, 3 * self.head_dim)
        qkv = qkv.permute(0, 2, 1, 3)  # (B, H, T, 3·D)
        q, k, v = qkv.chunk(3, dim=-1)
        return q, k, v

    def forward(
        self, x: Tensor, mask: Tensor | None = None, *, permute_back: bool = True
    ) -> tuple[Tensor, Tensor]:
        batch_size, sequence_length, _ = x.size()
        values, attention = seed003_scaled_dot_product(*self.heads(x), mask=mask)  # (B, H, T, D)
        if permute_back:
            values = values.permute(0, 2, 1, 3)  # (B, T, H, D): the fix
        values = values.reshape(batch_size, sequence_length, self.num_heads * self.head_dim)
        return self.linear_layer(values), attention


def seed003_causal_mask(size: torch.Size, device: torch.device) -> Tensor:
    """The seed's additive causal mask: -inf above the diagonal."""
    return torch.triu(torch.full(size, float("-inf"), device=device), diagonal=1)


def per_head_to_packed(num_heads: int, head_dim: int) -> Tensor:
    """Row permutation from seed 003's per-head packing to ours.

    Seed 003's qkv row for (head h, part p in q/k/v, dim d) is h·3D + p·D + d; ours (rows
    [all q | all k | all v]) is p·H·D + h·D + d. ``ours_weight = seed_weight[perm]``.
    """
    return torch.arange(3 * num_heads * head_dim).view(num_heads, 3, head_dim).transpose(0, 1)


def _seed003_pair(device: torch.device) -> tuple[Seed003, MultiHeadAttention]:
    seed = Seed003(IN, E, H)
    ours = MultiHeadAttention(IN, H, head_dim=D, out_dim=E)
    perm = per_head_to_packed(H, D).reshape(-1)
    assert ours.qkv_proj is not None and ours.qkv_proj.bias is not None
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(seed.qkv_layer.weight[perm])
        ours.qkv_proj.bias.copy_(seed.qkv_layer.bias[perm])
    _load_linear(ours.out_proj, seed.linear_layer)
    return seed.to(device), ours.to(device)


def test_seed_003_permutation_maps_each_head(device: torch.device) -> None:
    seed, ours = _seed003_pair(device)
    x = torch.randn(B, T, IN, device=device)
    for theirs, mine in zip(seed.heads(x), ours.project(x), strict=True):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("causal", [False, True])
def test_seed_003_per_head_packing(causal: bool, device: torch.device) -> None:
    seed, ours = _seed003_pair(device)
    x = torch.randn(B, T, IN, device=device)
    mask = seed003_causal_mask(torch.Size((B, H, T, T)), device) if causal else None
    expected, expected_w = seed(x, mask)
    out, w = ours(x, is_causal=causal, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(w, expected_w, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours(x, is_causal=causal), expected, atol=ATOL, rtol=RTOL)
    if causal:  # the seed's additive mask, passed as ours: the same thing
        torch.testing.assert_close(ours(x, mask=mask), expected, atol=ATOL, rtol=RTOL)


def test_seed_003_bugs_change_the_result(device: torch.device) -> None:
    seed, ours = _seed003_pair(device)
    x = torch.randn(B, T, IN, device=device)
    # The published reshape without moving the head axis back mixes heads and positions.
    published, _ = seed(x, permute_back=False)
    assert not torch.allclose(published, ours(x), atol=1e-3)
    # The published `if mask:` cannot even run with a mask tensor.
    mask = seed003_causal_mask(torch.Size((B, H, T, T)), device)
    with pytest.raises(RuntimeError, match="ambiguous"):
        if mask:
            pass


# -- seed 004: parameter-free self-attention, and wide heads -------------------------------------


def seed004_self_attention(x: Tensor) -> Tensor:
    """Seed 004's parameter-free self-attention, as written: y = softmax(x xᵀ) x, unscaled."""
    raw_weights = torch.bmm(x, x.transpose(1, 2))
    weights = F.softmax(raw_weights, dim=2)
    return torch.bmm(weights, x)


class Seed004SelfAttention(nn.Module):
    """Seed 004's SelfAttention with wide heads (each head k wide).

    Fixed: ``nn.module`` → ``nn.Module``; ``forward`` moved out of ``__init__`` (defined there it
    is a local function, and the module has no forward); keys and values projected by
    ``tokeys`` / ``tovalues`` instead of being rebuilt from the already reshaped queries.
    """

    def __init__(self, k: int, n_heads: int = 8) -> None:
        super().__init__()
        self.k = k
        self.n_heads = n_heads
        self.tokeys = nn.Linear(k, k * n_heads, bias=False)
        self.toqueries = nn.Linear(k, k * n_heads, bias=False)
        self.tovalues = nn.Linear(k, k * n_heads, bias=False)
        self.unifyheads = nn.Linear(n_heads * k, k)

    def forward(self, x: Tensor, *, published_bug: bool = False) -> Tensor:
        b, t, k = x.size()
        h = self.n_heads
        queries = self.toqueries(x).view(b, t, h, k)
        keys = self.tokeys(x).view(b, t, h, k)
        values = self.tovalues(x).view(b, t, h, k)
        queries = queries.transpose(1, 2).contiguous().view(b * h, t, k)
        if published_bug:  # keys and values rebuilt from the (reshaped) queries
            keys = queries.transpose(1, 2).contiguous().view(b * h, t, k)
            values = queries.transpose(1, 2).contiguous().view(b * h, t, k)
        else:
            keys = keys.transpose(1, 2).contiguous().view(b * h, t, k)
            values = values.transpose(1, 2).contiguous().view(b * h, t, k)
        # q and k each divided by k^(1/4): together the usual 1/sqrt(k).
        queries = queries / (k ** (1 / 4))
        keys = keys / (k ** (1 / 4))
        dot = torch.bmm(queries, keys.transpose(1, 2))  # (B·H, T, T)
        dot = F.softmax(dot, dim=2)
        out = torch.bmm(dot, values).view(b, h, t, k)
        out = out.transpose(1, 2).contiguous().view(b, t, h * k)
        return self.unifyheads(out)


def test_seed_004_parameter_free_self_attention(device: torch.device) -> None:
    x = torch.randn(B, T, D, device=device)
    heads = x.unsqueeze(1)  # (B, 1, T, D): one head, q = k = v = x
    # The seed does not scale the scores: scale=1, not the default 1/sqrt(D).
    out = functional.attention(heads, heads, heads, scale=1.0).squeeze(1)
    torch.testing.assert_close(out, seed004_self_attention(x), atol=ATOL, rtol=RTOL)
    scaled = functional.attention(heads, heads, heads).squeeze(1)
    assert not torch.allclose(scaled, out, atol=1e-3)


def _seed004_pair(device: torch.device) -> tuple[Seed004SelfAttention, MultiHeadAttention]:
    k = D
    seed = Seed004SelfAttention(k, n_heads=H)
    # Wide heads: head_dim = k, so the heads are H·k wide together; out_proj maps H·k -> k.
    ours = MultiHeadAttention(k, H, head_dim=k)
    # Bias-free q/k/v (zero biases), but a biased output projection.
    _load_packed(ours, [seed.toqueries.weight, seed.tokeys.weight, seed.tovalues.weight], None)
    _load_linear(ours.out_proj, seed.unifyheads)
    return seed.to(device), ours.to(device)


def test_seed_004_wide_heads(device: torch.device) -> None:
    seed, ours = _seed004_pair(device)
    assert ours.head_dim == D and ours.out_proj.in_features == H * D
    x = torch.randn(B, T, D, device=device)
    expected = seed(x)
    torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=RTOL)
    out, w = ours(x, need_weights=True)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
    assert w.shape == (B, H, T, T)
    # The published bug (keys and values from the queries) gives something else entirely.
    assert not torch.allclose(seed(x, published_bug=True), expected, atol=1e-3)


def test_seed_004_published_class_has_no_forward(device: torch.device) -> None:
    """As published, seed 004's SelfAttention defines ``forward`` inside ``__init__`` (a local
    function, never bound), so calling the module fails. Its layers are built all the same, and
    MultiHeadAttention loaded from them runs the computation the seed meant."""

    class Published(nn.Module):  # the seed's class as written, but for `nn.module`
        def __init__(self, k: int, n_heads: int = 8) -> None:
            super().__init__()
            self.k = k
            self.n_heads = n_heads
            self.tokeys = nn.Linear(k, k * n_heads, bias=False)
            self.toqueries = nn.Linear(k, k * n_heads, bias=False)
            self.tovalues = nn.Linear(k, k * n_heads, bias=False)
            self.unifyheads = nn.Linear(n_heads * k, k)

            def forward(self: nn.Module, x: Tensor) -> Tensor:  # local, never bound
                return x

    published = Published(D, n_heads=H).to(device)
    x = torch.randn(B, T, D, device=device)
    with pytest.raises(NotImplementedError, match="forward"):
        published(x)
    assert not hasattr(nn, "module")  # `nn.module` (lower case) is an AttributeError
    # Ours, given the published module's own weights, has a forward and computes what the
    # corrected seed computes with those weights.
    ours = MultiHeadAttention(D, H, head_dim=D)
    _load_packed(
        ours, [published.toqueries.weight, published.tokeys.weight, published.tovalues.weight], None
    )
    _load_linear(ours.out_proj, published.unifyheads)
    fixed = Seed004SelfAttention(D, n_heads=H)
    fixed.load_state_dict(published.state_dict())
    ours.to(device)
    fixed.to(device)
    out = ours(x)
    assert out.shape == (B, T, D)
    torch.testing.assert_close(out, fixed(x), atol=ATOL, rtol=RTOL)
