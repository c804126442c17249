"""The hyperparameters of a :class:`~multihead.models.TransformerLM`: what ``config.json`` stores
under ``"model"``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LMConfig"]


@dataclass(frozen=True)
class LMConfig:
    """The hyperparameters of a :class:`TransformerLM`; what ``config.json`` stores.

    Args: as :class:`~multihead.models.TransformerLM`. ``attn_only`` and ``embedding_std``
    were added later: a ``config.json`` without them gets their defaults (False, 0.02).
    """

    vocab_size: int
    embed_dim: int
    num_heads: int
    num_layers: int
    ff_dim: int
    max_len: int
    num_kv_heads: int | None = None
    dropout: float = 0.0
    norm_first: bool = True
    attn_only: bool = False
    embedding_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "embed_dim", "num_heads", "num_layers", "ff_dim", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        kv = self.num_kv_heads
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0):
            raise ValueError(f"num_kv_heads must be a positive int or None, got {kv!r}")
        if self.embed_dim % self.num_heads != 0:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads})"
            )
        if kv is not None and self.num_heads % kv != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({kv})"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {self.dropout!r}")
        for name in ("norm_first", "attn_only"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        std = self.embedding_std
        if (
            not isinstance(std, (int, float))
            or isinstance(std, bool)
            or not math.isfinite(std)
            or std <= 0
        ):
            raise ValueError(f"embedding_std must be a finite float > 0, got {std!r}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LMConfig:
        """Build from a mapping, e.g. parsed JSON; unknown or missing keys raise ValueError."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an LMConfig must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"unknown LMConfig keys {unknown}; expected a subset of {sorted(names)}"
            )
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"LMConfig is missing the keys {missing}")
        return cls(**data)
