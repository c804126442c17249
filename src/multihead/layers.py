"""Transformer layers around MultiHeadAttention: feed-forward, encoder/decoder layers, positions.

Each ``forward`` reads like its equation. With E the width and sublayer(x) attention or the
feed-forward network:

- pre-LN (``norm_first=True``, seed 001, GPT-2):  x = x + sublayer(LayerNorm(x))
- post-LN (``norm_first=False``, "Attention Is All You Need", BERT):  x = LayerNorm(x + sublayer(x))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import AttentionCache, MultiHeadAttention, PackedBatch

__all__ = [
    "ACTIVATIONS",
    "FeedForward",
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
    "SinusoidalPositionalEncoding",
    "LearnedPositionalEmbedding",
]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, as BERT and torch use it
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


def _activation(name: str) -> Callable[[Tensor], Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(
            f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, got {name!r}"
        )
    return ACTIVATIONS[name]


def _check_dropout(dropout: float) -> float:
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_x(name: str, x: Tensor, embed_dim: int) -> None:
    """x must be (B, T, E) or unbatched (T, E); checked before a LayerNorm sees it."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3) or x.shape[-1] != embed_dim:
        raise ValueError(
            f"{name} must be (B, T, E) or (T, E) with E={embed_dim}, got shape {tuple(x.shape)}"
        )


def _split(result: Tensor | tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor | None]:
    """(out, weights) from an attention call that may or may not have returned weights."""
    return result if isinstance(result, tuple) else (result, None)


class LayerCaches(Protocol):
    """A cache for a stack of layers: ``caches[i]`` is layer i's :class:`AttentionCache`."""

    def __getitem__(self, index: int) -> AttentionCache: ...


