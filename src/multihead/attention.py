"""MultiHeadAttention: projections, head split and merge. The math itself is in ``functional``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead import functional

__all__ = ["MultiHeadAttention", "AttentionCache", "AttentionObserver", "PackedBatch"]


class AttentionCache(Protocol):
    """What ``MultiHeadAttention(..., cache=...)`` needs of a key/value cache (one layer's).

    ``update`` stores the new keys and values (B, Hk, T, D) after the ones already held and
    returns all of them, (B, Hk, S, D) with S = cached + T.
    """

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


# Called as observer(module, q, k, v, mask, is_causal, scale) with the projected heads
# q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, Dv) and the mask handed to the core. It sees what
# the attention saw, without changing the result; ``multihead.capture`` installs one.
AttentionObserver = Callable[
    ["MultiHeadAttention", Tensor, Tensor, Tensor, "Tensor | None", bool, float], None
]


def _shape_str(t: Tensor) -> str:
    return str(tuple(t.shape))


class PackedBatch:
    """Where the real tokens of a padded batch sit, to compute on them alone ("unpadding").

    A batch padded to (B, T) holds N <= B·T real tokens. Linear layers, LayerNorm and the
    feed-forward network act on each token alone, so they can run on the packed (N, E) tokens and
    skip the padding; only attention needs the (B, T) layout back, which :meth:`unpack` restores.
    For attention the batch is sorted by effective length (last real position + 1) and cut into
    at most ``num_buckets`` buckets of consecutive sequences, each attended at its own longest
    length: little of the padded score matrix is computed, in a handful of kernel calls (one call
    per sequence would compute none, but many small parallel kernels are slow on a busy CPU).
    Build this once per forward and share it across layers: indices, order, buckets and masks are
    computed here, not per layer.

    Args:
        key_mask: bool (B, T), True = a real token. Tokens are packed in row-major order (batch
            by batch, position by position); a sequence's real tokens need not be contiguous.

    Attributes:
        key_mask: (B, T) bool, as given.
        batch_index: (N,) int64, the batch row of each packed token.
        position_index: (N,) int64, the position (column) of each packed token.
        attn_mask: (B, 1, 1, T) bool view of ``key_mask``, as the padded computation uses it.
        num_tokens: N.
        order: (B,) int64, the batch rows sorted by effective length, longest first.
        sorted_batch_index: (N,) int64, each packed token's row in the sorted batch.
        buckets: ``(start, stop, length, mask)`` per bucket: sorted rows ``start:stop`` attend
            over their first ``length`` positions under ``mask`` (n, 1, 1, length), or no mask
            when all of those keys are real.
        num_buckets: the most buckets (class attribute, 4).

    Example:
        >>> packing = PackedBatch(torch.tensor([[True, True, False], [True, False, False]]))
        >>> x = torch.arange(6.0).view(2, 3, 1)  # (B, T, E)
        >>> packing.pack(x).flatten().tolist()
        [0.0, 1.0, 3.0]
        >>> packing.unpack(packing.pack(x)).flatten().tolist()
        [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]
    """

    num_buckets = 4

    def __init__(self, key_mask: Tensor) -> None:
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or key_mask.dim() != 2:
            got = (
                f"{key_mask.dtype} tensor of shape {_shape_str(key_mask)}"
                if isinstance(key_mask, Tensor)
                else type(key_mask).__name__
            )
            raise TypeError(f"key_mask must be a bool tensor (B, T), got {got}")
        self.key_mask = key_mask
        self.batch_index, self.position_index = key_mask.nonzero(as_tuple=True)  # (N,), (N,)
        self.attn_mask = key_mask[:, None, None, :]  # (B, 1, 1, T)
        self.num_tokens = int(self.batch_index.shape[0])
        # Attention runs on the batch sorted by effective length (last real position + 1),
        # in a few buckets of consecutive sequences, each cut to its own longest: most of the
        # padded scores are never computed, yet there are only a handful of kernel calls.
        t = key_mask.shape[1]
        positions = torch.arange(1, t + 1, device=key_mask.device)
        effective = torch.where(key_mask, positions, 0).amax(1)  # (B,)
        effective, self.order = effective.sort(descending=True, stable=True)  # (B,), (B,)
        rank = torch.empty_like(self.order)
        rank[self.order] = torch.arange(self.order.shape[0], device=key_mask.device)
        self.sorted_batch_index = rank[self.batch_index]  # (N,): row in the sorted batch
        sorted_mask = key_mask[self.order]  # (B, T)
        lengths = effective.tolist()  # one host sync per forward, not per layer
        b = len(lengths)
        # (first row, end row, length, mask (n, 1, 1, L) or None when every key is real)
        self.buckets: list[tuple[int, int, int, Tensor | None]] = []
        groups = min(self.num_buckets, b)
        for g in range(groups):
            start, stop = g * b // groups, (g + 1) * b // groups
            if start == stop or lengths[start] == 0:
                continue
            length = lengths[start]
            block = sorted_mask[start:stop, :length]
            mask = None if bool(block.all()) else block[:, None, None, :]
            self.buckets.append((start, stop, length, mask))

    @property
    def batch_size(self) -> int:
        return int(self.key_mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.key_mask.shape[1])

    def pack(self, x: Tensor) -> Tensor:
        """Gather the real tokens: (B, T, ...) -> (N, ...), straight from strided views."""
        return x[self.batch_index, self.position_index]

    def unpack(self, x: Tensor, *, sorted: bool = False) -> Tensor:
        """Scatter packed tokens back: (N, ...) -> (B, T, ...), zeros at the padding.

        With ``sorted``, the batch rows come in ``order`` (longest first), as attention uses them.
        """
        out = x.new_zeros(self.batch_size, self.length, *x.shape[1:])
        rows = self.sorted_batch_index if sorted else self.batch_index
        out[rows, self.position_index] = x
        return out


class MultiHeadAttention(nn.Module):
    r"""Multi-head attention (Vaswani et al., 2017), batch-first, with grouped-query heads.

    .. math::
        \text{head}_h = \text{softmax}\big(\tfrac{(X W^Q_h)(Y W^K_{g(h)})^\top}{\sqrt{D}}
        + M\big)\, Y W^V_{g(h)}, \qquad
        \text{out} = [\text{head}_1; \dots; \text{head}_H]\, W^O

    where g(h) = h // (H // Hk) picks the key/value head that query head h shares.

    Args:
        embed_dim: E, the width of the query input.
        num_heads: H, the number of query heads.
        kdim: width of the key input; default ``embed_dim``.
        vdim: width of the value input; default ``embed_dim``.
        head_dim: D, the width of one head; default ``embed_dim // num_heads`` (which must then
            divide evenly). Any value is allowed, e.g. ``head_dim=embed_dim`` for "wide" heads.
        num_kv_heads: Hk, the number of key/value heads; default ``num_heads``. ``num_heads``
            must be a multiple of it (1 is multi-query attention).
        out_dim: width of the output; default ``embed_dim``.
        bias: whether the projections have biases.
        dropout: dropout on the attention weights, in training mode only.
        device, dtype: as for any torch module.

    Parameters (the layout that checkpoints and converters rely on):
        - When ``kdim == vdim == embed_dim``, one packed projection ``qkv_proj``:
          ``nn.Linear(E, (H + 2·Hk)·D)``, whose output rows are [q heads 0..H-1 | k heads 0..Hk-1 |
          v heads 0..Hk-1], each head D consecutive rows. With Hk = H and H·D = E this is exactly
          torch.nn.MultiheadAttention's ``in_proj_weight`` / ``in_proj_bias``. Self-attention runs
          it as one matmul; cross-attention uses its three row blocks separately.
        - Otherwise three projections ``q_proj`` (E → H·D), ``k_proj`` (kdim → Hk·D),
          ``v_proj`` (vdim → Hk·D).
        - ``out_proj``: ``nn.Linear(H·D, out_dim)``.

    Initialisation (``reset_parameters``): each of the q, k and v weight blocks is drawn
    Xavier-uniform on its own (E_in → H·D or Hk·D), as is ``out_proj.weight``; all biases start
    at zero. This matches torch.nn.MultiheadAttention except that torch draws the packed block as
    one matrix and ``out_proj`` with nn.Linear's default.

    Shapes:
        - query (B, T, E) or unbatched (T, E); key (B, S, kdim); value (B, S, vdim).
        - output (B, T, out_dim); weights (B, H, T, S). Unbatched inputs drop the B axis.

    Example:
        >>> mha = MultiHeadAttention(64, num_heads=4)
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, is_causal=True, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 4, 10, 10]))
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        head_dim: int | None = None,
        num_kv_heads: int | None = None,
        out_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name, opt in (
            ("kdim", kdim),
            ("vdim", vdim),
            ("head_dim", head_dim),
            ("num_kv_heads", num_kv_heads),
            ("out_dim", out_dim),
        ):
            if opt is not None and (not isinstance(opt, int) or isinstance(opt, bool) or opt <= 0):
                raise ValueError(f"{name} must be a positive int or None, got {opt!r}")
        if head_dim is None:
            if embed_dim % num_heads != 0:
                raise ValueError(
                    f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), "
                    f"or pass head_dim explicitly"
                )
            head_dim = embed_dim // num_heads
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")

        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.out_dim = embed_dim if out_dim is None else out_dim
        self.dropout = float(dropout)
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        # Not a submodule or buffer: a hook that ``multihead.capture`` sets and clears.
        self.observer: AttentionObserver | None = None

        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj: nn.Linear | None
        self.q_proj: nn.Linear | None
        self.k_proj: nn.Linear | None
        self.v_proj: nn.Linear | None
        if self.packed:
            self.qkv_proj = nn.Linear(embed_dim, q_width + 2 * kv_width, bias=bias, **factory)
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.qkv_proj = None
            self.q_proj = nn.Linear(embed_dim, q_width, bias=bias, **factory)
            self.k_proj = nn.Linear(self.kdim, kv_width, bias=bias, **factory)
            self.v_proj = nn.Linear(self.vdim, kv_width, bias=bias, **factory)
        self.out_proj = nn.Linear(q_width, self.out_dim, bias=bias, **factory)
        self.reset_parameters()

    # -- parameters -----------------------------------------------------------------------------

    def _qkv_blocks(self) -> tuple[tuple[Tensor, Tensor | None], ...]:
        """The (weight, bias) of the q, k and v projections, as views when packed."""
        if self.qkv_proj is not None:
            q_width = self.num_heads * self.head_dim
            kv_width = self.num_kv_heads * self.head_dim
            w, b = self.qkv_proj.weight, self.qkv_proj.bias
            ws = w.split([q_width, kv_width, kv_width], dim=0)
            bs = b.split([q_width, kv_width, kv_width]) if b is not None else (None,) * 3
            return tuple(zip(ws, bs, strict=True))
        assert self.q_proj is not None and self.k_proj is not None and self.v_proj is not None
        return tuple((p.weight, p.bias) for p in (self.q_proj, self.k_proj, self.v_proj))

    def reset_parameters(self) -> None:
        """Xavier-uniform weights for each of q, k, v and the output; zero biases."""
        with torch.no_grad():
            for w, b in self._qkv_blocks():
                nn.init.xavier_uniform_(w)
                if b is not None:
                    b.zero_()
            nn.init.xavier_uniform_(self.out_proj.weight)
            if self.out_proj.bias is not None:
                self.out_proj.bias.zero_()

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        if not self.packed:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.out_dim != self.embed_dim:
            parts.append(f"out_dim={self.out_dim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        return ", ".join(parts)

    # -- forward --------------------------------------------------------------------------------

    def _split_heads(self, x: Tensor, heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # (B, T, H·D) -> (B, H, T, D)

    def project(
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Project batched inputs to heads.

        Args:
            query: (B, T, E). key: (B, S, kdim) or None for self-attention. value: (B, S, vdim),
                default ``key``.

        Returns:
            q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, D): views into the projections.
        """
        h, hk = self.num_heads, self.num_kv_heads
        if key is query and (value is None or value is key):
            key = value = None  # self-attention passed explicitly: still one packed matmul
        if key is None and self.qkv_proj is not None:
            qkv = self.qkv_proj(query)  # (B, T, (H + 2·Hk)·D): one matmul for all three
            q, k, v = qkv.split([h * self.head_dim, hk * self.head_dim, hk * self.head_dim], -1)
        else:
            key = query if key is None else key
            value = key if value is None else value
            (wq, bq), (wk, bk), (wv, bv) = self._qkv_blocks()
            q, k, v = F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)
        return self._split_heads(q, h), self._split_heads(k, hk), self._split_heads(v, hk)

    def merge(self, out: Tensor) -> Tensor:
        """Concatenate heads and apply the output projection: (B, H, T, D) -> (B, T, out_dim)."""
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H·D)
        return self.out_proj(out)

    def _check_forward(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        key_mask: Tensor | None,
    ) -> None:
        if not isinstance(query, Tensor):
            raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
        if query.dim() not in (2, 3):
            raise ValueError(
                f"query must be 2-D (T, E) or 3-D (B, T, E), got {query.dim()}-D shape "
                f"{_shape_str(query)}"
            )
        if query.shape[-1] != self.embed_dim:
            raise ValueError(
                f"query's last dimension must be embed_dim={self.embed_dim}, got shape "
                f"{_shape_str(query)}"
            )
        for name, t, width in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
            if t.dim() != query.dim():
                raise ValueError(
                    f"{name} must be {query.dim()}-D like query {_shape_str(query)}, got shape "
                    f"{_shape_str(t)}"
                )
            if t.shape[-1] != width:
                dim = "kdim" if name == "key" else "vdim"
                raise ValueError(
                    f"{name}'s last dimension must be {dim}={width}, got shape {_shape_str(t)}"
                )
            if query.dim() == 3 and t.shape[0] != query.shape[0]:
                raise ValueError(
                    f"batch sizes disagree: query {_shape_str(query)} and {name} {_shape_str(t)}"
                )
        if value is not None and key is None:
            raise ValueError("value was given without key: pass key too (or neither)")
        if key is not None and value is not None and key.shape[-2] != value.shape[-2]:
            raise ValueError(
                f"key and value must have the same length, got key {_shape_str(key)} and "
                f"value {_shape_str(value)}"
            )
        if key_mask is not None:
            if not isinstance(key_mask, Tensor):
                raise TypeError(
                    f"key_mask must be a bool torch.Tensor or None, got {type(key_mask).__name__}"
                )
            if key_mask.dtype != torch.bool:
                raise TypeError(
                    f"key_mask must be a bool tensor (True = a real token), got dtype "
                    f"{key_mask.dtype}; for torch's key_padding_mask (True = padding) pass "
                    f"~key_padding_mask"
                )

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        cache: AttentionCache | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when ``key`` is None).

        Args:
            query: (B, T, E), or unbatched (T, E).
            key: (B, S, kdim), or None for self-attention.
            value: (B, S, vdim); defaults to ``key``.
            mask: bool (True = may attend) or float (added to the scores), of shape (T, S),
                (B, T, S) or (B or 1, H or 1, T, S); unbatched: (T, S) or (H, T, S).
            key_mask: bool (B, S), True = a real token, False = padding; unbatched (S,). This is
                the negation of torch.nn.MultiheadAttention's ``key_padding_mask`` (True = pad).
            is_causal: query i sees keys j <= i + (S - T) (bottom-right aligned), ANDed with the
                masks.
            need_weights: also return the per-head attention weights (B, H, T, S), never
                averaged over heads.
            cache: a key/value cache for incremental decoding (see ``multihead.KVCache``): the new
                keys/values are stored in it and attention runs over everything it holds.

        Returns:
            output (B, T, out_dim), or ``(output, weights)`` when ``need_weights``.
        """
        self._check_forward(query, key, value, key_mask)
        unbatched = query.dim() == 2
        if unbatched:
            query = query.unsqueeze(0)
            key = key.unsqueeze(0) if key is not None else None
            value = value.unsqueeze(0) if value is not None else None
            key_mask = key_mask.unsqueeze(0) if key_mask is not None else None
            if mask is not None and mask.dim() == 3:
                mask = mask.unsqueeze(0)  # (H, T, S) -> (1, H, T, S)

        q, k, v = self.project(query, key, value)
        if cache is not None:
            k, v = cache.update(k, v)
        attn_mask = self._attn_mask(mask, key_mask, q, k)
        scale = 1.0 / math.sqrt(self.head_dim)
        if self.observer is not None:
            self.observer(self, q, k, v, attn_mask, is_causal, scale)
        result = functional.attention(
            q,
            k,
            v,
            mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=need_weights,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = self.merge(out)
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return (out, weights) if weights is not None else out

    def forward_packed(self, x: Tensor, packing: PackedBatch) -> Tensor:
        """Self-attention over the real tokens of a padded batch, handed over packed.

        The same result as ``forward(packing.unpack(x), key_mask=packing.key_mask)`` on the real
        tokens, for less work: the q/k/v and output projections run on the N real tokens only,
        and attention runs per bucket of similar-length sequences (``packing.buckets``) under the
        key mask, with zero queries, keys and values at the padding (masked keys, and query rows
        dropped again afterwards). The observer, if any, is called as in :meth:`forward`, with
        heads (B, H, T, D) in batch order and the mask (B, 1, 1, T).

        Args:
            x: (N, E), the real tokens, packed as ``packing`` describes.
            packing: where those tokens sit in the (B, T) batch.

        Returns:
            (N, out_dim).

        Raises:
            TypeError: ``packing`` is not a :class:`PackedBatch`.
            ValueError: ``x`` is not (N, E), or the module is not packed self-attention.
        """
        if self.qkv_proj is None:
            raise ValueError(
                "forward_packed is self-attention only: it needs kdim == vdim == embed_dim "
                f"(got kdim={self.kdim}, vdim={self.vdim}, embed_dim={self.embed_dim})"
            )
        if not isinstance(packing, PackedBatch):
            raise TypeError(f"packing must be a PackedBatch, got {type(packing).__name__}")
        if not isinstance(x, Tensor) or x.shape != (packing.num_tokens, self.embed_dim):
            got = _shape_str(x) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"x must be the packed tokens (N, E) = ({packing.num_tokens}, {self.embed_dim}), "
                f"got {got}"
            )
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        widths = [h * d, hk * d, hk * d]
        scale = 1.0 / math.sqrt(d)
        dropout_p = self.dropout if self.training else 0.0
        qkv = self.qkv_proj(x)  # (N, (H + 2·Hk)·D)
        if self.observer is not None:
            q, k, v = packing.unpack(qkv).split(widths, -1)  # (B, T, ·) each, in batch order
            q, k, v = self._split_heads(q, h), self._split_heads(k, hk), self._split_heads(v, hk)
            self.observer(self, q, k, v, packing.attn_mask, False, scale)
        # (B, T, (H + 2·Hk)·D), rows sorted longest first, zeros at the padding
        q, k, v = packing.unpack(qkv, sorted=True).split(widths, -1)
        q, k, v = self._split_heads(q, h), self._split_heads(k, hk), self._split_heads(v, hk)
        # Positions past a bucket's length are never written and never read back.
        out = qkv.new_empty(packing.batch_size, packing.length, h, d)  # (B, T, H, D), sorted
        for start, stop, length, mask in packing.buckets:
            o = functional.attention(
                q[start:stop, :, :length],  # (n, H, L, D) views
                k[start:stop, :, :length],
                v[start:stop, :, :length],
                mask=mask,
                scale=scale,
                dropout_p=dropout_p,
            )  # (n, H, L, D)
            out[start:stop, :length] = o.transpose(1, 2)
        out = out[packing.sorted_batch_index, packing.position_index]  # (N, H, D), one gather
        return self.out_proj(out.reshape(packing.num_tokens, h * d))

    def _attn_mask(
        self, mask: Tensor | None, key_mask: Tensor | None, q: Tensor, k: Tensor
    ) -> Tensor | None:
        """Combine ``mask`` and ``key_mask`` into one mask broadcastable to (B, H, T, S)."""
        b, _, t, _ = q.shape
        s = k.shape[-2]
        if key_mask is not None:
            if key_mask.shape != (b, s):
                raise ValueError(
                    f"key_mask must have shape (B, S) = ({b}, {s}) (unbatched: ({s},)), got "
                    f"{tuple(key_mask.shape)}"
                )
            key_mask = key_mask[:, None, None, :]  # (B, 1, 1, S)
        if mask is not None:
            if not isinstance(mask, Tensor):
                raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
            if mask.dim() == 3:
                mask = mask.unsqueeze(1)  # (B, T, S) -> (B, 1, T, S)
            if mask.dim() not in (2, 4):
                raise ValueError(
                    f"mask must be (T, S), (B, T, S) or (B, H, T, S), got shape {tuple(mask.shape)}"
                )
            target = (b, self.num_heads, t, s)
            try:
                ok = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
            except RuntimeError:
                ok = False
            if not ok:
                raise ValueError(
                    f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = "
                    f"{target}"
                )
        if key_mask is None:
            return mask
        if mask is None:
            return key_mask
        if mask.dtype == torch.bool:
            return mask & key_mask
        return mask.masked_fill(~key_mask, float("-inf"))

    # -- conversion -----------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """Build an exact copy of a torch.nn.MultiheadAttention (same parameters, same outputs).

        The result is batch-first whatever ``m.batch_first`` was: transpose inputs that were
        (T, B, E). ``add_bias_kv`` and ``add_zero_attn`` have no equivalent and raise.
        """
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError(
                "cannot convert a torch.nn.MultiheadAttention built with add_bias_kv=True or "
                "add_zero_attn=True: multihead has no equivalent"
            )
        ref = m.out_proj.weight
        ours = cls(
            m.embed_dim,
            m.num_heads,
            kdim=m.kdim,
            vdim=m.vdim,
            bias=m.in_proj_bias is not None,
            dropout=m.dropout,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            if m._qkv_same_embed_dim:
                assert m.in_proj_weight is not None
                weights: tuple[Tensor, ...] = m.in_proj_weight.chunk(3, dim=0)
            else:
                weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
            biases = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
            for (w, b), w_src, b_src in zip(ours._qkv_blocks(), weights, biases, strict=True):
                w.copy_(w_src)
                if b is not None and b_src is not None:
                    b.copy_(b_src)
            ours.out_proj.weight.copy_(m.out_proj.weight)
            if ours.out_proj.bias is not None and m.out_proj.bias is not None:
                ours.out_proj.bias.copy_(m.out_proj.bias)
        return ours

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An exact torch.nn.MultiheadAttention copy of this module.

        torch's module needs H·D == E, one key/value head per query head, and out_dim == E.
        """
        problems = []
        if self.num_heads * self.head_dim != self.embed_dim:
            problems.append(f"num_heads·head_dim ({self.num_heads}·{self.head_dim}) != embed_dim")
        if self.num_kv_heads != self.num_heads:
            problems.append(f"num_kv_heads ({self.num_kv_heads}) != num_heads ({self.num_heads})")
        if self.out_dim != self.embed_dim:
            problems.append(f"out_dim ({self.out_dim}) != embed_dim ({self.embed_dim})")
        if problems:
            raise ValueError(
                "torch.nn.MultiheadAttention cannot represent this module: " + "; ".join(problems)
            )
        ref = self.out_proj.weight
        m = nn.MultiheadAttention(
            self.embed_dim,
            self.num_heads,
            dropout=self.dropout,
            bias=self.out_proj.bias is not None,
            kdim=self.kdim,
            vdim=self.vdim,
            batch_first=batch_first,
            device=ref.device,
            dtype=ref.dtype,
        )
        with torch.no_grad():
            blocks = self._qkv_blocks()
            if m._qkv_same_embed_dim:
                assert m.in_proj_weight is not None
                m.in_proj_weight.copy_(torch.cat([w for w, _ in blocks]))
            else:
                for target, (w, _) in zip(
                    (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), blocks, strict=True
                ):
                    target.copy_(w)
            if m.in_proj_bias is not None:
                m.in_proj_bias.copy_(torch.cat([b for _, b in blocks if b is not None]))
            m.out_proj.weight.copy_(self.out_proj.weight)
            if m.out_proj.bias is not None and self.out_proj.bias is not None:
                m.out_proj.bias.copy_(self.out_proj.bias)
        return m
