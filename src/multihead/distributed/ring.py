"""Ring attention (context parallelism) on torch.distributed.

When one sequence is too long for one process, split it: each of the ``world`` ranks of a process
group holds a chunk of the sequence (its queries, keys and values) and gets back its chunk of the
exact attention output. The key/value chunks travel around the ring of ranks (rank r sends to
r + 1 and receives from r − 1, with torch.distributed point-to-point operations), each rank
attends its queries to every chunk as it passes, and the partial results merge by the
log-sum-exp rule (:func:`multihead.kernels.merge_block`). The next transfer is posted before the
current chunk is computed on, so communication overlaps with compute wherever the backend runs
point-to-point work in the background (gloo and nccl both do). How the sequence is cut (the
``"contiguous"`` and ``"zigzag"`` layouts) and which pieces meet: :mod:`.sharding`.

Memory. The key/value heads go around the ring one at a time (one pass per key/value head, each
a full ring), so the buffers in flight hold one head's chunk, not the whole chunk: a rank holds
its q, k, v and output chunks plus at most two one-head key/value receive buffers (one when
world = 2), reused across steps and passes, and one block output (the query heads sharing that
key/value head). The price of the passes is Hk times as many (Hk times smaller) messages.

Kernels. Each block runs :func:`multihead.kernels.block_attention` and, in backward,
:func:`multihead.kernels.block_attention_backward` (torch's CPU flash kernels where they apply,
the explicit formula elsewhere).

Agreement. Before anything travels point to point, one small all-gather compares every rank's
arguments, so that a mistake on one rank raises on every rank instead of leaving the others
waiting for it (:mod:`._group`, which also holds the ring's point-to-point exchanges).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from multihead import functional
from multihead._checks import check_tensor
from multihead.attention import MultiHeadAttention
from multihead.distributed._group import Ring, agree, agreed_fields, local_problem, ring_of, wait
from multihead.distributed.sharding import check_layout, chunk_ids, plan_blocks
from multihead.kernels import block_attention, block_attention_backward, merge_block

__all__ = ["ring_attention", "RingSelfAttention"]


# -- forward and backward around the ring ---------------------------------------------------------


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float, layout: str
) -> tuple[Tensor, Tensor]:
    """q (B, H, C, D), k (B, Hk, C, D), v (B, Hk, C, Dv) -> out (B, H, C, Dv), lse (B, H, C)."""
    b, h, c, _ = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    group = h // hk
    mine = chunk_ids(ring.rank, ring.world, layout)
    sub = c // len(mine)  # sub-chunk length: queries and keys of one global chunk
    acc = torch.promote_types(q.dtype, torch.float32)
    out = q.new_zeros((b, h, c, dv), dtype=acc)
    lse = q.new_full((b, h, c), float("-inf"), dtype=acc)
    buffers: list[tuple[Tensor, Tensor]] = []  # one-head receive buffers, reused throughout
    works: list[Any] = []
    # One pass around the ring per key/value head: only one head's chunk is ever in flight.
    for j in range(hk):
        heads = slice(j * group, (j + 1) * group)
        q_j, out_j, lse_j = q[:, heads], out[:, heads], lse[:, heads]
        cur_k, cur_v = k[:, j : j + 1].contiguous(), v[:, j : j + 1].contiguous()  # (B, 1, C, D)
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            if step < ring.world - 1:
                # Post the next transfer first, so that it runs while this chunk is computed on.
                works = ring.pass_kv(cur_k, cur_v, buffers, step)
            for blk in plan_blocks(mine, chunk_ids(source, ring.world, layout), causal):
                rows, cols = slice(blk.q0 * sub, blk.q1 * sub), slice(blk.k0 * sub, blk.k1 * sub)
                o_blk, l_blk = block_attention(
                    q_j[:, :, rows],
                    cur_k[:, :, cols],
                    cur_v[:, :, cols],
                    causal=blk.causal,
                    scale=scale,
                )
                merge_block(out_j[:, :, rows], lse_j[:, :, rows], o_blk, l_blk)
                del o_blk, l_blk
            wait(works)
            if step < ring.world - 1:
                cur_k, cur_v = buffers[step % 2]
    return out, lse


def _ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    ring: Ring,
    causal: bool,
    scale: float,
    layout: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v. Keys and values go around the ring again; beside each chunk
    travels the gradient accumulated for it so far, which after a full circle comes home."""
    b, h, c, _ = q.shape
    hk = k.shape[1]
    group = h // hk
    mine = chunk_ids(ring.rank, ring.world, layout)
    sub = c // len(mine)
    acc = torch.promote_types(q.dtype, torch.float32)
    dout = dout.contiguous()  # autograd may hand in any strides, even expanded ones
    out = out.to(dout.dtype)
    dq = torch.zeros_like(q, dtype=acc)
    dk = torch.zeros_like(k, dtype=acc)
    dv = torch.zeros_like(v, dtype=acc)
    kv_buffers: list[tuple[Tensor, Tensor]] = []
    grad_buffers: list[tuple[Tensor, Tensor]] = []
    kv_works: list[Any] = []
    grad_works: list[Any] = []
    for j in range(hk):
        heads = slice(j * group, (j + 1) * group)
        q_j, do_j, o_j, l_j, dq_j = (t[:, heads] for t in (q, dout, out, lse, dq))
        cur_k, cur_v = k[:, j : j + 1].contiguous(), v[:, j : j + 1].contiguous()  # (B, 1, C, D)
        if not grad_buffers:
            grad_buffers = [
                (cur_k.new_empty(cur_k.shape, dtype=acc), cur_v.new_empty(cur_v.shape, dtype=acc))
                for _ in range(2)
            ]
        for step in range(ring.world):
            source = (ring.rank - step) % ring.world
            if step < ring.world - 1:
                kv_works = ring.pass_kv(cur_k, cur_v, kv_buffers, step)
            # This rank's share of the gradients of the chunk it holds now.
            part_k = cur_k.new_zeros(cur_k.shape, dtype=acc)
            part_v = cur_v.new_zeros(cur_v.shape, dtype=acc)
            for blk in plan_blocks(mine, chunk_ids(source, ring.world, layout), causal):
                rows, cols = slice(blk.q0 * sub, blk.q1 * sub), slice(blk.k0 * sub, blk.k1 * sub)
                g_q, g_k, g_v = block_attention_backward(
                    do_j[:, :, rows],
                    q_j[:, :, rows],
                    cur_k[:, :, cols],
                    cur_v[:, :, cols],
                    o_j[:, :, rows],
                    l_j[:, :, rows],
                    causal=blk.causal,
                    scale=scale,
                )
                dq_j[:, :, rows] += g_q
                part_k[:, :, cols] += g_k
                part_v[:, :, cols] += g_v
            # Also frees the buffer sent last step, which receives next.
            wait(grad_works, ring)
            if step == 0:
                grad_k, grad_v = part_k, part_v
            else:
                # Add to the shares of the ranks this chunk visited before (from rank - 1).
                grad_k, grad_v = grad_buffers[step % 2]
                grad_k += part_k
                grad_v += part_v
            # Pass the sum on (after the last step it reaches the rank the chunk belongs to) and
            # take in the sum for the chunk that comes next.
            grad_works = ring.pass_grads(grad_k, grad_v, grad_buffers[(step + 1) % 2])
            wait(kv_works, ring)
            if step < ring.world - 1:
                cur_k, cur_v = kv_buffers[step % 2]
        wait(grad_works, ring)
        home_k, home_v = grad_buffers[ring.world % 2]
        dk[:, j : j + 1] = home_k
        dv[:, j : j + 1] = home_v
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        ring: Ring,
        causal: bool,
        scale: float,
        layout: str,
    ) -> Tensor:
        # The kernels need dense rows: one copy of q here (only when its rows are strided) rather
        # than one per block. k and v are copied head by head in the ring anyway.
        q = q if q.stride(-1) == 1 else q.contiguous()
        out, lse = _ring_forward(q, k, v, ring, causal, scale, layout)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.causal, ctx.scale, ctx.layout = ring, causal, scale, layout
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(
            dout, q, k, v, out, lse, ctx.ring, ctx.causal, ctx.scale, ctx.layout
        )
        return dq, dk, dv, None, None, None, None


