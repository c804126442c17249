"""The process group as a ring, and the agreement on arguments before the ring starts.

- :class:`Ring`: a rank's neighbours in its group (it sends to rank + 1 and receives from
  rank − 1) and the point-to-point exchanges with them.
- :func:`agree`: one all-gather through which every rank learns every other rank's arguments (or
  what was wrong with them) before anything travels point to point, so that every rank raises
  the same error where one rank alone would leave the others waiting for it forever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from multihead._checks import check_finite_float, check_tensor, describe
from multihead.distributed.sharding import check_layout

__all__ = ["Ring", "wait", "ring_of", "local_problem", "agreed_fields", "agree"]


# Distinct tags keep the key/value traffic and the gradient traffic (both r -> r + 1) apart on
# backends that match messages by tag (gloo); nccl ignores tags and matches by issue order, which
# every rank keeps identical.
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4


# -- the ring -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ring:
    """This rank's place in its process group, seen as a ring: it sends to rank + 1 and receives
    from rank − 1 (both by global rank, which point-to-point operations take)."""

    group: Any  # ProcessGroup | None
    rank: int  # within the group
    world: int
    send_to: int  # global rank of rank + 1
    recv_from: int  # global rank of rank - 1

    @classmethod
    def of(cls, group: Any) -> Ring:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("group must contain this process, got a group without it")

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

    def pass_grads(self, grad_k: Tensor, grad_v: Tensor, recv: tuple[Tensor, Tensor]) -> list[Any]:
        """Send gradient sums on and receive the next ones into ``recv``."""
        return self.exchange((grad_k, grad_v), recv, (_TAG_DK, _TAG_DV))


def wait(works: list[Any], ring: Ring | None = None) -> None:
    """Wait for ``works``; with ``ring`` (in backward), explain a timeout's likely cause."""
    try:
        for work in works:
            work.wait()
    except RuntimeError as e:
        if ring is None:
            raise
        # Forward calls were agreed on; a backward that one rank never runs cannot be, and gloo
        # reports the wait for it only as a timeout.
        raise RuntimeError(
            f"ring_attention backward: rank {ring.rank} of {ring.world} timed out waiting for its "
            f"neighbours. Every rank of the group must run backward through its ring_attention "
            f"output (a rank whose loss does not use it can add 0 * out.sum()); or a rank failed"
        ) from e
    works.clear()


# -- input checks, agreed on by every rank --------------------------------------------------------


def check_local(q: Any, k: Any, v: Any, is_causal: Any, scale: Any, layout: Any) -> None:
    """Raise on what is wrong with this rank's own arguments (no communication)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (B, heads, T/world, head_dim), got shape {tuple(t.shape)}"
            )
    check_layout(layout)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {describe(is_causal)}")
    if scale is not None:
        check_finite_float("scale", scale)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")
    check_tensor("q", q, floating=True)
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device} and {v.device}"
        )
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k and v must have one batch size, got {shapes}")
    if not (q.shape[2] == k.shape[2] == v.shape[2]):
        raise ValueError(
            f"q, k and v must hold the same positions (one local length T/world), got {shapes}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {shapes}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of heads, got {shapes}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"q's heads must be a multiple of k's (grouped-query attention), got {shapes}"
        )
    if q.shape[2] == 0:
        raise ValueError(f"the local length T/world must be at least 1, got {shapes}")
    if layout == "zigzag" and q.shape[2] % 2 != 0:
        raise ValueError(
            f"layout='zigzag' holds two equal chunks per rank, so the local length must be even, "
            f"got {q.shape[2]} ({shapes})"
        )


def local_problem(*args: Any) -> Exception | None:
    """What :func:`check_local` finds wrong with this rank's arguments, or None."""
    try:
        check_local(*args)
    except Exception as e:  # whatever it is, even a check that broke, every rank must hear of it
        return e
    return None


def agreed_fields(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: Any, layout: str
) -> dict[str, Any]:
    """What every rank must agree on; plain values (the arguments were checked), so they pickle."""
    return {
        "q": tuple(q.shape),
        "k": tuple(k.shape),
        "v": tuple(v.shape),
        "dtype": str(q.dtype),
        "is_causal": is_causal,
        "scale": None if scale is None else float(scale),
        "layout": layout,
        # Function.apply records a backward exactly when this holds; a backward that runs on some
        # ranks only would wait forever for the others' messages.
        "requires_grad": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    }


_DISAGREEMENT_HINTS = {
    "requires_grad": "either every rank records the call for backward or none does (grad mode "
    "on and q, k or v requiring grad): the gradients travel around the ring",
}


def agree(ring: Ring, summary: dict[str, Any], problem: Exception | None) -> None:
    """Compare every rank's arguments with one collective; raise the same verdict on all ranks.

    A rank that raised on its own would leave the others blocked in the ring forever; here every
    rank learns what every other rank got before anything is sent point to point. A rank with a
    ``problem`` sends an empty summary and the problem's message, plain text that always pickles.
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
            hint = _DISAGREEMENT_HINTS.get(
                key, "every rank must pass the same shapes, dtype and options"
            )
            raise ValueError(f"ring_attention: the ranks disagree on {key} ({listing}); {hint}")


def ring_of(group: Any) -> Ring | None:
    """The ring of ``group``, or None when there is nothing to distribute (one process)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    ring = Ring.of(group)
    return ring if ring.world > 1 else None
