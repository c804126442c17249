"""Devices and data-parallel process groups for :func:`~multihead.training.train`.

The device checks (``check_device``, ``resolve_device``) are :mod:`multihead.devices`'s, shared
with the loaders.

Under ``torchrun`` (the environment says ``WORLD_SIZE > 1``) every rank joins one process group,
gloo on CPU or nccl on GPUs (one GPU per local rank). Everything a rank can check alone — the
device string, whether that device exists, whether the run fits in its memory — is checked
before the group is joined and before anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["World", "check_threads", "setup_world", "world_size", "check_fits"]


@dataclass
class World:
    """This process's place in the data-parallel run (a single process: rank 0 of 1)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False


def world_size() -> int:
    """The number of data-parallel ranks, as torchrun's ``WORLD_SIZE`` says (default 1)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_threads(threads: int | None) -> None:
    """More threads than CPUs only makes OpenMP spin: refuse them (None: torch's choice).

    Raises:
        ValueError: more threads than this machine's CPUs.
    """
    cpus = os.cpu_count() or 1
    if threads is not None and threads > cpus:
        raise ValueError(f"threads must be at most the {cpus} CPUs here, got {threads}")


def setup_world(device: torch.device) -> World:
    """Join the process group when torchrun started several ranks; a single process joins none."""
    size = world_size()
    if device.type == "cuda" and device.index is not None:  # "cuda" alone: the current GPU
        torch.cuda.set_device(device)
    if size <= 1:
        return World(device=device)
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        owns = True
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=device, owns_group=owns)


def _memory_of(device: torch.device) -> int | None:
    """Bytes of memory on ``device``, or None where we can't tell."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows)
        return None


def check_fits(
    *,
    vocab_size: int,
    embed_dim: int,
    num_layers: int,
    ff_dim: int,
    num_heads: int,
    seq_len: int,
    batch_size: int,
    device: torch.device,
) -> None:
    """Refuse a run whose weights, AdamW state and one batch's activations can't fit ``device``.

    A deliberate underestimate (float32; per layer the attention scores, the feed-forward
    activations and a few (B, T, E) tensors), so that it only stops absurd sizes, and stops them
    before anything is allocated or written.

    Args:
        seq_len: T, the positions per example; ``batch_size``: B on this rank.

    Raises:
        ValueError: the estimate exceeds the device's memory.
    """
    available = _memory_of(device)
    if available is None:
        return
    e, f, layers, t, b = embed_dim, ff_dim, num_layers, seq_len, batch_size
    params = 2 * vocab_size * e + t * e + layers * (4 * e * e + 2 * e * f)
    activations = b * t * (layers * (6 * e + 2 * f + 2 * num_heads * t) + 2 * vocab_size)
    needed = 4 * (4 * params + activations)  # weights, gradients, two AdamW moments; float32
    if needed > available:
        raise ValueError(
            f"the run needs at least {_gib(needed)} (about {params:.3g} parameters with their "
            f"gradients and AdamW state, and the activations of a batch of {b}×{t}), more than "
            f"the {_gib(available)} of {device}: choose smaller embed_dim, ff_dim, num_layers or "
            f"batch_size"
        )


def _gib(n: int) -> str:
    gib = n / 2**30
    return f"{gib:.1f} GiB" if gib < 1e5 else f"{gib:.2g} GiB"