# -- public ---------------------------------------------------------------------------------------


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: Any = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of a process group.

    Each rank passes its chunk of the sequence and gets back its chunk of
    softmax(q kᵀ · scale) · v over the *whole* sequence, as single-process attention would give.
    Key/value chunks go around the ring (point-to-point, overlapped with compute) and the partial
    results merge by the log-sum-exp rule. Backward is exact too: the key/value gradients travel
    around the ring back to their owners.

    Args:
        q: this rank's queries (B, H, T/world, D).
        k: this rank's keys (B, Hk, T/world, D); H must be a multiple of Hk (grouped-query
            attention: query head h reads key/value head h // (H // Hk)).
        v: this rank's values (B, Hk, T/world, Dv). q, k, v may have any strides.
        group: the process group of the ring (default: the world group).
        is_causal: global query position i sees keys j <= i, positions counted over the whole
            sequence as ``layout`` lays it out. Key chunks wholly in a query chunk's future are
            skipped (no compute).
        scale: the factor on the scores; default 1 / sqrt(D).
        layout: ``"contiguous"``: rank r holds positions [r·T/world, (r+1)·T/world).
            ``"zigzag"``: rank r holds chunks r and 2·world − 1 − r of 2·world chunks, glued in
            that order, which balances the causal work (see :mod:`multihead.distributed.sharding`
            and :func:`shard_sequence`).

    Masks other than ``is_causal`` (padding, arbitrary bool/float masks) and dropout are not part
    of this API: pad the sequence to a multiple of world (2·world for zigzag) and mask the padded
    positions' outputs afterwards, or use :func:`multihead.functional.attention` on one process.

    Every rank of the group must call this, with the same ``group``, in the same order as the
    group's other collectives. **Backward:** when one rank runs backward through the result, every
    rank must, since the gradient sums travel around the ring. Whether a backward is recorded
    (grad mode on and q, k or v requiring grad) is checked to agree across ranks; that each rank
    then really runs it cannot be: a rank whose loss does not use its output must still
    backpropagate through it (add ``0 * out.sum()`` to its loss). Otherwise the ranks that do wait
    for it until the group's timeout (on gloo they then raise a RuntimeError saying so; nccl's
    watchdog aborts the job).

    One process: when ``group`` is None and no default process group is initialised, or the group
    has one rank, this is plain :func:`multihead.functional.attention` on the local tensors (which
    are then the whole sequence), with the same checks.

    Returns:
        This rank's chunk of the output, (B, H, T/world, Dv), in q's dtype.

    Raises:
        TypeError / ValueError: on every rank, when any rank's shapes, dtype, ``is_causal``,
            ``scale``, ``layout`` or need for a backward differ from another's, or any rank's own
            input is invalid (the offending rank raises its own TypeError/ValueError, the others a
            ValueError naming it). The check is one small all-gather before any transfer, so a
            mistake never leaves ranks waiting for each other.

    Example (on each of 2 ranks, after ``dist.init_process_group``)::

        x = torch.randn(1, 8, 1024, 64)  # (B, H, T, D), the same on every rank
        part = shard_sequence(x, dist.get_rank(), 2, "zigzag")  # (1, 8, 512, 64)
        out = ring_attention(part, part, part, is_causal=True, layout="zigzag")
    """
    ring = ring_of(group)
    problem = local_problem(q, k, v, is_causal, scale, layout)
    if ring is None:
        if problem is not None:
            raise problem
        return functional.attention(q, k, v, is_causal=is_causal, scale=scale)
    agree(ring, {} if problem else agreed_fields(q, k, v, is_causal, scale, layout), problem)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out: Tensor = _RingAttention.apply(q, k, v, ring, is_causal, float(scale), layout)
    return out


class RingSelfAttention(nn.Module):
    """Run a :class:`multihead.MultiHeadAttention` as self-attention on a sharded sequence.

    Each rank passes its part of the input sequence (B, T/world, E), cut with
    :func:`shard_sequence` (``dim=1``) in the chosen ``layout``, and gets back its part of the
    output. The module's own projections (``project``/``merge``) run locally, the attention runs
    with :func:`ring_attention`. The wrapped module's parameters are this module's, so optimisers
    and DistributedDataParallel see them as usual; keep them identical on every rank.

    Not supported here (they raise or are not consulted): masks other than ``is_causal``,
    attention dropout in training, ``need_weights``, a key/value cache, and observers (an
    observer sees a call's per-head q, k, v and output for the whole sequence, which ring
    attention never holds in one place).

    Args:
        mha: the attention module; self-attention only (packed or not).
        group: the process group of the ring (default: the world group).
        layout: ``"contiguous"`` or ``"zigzag"``, as the input was sharded.

    Example (on each rank)::

        ring = RingSelfAttention(mha, layout="zigzag")
        x_part = shard_sequence(x, rank, world, "zigzag", dim=1)  # (B, T/world, E)
        y_part = ring(x_part, is_causal=True)  # (B, T/world, out_dim)
    """

    def __init__(self, mha: MultiHeadAttention, *, group: Any = None, layout: str = "contiguous"):
        super().__init__()
        if not isinstance(mha, MultiHeadAttention):
            raise TypeError(f"mha must be a multihead.MultiHeadAttention, got {type(mha).__name__}")
        check_layout(layout)
        self.mha = mha
        self.group = group
        self.layout = layout

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"

    def _check(self, x: Any) -> None:
        mha = self.mha
        check_tensor("x", x)
        if x.dim() != 3 or x.shape[-1] != mha.embed_dim:
            raise ValueError(
                f"x must be (B, T/world, E) with E = embed_dim = {mha.embed_dim}, got shape "
                f"{tuple(x.shape)}"
            )
        if mha.training and mha.dropout > 0:
            raise ValueError(
                f"ring attention has no attention dropout, but the module has dropout="
                f"{mha.dropout} and is in training mode: use dropout=0 or eval()"
            )
        # the observer channel and, before it, the single `observer` attribute
        observers = len(mha.observers)
        observers += getattr(mha, "observer", None) is not None
        if observers:
            raise ValueError(
                f"mha must have no observers to run under RingSelfAttention, got {observers}: "
                f"an observer sees a call's q, k, v and per-head output over the whole sequence, "
                f"which ring attention never holds in one place; remove them first"
            )

    def forward(self, x: Tensor, *, is_causal: bool = False) -> Tensor:
        """Self-attention over the whole sequence, from and to this rank's part.

        Args:
            x: this rank's part of the input, (B, T/world, E).
            is_causal: global position i attends to positions j <= i.

        Returns:
            This rank's part of the output, (B, T/world, out_dim).

        Raises:
            ValueError / TypeError: as :func:`ring_attention`, on every rank; also when x is not
                (B, T/world, embed_dim), the module would apply attention dropout or has
                observers, or its projections reject x (e.g. another dtype).
        """
        try:
            self._check(x)
            q, k, v = self.mha.project(x)  # (B, H, T/world, D), (B, Hk, T/world, D) x 2
        except Exception as problem:  # whatever it is, every rank must hear of it
            ring = ring_of(self.group)
            if ring is not None:
                # The ranks without a problem are in ring_attention's all-gather: this one's match.
                agree(ring, {}, problem)
            raise
        out = ring_attention(
            q,
            k,
            v,
            group=self.group,
            is_causal=is_causal,
            scale=1.0 / math.sqrt(self.mha.head_dim),
            layout=self.layout,
        )
        return self.mha.merge(out)  # (B, T/world, out_dim)
