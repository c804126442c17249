"""The two ends of a path, as :func:`~multihead.path_patching` reads them and
its result writes them.

A **sender** (a :class:`~multihead.circuits.graph.Sender` of the graph every circuit method
names) is what changes between the two runs:

    (layer, head), "L0H1"          the head's output (B, T, Dv) before the output projection
    ("mlp", layer), "mlp3"         what block ``layer``'s feed-forward network adds to the
                                   residual stream (B, T, E); written "MLP3"

A **receiver** is where the change is read:

    (layer, head), "L1H3"          the head's queries, keys or values, at every position
    (layer, head, positions)       ... at these positions only (an int or ints along the
                                   input's sequence axis, negative from the end); written
                                   "L1H3@[6]"
    [receiver, receiver, ...]      a set of such receivers patched together, in one run (e.g.
                                   every S-inhibition head's values): a list (a tuple is one
                                   receiver); written "{L7H3, L8H6}"
    "logits"                       the final residual stream, read by the metric directly

Shapes: B batch, T positions, Dv one head's width, E the residual width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from multihead._checks import check_index, describe, is_int
from multihead.circuits.graph import LOGITS, Sender
from multihead.heads import head_label, mlp_layer, resolve_head
from multihead.map_types import ModelMap, Site

__all__ = ["Member", "ReceiverSet", "parse_receivers", "parse_senders"]

_RECEIVER_FORMS = (
    "(layer, head), (layer, head, positions), a list of these patched together, or 'logits'"
)


@dataclass(frozen=True)
class Member:
    """One receiving head: its layer, its (query) head, the positions of its input to patch
    (non-negative once resolved; None: every position)."""

    layer: int
    head: int
    positions: tuple[int, ...] | None = None

    @property
    def label(self) -> str:
        """``"L1H3"`` or ``"L1H3@[5, 6]"``."""
        at = "" if self.positions is None else f"@{list(self.positions)}"
        return head_label(self.layer, self.head) + at

    def resolved(self, length: int, name: str) -> Member:
        """The member with its positions in [0, length) (``name`` names it in errors)."""
        if self.positions is None:
            return self
        what = "positions in the receivers' inputs"
        at = [check_index(f"{name} position", p, length, what) for p in self.positions]
        return Member(self.layer, self.head, tuple(sorted(set(at))))


@dataclass(frozen=True)
class ReceiverSet:
    """One receiver of the result's receiver axis: heads whose inputs are patched together in
    one run (one head, or a joint set), or the logits (no members)."""

    members: tuple[Member, ...]
    joint: bool = False

    @property
    def logits(self) -> bool:
        return not self.members

    @property
    def label(self) -> str:
        """``"L1H3"``, ``"L1H3@[6]"``, ``"{L1H3, L1H4}"`` or ``"logits"``."""
        if self.logits:
            return LOGITS
        names = ", ".join(m.label for m in self.members)
        return f"{{{names}}}" if self.joint else names

    @property
    def first_layer(self) -> int:
        return min(m.layer for m in self.members)

    def resolved(self, length: int) -> ReceiverSet:
        """The receiver with every member's positions in [0, length)."""
        name = f"receivers item {self.label}"
        return ReceiverSet(tuple(m.resolved(length, name) for m in self.members), self.joint)


def parse_senders(senders: object, found: Sequence[Site], mapped: ModelMap) -> list[Sender]:
    """``senders``, a non-empty sequence of heads (``(layer, head)``, ``"L0H1"``) and
    feed-forward networks (``("mlp", layer)``, ``"mlp3"``), resolved in order.

    Raises:
        TypeError: not a sequence, or an item of neither form.
        ValueError: none given, an index out of range, a block without a feed-forward network.
    """
    items = _items("senders", senders, "(layer, head) pairs or ('mlp', layer)")
    return [_sender(item, found, mapped) for item in items]


def parse_receivers(receivers: object, found: Sequence[Site]) -> list[ReceiverSet]:
    """``receivers``, a non-empty sequence of receivers (module docstring), resolved in order;
    positions stay as given until :meth:`ReceiverSet.resolved`.

    Raises:
        TypeError: not a sequence, or an item of none of the forms.
        ValueError: none given, an empty set, heads out of range, empty positions.
    """
    items = _items("receivers", receivers, _RECEIVER_FORMS)
    return [_receiver(item, found) for item in items]


