"""The unpadded self-attention path of :class:`~multihead.attention.MultiHeadAttention`,
``forward(x, packing=...)``, whose arguments :func:`~multihead.attention_checks.check_packed_call`
has checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from multihead.observers import AttentionCall, run_observers
from multihead.packing import PackedBatch

if TYPE_CHECKING:
    from multihead.attention import MultiHeadAttention

__all__ = ["attend_packed"]


def attend_packed(
    mha: MultiHeadAttention,
    x: Tensor,
    packing: PackedBatch,
    *,
    is_causal: bool,
    scale: float,
    dropout_p: float,
) -> Tensor:
    """Self-attention over the N real tokens (N, E) of ``packing``'s batch -> (N, out_dim).

    The projections run on the real tokens only; attention runs in the sorted (B, T) layout,
    bucket by bucket (:meth:`PackedBatch.attend`). Observers see batch order.
    """
    assert mha.qkv_proj is not None
    h, hk, d = mha.num_heads, mha.num_kv_heads, mha.head_dim
    qkv = mha.qkv_proj(x)  # (N, (H + 2·Hk)·D)
    # (B, T, ·) each, rows sorted longest first, zeros at the padding
    q, k, v = packing.unpack(qkv, sorted=True).split([h * d, hk * d, hk * d], -1)
    q, k, v = mha._split_heads(q, h), mha._split_heads(k, hk), mha._split_heads(v, hk)
    out = packing.attend(
        q,
        k,
        v,
        is_causal=is_causal,
        scale=scale,
        dropout_p=dropout_p,
        zero_fill=bool(mha._observers),
    )
    if mha._observers:

        def heads() -> tuple[Tensor, Tensor, Tensor]:
            return (
                packing.to_batch_order(q),
                packing.to_batch_order(k),
                packing.to_batch_order(v),
            )

        call = AttentionCall(
            mha,
            heads,
            packing.attn_mask,
            is_causal,
            scale,
            packing.key_mask,
        )
        out = run_observers(mha._observers.values(), call, packing.to_batch_order(out))
        out = packing.pack(out)  # (N, H, Dv)
    else:
        out = packing.gather_sorted(out)  # (N, H, Dv)
    return mha.out_proj(out.flatten(1))  # (N, H·Dv) -> (N, out_dim)
