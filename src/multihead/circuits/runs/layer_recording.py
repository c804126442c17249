"""The heads' outputs of chosen layers, recorded on one run (what a patch is taken from).

Shapes: B batch, T tokens, H heads, Dv one head's output width.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from multihead.map_types import Site
from multihead.observers import AttentionCall, registered

__all__ = ["check_recorded", "record_layers"]


@contextlib.contextmanager
def record_layers(found: list[Site], layers: Sequence[int]) -> Any:
    """Within the block, ``recorded[layer]`` is the layer's per-head output (B, T, H, Dv) of
    its latest call, detached."""
    recorded: dict[int, Tensor] = {}

    def make(layer: int) -> Any:
        def observer(call: AttentionCall, out: Tensor) -> None:
            recorded[layer] = out.detach()

        return observer

    with registered(found[layer].attention.register_observer(make(layer)) for layer in layers):
        yield recorded


def check_recorded(found: list[Site], layers: Sequence[int], recorded: dict[int, Tensor]) -> None:
    """Every layer of ``layers`` was called (and so recorded) by the run: else a ValueError."""
    missing = [layer for layer in layers if layer not in recorded]
    if missing:
        raise ValueError(
            f"the model did not call attention layer {missing[0]} ({found[missing[0]].name}) on "
            f"the inputs: there is nothing to patch there"
        )
