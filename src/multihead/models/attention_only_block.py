"""The block of an attention-only transformer: causal self-attention and a skip, no feed-forward
network (the setting of Elhage et al.'s "A Mathematical Framework for Transformer Circuits",
where induction heads were first described). :class:`~multihead.models.TransformerLM` stacks
them with ``attn_only=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from multihead.attention import AttentionCache, MultiHeadAttention
from multihead.layer_parts import build_parts, check_layer_input
from multihead.map_types import BlockParts

__all__ = ["AttentionOnlyBlock"]


class AttentionOnlyBlock(nn.Module):
    """A decoder block without its feed-forward network: causal self-attention and a skip.

    - pre-LN (``norm_first=True``):  x = x + attn(norm1(x))
    - post-LN (``norm_first=False``):  x = norm1(x + attn(x))

    Built from the parts of :class:`~multihead.layers.TransformerEncoderLayer` (``self_attn``,
    ``norm1``, ``dropout1``; :func:`~multihead.layer_parts.build_parts` without ``ff``), so an
    attention-only model's weights read like a full one's minus ``ff`` and ``norm2``.

    Args:
        embed_dim, num_heads, num_kv_heads, dropout, norm_first, device, dtype: as for
            :class:`~multihead.layers.TransformerEncoderLayer`.
    """

    # the model map reads it (multihead.map_types): only attention writes into the residual stream
    block_parts = BlockParts(attention="self_attn", mlp=None)

    norm_first: bool
    self_attn: MultiHeadAttention
    norm1: nn.LayerNorm
    dropout1: nn.Dropout

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        build_parts(
            self,
            embed_dim,
            num_heads,
            None,  # no feed-forward network
            sublayers=1,
            num_kv_heads=num_kv_heads,
            head_dim=None,
            dropout=dropout,
            norm_first=norm_first,
            norm_eps=1e-5,
            activation="gelu",
            bias=True,
            device=device,
            dtype=dtype,
        )

    def forward(
        self,
        x: Tensor,
        *,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        cache: AttentionCache | None = None,
    ) -> Tensor:
        """x (B, T, E) -> (B, T, E); key_mask (B, S), is_causal and cache as for attention."""
        check_layer_input(x, self.self_attn.embed_dim, None)
        kw: dict[str, Any] = {"key_mask": key_mask, "is_causal": is_causal, "cache": cache}
        if self.norm_first:
            return x + self.dropout1(self.self_attn(self.norm1(x), **kw))
        return self.norm1(x + self.dropout1(self.self_attn(x, **kw)))
