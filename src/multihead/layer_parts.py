"""What every transformer layer is built from: the feed-forward network, the shared constructor
that gives a layer its ``self_attn``, ``ff``, LayerNorms and Dropouts, and the check of its input.

The layers themselves (encoder, decoder, stack) are in :mod:`multihead.layers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import check_choice, check_probability, check_tensor
from multihead.attention import MultiHeadAttention
from multihead.packing import PackedBatch

__all__ = ["ACTIVATIONS", "FeedForward", "build_parts", "check_layer_input"]

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,  # exact (erf) GELU, as BERT and torch use it
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


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
        self.activation_name = check_choice("activation", activation, ACTIVATIONS)
        self.activation = ACTIVATIONS[activation]
        self.linear1 = nn.Linear(embed_dim, ff_dim, bias=bias, device=device, dtype=dtype)
        self.linear2 = nn.Linear(ff_dim, embed_dim, bias=bias, device=device, dtype=dtype)
        self.dropout = nn.Dropout(check_probability("dropout", dropout))

    def forward(self, x: Tensor) -> Tensor:
        """(..., E) -> (..., F) -> (..., E)."""
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


def build_parts(
    layer: Any,
    embed_dim: int,
    num_heads: int,
    ff_dim: int | None,
    *,
    sublayers: int,
    num_kv_heads: int | None,
    head_dim: int | None,
    dropout: float,
    norm_first: bool,
    norm_eps: float,
    activation: str,
    bias: bool,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> dict[str, Any]:
    """Give ``layer`` what every transformer layer has: ``norm_first``, ``self_attn``, ``ff``,
    and a LayerNorm ``norm{i}`` and a Dropout ``dropout{i}`` per sublayer i = 1..``sublayers``.
    With ``ff_dim=None`` the layer has no ``ff`` (an attention-only block).

    Returns the keyword arguments ``self_attn`` was built with (heads, dropout, bias, device,
    dtype), for further attention modules of the layer.
    """
    factory: dict[str, Any] = {"device": device, "dtype": dtype}
    dropout = check_probability("dropout", dropout)
    attn_kwargs: dict[str, Any] = {
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "dropout": dropout,
        "bias": bias,
        **factory,
    }
    layer.norm_first = norm_first
    layer.self_attn = MultiHeadAttention(embed_dim, num_heads, **attn_kwargs)
    if ff_dim is not None:
        layer.ff = FeedForward(
            embed_dim, ff_dim, dropout=dropout, activation=activation, bias=bias, **factory
        )
    for i in range(1, sublayers + 1):
        layer.add_module(f"norm{i}", nn.LayerNorm(embed_dim, eps=norm_eps, bias=bias, **factory))
        layer.add_module(f"dropout{i}", nn.Dropout(dropout))
    return attn_kwargs


def check_layer_input(x: Tensor, embed_dim: int, packing: PackedBatch | None) -> None:
    """x must be (B, T, E), unbatched (T, E) or packed (N, E), checked before LayerNorm."""
    check_tensor("x", x)
    if packing is not None and (x.dim() != 2 or x.shape[-1] != embed_dim):
        raise ValueError(
            f"x must be the packed tokens (N, E) with E={embed_dim}, got shape {tuple(x.shape)}"
        )
    if x.dim() not in (2, 3) or x.shape[-1] != embed_dim:
        raise ValueError(
            f"x must be (B, T, E) or (T, E) with E={embed_dim}, got shape {tuple(x.shape)}"
        )
