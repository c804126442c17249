"""Ring attention (context parallelism) on torch.distributed.

When one sequence is too long for one process, split it: each of the ``world`` ranks of a process
group holds a chunk of the sequence (its queries, keys and values) and gets back its chunk of the
exact attention output. The key/value chunks travel around the ring of ranks (rank r sends to
r + 1 and receives from r − 1, with torch.distributed point-to-point operations), each rank
attends its queries to every chunk as it passes, and the partial results merge by the
log-sum-exp rule (Liu et al., 2023, "Ring Attention with Blockwise Transformers"):

    m = logaddexp(lse_a, lse_b),   out = out_a · exp(lse_a − m) + out_b · exp(lse_b − m)

where ``out_x``/``lse_x`` are the attention output and the log-sum-exp of the scores over one part
of the keys. The next transfer is posted before the current chunk is computed on, so
communication overlaps with compute wherever the backend runs point-to-point work in the
background (gloo and nccl both do).

Layouts (how the global sequence of length T is cut, ``world`` ranks):

- ``"contiguous"``: rank r holds positions [r·T/world, (r+1)·T/world). Simple, and any
  sequence-parallel code already uses it. With ``is_causal`` the work is unbalanced: rank r has
  r + 1 chunks of keys to attend to (the ones after it are skipped), so the last rank does about
  twice the average work and the others wait for it.
- ``"zigzag"``: the sequence is cut into 2·world chunks and rank r holds chunks r and
  2·world − 1 − r (one early, one late). With ``is_causal`` every rank then does the same work at
  every step of the ring: half of a full chunk-by-chunk product. The price: the local sequence is
  not contiguous (positional encodings and the un-sharding must follow the layout, see
  :func:`shard_sequence` / :func:`unshard_sequence`) and each step issues up to three smaller
  kernel calls instead of one. Without ``is_causal`` both layouts do the same work.

Memory. The key/value heads go around the ring one at a time (one pass per key/value head, each
a full ring), so the buffers in flight hold one head's chunk, not the whole chunk: a rank holds
its q, k, v and output chunks plus at most two one-head key/value receive buffers (one when
world = 2), reused across steps and passes, and one block output (the query heads sharing that
key/value head). The price of the passes is Hk times as many (Hk times smaller) messages.

Kernels. On CPU each block runs ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward), which returns the log-sum-exp beside the output and handles grouped-query
heads; elsewhere (CUDA, or a key head dim that differs from the value head dim) the explicit
formula computes both, in float32 at least, materialising one block of scores.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from multihead import functional
from multihead.attention import MultiHeadAttention

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "RingSelfAttention", "LAYOUTS"]

Layout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")

# Distinct tags keep the key/value traffic and the gradient traffic (both r -> r + 1) apart on
# backends that match messages by tag (gloo); nccl ignores tags and matches by issue order, which
# every rank keeps identical.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4

# Tests switch this off to exercise the explicit formula on CPU.
_USE_CPU_FLASH = True


# -- sharding -------------------------------------------------------------------------------------


def _check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")


def _chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices a rank holds, in local order (chunks of T/world or T/(2·world))."""
    if layout == "contiguous":
        return (rank,)
    return (rank, 2 * world - 1 - rank)


