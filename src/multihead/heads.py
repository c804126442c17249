"""The one head notation and the lookups every head function shares.

A head is written one way everywhere: ``"L0H1"`` (layer 0, head 1) or the pair ``(0, 1)``
(:data:`HeadName`); a block's feed-forward network is ``"MLP3"``. ``layer`` numbers a model's
attention sites in module order (:func:`multihead.model_map`), ``head`` is a query head. The
lookups check such names against a model's sites (:class:`LayerHeads`: in layer order): one
head (:func:`resolve_head`), a set of them by layer (:func:`chosen_heads`), and the (L, H) table
of NaN that every per-head result starts from (:func:`head_table`).

Shapes: L attention layers, H heads (the most any layer has), T positions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple, Protocol, Union

import torch
from torch import Tensor

from multihead._checks import check_index, describe

__all__ = [
    "chosen_heads",
    "HeadCount",
    "LayerHeads",
    "HeadKey",
    "HeadName",
    "head_label",
    "head_table",
    "is_head",
    "mlp_label",
    "mlp_layer",
    "parse_head",
    "resolve_head",
]


# One head, in the one notation: "L0H1" or (0, 1).
HeadName = Union[tuple[int, int], str]  # noqa: UP007 - a runtime alias


def head_label(layer: int, head: int) -> str:
    """The one written name of a head: ``"L0H1"`` for layer 0, head 1."""
    return f"L{layer}H{head}"


_HEAD_NAME = re.compile(r"\s*[Ll]\s*(-?\d+)\s*[Hh]\s*(-?\d+)\s*")


_MLP_NAME = re.compile(r"\s*mlp\s*(-?\d+)\s*", re.IGNORECASE)


def mlp_label(layer: int) -> str:
    """The one written name of a block's feed-forward network: ``"MLP3"`` for block 3."""
    return f"MLP{layer}"


def mlp_layer(value: object) -> object:
    """The layer a feed-forward network is named by, ``"MLP3"`` (any case) or ``("mlp", 3)``
    (not yet checked: it may be any object in the pair form), or None when ``value`` is not
    written as a feed-forward network."""
    if isinstance(value, str):
        match = _MLP_NAME.fullmatch(value)
        return None if match is None else int(match[1])
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and isinstance(value[0], str)
        and value[0].lower() == "mlp"
    ):
        return value[1]
    return None


def is_head(value: object) -> bool:
    """Whether ``value`` is written as one head: ``"L0H1"`` or a ``(layer, head)`` pair of ints."""
    if isinstance(value, str):
        return _HEAD_NAME.fullmatch(value) is not None
    return (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def parse_head(name: str, value: object) -> tuple[int, int]:
    """One head in the one notation, ``"L0H1"`` or ``(0, 1)``, as ``(layer, head)`` ints (not
    yet checked against a model: negative indices count from the end there).

    Raises:
        TypeError: neither form (``name`` names the argument).
    """
    if isinstance(value, str):
        match = _HEAD_NAME.fullmatch(value)
        if match is not None:
            return int(match[1]), int(match[2])
    elif is_head(value):
        assert isinstance(value, tuple)
        return value[0], value[1]
    raise TypeError(
        f"{name} must be a (layer, head) pair of ints, got {value!r} (or a head written as "
        f"'L0H1': layer 0, head 1)"
    )


HeadKey = tuple[int, int]


class LayerHeads(Protocol):
    """What the lookups read of a layer (a :class:`multihead.map_types.Site`, a
    :class:`HeadCount`): its name, for messages, and how many heads it numbers."""

    @property
    def name(self) -> str: ...

    @property
    def num_heads(self) -> int: ...


class HeadCount(NamedTuple):
    """A layer's name and how many heads of one kind it numbers (its key/value heads, say)."""

    name: str
    num_heads: int


def head_table(found: Sequence[LayerHeads], like: Tensor, positions: int | None) -> Tensor:
    """(L, H) or (L, H, T) of NaN in ``like``'s dtype and device: unscored heads stay NaN."""
    most = max(site.num_heads for site in found)
    shape = (len(found), most) if positions is None else (len(found), most, positions)
    return torch.full(shape, float("nan"), dtype=like.dtype, device=like.device)


def resolve_head(name: str, key: object, found: Sequence[LayerHeads]) -> HeadKey:
    """Check one head, ``"L0H1"`` or ``(0, 1)`` (:func:`multihead.heads.parse_head`), against
    the model; negative indices count from the end.

    Returns the key with both indices in range, e.g. ``(5, 11)`` for ``(-1, -1)`` or
    ``"L-1H-1"`` on MiniLM.
    """
    raw = parse_head(name, key)
    layer = check_index(f"{name} {key!r}: layer", raw[0], len(found), "attention layers")
    site = found[layer]
    head = check_index(
        f"{name} {key!r}: head", raw[1], site.num_heads, f"heads in layer {layer} ({site.name})"
    )
    return layer, head


def chosen_heads(heads: object, found: Sequence[LayerHeads]) -> dict[int, list[int]]:
    """``heads`` (None: every head; else ``(layer, head)`` pairs) as layer -> heads, in order."""
    if heads is None:
        return {layer: list(range(site.num_heads)) for layer, site in enumerate(found)}
    if isinstance(heads, (str, bytes, Tensor)) or not isinstance(heads, Sequence):
        raise TypeError(
            f"heads must be None or a sequence of (layer, head) pairs, got {describe(heads)}"
        )
    if not heads:
        raise ValueError("heads must name at least one (layer, head) pair, got none")
    keys: list[HeadKey] = list(dict.fromkeys(resolve_head("heads item", k, found) for k in heads))
    by_layer: dict[int, list[int]] = {}
    for layer, head in sorted(keys):
        by_layer.setdefault(layer, []).append(head)
    return by_layer
