"""MultiHeadAttention: project, split heads, attend, let observers see each head, merge.

The math is in :mod:`multihead.functional`, the argument checks in
:mod:`multihead.attention_checks`, the observer channel in :mod:`multihead.observers`. The
unpadded path (``packing=``) and the exact conversion to and from torch.nn are methods here.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from multihead import functional
from multihead._checks import (
    check_optional_positive_int,
    check_positive_int,
    check_probability,
)
from multihead.attention_checks import check_call, check_packed_call, combined_mask
from multihead.head_shard import HeadShard
from multihead.observers import (
    AttentionCall,
    AttentionObserver,
    ObserverHandle,
    Observers,
    QKVEditor,
)
from multihead.packing import PackedBatch
from multihead.score_mods import ScoreMod, ScoreMods

__all__ = ["MultiHeadAttention", "AttentionCache"]


class AttentionCache(Protocol):
    """What ``MultiHeadAttention(..., cache=...)`` needs of a key/value cache (one layer's).

    ``length`` is the number of positions held; ``update`` stores the new keys and values
    (B, Hk, T, D) after them and returns all of them, (B, Hk, S, D) with S = length + T.
    """

    @property
    def length(self) -> int: ...

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...


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

    Observers (:meth:`register_observer`) see every call's per-head q, k, v, mask and per-head
    output before ``out_proj``, and may replace that output: :func:`multihead.capture`, head
    statistics and head interventions are observers. Editors (:meth:`register_qkv_editor`) may
    replace q, k or v before attention (path patching).

    Example:
        >>> mha = MultiHeadAttention(64, num_heads=4)
        >>> x = torch.randn(2, 10, 64)
        >>> out, weights = mha(x, is_causal=True, need_weights=True)
        >>> out.shape, weights.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 4, 10, 10]))
    """

    # every call holds all H heads (ring attention splits the sequence, never the heads)
    head_shard: HeadShard | None = None

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
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        for name, opt in (
            ("kdim", kdim),
            ("vdim", vdim),
            ("head_dim", head_dim),
            ("num_kv_heads", num_kv_heads),
            ("out_dim", out_dim),
        ):
            check_optional_positive_int(name, opt)
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
        dropout = check_probability("dropout", dropout)

        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.out_dim = embed_dim if out_dim is None else out_dim
        self.dropout = float(dropout)
        self.packed = self.kdim == embed_dim and self.vdim == embed_dim
        self._observers = Observers()

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

    # -- observers ------------------------------------------------------------------------------

    @property
    def observers(self) -> Observers:
        """The observers and q/k/v editors registered on this module (``len``, ``bool``)."""
        return self._observers

    def register_observer(self, fn: AttentionObserver) -> ObserverHandle:
        """Call ``fn(call, out)`` on every forward, after attention and before ``out_proj``.

        ``call`` is an :class:`~multihead.observers.AttentionCall` (per-head q, k, v, the mask
        as the kernel saw it, ...); ``out`` is the per-head output (B, T, H, Dv), the one place
        where a head exists as itself. ``fn`` returns None to leave it, or a replacement of the
        same shape and dtype (to ablate, scale or patch heads). Observers run in registration
        order, each seeing the previous one's output. Unbatched calls are seen with B = 1.

        Args:
            fn: the observer.

        Returns:
            A handle whose ``.remove()`` unregisters ``fn``.
        """
        return self._observers.register(fn)

    def register_qkv_editor(self, fn: QKVEditor) -> ObserverHandle:
        """Call ``fn(call)`` on every forward before attention; it may replace q, k or v.

        ``call`` is what observers see (per-head q (B, H, T, D), k (B, Hk, S, D), v
        (B, Hk, S, Dv), the mask, ...). ``fn`` returns None to leave them, or ``(q, k, v)``:
        q of q's shape, k and v with Hk heads or with H (one per query head: on a grouped-query
        module, changing the keys one query head sees leaves its siblings' alone). Attention
        then runs on the replacements, and observers see them. Editors run in registration
        order, each seeing the previous one's replacements. A key/value cache keeps the
        projected keys and values, not the edited ones.

        Args:
            fn: the editor.

        Returns:
            A handle whose ``.remove()`` unregisters ``fn``.
        """
        return self._observers.register_editor(fn)

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
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, T, H·D) -> (B, T, out_dim)

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
        packing: PackedBatch | None = None,
        softcap: float | None = None,
        sinks: Tensor | None = None,
        score_mod: ScoreMod | None = None,
        block_mask: BlockMask | None = None,
        sink_weights: str = "dropped",
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when ``key`` is None).

        Args:
            query: (B, T, E), or unbatched (T, E); with ``packing``, the packed real tokens
                (N, E).
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
            packing: a :class:`~multihead.packing.PackedBatch`: ``query`` holds the real tokens
                of a padded (B, T) batch, packed, and the call is self-attention under its key
                mask, computed on those tokens only. Not with key, value, mask, key_mask, cache,
                need_weights or a score modification.
            softcap, sinks, score_mod, block_mask, sink_weights: score modifications, as for
                :func:`multihead.functional.attention` (attention-logit softcapping, one sink
                logit per head, FlexAttention's ``score_mod`` and ``BlockMask``, and which
                weights a call with sinks returns); observers see them in ``call.mods``, and
                capture recomputes its rows' weights under them.

        Returns:
            output (B, T, out_dim) ((N, out_dim) with ``packing``), or ``(output, weights)``
            when ``need_weights``.

        Raises:
            TypeError, ValueError: arguments of the wrong type or shape, all checked before the
                cache or anything else changes.
        """
        scale = 1.0 / math.sqrt(self.head_dim)
        dropout_p = self.dropout if self.training else 0.0
        mods = ScoreMods(
            softcap=softcap,
            sinks=sinks,
            score_mod=score_mod,
            block_mask=block_mask,
            sink_weights=sink_weights,
        )
        if packing is not None:
            if mods:
                raise ValueError(
                    "packing= cannot be combined with softcap, sinks, score_mod or block_mask "
                    "(a packed batch's rows are not the batch's): run the padded batch"
                )
            check_packed_call(
                query,
                key,
                value,
                mask,
                key_mask,
                need_weights,
                cache,
                packing,
                embed_dim=self.embed_dim,
                kdim=self.kdim,
                vdim=self.vdim,
            )
            return self._attend_packed(
                query, packing, is_causal=is_causal, scale=scale, dropout_p=dropout_p
            )
        check_call(
            query, key, value, key_mask, embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim
        )
        unbatched = query.dim() == 2
        if unbatched:
            query = query.unsqueeze(0)
            key = key.unsqueeze(0) if key is not None else None
            value = value.unsqueeze(0) if value is not None else None
            key_mask = key_mask.unsqueeze(0) if key_mask is not None else None
            if mask is not None and mask.dim() == 3:
                mask = mask.unsqueeze(0)  # (H, T, S) -> (1, H, T, S)
        b, t = query.shape[0], query.shape[1]
        s = (t if key is None else key.shape[1]) + (cache.length if cache is not None else 0)
        attn_mask = combined_mask(mask, key_mask, b, self.num_heads, t, s)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")

        q, k, v = self.project(query, key, value)
        if cache is not None:
            k, v = cache.update(k, v)
        call = None
        if self._observers:
            self_attention = key is None and cache is None
            query_mask = key_mask if self_attention else None
            call = AttentionCall(
                self, (q, k, v), attn_mask, is_causal, scale, query_mask, mods=mods
            )
            if self._observers.editing:
                call = self._observers.edit(call)
                q, k, v = call.q, call.k, call.v
        result = functional.attention(
            q,
            k,
            v,
            mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            dropout_p=dropout_p,
            need_weights=need_weights,
            softcap=softcap,
            sinks=sinks,
            score_mod=score_mod,
            block_mask=block_mask,
            sink_weights=sink_weights,
        )
        out, weights = result if isinstance(result, tuple) else (result, None)
        out = out.transpose(1, 2)  # (B, H, T, Dv) -> (B, T, H, Dv)
        if call is not None:
            out = self._observers.run(call, out)
        out = self.out_proj(out.flatten(2))  # (B, T, H·Dv) -> (B, T, out_dim)
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        return (out, weights) if need_weights and weights is not None else out

    def _attend_packed(
        self, x: Tensor, packing: PackedBatch, *, is_causal: bool, scale: float, dropout_p: float
    ) -> Tensor:
        """Self-attention over the N real tokens (N, E) of ``packing``'s batch -> (N, out_dim).

        The projections run on the real tokens only; attention runs in the sorted (B, T) layout,
        bucket by bucket (:meth:`PackedBatch.attend`). Observers and editors see batch order.
        """
        assert self.qkv_proj is not None  # check_packed_call made sure
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (N, (H + 2·Hk)·D)
        # (B, T, ·) each, rows sorted longest first, zeros at the padding
        q, k, v = packing.unpack(qkv, sorted=True).split([h * d, hk * d, hk * d], -1)
        q, k, v = self._split_heads(q, h), self._split_heads(k, hk), self._split_heads(v, hk)
        call = None
        if self._observers:
            sq, sk, sv = q, k, v

            def heads() -> tuple[Tensor, Tensor, Tensor]:
                to_batch = packing.to_batch_order
                return to_batch(sq), to_batch(sk), to_batch(sv)

            call = AttentionCall(self, heads, packing.attn_mask, is_causal, scale, packing.key_mask)
            if self._observers.editing:
                edited = self._observers.edit(call)
                if edited is not call:
                    call = edited
                    q, k, v = (packing.to_sorted_order(t) for t in (call.q, call.k, call.v))
        observing = call is not None and self._observers.observing
        out = packing.attend(
            q, k, v, is_causal=is_causal, scale=scale, dropout_p=dropout_p, zero_fill=observing
        )
        if call is not None and observing:
            out = self._observers.run(call, packing.to_batch_order(out))
            out = packing.pack(out)  # (N, H, Dv)
        else:
            out = packing.gather_sorted(out)  # (N, H, Dv)
        return self.out_proj(out.flatten(1))  # (N, H·Dv) -> (N, out_dim)

    # -- conversion to and from torch.nn --------------------------------------------------------

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """An exact copy of a torch.nn.MultiheadAttention (same parameters, same outputs).

        Parameters are copied, never shared. The result is batch-first whatever
        ``m.batch_first`` was: transpose inputs that were (T, B, E). ``add_bias_kv`` and
        ``add_zero_attn`` have no equivalent and raise.
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
            # torch keeps one packed in_proj_weight when kdim == vdim == E, else three
            if m.in_proj_weight is not None:
                weights: tuple[Tensor | None, ...] = m.in_proj_weight.chunk(3, dim=0)
            else:
                weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
            biases = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
            for (w, b), w_src, b_src in zip(ours._qkv_blocks(), weights, biases, strict=True):
                assert w_src is not None
                w.copy_(w_src)
                if b is not None and b_src is not None:
                    b.copy_(b_src)
            ours.out_proj.weight.copy_(m.out_proj.weight)
            if ours.out_proj.bias is not None and m.out_proj.bias is not None:
                ours.out_proj.bias.copy_(m.out_proj.bias)
        return ours

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """An exact torch.nn.MultiheadAttention copy of this module (parameters copied).

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
            if m.in_proj_weight is not None:
                m.in_proj_weight.copy_(torch.cat([w for w, _ in blocks]))
            else:
                for target, (w, _) in zip(
                    (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), blocks, strict=True
                ):
                    assert target is not None
                    target.copy_(w)
            if m.in_proj_bias is not None:
                m.in_proj_bias.copy_(torch.cat([b for _, b in blocks if b is not None]))
            m.out_proj.weight.copy_(self.out_proj.weight)
            if m.out_proj.bias is not None and self.out_proj.bias is not None:
                m.out_proj.bias.copy_(self.out_proj.bias)
        return m
