"""Ragged batches without padding ("unpadding"), passed down through the layers like a mask.

A :class:`PackedBatch` is built once per forward from the batch's key mask and handed to every
layer as ``packing=``: the layers' token-wise parts (projections, LayerNorm, feed-forward) run on
the N real tokens only, and attention runs on the (B, T) layout in a few length-sorted buckets.
"""

from __future__ import annotations

import torch
from torch import Tensor

from multihead import functional
from multihead._checks import check_tensor

__all__ = ["PackedBatch"]


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
        rank: (B,) int64, the inverse of ``order``: batch row b is row ``rank[b]`` when sorted.
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
        check_tensor("key_mask", key_mask, dims=2, dtypes=(torch.bool,))
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
        # rank[b]: where batch row b sits in the sorted batch
        self.rank = torch.empty_like(self.order)
        self.rank[self.order] = torch.arange(self.order.shape[0], device=key_mask.device)
        self.sorted_batch_index = self.rank[self.batch_index]  # (N,): row in the sorted batch
        order = self.order.tolist()
        self._identity_order = order == list(range(len(order)))
        sorted_mask = key_mask[self.order]  # (B, T)
        # Host syncs (nonzero, these lists, one per bucket below) happen once per forward, here,
        # not once per layer.
        lengths = effective.tolist()
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

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        is_causal: bool = False,
        scale: float | None = None,
        dropout_p: float = 0.0,
        zero_fill: bool = True,
    ) -> Tensor:
        """Attention in the sorted layout, one kernel call per bucket, under the key mask.

        Args:
            q: (B, H, T, D), k: (B, Hk, T, D), v: (B, Hk, T, Dv): batch rows in ``order``
                (``unpack(..., sorted=True)``), zeros at the padding.
            is_causal, scale, dropout_p: as for :func:`multihead.functional.attention`.
            zero_fill: zeros past each bucket's length (for observers, who see every
                position); without it those positions are left unwritten, since
                :meth:`gather_sorted` never reads them back.

        Returns:
            (B, T, H, Dv) in the sorted layout; past each bucket's length zeros (or nothing
            written), and at padding inside it whatever the masked rows give.
        """
        b, h, t, _ = q.shape
        shape = (b, t, h, v.shape[-1])  # (B, T, H, Dv), sorted
        out = q.new_zeros(shape) if zero_fill else q.new_empty(shape)
        for start, stop, length, mask in self.buckets:
            o = functional.attention(
                q[start:stop, :, :length],  # (n, H, L, D) views
                k[start:stop, :, :length],
                v[start:stop, :, :length],
                mask=mask,
                is_causal=is_causal,
                scale=scale,
                dropout_p=dropout_p,
            )  # (n, H, L, Dv)
            out[start:stop, :length] = o.transpose(1, 2)
        return out

    def gather_sorted(self, x: Tensor) -> Tensor:
        """The real tokens of a sorted (B, T, ...) tensor, packed: (N, ...), one gather."""
        return x[self.sorted_batch_index, self.position_index]

    def to_batch_order(self, x: Tensor) -> Tensor:
        """A sorted (B, ...) tensor back in batch order (B, ...); a view when already in order."""
        if self._identity_order:
            return x
        return x.index_select(0, self.rank)

    def to_sorted_order(self, x: Tensor) -> Tensor:
        """A (B, ...) tensor in batch order put in the sorted order, the inverse of
        :meth:`to_batch_order`; a view when already in order."""
        if self._identity_order:
            return x
        return x.index_select(0, self.order)
