"""A preallocated key/value cache for incremental (token by token) decoding.

Causal self-attention recomputes nothing for the positions it has already seen: their keys and
values do not change when a token is appended. A cache keeps them, so a decoding step projects
only the new token(s) and attends over everything stored:

    step t:  k_new, v_new = project(x_t)            # (B, Hk, T, D), T new positions
             K, V = cache.update(k_new, v_new)      # (B, Hk, S, D), S = stored + T
             out = attention(q_new, K, V, is_causal=True)   # bottom-right aligned

Buffers are allocated once, up to ``max_len`` positions, and written in place, so a step costs
the same whatever the position (no ``torch.cat`` that copies the whole history each step).

Lengths are tracked per layer: each layer's :meth:`LayerKVCache.update` advances its own length,
so the cache works with any stack that calls its layers in order (no "advance" call to forget
after each step), and :attr:`KVCache.length` reports the positions every layer holds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead._checks import check_positive_int

__all__ = ["KVCache", "LayerKVCache"]


class LayerKVCache:
    """One layer's view of a :class:`KVCache`; what ``MultiHeadAttention(cache=...)`` calls.

    Obtained as ``cache[i]``; it holds no tensors of its own, only its index.
    """

    __slots__ = ("_cache", "index")

    def __init__(self, cache: KVCache, index: int) -> None:
        self._cache = cache
        self.index = index

    @property
    def length(self) -> int:
        """The number of positions this layer holds."""
        return self._cache.lengths[self.index]

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new keys and values after the ones held; return everything held.

        Args:
            k: new keys (B, Hk, T, D).
            v: new values (B, Hk, T, D).

        Returns:
            ``(keys, values)``, each (B, Hk, S, D) with S = held + T: views of the cache's
            buffers (no copy), valid until the next ``update`` or :meth:`KVCache.reset`.

        Raises:
            ValueError: shapes that don't match the cache, or more than ``max_len`` positions.
            TypeError: a dtype that differs from the cache's.
        """
        c = self._cache
        expected = (c.batch_size, c.num_kv_heads, c.head_dim)
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or (t.shape[0], t.shape[1], t.shape[3]) != expected:
                raise ValueError(
                    f"{name} must have shape (B, Hk, T, D) = ({c.batch_size}, {c.num_kv_heads}, "
                    f"T, {c.head_dim}) to match the cache, got {tuple(t.shape)}"
                )
            if t.dtype != c.dtype:
                raise TypeError(f"{name} has dtype {t.dtype} but the cache holds {c.dtype}")
        if k.shape[2] != v.shape[2]:
            raise ValueError(
                f"k and v must hold the same number of positions, got k {tuple(k.shape)} and "
                f"v {tuple(v.shape)}"
            )
        start = c.lengths[self.index]
        end = start + k.shape[2]
        if end > c.max_len:
            raise ValueError(
                f"the cache holds at most max_len={c.max_len} positions: layer {self.index} "
                f"has {start} and got {k.shape[2]} more"
            )
        c.keys[self.index, :, :, start:end].copy_(k)
        c.values[self.index, :, :, start:end].copy_(v)
        c.lengths[self.index] = end
        # (B, Hk, S, D) views of the filled prefix
        return c.keys[self.index, :, :, :end], c.values[self.index, :, :, :end]


class KVCache:
    """Keys and values of every layer of a decoder, preallocated up to ``max_len`` positions.

    Args:
        num_layers: L, the number of attention layers that share the cache.
        batch_size: B.
        num_kv_heads: Hk, key/value heads per layer (fewer than query heads with grouped-query
            attention, which is what makes its cache smaller).
        head_dim: D.
        max_len: the most positions any layer can hold (prompt plus generated tokens).
        device: where the buffers live; default torch's default device.
        dtype: the buffers' dtype; default torch's default dtype. It must be the dtype of the
            keys and values the model produces.

    Attributes:
        keys, values: the buffers, each (L, B, Hk, max_len, D); positions at or after a layer's
            length hold stale or zero data.
        lengths: positions held per layer (a list of L ints).

    Memory: 2 · L · B · Hk · max_len · D elements.

    Example:
        >>> layers = TransformerEncoder([TransformerEncoderLayer(64, 4, 256) for _ in range(2)])
        >>> cache = KVCache(2, batch_size=1, num_kv_heads=4, head_dim=16, max_len=32)
        >>> with torch.no_grad():
        ...     prompt = layers(torch.randn(1, 5, 64), is_causal=True, cache=cache)
        ...     step = layers(torch.randn(1, 1, 64), is_causal=True, cache=cache)
        >>> cache.length
        6

    The cache is for inference: use it under ``torch.no_grad()`` or ``torch.inference_mode()``.
    """

    def __init__(
        self,
        num_layers: int,
        batch_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.batch_size = check_positive_int("batch_size", batch_size)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.max_len = check_positive_int("max_len", max_len)
        shape = (num_layers, batch_size, num_kv_heads, max_len, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths: list[int] = [0] * num_layers
        self._views = tuple(LayerKVCache(self, i) for i in range(num_layers))

    @property
    def dtype(self) -> torch.dtype:
        return self.keys.dtype

    @property
    def device(self) -> torch.device:
        return self.keys.device

    @property
    def length(self) -> int:
        """Positions held by every layer (between steps all layers hold the same number)."""
        return min(self.lengths)

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index: int) -> LayerKVCache:
        """Layer ``index``'s view, to pass as ``cache=`` to that layer's attention."""
        if not isinstance(index, int) or not -self.num_layers <= index < self.num_layers:
            raise IndexError(f"layer index must be an int in [0, {self.num_layers}), got {index!r}")
        return self._views[index]

    def reset(self) -> None:
        """Forget every position (the buffers stay allocated) to decode a new batch."""
        self.lengths = [0] * self.num_layers

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, batch_size={self.batch_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, max_len={self.max_len}, "
            f"lengths={self.lengths}, dtype={self.dtype}, device={self.device})"
        )
