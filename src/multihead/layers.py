"""Transformer layers around MultiHeadAttention: the encoder and decoder layers, and a stack of
layers. What they are built from (:class:`~multihead.layer_parts.FeedForward`, ``ACTIVATIONS``,
the shared constructor) is in :mod:`multihead.layer_parts`.

Each ``forward`` reads like its equation. With sublayer(x) attention or the feed-forward network:

- pre-LN (``norm_first=True``, seed 001, GPT-2):  x = x + sublayer(LayerNorm(x))
- post-LN (``norm_first=False``, "Attention Is All You Need", BERT):  x = LayerNorm(x + sublayer(x))

Layers return the new x only; attention weights come from :func:`multihead.capture`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.attention import AttentionCache, MultiHeadAttention
from multihead.layer_parts import FeedForward, build_parts, check_layer_input
from multihead.map_types import BlockParts
from multihead.packing import PackedBatch

__all__ = [
    "TransformerEncoderLayer",
    "TransformerEncoder",
    "TransformerDecoderLayer",
]


class LayerCaches(Protocol):
    """A cache for a stack of layers: ``caches[i]`` is layer i's :class:`AttentionCache`."""

    def __getitem__(self, index: int) -> AttentionCache: ...


class TransformerEncoderLayer(nn.Module):
    """Self-attention and a feed-forward network, each with a skip connection and LayerNorm.

    - pre-LN (``norm_first=True``):  x = x + attn(norm1(x));  x = x + ff(norm2(x))
    - post-LN (``norm_first=False``):  x = norm1(x + attn(x));  x = norm2(x + ff(x))

    Run with ``is_causal=True`` it is the block of a decoder-only language model (GPT).

    Args:
        embed_dim: E.
        num_heads: H.
        ff_dim: the feed-forward hidden width.
        num_kv_heads: key/value heads (grouped-query attention); default ``num_heads``.
        head_dim: D; default ``embed_dim // num_heads``.
        dropout: on attention weights, feed-forward hidden units and the residual branches.
        norm_first: True for pre-LN (seed 001), False for post-LN (the paper, BERT).
        norm_eps: LayerNorm epsilon.
        activation: the feed-forward activation (see :class:`FeedForward`).
        bias: biases in every linear layer and LayerNorm.

    Submodules: ``self_attn`` (:class:`MultiHeadAttention`), ``ff`` (:class:`FeedForward`),
    ``norm1`` (before/after attention), ``norm2`` (before/after the feed-forward), ``dropout1``,
    ``dropout2`` (on the residual branches).

    Example:
        >>> layer = TransformerEncoderLayer(64, 4, 256, norm_first=False)
        >>> layer(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    # the model map reads it (multihead.map_types): where the block writes into the residual stream
    block_parts = BlockParts(
        attention="self_attn", mlp="ff", mlp_in="ff.linear1", mlp_down="ff.linear2"
    )

    norm_first: bool
    self_attn: MultiHeadAttention
    ff: FeedForward
    norm1: nn.LayerNorm
    norm2: nn.LayerNorm
    dropout1: nn.Dropout
    dropout2: nn.Dropout

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
        build_parts(
            self,
            embed_dim,
            num_heads,
            ff_dim,
            sublayers=2,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dropout=dropout,
            norm_first=norm_first,
            norm_eps=norm_eps,
            activation=activation,
            bias=bias,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: AttentionCache | None = None,
        packing: PackedBatch | None = None,
    ) -> Tensor:
        """Apply the layer.

        Args:
            x: (B, T, E), unbatched (T, E), or with ``packing`` the packed real tokens (N, E).
            mask: bool (True = may attend) or float mask, (T, S), (B, T, S) or (B, H, T, S).
            key_mask: bool (B, S), True = a real token.
            is_causal: causal self-attention (bottom-right aligned), ANDed with the masks.
            cache: a key/value cache for incremental decoding (see ``multihead.KVCache``).
            packing: a :class:`~multihead.packing.PackedBatch`: x holds the real tokens of a
                padded batch and the layer computes on them alone.

        Returns:
            x, shaped as given.
        """
        check_layer_input(x, self.self_attn.embed_dim, packing)
        kw: dict[str, Any] = {
            "mask": mask,
            "key_mask": key_mask,
            "is_causal": is_causal,
            "cache": cache,
            "packing": packing,
        }
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x), **kw))
            x = x + self.dropout2(self.ff(self.norm2(x)))
        else:
            x = self.norm1(x + self.dropout1(self.self_attn(x, **kw)))
            x = self.norm2(x + self.dropout2(self.ff(x)))
        return x

    # -- conversion to and from torch.nn --------------------------------------------------------

    @classmethod
    def from_torch(cls, m: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
        """An exact copy of a torch.nn.TransformerEncoderLayer (ReLU or GELU activation).

        Parameters are copied, never shared. The copy is batch-first whatever ``m.batch_first``
        was.
        """
        if not isinstance(m, nn.TransformerEncoderLayer):
            raise TypeError(f"m must be a torch.nn.TransformerEncoderLayer, got {type(m).__name__}")
        activation = _activation_name(m.activation)
        if activation is None:
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
            activation=activation,
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


def _activation_name(activation: object) -> str | None:
    """The name of a torch encoder layer's activation among ours, or None: torch keeps the
    function (``F.relu``, ``F.gelu``, what a string names) or the module it was given."""
    if activation is F.relu or isinstance(activation, nn.ReLU):
        return "relu"
    if activation is F.gelu or (
        isinstance(activation, nn.GELU) and activation.approximate == "none"
    ):
        return "gelu"
    if isinstance(activation, nn.GELU) and activation.approximate == "tanh":
        return "gelu_tanh"
    return None


class TransformerDecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to a memory, and a feed-forward network.

    The encoder layer's parts, plus cross-attention between them (torch's names and order):

    - pre-LN:  x = x + attn(norm1(x));  x = x + cross(norm2(x), memory);  x = x + ff(norm3(x))
    - post-LN: x = norm1(x + attn(x));  x = norm2(x + cross(x, memory));  x = norm3(x + ff(x))

    Args: as :class:`TransformerEncoderLayer`, plus ``memory_dim`` (width of the memory the layer
    attends to; default ``embed_dim``).

    Submodules: ``self_attn``, ``cross_attn`` (:class:`MultiHeadAttention`), ``ff``, ``norm1``,
    ``norm2``, ``norm3``, ``dropout1``..``dropout3``.
    """

    # the model map reads it (multihead.map_types): where the block writes into the residual stream
    block_parts = BlockParts(
        attention="self_attn", mlp="ff", mlp_in="ff.linear1", mlp_down="ff.linear2"
    )

    norm_first: bool
    self_attn: MultiHeadAttention
    ff: FeedForward
    norm1: nn.LayerNorm
    norm2: nn.LayerNorm
    norm3: nn.LayerNorm
    dropout1: nn.Dropout
    dropout2: nn.Dropout
    dropout3: nn.Dropout

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
        attn_kwargs = build_parts(
            self,
            embed_dim,
            num_heads,
            ff_dim,
            sublayers=3,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dropout=dropout,
            norm_first=norm_first,
            norm_eps=norm_eps,
            activation=activation,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.cross_attn = MultiHeadAttention(
            embed_dim, num_heads, kdim=memory_dim, vdim=memory_dim, **attn_kwargs
        )

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        memory_key_mask: Tensor | None = None,
        is_causal: bool = True,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """Apply the layer.

        Args:
            x: (B, T, E), the target sequence.
            memory: (B, S, memory_dim), e.g. the encoder's output.
            mask, key_mask, is_causal: for self-attention (causal by default).
            memory_key_mask: bool (B, S), True = a real memory token.
            cache: self-attention key/value cache for incremental decoding.

        Returns:
            x (B, T, E).
        """
        check_layer_input(x, self.self_attn.embed_dim, None)
        if not isinstance(memory, Tensor) or memory.dim() != x.dim():
            got = tuple(memory.shape) if isinstance(memory, Tensor) else type(memory).__name__
            raise ValueError(f"memory must be (B, S, memory_dim) like x is (B, T, E), got {got}")
        kw: dict[str, Any] = {
            "mask": mask,
            "key_mask": key_mask,
            "is_causal": is_causal,
            "cache": cache,
        }
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x), **kw))
            x = x + self.dropout2(self.cross_attn(self.norm2(x), memory, key_mask=memory_key_mask))
            x = x + self.dropout3(self.ff(self.norm3(x)))
        else:
            x = self.norm1(x + self.dropout1(self.self_attn(x, **kw)))
            x = self.norm2(x + self.dropout2(self.cross_attn(x, memory, key_mask=memory_key_mask)))
            x = self.norm3(x + self.dropout3(self.ff(x)))
        return x


class TransformerEncoder(nn.Module):
    """A stack of layers, with an optional final LayerNorm (usual with pre-LN layers).

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
        cache: LayerCaches | None = None,
        packing: PackedBatch | None = None,
    ) -> Tensor:
        """Apply every layer, then the final norm.

        Args:
            x: (B, T, E), or the packed real tokens (N, E) with ``packing``.
            mask, key_mask, is_causal, packing: as for :meth:`TransformerEncoderLayer.forward`.
            cache: one layer cache per layer (``cache[i]``).

        Returns:
            x, shaped as given.
        """
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                mask=mask,
                key_mask=key_mask,
                is_causal=is_causal,
                cache=cache[i] if cache is not None else None,
                packing=packing,
            )
        if self.norm is not None:
            x = self.norm(x)
        return x
