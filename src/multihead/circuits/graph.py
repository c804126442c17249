"""A model's computational graph as every circuit method names it: what writes into the
residual stream (senders), what reads from it (receivers), and the edges between them.

    senders     Sender("embed")        "embed"    what block 0 is given (token + position
                                                  embeddings)
                Sender("head", l, h)   "L0H1"     a head's write (its output, or its output
                                                  through its slice of the output projection)
                Sender("mlp", l)       "MLP0"     what block l's feed-forward network adds
    receivers   Receiver("q", l, h)    "L1H3.q"   a head's queries (.k keys, .v values): each
                                                  reads the stream through the block's norm;
                                                  with ``shared`` a grouped model's key/value
                                                  head, "L1KV0.k"
                Receiver("mlp", l)     "MLP1"     block l's feed-forward network
                Receiver("logits", L)  "logits"   the final residual stream (L: the depth)

Every node has a **stage**, when it writes or reads: 0 the embeddings, 2l + 1 layer l's heads,
2l + 2 its MLP, 2L + 2 the logits. An edge ``sender -> receiver`` exists when the sender writes
before the receiver reads (``sender.stage < receiver.stage``). A :class:`Graph` is one set of
senders and receivers with the head counts that say which query heads a shared key/value
receiver feeds; labels are made from the nodes on demand and looked up (never parsed) when a
user gives one.

Edge attribution, faithfulness, path patching and QK attribution all name their ends with these
types.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from multihead.heads import head_label, mlp_label
from multihead.map_types import ModelMap

__all__ = ["EMBED", "KV_MODES", "LOGITS", "RECEIVER_KINDS", "Graph", "Node", "Receiver", "Sender"]

EMBED = "embed"
LOGITS = "logits"
RECEIVER_KINDS = ("q", "k", "v", "mlp", "logits")
KV_MODES = ("query_head", "shared")


@dataclass(frozen=True)
class Sender:
    """``kind`` "embed", "head" or "mlp"; ``layer`` (-1 for the embeddings), ``head``."""

    kind: str
    layer: int = -1
    head: int = 0

    @property
    def label(self) -> str:
        """``"embed"``, ``"L0H1"`` or ``"MLP0"``."""
        if self.kind == EMBED:
            return EMBED
        return head_label(self.layer, self.head) if self.kind == "head" else mlp_label(self.layer)

    @property
    def shown(self) -> str:
        """As errors write it: ``(0, 1)``, ``'MLP3'`` or ``'embed'``."""
        return str((self.layer, self.head)) if self.kind == "head" else repr(self.label)

    @property
    def stage(self) -> int:
        """When it writes: 0 the embeddings, 2l + 1 layer l's heads, 2l + 2 its MLP."""
        return 0 if self.kind == EMBED else 2 * self.layer + (1 if self.kind == "head" else 2)

    @property
    def place(self) -> tuple[float, float]:
        """(row, order in the row) in a picture of the graph: the stage, then the head."""
        return float(self.stage), float(self.head if self.kind == "head" else 0)


@dataclass(frozen=True)
class Receiver:
    """``kind`` one of q, k, v (``head`` a query head, or with ``shared`` a key/value head),
    "mlp" or "logits" (``layer`` the model's depth)."""

    kind: str
    layer: int
    head: int = 0
    shared: bool = False

    @property
    def label(self) -> str:
        """``"L1H3.k"``, ``"L1KV0.k"``, ``"MLP1"`` or ``"logits"``."""
        if self.kind == LOGITS:
            return LOGITS
        if self.kind == "mlp":
            return mlp_label(self.layer)
        return f"{self.node_label}.{self.kind}"

    @property
    def node_label(self) -> str:
        """The label of the node that reads: ``"L1H3"``, ``"L1KV0"``, ``"MLP1"``, ``"logits"``."""
        if self.kind in (LOGITS, "mlp"):
            return self.label
        if self.shared and self.kind != "q":
            return f"L{self.layer}KV{self.head}"
        return head_label(self.layer, self.head)

    @property
    def via(self) -> str:
        """The input read: "q", "k" or "v"; "" for an MLP or the logits."""
        return self.kind if self.kind in ("q", "k", "v") else ""

    @property
    def stage(self) -> int:
        """When it reads: layer l's heads at 2l + 1 (before they write), its MLP at 2l + 2."""
        return 2 * self.layer + (2 if self.kind in ("mlp", LOGITS) else 1)

    @property
    def place(self) -> tuple[float, float]:
        """(row, order in the row) in a picture of the graph (:attr:`Sender.place`)."""
        return float(self.stage), float(self.head if self.via else 0)


#: a component of the graph: a sender, or the logits' receiver
Node = Sender | Receiver


