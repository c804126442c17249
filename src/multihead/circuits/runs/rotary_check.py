"""Whether a layer's queries and keys turn with their positions (rotary), found on a run.

TransformerLens names a rotary model's queries and keys twice: ``hook_q`` / ``hook_k`` before
the rotation, ``hook_rot_q`` / ``hook_rot_k`` after. multihead's ``q`` and ``k`` are what the
kernel reads, after it; on a model without rotary positions the two are one. :class:`RotaryCheck`
tells them apart without naming a family: it records what each attention module was given in a
run, and runs the module once more (:func:`~multihead.circuits.runs.attention_replay.
replay_attention`) with every position given the first position's input: queries or keys that
then differ between positions were turned by position.

Shapes: B batch, T tokens, E width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.runs.attention_replay import replay_attention
from multihead.map_types import ModelMap
from multihead.observers import AttentionCall, Removable

__all__ = ["RotaryCheck"]


class RotaryCheck:
    """The hooks that record each chosen layer's attention call in a run, and afterwards
    :meth:`rotary`: the layers whose queries or keys depend on the position.

    Args:
        mapped: the model's map.
        layers: the layers to check.
    """

    def __init__(self, mapped: ModelMap, layers: set[int]) -> None:
        self._mapped = mapped
        self._layers = sorted(layers)
        # per layer: (args, kwargs) with the stream replaced by its first position (B, 1, E),
        # that first position, and T; the stream itself is not kept
        self._calls: dict[int, tuple[tuple[Any, ...], dict[str, Any], Tensor, int]] = {}

    def hooks(self) -> Iterator[Removable]:
        """The hooks to register for the run."""
        for layer in self._layers:
            module = self._mapped.sites[layer].module
            yield module.register_forward_pre_hook(self._on_call(layer), with_kwargs=True)

    def _on_call(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            given = self._mapped.stream_of(args, kwargs)
            if layer in self._calls or not isinstance(given, Tensor) or given.dim() != 3:
                return  # a packed (N, E) stream: its positions are not an axis here
            first = given[:, :1].detach().clone()

            def swap(value: Any) -> Any:
                return first if value is given else value

            call = (tuple(map(swap, args)), {k: swap(v) for k, v in kwargs.items()})
            self._calls[layer] = (*call, first, given.shape[1])

        return hook

    def rotary(self) -> frozenset[int]:
        """The checked layers whose queries or keys differ between positions given one input
        (the recorded calls are dropped)."""
        found = set()
        for layer, (args, kwargs, first, length) in self._calls.items():
            site = self._mapped.sites[layer]

            def read(call: AttentionCall) -> tuple[Tensor, ...]:
                return call.q, call.k

            q, k = replay_attention(
                site.module, site.attention, (args, kwargs), first, first, len(first), read,
                length=length,
            )  # fmt: skip
            if any(not _same_everywhere(t) for t in (q, k)):
                found.add(layer)
        self._calls.clear()
        return frozenset(found)


def _same_everywhere(t: Tensor) -> bool:
    """Whether (B, heads, T, D) is the same at every position, to a few rounding steps."""
    reference = t[:, :, :1]
    tolerance = 16 * torch.finfo(t.dtype).eps * float(t.abs().max().clamp(min=1.0))
    return float((t - reference).abs().max()) <= tolerance
