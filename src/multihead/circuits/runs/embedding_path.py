"""The straight path between two runs' embeddings, along which integrated gradients average.

Integrated gradients (Sundararajan et al., 2017) replace one gradient by its mean along a path
from one input to another. For two token sequences the path runs between their embeddings:
what the first block is given (token + position embeddings), ``x_α = source + α (target -
source)``. EAP-IG (Hanna et al., "Have Faith in Faithfulness", 2024) takes the gradient at
``α = k / m`` for ``k = 1 … m``: the m-th point is the target run itself, so one point is the
plain gradient (EAP, attribution patching). (Their released code takes ``k = 0 … m - 1``, from
the source end; the two sums differ by the endpoints' gradients over m.)

Shapes: B batch, T tokens, E residual width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from multihead.map_types import ModelMap

__all__ = ["interpolated_embeddings", "path_points", "recorded_embeddings"]


def path_points(steps: int) -> list[float]:
    """α of each point: ``[1/m, 2/m, …, 1]`` for ``m = steps``."""
    return [k / steps for k in range(1, steps + 1)]


def _first_block(mapped: ModelMap, caller: str) -> nn.Module:
    return mapped.stack_block(0, f"{caller} (the embeddings are what block 0 is given)").module


@contextlib.contextmanager
def recorded_embeddings(mapped: ModelMap, caller: str) -> Iterator[list[Tensor]]:
    """Within the block, ``recorded[-1]`` is what block 0 was given in the latest run (B, T, E),
    detached."""
    recorded: list[Tensor] = []

    def hook(m: nn.Module, args: Any, kwargs: Any) -> None:
        recorded.append(mapped.stream_of(args, kwargs).detach())

    handle = _first_block(mapped, caller).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield recorded
    finally:
        handle.remove()


@contextlib.contextmanager
def interpolated_embeddings(
    mapped: ModelMap, source: Tensor | None, target: Tensor | None, alpha: float, caller: str
) -> Iterator[None]:
    """Within the block, block 0 is given ``source + alpha (target - source)`` (B, T, E) as a
    leaf that requires grad (at ``alpha == 1``, its own input, which is the target's: then
    ``source`` and ``target`` may be None), so that every later activation has a gradient
    whatever the parameters' ``requires_grad``."""
    assert alpha == 1 or (source is not None and target is not None), "a point needs both ends"

    def hook(m: nn.Module, args: Any, kwargs: Any) -> Any:
        given = mapped.stream_of(args, kwargs)
        x = given if alpha == 1 else source + alpha * (target - source)  # type: ignore[operator]
        return mapped.with_stream(args, kwargs, x.detach().to(given.dtype).requires_grad_())

    handle = _first_block(mapped, caller).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.enable_grad():
            yield
    finally:
        handle.remove()