@dataclass(frozen=True)
class Graph:
    """One set of senders and receivers, in forward order, and what they make.

    Attributes:
        senders, receivers: the nodes.
        kinds: the receiver kinds the graph holds (of :data:`RECEIVER_KINDS`); a component
            reading through a kind not held reads the run's stream unchanged.
        kv: ``"query_head"`` or ``"shared"``: what a key/value receiver is.
        heads: per layer, (query heads, key/value heads): the model's depth, and which query
            heads a shared key/value receiver feeds.
        mlps: the layers whose block has a feed-forward network.
        width: E, the residual stream's width (0 when the map does not know it).
    """

    senders: tuple[Sender, ...]
    receivers: tuple[Receiver, ...]
    kinds: tuple[str, ...]
    kv: str
    heads: tuple[tuple[int, int], ...]
    mlps: tuple[int, ...] = ()
    width: int = 0

    @classmethod
    def of(
        cls,
        mapped: ModelMap,
        kinds: Sequence[str],
        kv: str,
        senders: Sequence[Sender] | None = None,
        *,
        caller: str,
    ) -> Graph:
        """The graph of a model's map: ``senders`` (default: every sender, in forward order)
        and every receiver of ``kinds``, in forward order (a shared key/value receiver per
        key/value head with ``kv="shared"``).

        Raises:
            ValueError: a map that is not a stack of one attention layer per block (named
                ``caller``).
        """
        mlps = tuple(
            layer
            for layer in range(mapped.num_layers)
            if mapped.stack_block(layer, caller).mlp is not None
        )
        heads = tuple((site.num_heads, site.num_kv_heads) for site in mapped.sites)
        receivers: list[Receiver] = []
        shared = kv == "shared"
        for layer, (h, hk) in enumerate(heads):
            for kind in ("q", "k", "v"):
                if kind in kinds:
                    count = hk if shared and kind != "q" else h
                    receivers += [Receiver(kind, layer, i, shared) for i in range(count)]
            if layer in mlps and "mlp" in kinds:
                receivers.append(Receiver("mlp", layer))
        if LOGITS in kinds:
            receivers.append(Receiver(LOGITS, mapped.num_layers))
        every = _every_sender(heads, mlps)
        chosen = every if senders is None else tuple(senders)
        return cls(chosen, tuple(receivers), tuple(kinds), kv, heads, mlps, mapped.width or 0)

    @property
    def whole(self) -> bool:
        """Whether the graph holds every sender of its model, in forward order."""
        return self.senders == _every_sender(self.heads, self.mlps)

    @cached_property
    def edges(self) -> tuple[tuple[int, int], ...]:
        """Every edge as (sender index, receiver index), sender-major."""
        return tuple(
            (i, j)
            for i, s in enumerate(self.senders)
            for j, r in enumerate(self.receivers)
            if s.stage < r.stage
        )

    def label(self, edge: tuple[int, int]) -> str:
        """``"L0H1 -> L1H3.k"``."""
        return f"{self.senders[edge[0]].label} -> {self.receivers[edge[1]].label}"

    def nodes(self, edge: tuple[int, int]) -> tuple[Sender, Receiver]:
        return self.senders[edge[0]], self.receivers[edge[1]]

    @cached_property
    def by_label(self) -> dict[str, tuple[int, int]]:
        """Every edge's label -> the edge: how a label a user gives is found."""
        return {self.label(e): e for e in self.edges}

    def find(self, labels: Sequence[str], name: str) -> list[tuple[int, int]]:
        """The edges of ``labels`` (``name`` names the argument in errors).

        Raises:
            ValueError: a label that is not an edge of this graph.
        """
        unknown = [e for e in labels if e not in self.by_label]
        if unknown:
            raise ValueError(
                f"{name} must be edges of this graph ('sender -> receiver', e.g. "
                f"{next(iter(self.by_label), '')!r}), got {unknown[0]!r}"
                + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else "")
            )
        return [self.by_label[e] for e in labels]

    # -- components: what a receiver feeds, who reads through an unscored kind -----------------

    def feeds(self, receiver: Receiver) -> list[Node]:
        """The components a receiver feeds: its head (a shared key/value head: its group of
        query heads), its MLP, or the logits."""
        if receiver.kind == LOGITS:
            return [receiver]
        if receiver.kind == "mlp":
            return [Sender("mlp", receiver.layer)]
        if not receiver.shared or receiver.kind == "q":
            return [Sender("head", receiver.layer, receiver.head)]
        heads, kv_heads = self.heads[receiver.layer]
        size = heads // kv_heads
        h = receiver.head
        return [Sender("head", receiver.layer, g) for g in range(h * size, (h + 1) * size)]

    @cached_property
    def components(self) -> tuple[Node, ...]:
        """Every component, in stage order: the senders, the heads and MLPs that only receive,
        the logits."""
        found: dict[Node, None] = {Sender(EMBED): None}
        for s in self.senders:
            found[s] = None
        for r in self.receivers:
            for node in self.feeds(r):
                found[node] = None
        found[self.logits] = None
        return tuple(sorted(found, key=lambda n: (n.stage, n.place[1])))

    @property
    def logits(self) -> Receiver:
        """The logits' receiver (and component): it reads after every layer."""
        return Receiver(LOGITS, len(self.heads))

    def open(self, node: Node) -> bool:
        """Whether ``node`` reads through a receiver kind the graph does not hold (so reads
        every earlier write unchanged)."""
        if isinstance(node, Receiver):
            return LOGITS not in self.kinds
        if node.kind == "mlp":
            return "mlp" not in self.kinds
        return node.kind == "head" and not {"q", "k", "v"} <= set(self.kinds)


def _every_sender(heads: Sequence[tuple[int, int]], mlps: Sequence[int]) -> tuple[Sender, ...]:
    """Every sender of a model with ``heads`` per layer and feed-forward networks in ``mlps``,
    in forward order: the embeddings, then each layer's heads and its MLP."""
    every = [Sender(EMBED)]
    for layer, (h, _) in enumerate(heads):
        every += [Sender("head", layer, i) for i in range(h)]
        if layer in mlps:
            every.append(Sender("mlp", layer))
    return tuple(every)