def shard_sequence(
    x: Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = -2
) -> Tensor:
    """Cut a rank's part out of a whole sequence.

    Args:
        x: a tensor holding the whole sequence along ``dim``, e.g. (B, H, T, D) for heads (the
            default ``dim=-2``) or (B, T, E) with ``dim=1``.
        rank: this rank, 0 <= rank < world.
        world: the number of ranks.
        layout: ``"contiguous"`` (rank r gets positions [r·T/world, (r+1)·T/world)) or
            ``"zigzag"`` (rank r gets chunks r and 2·world − 1 − r of 2·world chunks, glued).
        dim: the sequence dimension.

    Returns:
        The rank's part, T/world long along ``dim`` (a view for ``"contiguous"``, a copy for
        ``"zigzag"``).

    Raises:
        ValueError: an unknown layout, a rank outside [0, world), or a length that does not divide
            into world (``"zigzag"``: 2·world) equal chunks.

    Example:
        >>> x = torch.arange(8).view(1, 1, 8, 1)
        >>> shard_sequence(x, 0, 2, "zigzag").flatten().tolist()
        [0, 1, 6, 7]
    """
    _check_layout(layout)
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    if not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"rank must be an int in [0, {world}), got {rank!r}")
    pieces = world if layout == "contiguous" else 2 * world
    length = x.shape[dim]
    if length % pieces != 0:
        raise ValueError(
            f"x's length along dim {dim} ({length}) must divide into {pieces} equal chunks for "
            f"layout={layout!r} with world={world}"
        )
    size = length // pieces
    parts = [x.narrow(dim, i * size, size) for i in _chunk_ids(rank, world, layout)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_sequence(chunks: Sequence[Tensor], layout: str = "contiguous", dim: int = -2) -> Tensor:
    """Glue the ranks' parts (in rank order) back into the whole sequence.

    The inverse of :func:`shard_sequence`: ``unshard_sequence([shard_sequence(x, r, w, layout)
    for r in range(w)], layout)`` equals ``x``.

    Args:
        chunks: one tensor per rank, rank 0 first, all the same length along ``dim``.
        layout: ``"contiguous"`` or ``"zigzag"``, as they were cut.
        dim: the sequence dimension.

    Returns:
        The whole sequence, world·(chunk length) long along ``dim``.

    Raises:
        ValueError: an unknown layout, no chunks, chunks of different lengths, or (``"zigzag"``)
            an odd chunk length.
    """
    _check_layout(layout)
    if len(chunks) == 0:
        raise ValueError("chunks must hold one tensor per rank, got none")
    lengths = [c.shape[dim] for c in chunks]
    if len(set(lengths)) != 1:
        raise ValueError(f"chunks must all have the same length along dim {dim}, got {lengths}")
    if layout == "contiguous":
        return torch.cat(list(chunks), dim=dim)
    if lengths[0] % 2 != 0:
        raise ValueError(
            f"zigzag chunks hold two equal halves, so their length along dim {dim} must be even, "
            f"got {lengths[0]}"
        )
    half = lengths[0] // 2
    early = [c.narrow(dim, 0, half) for c in chunks]  # chunks 0 .. world-1
    late = [c.narrow(dim, half, half) for c in reversed(chunks)]  # chunks world .. 2·world-1
    return torch.cat(early + late, dim=dim)


# -- the ring --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ring:
    group: Any  # ProcessGroup | None
    rank: int  # within the group
    world: int
    send_to: int  # global rank of rank + 1
    recv_from: int  # global rank of rank - 1

    @classmethod
    def of(cls, group: Any) -> _Ring:
        rank, world = dist.get_rank(group), dist.get_world_size(group)

        def global_rank(r: int) -> int:
            return r if group is None else dist.get_global_rank(group, r)

        return cls(
            group, rank, world, global_rank((rank + 1) % world), global_rank((rank - 1) % world)
        )

    def exchange(
        self, send: Sequence[Tensor], recv: Sequence[Tensor], tags: Sequence[int]
    ) -> list[Any]:
        """Post sends to rank + 1 and receives from rank − 1; returns the works to wait on."""
        ops = [
            dist.P2POp(dist.isend, t, self.send_to, self.group, tag)
            for t, tag in zip(send, tags, strict=True)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self.recv_from, self.group, tag)
            for t, tag in zip(recv, tags, strict=True)
        ]
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def pass_kv(
        self, cur_k: Tensor, cur_v: Tensor, buffers: list[tuple[Tensor, Tensor]], step: int
    ) -> list[Any]:
        """Send the current K/V chunk on and receive the next one into ``buffers[step % 2]``.

        Two receive buffers, allocated on first use and reused for the rest of the pass, so a rank
        holds at most the chunk it computes on and the one arriving.
        """
        if len(buffers) <= step % 2:
            buffers.append((torch.empty_like(cur_k), torch.empty_like(cur_v)))
        return self.exchange((cur_k, cur_v), buffers[step % 2], (_TAG_K, _TAG_V))


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()
    works.clear()


