"""Data parallelism over independent items: the texts of a corpus, the patched variants of a sweep.

:class:`DataParallelGroup` is a ``torch.distributed`` process group seen as ranks that share out
items needing no communication while they run (each text's forward is its own), then combine
what they summed, so that every rank ends with what one process running every item would have.
The loops that use it (``multihead.text.corpus_statistics``, ``head_distances``,
``multihead.circuits.patch_heads``) call :meth:`DataParallelGroup.of` to learn whether to split:

- no process group initialised, a group of one rank, or a model whose parameters are sharded
  over ranks of the group (``DTensor`` parameters: tensor parallelism, FSDP; such a model's
  forward is a collective every rank runs together): one process does everything, and nothing
  is exchanged;
- otherwise each rank runs its share (:meth:`~DataParallelGroup.share`), and the sums meet in
  one all-reduce (:meth:`~DataParallelGroup.sum`) and what is not a sum (per-item results, names)
  in one all-gather (:meth:`~DataParallelGroup.gather`).

Bad input never hangs: :meth:`~DataParallelGroup.gather` carries each rank's error, if it had
one, and every rank raises when any rank failed, before any other collective.

Collective tensors go where the backend takes them: the CPU for gloo (and MPI), the current
accelerator for the others (nccl: ``torch.cuda.set_device(local_rank)`` first, as for any nccl
object collective).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

if dist.is_available():  # a torch built without distributed has no DTensor
    from torch.distributed.tensor import DTensor

__all__ = ["DataParallelGroup"]

T = TypeVar("T")

# An error one rank raised is raised on the others as the same type when it is one of these (so
# that every rank tells the user the same thing), else as a RuntimeError naming it.
_SAME_TYPE: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "TypeError": TypeError,
    "FileNotFoundError": FileNotFoundError,
    "PermissionError": PermissionError,
    "MemoryError": MemoryError,
}


@dataclass(frozen=True)
class DataParallelGroup:
    """Ranks that share out independent items and combine their sums.

    Build one with :meth:`of` (or :meth:`single` for one process). With ``world == 1`` nothing
    is ever exchanged: :meth:`share` is every item, :meth:`sum` the tensor itself.

    Attributes:
        group: the ``torch.distributed`` process group (None with one process).
        rank: this process's rank in it (0 with one process).
        world: how many ranks share the items.
        device: where the tensors of the group's collectives go.
    """

    group: Any
    rank: int
    world: int
    device: torch.device

    @classmethod
    def single(cls) -> DataParallelGroup:
        """One process: every item here, nothing exchanged."""
        return cls(None, 0, 1, torch.device("cpu"))

    @classmethod
    def of(cls, group: Any = None, model: nn.Module | None = None) -> DataParallelGroup:
        """The ranks to split over: ``group``, or by default every rank of the default group
        when ``torch.distributed`` is initialised (as under ``torchrun``); one process when none
        is, when the group has one rank, or when ``model``'s parameters are sharded over more
        than one of its ranks (``DTensor`` parameters: tensor parallelism, FSDP), whose forward
        every rank must run together: then every rank runs every item.

        Raises:
            ValueError: ``group`` given but ``torch.distributed`` is not initialised, or this
                process is not in it.
        """
        initialised = dist.is_available() and dist.is_initialized()
        if group is None:
            if not initialised:
                return cls.single()
            group = dist.group.WORLD
        elif not initialised:
            raise ValueError(
                "group was given, but torch.distributed is not initialised: call "
                "torch.distributed.init_process_group first (torchrun sets up its rendezvous)"
            )
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("group must contain this process, got a group without it")
        if world == 1:
            return cls.single()
        if model is not None and len(_sharded_ranks(model) & set(_group_ranks(group))) > 1:
            return cls.single()  # a sharded model's forward is every rank's: run every item
        return cls(group, rank, world, _collective_device(group))

    def share(self, items: Sequence[T]) -> list[T]:
        """This rank's items: every ``world``-th, from the ``rank``-th (neighbours, often alike
        in cost, go to different ranks)."""
        return list(items[self.rank :: self.world])

    def gather(self, value: Any, error: BaseException | None = None) -> list[Any]:
        """Every rank's ``value`` (picklable), in rank order; or, when any rank passes an
        ``error``, raise on every rank: the failing rank its own error, the others the same
        type (ValueError, TypeError, ...) or a RuntimeError, naming the rank and the message.
        Every rank must call it, whether it failed or not."""
        if self.world == 1:
            if error is not None:
                raise error
            return [value]
        said = None if error is None else (type(error).__name__, str(error))
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, (said, None if error else value), group=self.group)
        if error is not None:
            raise error
        for rank, (failed, _) in enumerate(reports):
            if failed is not None:
                kind, message = failed
                raise _SAME_TYPE.get(kind, RuntimeError)(
                    f"rank {rank} of {self.world} failed ({kind}): {message}"
                )
        return [value for _, value in reports]

    def sum(self, tensor: Tensor) -> Tensor:
        """The sum of every rank's ``tensor`` (same shape and dtype on every rank), on every
        rank, on ``tensor``'s device."""
        if self.world == 1:
            return tensor
        buffer = tensor.to(self.device, copy=True)
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self.group)
        return buffer.to(tensor.device)


def _group_ranks(group: Any) -> list[int]:
    """The global ranks of a process group."""
    return list(dist.get_process_group_ranks(group))


def _sharded_ranks(model: nn.Module) -> set[int]:
    """The global ranks ``model``'s parameters are sharded over (the device meshes of its
    ``DTensor`` parameters); empty when none is."""
    if not dist.is_available():
        return set()
    ranks: set[int] = set()
    meshes: set[int] = set()
    for p in model.parameters():
        if isinstance(p, DTensor) and id(p.device_mesh) not in meshes:
            meshes.add(id(p.device_mesh))
            ranks.update(int(r) for r in p.device_mesh.mesh.flatten().tolist())
    return ranks


def _collective_device(group: Any) -> torch.device:
    """Where a backend takes its collectives' tensors: gloo and MPI the CPU's (the only device
    gloo reduces on here), others (nccl, ...) the current accelerator's."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())