class FeedForward(nn.Module):
    """The position-wise feed-forward network: linear2(dropout(activation(linear1(x)))).

    Args:
        embed_dim: E, input and output width.
        ff_dim: F, the hidden width (4·E in most models).
        dropout: dropout on the hidden activations, in training mode.
        activation: "gelu" (exact), "gelu_tanh", "relu" or "silu".
        bias: whether the two linear layers have biases.

    Shapes: (..., E) -> (..., E).
    """

    def __init__(
        self,
        embed_dim: int,
        ff_dim: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.activation_name = activation
        self.activation = _activation(activation)
        self.linear1 = nn.Linear(embed_dim, ff_dim, bias=bias, device=device, dtype=dtype)
        self.linear2 = nn.Linear(ff_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(_check_dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        """(..., E) -> (..., F) -> (..., E)."""
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class TransformerEncoderLayer(nn.Module):
    """Self-attention and a feed-forward network, each with a skip connection and LayerNorm.

    - pre-LN (``norm_first=True``):  x = x + attn(norm1(x));  x = x + ff(norm2(x))
    - post-LN (``norm_first=False``):  x = norm1(x + attn(x));  x = norm2(x + ff(x))

    Args:
        embed_dim: E.
        num_heads: H.
        ff_dim: the feed-forward hidden width.
        num_kv_heads: key/value heads (grouped-query attention); default ``num_heads``.
        head_dim: D; default ``embed_dim // num_heads``.
        dropout: on attention weights, feed-forward hidden units and both residual branches.
        norm_first: True for pre-LN (seed 001), False for post-LN (the paper, BERT).
        norm_eps: LayerNorm epsilon.
        activation: the feed-forward activation (see :class:`FeedForward`).
        bias: biases in every linear layer and LayerNorm.

    Submodules: ``self_attn`` (:class:`MultiHeadAttention`), ``ff`` (:class:`FeedForward`),
    ``norm1`` (before/after attention), ``norm2`` (before/after the feed-forward).

    Example:
        >>> layer = TransformerEncoderLayer(64, 4, 256, norm_first=False)
        >>> x, weights = layer(torch.randn(2, 10, 64), need_weights=True)
        >>> x.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 4, 10, 10]))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        norm_eps: float = 1e-5,
        activation: str = "gelu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        dropout = _check_dropout(dropout)
        self.norm_first = norm_first
        self.self_attn = MultiHeadAttention(
            embed_dim,
            num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dropout=dropout,
            bias=bias,
            **factory,
        )
        self.ff = FeedForward(
            embed_dim, ff_dim, dropout=dropout, activation=activation, bias=bias, **factory
        )
        self.norm1 = nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: AttentionCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Apply the layer.

        Args:
            x: (B, T, E).
            mask: bool (True = may attend) or float mask, (T, S), (B, T, S) or (B, H, T, S).
            key_mask: bool (B, S), True = a real token.
            is_causal: causal self-attention (bottom-right aligned), ANDed with the masks.
            need_weights: also return the attention weights.
            cache: a key/value cache for incremental decoding (see ``multihead.KVCache``).

        Returns:
            x (B, T, E), or ``(x, weights)`` with weights (B, H, T, S) when ``need_weights``.
        """
        _check_x("x", x, self.self_attn.embed_dim)
        weights: Tensor | None = None

        def attend(h: Tensor) -> Tensor:
            nonlocal weights
            out, weights = _split(
                self.self_attn(
                    h,
                    mask=mask,
                    key_mask=key_mask,
                    is_causal=is_causal,
                    need_weights=need_weights,
                    cache=cache,
                )
            )
            return out

        x = self._sublayers(x, attend)
        return (x, weights) if weights is not None else x

    def forward_packed(self, x: Tensor, packing: PackedBatch) -> Tensor:
        """The layer on the real tokens of a padded batch only (unpadded), exact on them.

        LayerNorm, the projections and the feed-forward network act on each token alone, so they
        run on the packed tokens; attention sees the (B, T) layout under the key mask (see
        :meth:`MultiHeadAttention.forward_packed`).

        Args:
            x: (N, E), the real tokens packed as ``packing`` describes
                (``packing.pack(x_padded)``).
            packing: a :class:`PackedBatch` built once from the batch's key mask.

        Returns:
            (N, E): equal to ``packing.pack(self(x_padded, key_mask=packing.key_mask))``.
        """
        return self._sublayers(x, lambda h: self.self_attn.forward_packed(h, packing))

    def _sublayers(self, x: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        if self.norm_first:
            x = x + self.dropout1(attend(self.norm1(x)))
            x = x + self.dropout2(self.ff(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(attend(x)))
            x = self.norm2(x + self.dropout2(self.ff(x)))
        return x

    @classmethod
    def from_torch(cls, m: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """An exact copy of a torch.nn.TransformerEncoderLayer (ReLU or GELU activation).

        The copy is batch-first whatever ``m.batch_first`` was.
        """
        if not isinstance(m, nn.TransformerEncoderLayer):
            raise TypeError(f"m must be a torch.nn.TransformerEncoderLayer, got {type(m).__name__}")
        kind = getattr(m, "activation_relu_or_gelu", 0)
        if kind not in (1, 2):
            raise ValueError(
                f"cannot convert the activation {m.activation!r}: only ReLU and GELU have an "
                f"equivalent"
            )
        attn = m.self_attn
        ref = m.linear1.weight
        ours = cls(
            attn.embed_dim,
            attn.num_heads,
            m.linear1.out_features,
            dropout=attn.dropout,
            norm_first=m.norm_first,
            norm_eps=m.norm1.eps,
            activation="relu" if kind == 1 else "gelu",
            bias=m.linear1.bias is not None,
            device=ref.device,
            dtype=ref.dtype,
        )
        ours.self_attn = MultiHeadAttention.from_torch(attn)
        ours.ff.linear1.load_state_dict(m.linear1.state_dict())
        ours.ff.linear2.load_state_dict(m.linear2.state_dict())
        ours.norm1.load_state_dict(m.norm1.state_dict())
        ours.norm2.load_state_dict(m.norm2.state_dict())
        return ours

    def to_torch(self) -> nn.TransformerEncoderLayer:
        """An exact batch-first torch.nn.TransformerEncoderLayer copy (ReLU or GELU only)."""
        if self.ff.activation_name not in ("relu", "gelu"):
            raise ValueError(
                f"torch.nn.TransformerEncoderLayer supports activation 'relu' or 'gelu' "
                f"exactly, got {self.ff.activation_name!r}"
            )
        attn = self.self_attn
        ref = self.ff.linear1.weight
        m = nn.TransformerEncoderLayer(
            attn.embed_dim,
            attn.num_heads,
            dim_feedforward=self.ff.linear1.out_features,
            dropout=attn.dropout,
            activation=self.ff.activation_name,
            layer_norm_eps=self.norm1.eps,
            batch_first=True,
            norm_first=self.norm_first,
            bias=self.ff.linear1.bias is not None,
            device=ref.device,
            dtype=ref.dtype,
        )
        m.self_attn = attn.to_torch(batch_first=True)
        m.linear1.load_state_dict(self.ff.linear1.state_dict())
        m.linear2.load_state_dict(self.ff.linear2.state_dict())
        m.norm1.load_state_dict(self.norm1.state_dict())
        m.norm2.load_state_dict(self.norm2.state_dict())
        return m


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, with an optional final LayerNorm (usual with pre-LN layers).

    Args:
        layers: the layers, applied in order (each built on its own, so each has its own
            initialisation).
        norm: applied to the output of the last layer, or None.

    Example:
        >>> enc = TransformerEncoder(
        ...     [TransformerEncoderLayer(64, 4, 256) for _ in range(2)], norm=nn.LayerNorm(64)
        ... )
        >>> enc(torch.randn(2, 10, 64), is_causal=True).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, layers: Iterable[nn.Module], *, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if len(self.layers) == 0:
            raise ValueError("layers must hold at least one layer, got none")
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: LayerCaches | None = None,
    ) -> Tensor | tuple[Tensor, list[Tensor]]:
        """Args: x (B, T, E); the masks as for :meth:`TransformerEncoderLayer.forward`; ``cache``
        holds one layer cache per layer (``cache[i]``). Returns x (B, T, E), or
        ``(x, weights)`` with one (B, H, T, S) tensor per layer when ``need_weights``."""
        all_weights: list[Tensor] = []
        for i, layer in enumerate(self.layers):
            result = layer(
                x,
                mask=mask,
                key_mask=key_mask,
                is_causal=is_causal,
                need_weights=need_weights,
                cache=cache[i] if cache is not None else None,
            )
            x, weights = _split(result)
            if weights is not None:
                all_weights.append(weights)
        if self.norm is not None:
            x = self.norm(x)
        return (x, all_weights) if need_weights else x

    def forward_packed(self, x: Tensor, packing: PackedBatch) -> Tensor:
        """The stack on the real tokens of a padded batch only: (N, E) -> (N, E).

        Every layer must have a ``forward_packed`` (as :class:`TransformerEncoderLayer` does).
        The result equals ``packing.pack(self(x_padded, key_mask=packing.key_mask))``, for the
        work of N tokens instead of B·T in everything but attention itself.

        Args:
            x: (N, E), the real tokens (``packing.pack(x_padded)``).
            packing: a :class:`PackedBatch` built once from the key mask (B, T).

        Returns:
            (N, E).
        """
        for layer in self.layers:
            forward_packed = getattr(layer, "forward_packed", None)
            if forward_packed is None:
                raise TypeError(
                    f"forward_packed needs layers that have a forward_packed method, got "
                    f"{type(layer).__name__}"
                )
            x = forward_packed(x, packing)
        if self.norm is not None:
            x = self.norm(x)
        return x


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to a memory, and a feed-forward network.

    Args: as :class:`TransformerEncoderLayer`, plus ``memory_dim`` (width of the memory the layer
    attends to; default ``embed_dim``).

    Submodules: ``self_attn``, ``cross_attn`` (:class:`MultiHeadAttention`), ``ff``, ``norm1``,
    ``norm2``, ``norm3`` (around self-attention, cross-attention and the feed-forward).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ff_dim: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        memory_dim: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        norm_eps: float = 1e-5,
        activation: str = "gelu",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        dropout = _check_dropout(dropout)
        self.norm_first = norm_first
        attn_kwargs: dict[str, Any] = {
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "dropout": dropout,
            "bias": bias,
            **factory,
        }
        self.self_attn = MultiHeadAttention(embed_dim, num_heads, **attn_kwargs)
        self.cross_attn = MultiHeadAttention(
            embed_dim, num_heads, kdim=memory_dim, vdim=memory_dim, **attn_kwargs
        )
        self.ff = FeedForward(
            embed_dim, ff_dim, dropout=dropout, activation=activation, bias=bias, **factory
        )
        self.norm1 = nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory)
        self.norm2 = nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory)
        self.norm3 = nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        is_causal: bool = True,
        need_weights: bool = False,
        cache: AttentionCache | None = None,
    ) -> Tensor | tuple[Tensor, tuple[Tensor, Tensor]]:
        """Apply the layer.

        Args:
            x: (B, T, E), the target sequence.
            memory: (B, S, memory_dim), e.g. the encoder's output.
            mask, key_mask, is_causal: for self-attention (causal by default).
            memory_key_mask: bool (B, S), True = a real memory token.
            need_weights: also return the attention weights.
            cache: self-attention key/value cache for incremental decoding.

        Returns:
            x (B, T, E), or ``(x, (self_weights, cross_weights))`` when ``need_weights``, with
            self_weights (B, H, T, T') (T' = cached + T) and cross_weights (B, H, T, S).
        """
        _check_x("x", x, self.self_attn.embed_dim)
        if not isinstance(memory, Tensor) or memory.dim() != x.dim():
            got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise ValueError(f"memory must be (B, S, memory_dim) like x is (B, T, E), got {got}")

        def attend(h: Tensor) -> tuple[Tensor, Tensor | None]:
            return _split(
                self.self_attn(
                    h,
                    mask=mask,
                    key_mask=key_mask,
                    is_causal=is_causal,
                    need_weights=need_weights,
                    cache=cache,
                )
            )

        def cross(h: Tensor) -> tuple[Tensor, Tensor | None]:
            return _split(
                self.cross_attn(h, memory, key_mask=memory_key_mask, need_weights=need_weights)
            )

        if self.norm_first:
            a, self_w = attend(self.norm1(x))
            x = x + self.dropout1(a)
            c, cross_w = cross(self.norm2(x))
            x = x + self.dropout2(c)
            x = x + self.dropout3(self.ff(self.norm3(x)))
        else:
            a, self_w = attend(x)
            x = self.norm1(x + self.dropout1(a))
            c, cross_w = cross(x)
            x = self.norm2(x + self.dropout2(c))
            x = self.norm3(x + self.dropout3(self.ff(x)))
        if self_w is not None and cross_w is not None:
            return x, (self_w, cross_w)
        return x


def _positions(x: Tensor, positions: Tensor | None, max_len: int, embed_dim: int) -> Tensor:
    """Validate positions for x (B, T, E): default 0..T-1; returns (T,) or (B, T) int64."""
    if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[-1] != embed_dim:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be (..., T, E) with E={embed_dim}, got {shape}")
    t = x.shape[-2]
    if positions is None:
        if t > max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={max_len}")
        return torch.arange(t, device=x.device)
    if not isinstance(positions, Tensor) or positions.dtype not in (torch.int32, torch.int64):
        got = positions.dtype if isinstance(positions, Tensor) else type(positions).__name__
        raise TypeError(f"positions must be an int32/int64 tensor, got {got}")
    if positions.dim() == 0 or positions.shape[-1] != t:
        raise ValueError(
            f"positions must end in the sequence length T={t}, got shape {tuple(positions.shape)}"
        )
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_len):
        raise ValueError(
            f"positions must be in [0, max_len={max_len}), got values in "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    return positions


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class SinusoidalPositionalEncoding(nn.Module):
    r"""The fixed sinusoidal encoding of "Attention Is All You Need", added to the input.

    .. math::
        PE_{(p, 2i)} = \sin(p / \text{base}^{2i/E}), \quad
        PE_{(p, 2i+1)} = \cos(p / \text{base}^{2i/E})

    Args:
        embed_dim: E.
        max_len: the longest sequence it encodes.
        base: 10000 in the paper.

    Shapes: forward(x (B, T, E), positions (T,) or (B, T) optional) -> (B, T, E).
    """

    pe: Tensor

    def __init__(
        self,
        embed_dim: int,
        max_len: int = 4096,
        *,
        base: float = 10000.0,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(embed_dim=embed_dim, max_len=max_len)
        if not base > 0:
            raise ValueError(f"base must be positive, got {base!r}")
        self.embed_dim, self.max_len = embed_dim, max_len
        # Angles in float64: p · freq reaches thousands of radians, where float32 would lose
        # about 1e-4 of them.
        position = torch.arange(max_len, dtype=torch.float64, device=device)[:, None]  # (L, 1)
        freq = torch.exp(
            torch.arange(0, embed_dim, 2, dtype=torch.float64, device=device)
            * (-math.log(base) / embed_dim)
        )  # (ceil(E/2),)
        pe = torch.zeros(max_len, embed_dim, dtype=torch.float64, device=device)
        pe[:, 0::2] = torch.sin(position * freq)
        pe[:, 1::2] = torch.cos(position * freq[: embed_dim // 2])
        pe = pe.float()  # (L, E)
        # Not persistent: it is a function of the arguments, not a learned weight.
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        pos = _positions(x, positions, self.max_len, self.embed_dim)
        return x + self.pe[pos].to(x.dtype)


class LearnedPositionalEmbedding(nn.Module):
    """A learned embedding per position (BERT, GPT-2), added to the input.

    Args: max_len (the number of positions), embed_dim (E).
    Shapes: forward(x (B, T, E), positions (T,) or (B, T) optional) -> (B, T, E).
    """

    def __init__(
        self,
        max_len: int,
        embed_dim: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_sizes(max_len=max_len, embed_dim=embed_dim)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, embed_dim, device=device, dtype=dtype)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        pos = _positions(x, positions, self.max_len, self.embedding.embedding_dim)
        return x + self.embedding(pos)
