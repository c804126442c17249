"""Deprecated: exact conversion to and from torch.nn lives with the classes it builds.

Use :meth:`MultiHeadAttention.from_torch <multihead.MultiHeadAttention.from_torch>`,
:meth:`MultiHeadAttention.to_torch <multihead.MultiHeadAttention.to_torch>`,
:meth:`TransformerEncoderLayer.from_torch <multihead.layers.TransformerEncoderLayer.from_torch>`
and :meth:`TransformerEncoderLayer.to_torch <multihead.layers.TransformerEncoderLayer.to_torch>`.
The functions here call them, with a ``DeprecationWarning``, for one release.
"""

from __future__ import annotations

import warnings

from torch import nn

from multihead.attention import MultiHeadAttention
from multihead.layers import TransformerEncoderLayer

__all__ = [
    "mha_from_torch",
    "mha_to_torch",
    "encoder_layer_from_torch",
    "encoder_layer_to_torch",
]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(
        f"multihead.interop.{old} is deprecated (it goes in the next release): use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


def mha_from_torch(m: nn.MultiheadAttention) -> MultiHeadAttention:
    """Deprecated: :meth:`MultiHeadAttention.from_torch`."""
    _deprecated("mha_from_torch", "MultiHeadAttention.from_torch")
    return MultiHeadAttention.from_torch(m)


def mha_to_torch(mha: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """Deprecated: :meth:`MultiHeadAttention.to_torch`."""
    _deprecated("mha_to_torch", "MultiHeadAttention.to_torch")
    return mha.to_torch(batch_first=batch_first)


def encoder_layer_from_torch(m: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
    """Deprecated: :meth:`TransformerEncoderLayer.from_torch`."""
    _deprecated("encoder_layer_from_torch", "TransformerEncoderLayer.from_torch")
    return TransformerEncoderLayer.from_torch(m)


def encoder_layer_to_torch(layer: TransformerEncoderLayer) -> nn.TransformerEncoderLayer:
    """Deprecated: :meth:`TransformerEncoderLayer.to_torch`."""
    _deprecated("encoder_layer_to_torch", "TransformerEncoderLayer.to_torch")
    return layer.to_torch()
