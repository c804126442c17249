"""An attention module run again on other inputs, with the rest of a recorded call.

A forward pre-hook records what an attention module was given: its input x (B, T, E) and
everything else (its positions, rotary tables, mask). Calling the module again with other
inputs (N, T, E) in place of x, and the rest as recorded (it broadcasts over the batch), gives
the queries, keys and values it makes of them at the same positions, read off the observer
channel: no family's projections, fused layouts or rotary tables named. QK attribution runs a
head's attention on each component of the stream this way, and the weights reader on the unit
vectors.

Shapes: N inputs, T tokens, E width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from multihead.observers import AttentionCall, registered

__all__ = ["replay_attention"]


def replay_attention(
    module: nn.Module,
    attention: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    given: Tensor,
    inputs: Tensor,
    rows: int,
    read: Callable[[AttentionCall], tuple[Tensor, ...]],
    length: int | None = None,
) -> list[Tensor]:
    """What ``read`` takes of each call the observer channel ``attention`` sees when
    ``module`` runs on ``inputs`` (N, T, E), or (N, 1, E) for one vector at every position,
    ``rows`` at a time, in place of ``given`` (the input of the recorded ``call``: its args and
    kwargs), joined along the batch: one tensor per item ``read`` returns, each (N, ...). No
    gradient. ``length``: the positions to expand (N, 1, E) inputs to, default ``given``'s."""
    args, kwargs = call
    got: list[tuple[Tensor, ...]] = []

    def observer(seen: AttentionCall, out: Tensor) -> None:
        got.append(tuple(t.detach() for t in read(seen)))

    def swap(value: Any, chunk: Tensor) -> Any:
        return chunk if value is given else value

    with registered([attention.register_observer(observer)]), torch.no_grad():
        for part in inputs.split(rows):
            chunk = part.expand(-1, length or given.shape[1], -1).contiguous()
            swapped = {key: swap(value, chunk) for key, value in kwargs.items()}
            module(*(swap(a, chunk) for a in args), **swapped)
    return [torch.cat([g[i] for g in got]) for i in range(len(got[0]))] if got else []
