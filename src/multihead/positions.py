"""Positions: the sinusoidal encoding of "Attention Is All You Need" and learned embeddings."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from multihead._checks import check_positive_int

__all__ = ["SinusoidalPositionalEncoding", "LearnedPositionalEmbedding"]


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
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("max_len", max_len)
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
        check_positive_int("max_len", max_len)
        check_positive_int("embed_dim", embed_dim)
        self.max_len = max_len
        self.embedding = nn.Embedding(max_len, embed_dim, device=device, dtype=dtype)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        pos = _positions(x, positions, self.max_len, self.embedding.embedding_dim)
        return x + self.embedding(pos)