def _items(name: str, value: object, forms: str) -> list[object]:
    if isinstance(value, (str, bytes, Tensor)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a sequence of {forms}, got {describe(value)}")
    if len(value) == 2 and all(is_int(k) for k in value):
        raise TypeError(
            f"{name} must be a sequence of (layer, head) pairs, got {describe(value)} (one pair: "
            f"write [{describe(tuple(value))}])"
        )
    if not value:
        raise ValueError(f"{name} must name at least one of {forms}, got none")
    return list(value)


def _sender(item: object, found: Sequence[Site], mapped: ModelMap) -> Sender:
    layer = mlp_layer(item)
    if layer is None:
        return Sender("head", *resolve_head("senders item", item, found))
    name = f"senders item {item!r}"
    index = check_index(f"{name}: layer", layer, len(found), "attention layers")
    block = mapped.stack_block(index, f"{name} (a feed-forward network sender)")
    if block.mlp is None:
        raise ValueError(
            f"{name}: block {index} of {mapped.family} has no feed-forward network the map knows "
            f"(an attention-only block?): there is no MLP output to send"
        )
    return Sender("mlp", index)


def _receiver(item: object, found: Sequence[Site]) -> ReceiverSet:
    if isinstance(item, str) and item == LOGITS:
        return ReceiverSet(())
    if isinstance(item, tuple) and item and not is_int(item[0]) and not isinstance(item[0], str):
        raise TypeError(
            f"receivers item {item!r}: a set of receivers patched together is a list, e.g. "
            f"[(1, 3), (1, 4)]; a tuple is one receiver, (layer, head) or (layer, head, positions)"
        )
    if not (isinstance(item, list) and item and not is_int(item[0])):
        return ReceiverSet((_member(item, found),))
    members: dict[tuple[int, int], Member] = {}
    for part in item:
        nested = isinstance(part, list) and bool(part) and not is_int(part[0])
        if (isinstance(part, str) and part == LOGITS) or nested:
            raise ValueError(
                f"receivers item {item!r}: a set of receivers holds heads, (layer, head) or "
                f"(layer, head, positions), got {part!r} (the logits and sets are receivers of "
                f"their own)"
            )
        member = _member(part, found)
        key = (member.layer, member.head)
        if key in members:  # the same head twice: its positions together
            member = _union(members[key], member)
        members[key] = member
    return ReceiverSet(tuple(members.values()), joint=True)


def _member(item: object, found: Sequence[Site]) -> Member:
    """One head, ``(layer, head)`` / ``"L1H3"`` or ``(layer, head, positions)``."""
    if isinstance(item, (tuple, list)) and len(item) == 3 and is_int(item[0]) and is_int(item[1]):
        layer, head = resolve_head("receivers item", (item[0], item[1]), found)
        return Member(layer, head, _positions(item, item[2]))
    if isinstance(item, list):  # [1, 3] as (1, 3)
        item = tuple(item)
    if not isinstance(item, (str, tuple)):
        raise TypeError(f"receivers item must be one of {_RECEIVER_FORMS}, got {describe(item)}")
    return Member(*resolve_head("receivers item", item, found))


def _positions(item: object, positions: object) -> tuple[int, ...]:
    """A receiver's positions as given: an int or a non-empty sequence of ints."""
    if is_int(positions):
        return (int(positions),)  # type: ignore[call-overload]
    if (
        isinstance(positions, (str, bytes, Tensor))
        or not isinstance(positions, Sequence)
        or not all(is_int(p) for p in positions)
    ):
        raise TypeError(
            f"receivers item {item!r}: positions must be an int or a sequence of ints, got "
            f"{describe(positions)}"
        )
    if not positions:
        raise ValueError(f"receivers item {item!r}: positions must name at least one, got none")
    return tuple(int(p) for p in positions)


def _union(a: Member, b: Member) -> Member:
    if a.positions is None or b.positions is None:
        return Member(a.layer, a.head)
    return Member(a.layer, a.head, a.positions + b.positions)
