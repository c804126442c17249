"""Edge scores and circuits: what :func:`~multihead.edge_attribution` returns and
:func:`~multihead.faithfulness` takes.

Shapes: N senders, R receivers.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from multihead._checks import check_choice, check_positive_int, describe
from multihead.circuits.edges.edge_graph import EMBED, LOGITS
from multihead.viz.circuit_graph import circuit_figure

__all__ = ["METHODS", "Circuit", "EdgeScores", "circuit_edges"]

#: how :meth:`EdgeScores.circuit` chooses its edges
METHODS = ("top", "greedy")


@dataclass(frozen=True)
class Circuit:
    """A set of edges, written ``"L0H1 -> L1H3.k"``, and the receivers of the graph they were
    chosen from: in a faithfulness run every edge into those receivers that is not in the
    circuit carries the corrupt run's value, and receivers of other kinds are left alone.

    Attributes:
        edges: the edges' labels; ``len(circuit)`` is their number.
        receivers: the receiver kinds of the graph (of "q", "k", "v", "mlp", "logits").
        kv: ``"query_head"`` or ``"shared"``: what a key/value receiver is (see
            :func:`~multihead.edge_attribution`).
        inert: the edges chosen with them and pruned as inert
            (:meth:`EdgeScores.inert`; ``EdgeScores.circuit(n)`` keeps ``n - len(inert)``).
    """

    edges: tuple[str, ...]
    receivers: tuple[str, ...] = ("q", "k", "v", "logits")
    kv: str = "query_head"
    inert: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.edges)

    def __repr__(self) -> str:
        pruned = f", {len(self.inert)} inert pruned" if self.inert else ""
        return f"Circuit({len(self.edges)} edges{pruned}; receivers {', '.join(self.receivers)})"


@dataclass(frozen=True)
class EdgeScores:
    """Every edge's score: the sender's write difference (corrupt - clean) times the gradient of
    the metric at the receiver's input, summed over the batch, positions and the residual width
    (averaged over the integrated-gradient points).

    Attributes:
        senders: the senders' labels, in forward order (``"embed"``, ``"L0H1"``, ``"MLP0"``).
        receivers: the receivers' labels, in forward order (``"L1H3.k"``, ``"MLP1"``,
            ``"logits"``).
        values: (N, R), NaN where the sender writes after the receiver reads (no edge).
        clean, corrupt: the metric on the two runs.
        ig_steps: the integrated-gradient points (1: EAP).
        kinds: the receiver kinds scored; kv: what a key/value receiver is.
    """

    senders: tuple[str, ...]
    receivers: tuple[str, ...]
    values: Tensor
    clean: float
    corrupt: float
    ig_steps: int = 1
    kinds: tuple[str, ...] = ("q", "k", "v", "logits")
    kv: str = "query_head"

    @property
    def labels(self) -> list[str]:
        """Every edge's label, ``"sender -> receiver"``, sender-major."""
        return [label for label, _ in self._edges()]

    def _edges(self) -> list[tuple[str, float]]:
        values = self.values.detach().cpu().tolist()
        return [
            (f"{s} -> {r}", values[i][j])
            for i, s in enumerate(self.senders)
            for j, r in enumerate(self.receivers)
            if values[i][j] == values[i][j]  # not NaN: an edge
        ]

    def __len__(self) -> int:
        return int((~self.values.isnan()).sum())

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` edges with the largest ``|score|``, largest first: ``[(label, score)]``."""
        check_positive_int("n", n)
        return sorted(self._edges(), key=lambda e: -abs(e[1]))[:n]

    def circuit(self, n: int, *, prune: bool = True, method: str = "top") -> Circuit:
        """``n`` edges as a :class:`Circuit`, what :func:`~multihead.faithfulness` takes; with
        ``prune`` (the default) without those of them that are inert (:meth:`inert`), which
        ``circuit.inert`` lists.

        ``method="top"`` takes the ``n`` edges of largest ``|score|``, wherever they lie.
        ``method="greedy"`` grows the circuit from the logits (EAP-IG's ``apply_greedy``,
        ``absolute=True``): it takes, ``n`` times, the edge of largest ``|score|`` among those
        whose receiver's component is already in the circuit: the logits, or a head (through
        any of its q, k, v; with ``kv="shared"`` any query head of the key/value group) or MLP
        that an edge taken before sends from, or one that reads through a receiver kind the
        graph did not score from a component in the circuit (it reads every earlier write).
        Every edge it takes has a path to the logits, so pruning removes only those whose
        sender no path reaches from the embeddings.

        Pruning is the default because it changes nothing a circuit run computes (the
        faithfulness of the pruned circuit is the ``n`` edges', up to rounding: see
        :meth:`inert`) while ``len(circuit)`` becomes the number of edges the circuit really
        uses, the size a circuit should be judged by (EAP-IG and the MIB benchmark prune too).
        ``prune=False`` gives the ``n`` edges exactly (for ``"top"`` as :meth:`top` lists them).

        Raises:
            ValueError: ``n`` out of [0, edges], ``method`` not ``"top"`` or ``"greedy"``, or
                with ``"greedy"`` more than the edges that have a path to the logits (all of
                them unless ``edge_attribution`` was given fewer ``senders``).
            TypeError: ``prune`` not a bool.
        """
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(self):
            raise ValueError(f"n must be an int in [0, {len(self)}] (the edges), got {n!r}")
        if not isinstance(prune, bool):
            raise TypeError(f"prune must be True or False, got {describe(prune)}")
        check_choice("method", method, METHODS)
        ranked = [label for label, _ in self.top(len(self))] if len(self) else []
        edges = tuple(ranked[:n]) if method == "top" else self._greedy(ranked, n)
        if not prune:
            return Circuit(edges, self.kinds, self.kv)
        inert = set(self.inert(edges))
        kept = tuple(e for e in edges if e not in inert)
        return Circuit(kept, self.kinds, self.kv, tuple(e for e in edges if e in inert))

    def _greedy(self, ranked: list[str], n: int) -> tuple[str, ...]:
        """The first ``n`` edges :meth:`circuit`'s greedy search takes from ``ranked`` (every
        edge, largest ``|score|`` first; ties kept in that order)."""
        graph = _Nodes(self.senders, self.receivers, self.kinds)
        pairs = [label.split(" -> ") for label in ranked]
        waiting: dict[str, list[int]] = {}  # component -> the ranks of the edges into it
        for i, (_, r) in enumerate(pairs):
            for node in graph.of(r):
                waiting.setdefault(node, []).append(i)
        live: set[str] = set()
        frontier: list[int] = []  # a heap of ranks: the edges into live components

        def enter(node: str) -> None:
            for m in graph.spread(node, live, {}):
                for i in waiting.pop(m, ()):
                    heapq.heappush(frontier, i)

        enter(LOGITS)
        taken: list[int] = []
        chosen: set[int] = set()
        while len(taken) < n and frontier:
            i = heapq.heappop(frontier)
            if i not in chosen:  # a shared key/value receiver is waited on by each query head
                chosen.add(i)
                taken.append(i)
                enter(pairs[i][0])
        if len(taken) < n:
            raise ValueError(
                f"n must be at most {len(taken)} with method='greedy': only {len(taken)} of the "
                f"{len(self)} edges have a path to the logits (edge_attribution was given fewer "
                f"senders), got {n}"
            )
        return tuple(ranked[i] for i in taken)

    def inert(self, edges: Sequence[str]) -> tuple[str, ...]:
        """The edges of ``edges`` (labels of this graph's edges) that are inert in the circuit
        they make, in their order: those whose sender no path of the circuit's edges reaches
        from the embeddings, or whose receiver's component has no path of them to the logits.

        A component is a node: a head is reached when any of its q, k, v receives a reached
        edge (with ``kv="shared"`` a key/value receiver feeds every query head of its group), a
        feed-forward network likewise; the embeddings are the source. Receiver kinds the graph
        did not score read the run's stream unchanged, so a component reading through one is
        always reached and every earlier sender always has an edge into it (and every sender
        one to the logits when they are not scored).

        Dropping them leaves the circuit run as it was: a component no kept edge reaches reads
        the corrupt run's stream through every input, so it writes what it writes in the corrupt
        run, which is what a cut edge carries; and what a component with no path to the logits
        writes is read by no kept edge on the way there.

        Raises:
            TypeError, ValueError: ``edges`` not a sequence of this graph's edge labels.
        """
        if isinstance(edges, (str, bytes, Tensor)) or not isinstance(edges, Sequence):
            raise TypeError(
                f"edges must be a sequence of edge labels ('L0H1 -> L1H3.k'), got {describe(edges)}"
            )
        known = set(self.labels)
        unknown = [e for e in edges if e not in known]
        if unknown:
            raise ValueError(
                f"edges must be edges of this graph ('sender -> receiver', e.g. "
                f"{next(iter(self.labels), '')!r}), got {unknown[0]!r}"
                + (f" and {len(unknown) - 1} more" if len(unknown) > 1 else "")
            )
        pairs = [e.split(" -> ") for e in edges]
        graph = _Nodes(self.senders, self.receivers, self.kinds)
        into: dict[str, list[str]] = {}  # component -> the senders of its circuit edges
        for s, r in pairs:
            for node in graph.of(r):
                into.setdefault(node, []).append(s)
        order = sorted(graph.stages, key=graph.stages.__getitem__)
        reached = {EMBED}
        for node in order:
            if node in graph.open or any(s in reached for s in into.get(node, ())):
                reached.add(node)
        live: set[str] = set()
        graph.spread(LOGITS, live, into)
        return tuple(
            e
            for e, (s, r) in zip(edges, pairs, strict=True)
            if s not in reached or not any(m in live for m in graph.of(r))
        )

    def score(self, sender: str, receiver: str) -> float:
        """One edge's score, by its sender's and receiver's labels."""
        try:
            i, j = self.senders.index(sender), self.receivers.index(receiver)
        except ValueError:
            raise KeyError(
                f"no edge {sender!r} -> {receiver!r}: senders are {list(self.senders)[:4]}..., "
                f"receivers {list(self.receivers)[:4]}..."
            ) from None
        return float(self.values[i, j])

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per edge (sender, receiver, edge, score), sender-major: a table's rows."""
        rows = []
        values = self.values.detach().cpu().tolist()
        for i, s in enumerate(self.senders):
            for j, r in enumerate(self.receivers):
                v = values[i][j]
                if v == v:
                    rows.append({"sender": s, "receiver": r, "edge": f"{s} -> {r}", "score": v})
        return rows

    def plot(self, n: int = 20, *, prune: bool = True, method: str = "top", **kwargs: Any) -> Any:
        """The circuit of ``n`` edges (:meth:`circuit` by ``method``, pruned of its inert edges
        with ``prune``; at most every edge) as a graph picture (a matplotlib ``Figure``; the
        ``viz`` extra): :func:`multihead.viz.circuit_graph.circuit_figure`."""
        check_positive_int("n", n)
        circuit = self.circuit(min(n, len(self)), prune=prune, method=method)
        if method == "greedy":
            kwargs.setdefault("title", "Circuit: grown greedily from the logits")
        edges = [(e, self.score(*e.split(" -> "))) for e in circuit.edges]
        return circuit_figure(edges, **kwargs)

    def __repr__(self) -> str:
        method = "EAP" if self.ig_steps == 1 else f"EAP-IG ({self.ig_steps} steps)"
        return (
            f"EdgeScores({len(self)} edges, {len(self.senders)} senders x "
            f"{len(self.receivers)} receivers, {method}; clean {self.clean:.4g}, corrupt "
            f"{self.corrupt:.4g})"
        )


_HEAD_RECEIVER = re.compile(r"L(\d+)(H|KV)(\d+)\.([qkv])")
_HEAD = re.compile(r"L(\d+)H(\d+)")


class _Nodes:
    """The components of an :class:`EdgeScores` graph, named by their sender labels ("embed",
    "L0H1", "MLP0") and "logits": when each writes (``stages``: 0 the embeddings, 2l + 1 layer
    l's heads, 2l + 2 its MLP) and reads (``reads``), which read through a receiver kind the
    graph did not score (``open``), and which components a receiver feeds (:meth:`of`)."""

    def __init__(self, senders: Sequence[str], receivers: Sequence[str], kinds: Sequence[str]):
        heads: dict[int, set[int]] = {}
        self.queries: dict[int, int] = {}  # layer -> its q receivers (query heads)
        self.kv_heads: dict[int, set[int]] = {}  # layer -> its shared key/value heads
        self.stages: dict[str, int] = {EMBED: 0}
        for label in (*senders, *receivers):
            head, receiver = _HEAD.fullmatch(label), _HEAD_RECEIVER.fullmatch(label)
            if head:
                heads.setdefault(int(head[1]), set()).add(int(head[2]))
            elif receiver and receiver[2] == "H":
                heads.setdefault(int(receiver[1]), set()).add(int(receiver[3]))
                if receiver[4] == "q":
                    self.queries[int(receiver[1])] = self.queries.get(int(receiver[1]), 0) + 1
            elif receiver:
                self.kv_heads.setdefault(int(receiver[1]), set()).add(int(receiver[3]))
            elif label.startswith("MLP"):
                self.stages[label] = 2 * int(label[3:]) + 2
        self.heads = {layer: sorted(hs) for layer, hs in heads.items()}
        self.stages.update(
            {f"L{layer}H{h}": 2 * layer + 1 for layer, hs in heads.items() for h in hs}
        )
        self.reads = {n: stage for n, stage in self.stages.items() if n != EMBED}
        self.reads[LOGITS] = max(self.stages.values()) + 1
        self.open = {
            n
            for n in self.reads
            if (n == LOGITS and LOGITS not in kinds)
            or (n.startswith("MLP") and "mlp" not in kinds)
            or (_HEAD.fullmatch(n) is not None and not {"q", "k", "v"} <= set(kinds))
        }

    def spread(self, node: str, live: set[str], into: dict[str, list[str]]) -> list[str]:
        """Add to ``live`` ``node`` and every component with a path to it, through circuit
        edges (``into``: component -> the senders of its edges) or through receivers the
        graph did not score (a component reading through one reads every earlier write);
        returns the components added. Components already in ``live`` are not walked again."""
        added, todo = [], [node]
        while todo:
            m = todo.pop()
            if m in live:
                continue
            live.add(m)
            added.append(m)
            todo.extend(into.get(m, ()))
            if m in self.open:
                todo.extend(k for k, stage in self.stages.items() if stage < self.reads[m])
        return added

    def of(self, receiver: str) -> list[str]:
        """The components a receiver feeds: its head (a shared key/value head's query heads,
        or with no q receivers to count them by, every head of its layer), MLP or the logits."""
        m = _HEAD_RECEIVER.fullmatch(receiver)
        if m is None:
            return [receiver]
        layer, head = int(m[1]), int(m[3])
        if m[2] == "H":
            return [f"L{layer}H{head}"]
        if layer not in self.queries:
            return [f"L{layer}H{h}" for h in self.heads.get(layer, ())]
        size = self.queries[layer] // len(self.kv_heads[layer])
        return [f"L{layer}H{h}" for h in range(head * size, (head + 1) * size)]


def circuit_edges(circuit: object) -> Circuit:
    """``circuit`` as a :class:`Circuit`: one, or a sequence of edge labels (of the default
    graph: q, k, v and the logits as receivers)."""
    if isinstance(circuit, Circuit):
        return circuit
    if isinstance(circuit, (str, bytes, Tensor)) or not isinstance(circuit, Sequence):
        raise TypeError(
            f"circuit must be a Circuit (EdgeScores.circuit(n)) or a sequence of edge labels "
            f"('L0H1 -> L1H3.k'), got {describe(circuit)}"
        )
    if not all(isinstance(e, str) for e in circuit):
        raise TypeError(f"circuit's edges must be labels ('L0H1 -> L1H3.k'), got {circuit!r}")
    return Circuit(tuple(circuit))