@dataclass(frozen=True)
class _Block:
    """Queries in sub-chunks [q0, q1) attend to keys in sub-chunks [k0, k1); ``causal`` on the
    diagonal (a square block, where top-left and bottom-right causal alignment coincide)."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool


@functools.cache
def _plan(q_ids: tuple[int, ...], k_ids: tuple[int, ...], causal: bool) -> tuple[_Block, ...]:
    """The blocks to compute when queries of chunks ``q_ids`` meet keys of chunks ``k_ids``.

    With ``causal``, global query chunk a sees key chunk b fully when b < a, causally when b == a,
    and not at all when b > a (skipped: no compute). Neighbouring sub-chunks with the same
    treatment merge into one block, so each case is as few kernel calls as possible.
    """
    runs: list[_Block] = []
    for i, a in enumerate(q_ids):
        full = [j for j, b in enumerate(k_ids) if not causal or b < a]
        # contiguous runs of fully visible key sub-chunks
        start = None
        for j in range(len(k_ids) + 1):
            inside = j in full
            if inside and start is None:
                start = j
            if not inside and start is not None:
                runs.append(_Block(i, i + 1, start, j, False))
                start = None
        runs += [_Block(i, i + 1, j, j + 1, True) for j, b in enumerate(k_ids) if causal and b == a]
    merged: list[_Block] = []
    for blk in runs:
        last = merged[-1] if merged else None
        if (
            last is not None
            and not blk.causal
            and not last.causal
            and (last.k0, last.k1) == (blk.k0, blk.k1)
            and last.q1 == blk.q0
        ):
            merged[-1] = _Block(last.q0, blk.q1, blk.k0, blk.k1, False)
        else:
            merged.append(blk)
    return tuple(merged)


# -- per-block kernels ----------------------------------------------------------------------------


def _use_cpu_flash(q: Tensor, v: Tensor) -> bool:
    return (
        _USE_CPU_FLASH
        and q.device.type == "cpu"
        and q.shape[-1] == v.shape[-1]
        and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
        and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    )


@functools.cache
def _cpu_flash_groups_heads() -> bool:
    """Whether this torch's CPU flash kernel takes fewer key/value heads than query heads."""
    q = torch.zeros(1, 2, 1, 1)
    try:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q[:, :1], q[:, :1])
    except RuntimeError:
        return False
    return True


def _block_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of one block with its log-sum-exp.

    q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, Dv) -> out (B, H, T, Dv), lse (B, H, T).
    """
    group = q.shape[1] // k.shape[1]
    if _use_cpu_flash(q, v):
        if group > 1 and not _cpu_flash_groups_heads():
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse
    b, h, t, _ = q.shape
    hk, s, dv = k.shape[1], k.shape[2], v.shape[-1]
    compute = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(b, hk, group, t, -1).to(compute)  # (B, Hk, G, T, D): query heads by group
    k5 = k.to(compute).unsqueeze(2)  # (B, Hk, 1, S, D), shared by the group without a copy
    v5 = v.to(compute).unsqueeze(2)  # (B, Hk, 1, S, Dv)
    scores = torch.matmul(q5, k5.transpose(-2, -1)) * scale  # (B, Hk, G, T, S)
    if causal:
        scores.masked_fill_(~functional.causal_mask(t, s, device=q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, Hk, G, T)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs, v5)  # (B, Hk, G, T, S) x (B, Hk, 1, S, Dv) -> (B, Hk, G, T, Dv)
    return out.reshape(b, h, t, dv).to(q.dtype), lse.reshape(b, h, t)


def _block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's share of the gradients, given the *global* out and lse of its query rows.

    With P = exp(q kᵀ·scale − lse) (the block's columns of the global softmax) and
    Δ = rowsum(dout ⊙ out): dv = Pᵀ dout, dS = P ⊙ (dout vᵀ − Δ), dq = dS k·scale,
    dk = dSᵀ q·scale. Summing the blocks' dq over all key blocks gives the exact dq; each block's
    dk/dv is exact for its keys' share of these queries (flash-attention-2's backward).

    Shapes as in :func:`_block_forward`; dout and out (B, H, T, Dv), lse (B, H, T).
    Returns dq (B, H, T, D), dk (B, Hk, S, D), dv (B, Hk, S, Dv).
    """
    group = q.shape[1] // k.shape[1]
    if _use_cpu_flash(q, v):
        expand = group > 1 and not _cpu_flash_groups_heads()
        ke, ve = (
            (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)) if expand else (k, v)
        )
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, ke, ve, out, lse, 0.0, causal, scale=scale
        )
        if expand:
            dk = dk.unflatten(1, (k.shape[1], group)).sum(2)
            dv = dv.unflatten(1, (k.shape[1], group)).sum(2)
        return dq, dk, dv
    b, h, t, d = q.shape
    hk, s, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    compute = torch.promote_types(q.dtype, torch.float32)
    q5 = q.reshape(b, hk, group, t, d).to(compute)  # (B, Hk, G, T, D)
    k5 = k.to(compute).unsqueeze(2)  # (B, Hk, 1, S, D)
    v5 = v.to(compute).unsqueeze(2)  # (B, Hk, 1, S, Dv)
    do5 = dout.reshape(b, hk, group, t, dv_dim).to(compute)  # (B, Hk, G, T, Dv)
    o5 = out.reshape(b, hk, group, t, dv_dim).to(compute)
    scores = torch.matmul(q5, k5.transpose(-2, -1)) * scale  # (B, Hk, G, T, S)
    if causal:
        scores.masked_fill_(~functional.causal_mask(t, s, device=q.device), float("-inf"))
    probs = torch.exp(scores - lse.reshape(b, hk, group, t, 1).to(compute))
    grad_v = torch.matmul(probs.transpose(-2, -1), do5).sum(2)  # (B, Hk, S, Dv)
    delta = (do5 * o5).sum(-1, keepdim=True)  # (B, Hk, G, T, 1)
    ds = probs * (torch.matmul(do5, v5.transpose(-2, -1)) - delta)  # (B, Hk, G, T, S)
    grad_q = torch.matmul(ds, k5) * scale  # (B, Hk, G, T, D)
    grad_k = torch.matmul(ds.transpose(-2, -1), q5).sum(2) * scale  # (B, Hk, S, D)
    return grad_q.reshape(b, h, t, d).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


def _merge(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """Fold one block's (out, lse) into the running (out, lse), in place (log-sum-exp rule).

    An accumulator that is still empty (lse = −inf, out = 0) takes the block as it is.
    """
    lse_new = torch.logaddexp(lse_acc, lse_blk)
    out_acc.mul_(torch.exp(lse_acc - lse_new).unsqueeze(-1))
    out_acc.addcmul_(out_blk, torch.exp(lse_blk - lse_new).unsqueeze(-1).to(out_acc.dtype))
    lse_acc.copy_(lse_new)


# -- forward and backward around the ring ---------------------------------------------------------


def _ring_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: _Ring, causal: bool, scale: float, layout: str
) -> tuple[Tensor, Tensor]:
    """q (B, H, C, D), k (B, Hk, C, D), v (B, Hk, C, Dv) -> out (B, H, C, Dv), lse (B, H, C)."""
    b, h, c, _ = q.shape
    hk, dv = k.shape[1], v.shape[-1]
    group = h // hk
    mine = _chunk_ids(ring.rank, ring.world, layout)
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
            theirs = _chunk_ids(source, ring.world, layout)
            for blk in _plan(mine, theirs, causal):
                rows, cols = slice(blk.q0 * sub, blk.q1 * sub), slice(blk.k0 * sub, blk.k1 * sub)
                o_blk, l_blk = _block_forward(
                    q_j[:, :, rows], cur_k[:, :, cols], cur_v[:, :, cols], blk.causal, scale
                )
                _merge(out_j[:, :, rows], lse_j[:, :, rows], o_blk, l_blk)
                del o_blk, l_blk
            _wait(works)
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
    ring: _Ring,
    causal: bool,
    scale: float,
    layout: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of q, k and v. Keys and values go around the ring again; beside each chunk
    travels the gradient accumulated for it so far, which after a full circle comes home."""
    b, h, c, _ = q.shape
    hk = k.shape[1]
    group = h // hk
    mine = _chunk_ids(ring.rank, ring.world, layout)
    sub = c // len(mine)
    acc = torch.promote_types(q.dtype, torch.float32)
    dout = dout.contiguous()
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
            for blk in _plan(mine, _chunk_ids(source, ring.world, layout), causal):
                rows, cols = slice(blk.q0 * sub, blk.q1 * sub), slice(blk.k0 * sub, blk.k1 * sub)
                g_q, g_k, g_v = _block_backward(
                    do_j[:, :, rows],
                    q_j[:, :, rows],
                    cur_k[:, :, cols],
                    cur_v[:, :, cols],
                    o_j[:, :, rows],
                    l_j[:, :, rows].contiguous(),
                    blk.causal,
                    scale,
                )
                dq_j[:, :, rows] += g_q
                part_k[:, :, cols] += g_k
                part_v[:, :, cols] += g_v
            # Also frees the buffer sent last step, which receives next.
            _wait(grad_works)
            if step == 0:
                grad_k, grad_v = part_k, part_v
            else:
                # Add to the shares of the ranks this chunk visited before (from rank - 1).
                grad_k, grad_v = grad_buffers[step % 2]
                grad_k += part_k
                grad_v += part_v
            # Pass the sum on (after the last step it reaches the rank the chunk belongs to) and
            # take in the sum for the chunk that comes next.
            grad_works = ring.exchange(
                (grad_k, grad_v), grad_buffers[(step + 1) % 2], (_TAG_DK, _TAG_DV)
            )
            _wait(kv_works)
            if step < ring.world - 1:
                cur_k, cur_v = kv_buffers[step % 2]
        _wait(grad_works)
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
        ring: _Ring,
        causal: bool,
        scale: float,
        layout: str,
    ) -> Tensor:
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


# -- input checks, agreed on by every rank ---------------------------------------------------------


def _local_problem(q: Any, k: Any, v: Any, scale: Any, layout: Any) -> Exception | None:
    """What is wrong with this rank's own arguments (no communication), or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            return ValueError(
                f"{name} must be 4-D (B, heads, T/world, head_dim), got shape {tuple(t.shape)}"
            )
    if layout not in LAYOUTS:
        return ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if scale is not None and (
        not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale)
    ):
        return ValueError(f"scale must be a finite float or None, got {scale!r}")
    if not (q.dtype == k.dtype == v.dtype):
        return TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    if not q.is_floating_point():
        return TypeError(f"q, k and v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        return ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        return ValueError(f"q, k and v must have one batch size, got {shapes}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        return ValueError(
            f"q, k and v must hold the same positions (one local length T/world), got {shapes}"
        )
    if q.shape[-1] != k.shape[-1]:
        return ValueError(f"q and k must have the same head dim, got {shapes}")
    if k.shape[1] != v.shape[1]:
        return ValueError(f"k and v must have the same number of heads, got {shapes}")
    if q.shape[1] % k.shape[1] != 0:
        return ValueError(
            f"q's heads must be a multiple of k's (grouped-query attention), got {shapes}"
        )
    if q.shape[2] == 0:
        return ValueError(f"the local length T/world must be at least 1, got {shapes}")
    if layout == "zigzag" and q.shape[2] % 2 != 0:
        return ValueError(
            f"layout='zigzag' holds two equal chunks per rank, so the local length must be even, "
            f"got {q.shape[2]} ({shapes})"
        )
    return None


def _describe(q: Any, k: Any, v: Any, is_causal: bool, scale: Any, layout: Any) -> dict[str, Any]:
    def shape(t: Any) -> Any:
        return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__

    return {
        "q": shape(q),
        "k": shape(k),
        "v": shape(v),
        "dtype": str(q.dtype) if isinstance(q, Tensor) else None,
        "is_causal": bool(is_causal),
        "scale": scale,
        "layout": layout,
    }


def _agree(ring: _Ring, summary: dict[str, Any], problem: Exception | None) -> None:
    """Compare every rank's arguments with one collective; raise the same verdict on all ranks.

    A rank that raised on its own would leave the others blocked in the ring forever; here every
    rank learns what every other rank got before anything is sent point to point.
    """
    mine = (summary, None if problem is None else (type(problem).__name__, str(problem)))
    gathered: list[Any] = [None] * ring.world
    dist.all_gather_object(gathered, mine, group=ring.group)
    if problem is not None:
        raise problem
    bad = [(r, p) for r, (_, p) in enumerate(gathered) if p is not None]
    if bad:
        rank, (kind, message) = bad[0]
        raise ValueError(
            f"ring_attention: rank {rank} of {ring.world} rejected its input ({kind}: {message}), "
            f"so every rank stops"
        )
    first = gathered[0][0]
    for key in first:
        values = [s[key] for s, _ in gathered]
        if any(value != values[0] for value in values):
            listing = ", ".join(f"rank {r}: {value}" for r, value in enumerate(values))
            raise ValueError(
                f"ring_attention: the ranks disagree on {key} ({listing}); every rank must pass "
                f"the same shapes, dtype and options"
            )


def _ring_of(group: Any) -> _Ring | None:
    """The ring of ``group``, or None when there is nothing to distribute (one process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    ring = _Ring.of(group)
    return ring if ring.world > 1 else None


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
        v: this rank's values (B, Hk, T/world, Dv).
        group: the process group of the ring (default: the world group).
        is_causal: global query position i sees keys j <= i, positions counted over the whole
            sequence as ``layout`` lays it out. Key chunks wholly in a query chunk's future are
            skipped (no compute).
        scale: the factor on the scores; default 1 / sqrt(D).
        layout: ``"contiguous"``: rank r holds positions [r·T/world, (r+1)·T/world).
            ``"zigzag"``: rank r holds chunks r and 2·world − 1 − r of 2·world chunks, glued in
            that order, which balances the causal work (see the module docstring and
            :func:`shard_sequence`).

    Masks other than ``is_causal`` (padding, arbitrary bool/float masks) and dropout are not part
    of this API: pad the sequence to a multiple of world (2·world for zigzag) and mask the padded
    positions' outputs afterwards, or use :func:`multihead.functional.attention` on one process.

    Every rank of the group must call this, and run backward through the result when any rank
    does (the gradient sums travel around the ring), in the same order as the group's other
    collectives.

    One process: when ``group`` is None and no default process group is initialised, or the group
    has one rank, this is plain :func:`multihead.functional.attention` on the local tensors (which
    are then the whole sequence), with the same checks.

    Returns:
        This rank's chunk of the output, (B, H, T/world, Dv), in q's dtype.

    Raises:
        ValueError: on every rank, when any rank's shapes, dtype, ``is_causal``, ``scale`` or
            ``layout`` differ from another's, or any rank's own input is invalid (the offending
            rank raises its own TypeError/ValueError). The check is one small all-gather before
            any transfer, so a mistake never leaves ranks waiting for each other.

    Example (on each of 2 ranks, after ``dist.init_process_group``)::

        x = torch.randn(1, 8, 1024, 64)  # (B, H, T, D), the same on every rank
        part = shard_sequence(x, dist.get_rank(), 2, "zigzag")  # (1, 8, 512, 64)
        out = ring_attention(part, part, part, is_causal=True, layout="zigzag")
    """
    ring = _ring_of(group)
    problem = _local_problem(q, k, v, scale, layout)
    if ring is None:
        if problem is not None:
            raise problem
        return functional.attention(q, k, v, is_causal=is_causal, scale=scale)
    _agree(ring, _describe(q, k, v, is_causal, scale, layout), problem)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    out: Tensor = _RingAttention.apply(q, k, v, ring, bool(is_causal), float(scale), layout)
    return out


class RingSelfAttention(nn.Module):
    """Run a :class:`multihead.MultiHeadAttention` as self-attention on a sharded sequence.

    Each rank passes its part of the input sequence (B, T/world, E), cut with
    :func:`shard_sequence` (``dim=1``) in the chosen ``layout``, and gets back its part of the
    output. The module's own projections (``project``/``merge``) run locally, the attention runs
    with :func:`ring_attention`. The wrapped module's parameters are this module's, so optimisers
    and DistributedDataParallel see them as usual; keep them identical on every rank.

    Not supported here (they raise or are not consulted): masks other than ``is_causal``,
    attention dropout in training, ``need_weights``, a key/value cache and the ``observer`` hook
    (the weights never exist in one place).

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
        _check_layout(layout)
        self.mha = mha
        self.group = group
        self.layout = layout

    def extra_repr(self) -> str:
        return f"layout={self.layout!r}"

    def forward(self, x: Tensor, *, is_causal: bool = False) -> Tensor:
        """Self-attention over the whole sequence, from and to this rank's part.

        Args:
            x: this rank's part of the input, (B, T/world, E).
            is_causal: global position i attends to positions j <= i.

        Returns:
            This rank's part of the output, (B, T/world, out_dim).

        Raises:
            ValueError / TypeError: as :func:`ring_attention`, on every rank; also when x is not
                (B, T/world, embed_dim) or the module would apply attention dropout.
        """
        mha = self.mha
        problem: Exception | None = None
        if not isinstance(x, Tensor):
            problem = TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        elif x.dim() != 3 or x.shape[-1] != mha.embed_dim:
            problem = ValueError(
                f"x must be (B, T/world, E) with E = embed_dim = {mha.embed_dim}, got shape "
                f"{tuple(x.shape)}"
            )
        elif mha.training and mha.dropout > 0:
            problem = ValueError(
                f"ring attention has no attention dropout, but the module has dropout="
                f"{mha.dropout} and is in training mode: use dropout=0 or eval()"
            )
        if problem is not None:
            ring = _ring_of(self.group)
            if ring is not None:
                _agree(ring, {}, problem)
            raise problem
        q, k, v = mha.project(x)  # (B, H, T/world, D), (B, Hk, T/world, D) x 2
        out = ring_attention(
            q,
            k,
            v,
            group=self.group,
            is_causal=is_causal,
            scale=1.0 / math.sqrt(mha.head_dim),
            layout=self.layout,
        )
        return mha.merge(out)  # (B, T/world, out_dim)
