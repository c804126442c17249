"""Edge scores and circuits: what :func:`~multihead.edge_attribution` returns and
:func:`~multihead.faithfulness` takes. Both hold the :class:`~multihead.circuits.graph.Graph`
they were scored on; labels are made from its nodes on demand.

Shapes: N senders, R receivers.
"""

from __future__ import annotations

import heapq
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from multihead._checks import check_choice, check_positive_int, describe
from multihead.circuits.edges.circuit_comparison import CircuitComparison
from multihead.circuits.edges.mib_file import MIBFile
from multihead.circuits.graph import EMBED, RECEIVER_KINDS, Graph, Node, Receiver, Sender
from multihead.mapping import model_map
from multihead.viz.circuit_graph import Arrow, circuit_figure

__all__ = ["METHODS", "Circuit", "EdgeScores", "edge_labels"]

#: how :meth:`EdgeScores.circuit` chooses its edges
METHODS = ("top", "greedy")

Edge = tuple[int, int]  # (sender index, receiver index) in a Graph


def edge_labels(circuit: object) -> tuple[str, ...]:
    """``circuit``, a sequence of edge labels (``"L0H1 -> L1H3.k"``), checked.

    Raises:
        TypeError: not a sequence of strings (named ``circuit``).
    """
    if isinstance(circuit, (str, bytes, Tensor)) or not isinstance(circuit, Sequence):
        raise TypeError(
            f"circuit must be a Circuit (EdgeScores.circuit(n)) or a sequence of edge labels "
            f"('L0H1 -> L1H3.k'), got {describe(circuit)}"
        )
    if not all(isinstance(e, str) for e in circuit):
        raise TypeError(f"circuit's edges must be labels ('L0H1 -> L1H3.k'), got {circuit!r}")
    return tuple(circuit)


@dataclass(frozen=True)
class Circuit:
    """A set of edges of a graph: in a faithfulness run every edge into the graph's receivers
    that is not in the circuit carries the corrupt run's value, and receivers of other kinds
    are left alone.

    Attributes:
        graph: the :class:`~multihead.circuits.graph.Graph` the edges are chosen from.
        indices: the edges, as (sender, receiver) indices into ``graph``; ``len(circuit)`` is
            their number.
        inert_indices: the edges chosen with them and pruned as inert
            (:meth:`EdgeScores.inert`; ``EdgeScores.circuit(n)`` keeps ``n - len(inert)``).
        values: the (N, R) scores the edges were chosen by (``EdgeScores.circuit``, a MIB
            file read by :meth:`from_mib`), which :meth:`compare` ranks every edge by; None
            for a circuit given as labels.
    """

    graph: Graph
    indices: tuple[Edge, ...]
    inert_indices: tuple[Edge, ...] = ()
    values: Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, circuit: object, graph: Graph) -> Circuit:
        """``circuit`` as a circuit: a :class:`Circuit` as it is, or a sequence of edge labels
        (``"L0H1 -> L1H3.k"``) found in ``graph``.

        Raises:
            TypeError: neither.
            ValueError: a label that is not an edge of ``graph``.
        """
        if isinstance(circuit, Circuit):
            return circuit
        return cls(graph, tuple(graph.find(edge_labels(circuit), "circuit's edges")))

    @property
    def edges(self) -> tuple[str, ...]:
        """The edges' labels, ``"L0H1 -> L1H3.k"``."""
        return tuple(self.graph.label(e) for e in self.indices)

    @property
    def inert(self) -> tuple[str, ...]:
        """The labels of the edges pruned as inert."""
        return tuple(self.graph.label(e) for e in self.inert_indices)

    @property
    def nodes(self) -> tuple[tuple[Sender, Receiver], ...]:
        """The edges as (sender, receiver) nodes."""
        return tuple(self.graph.nodes(e) for e in self.indices)

    @property
    def receivers(self) -> tuple[str, ...]:
        """The receiver kinds of the graph (of "q", "k", "v", "mlp", "logits")."""
        return self.graph.kinds

    @property
    def kv(self) -> str:
        """``"query_head"`` or ``"shared"``: what a key/value receiver is (see
        :func:`~multihead.edge_attribution`)."""
        return self.graph.kv

    def __len__(self) -> int:
        return len(self.indices)

    def __repr__(self) -> str:
        pruned = f", {len(self.inert_indices)} inert pruned" if self.inert_indices else ""
        return f"Circuit({len(self)} edges{pruned}; receivers {', '.join(self.receivers)})"

    @classmethod
    def from_mib(cls, path: str | os.PathLike[str], model: Any) -> Circuit:
        """The circuit of a MIB circuit file (its edges with ``in_graph``; ``.json`` or
        ``.pt``: :mod:`~multihead.circuits.edges.mib_file`) on ``model``'s graph, with the
        file's scores as :attr:`values`.

        Raises:
            ValueError: as :meth:`EdgeScores.from_mib`.
        """
        file, graph = _read_mib(path, model)
        values, chosen = file.values_on(graph, repr(str(path)))
        return cls(graph, chosen, values=values)

    def compare(self, reference: Circuit | Sequence[str]) -> CircuitComparison:
        """How this circuit's edges match ``reference``'s (a circuit of the same model, or edge
        labels of this graph), as MIB's ``compare_graphs`` counts them, and the AUROC of
        :attr:`values` (every edge of the graph ranked by ``|score|``) against it.

        Raises:
            TypeError: ``reference`` neither a Circuit nor labels.
            ValueError: an edge of ``reference`` this graph lacks.
        """
        if isinstance(reference, Circuit) and reference.graph != self.graph:
            where = {self.graph.nodes(e): e for e in self.graph.edges}
            lacking = [
                reference.graph.label(e)
                for e in reference.indices
                if reference.graph.nodes(e) not in where
            ]
            if lacking:
                raise ValueError(
                    f"reference's edges must be edges of this circuit's graph, got "
                    f"{lacking[0]!r}"
                    + (f" and {len(lacking) - 1} more" if len(lacking) > 1 else "")
                )
            truth = {where[reference.graph.nodes(e)] for e in reference.indices}
        else:
            truth = set(Circuit.of(reference, self.graph).indices)
        return CircuitComparison.of(self.graph.edges, set(self.indices), truth, self.values)


@dataclass(frozen=True)
class EdgeScores:
    """Every edge's score: the sender's write difference (corrupt - clean) times the gradient of
    the metric at the receiver's input, summed over the batch, positions and the residual width
    (averaged over the integrated-gradient points).

    Attributes:
        graph: the :class:`~multihead.circuits.graph.Graph` scored: its senders and receivers
            in forward order (:attr:`senders` and :attr:`receivers` are their labels).
        values: (N, R), NaN where the sender writes after the receiver reads (no edge).
        clean, corrupt: the metric on the two runs.
        ig_steps: the integrated-gradient points (1: EAP).
    """

    graph: Graph
    values: Tensor
    clean: float
    corrupt: float
    ig_steps: int = 1

    @property
    def senders(self) -> tuple[str, ...]:
        """The senders' labels, in forward order (``"embed"``, ``"L0H1"``, ``"MLP0"``)."""
        return tuple(s.label for s in self.graph.senders)

    @property
    def receivers(self) -> tuple[str, ...]:
        """The receivers' labels, in forward order (``"L1H3.k"``, ``"MLP1"``, ``"logits"``)."""
        return tuple(r.label for r in self.graph.receivers)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The receiver kinds scored."""
        return self.graph.kinds

    @property
    def kv(self) -> str:
        """What a key/value receiver is: ``"query_head"`` or ``"shared"``."""
        return self.graph.kv

    @property
    def labels(self) -> list[str]:
        """Every edge's label, ``"sender -> receiver"``, sender-major."""
        return [self.graph.label(e) for e in self.graph.edges]

    def _ranked(self) -> list[Edge]:
        """Every edge, largest ``|score|`` first (ties in sender-major order)."""
        values = self.values.detach().cpu().tolist()
        return sorted(self.graph.edges, key=lambda e: -abs(values[e[0]][e[1]]))

    def _value(self, edge: Edge) -> float:
        return float(self.values[edge])

    def __len__(self) -> int:
        return len(self.graph.edges)

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` edges with the largest ``|score|``, largest first: ``[(label, score)]``."""
        check_positive_int("n", n)
        values = self.values.detach().cpu().tolist()
        return [(self.graph.label(e), values[e[0]][e[1]]) for e in self._ranked()[:n]]

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
        ranked = self._ranked()
        edges = tuple(ranked[:n]) if method == "top" else self._greedy(ranked, n)
        if not prune:
            return Circuit(self.graph, edges, values=self.values)
        inert = set(self.inert_of(edges))
        kept = tuple(e for e in edges if e not in inert)
        return Circuit(self.graph, kept, tuple(e for e in edges if e in inert), self.values)

    def _greedy(self, ranked: list[Edge], n: int) -> tuple[Edge, ...]:
        """The first ``n`` edges :meth:`circuit`'s greedy search takes from ``ranked`` (every
        edge, largest ``|score|`` first; ties kept in that order)."""
        graph = self.graph
        waiting: dict[Node, list[int]] = {}  # component -> the ranks of the edges into it
        for i, (_, j) in enumerate(ranked):
            for node in graph.feeds(graph.receivers[j]):
                waiting.setdefault(node, []).append(i)
        live: set[Node] = set()
        frontier: list[int] = []  # a heap of ranks: the edges into live components

        def enter(node: Node) -> None:
            for m in _spread(graph, node, live, {}):
                for i in waiting.pop(m, ()):
                    heapq.heappush(frontier, i)

        enter(graph.logits)
        taken: list[int] = []
        chosen: set[int] = set()
        while len(taken) < n and frontier:
            i = heapq.heappop(frontier)
            if i not in chosen:  # a shared key/value receiver is waited on by each query head
                chosen.add(i)
                taken.append(i)
                enter(graph.senders[ranked[i][0]])
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
        found = self.graph.find(edges, "edges")
        return tuple(self.graph.label(e) for e in self.inert_of(found))

    def inert_of(self, edges: Sequence[Edge]) -> tuple[Edge, ...]:
        """:meth:`inert` of edges given as (sender, receiver) indices into :attr:`graph`."""
        graph = self.graph
        into: dict[Node, list[Sender]] = {}  # component -> the senders of its circuit edges
        for i, j in edges:
            for node in graph.feeds(graph.receivers[j]):
                into.setdefault(node, []).append(graph.senders[i])
        reached: set[Node] = {Sender(EMBED)}
        for node in graph.components:  # in stage order: what feeds a node is reached first
            if graph.open(node) or any(s in reached for s in into.get(node, ())):
                reached.add(node)
        live: set[Node] = set()
        _spread(graph, graph.logits, live, into)
        return tuple(
            (i, j)
            for i, j in edges
            if graph.senders[i] not in reached
            or not any(m in live for m in graph.feeds(graph.receivers[j]))
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
        values = self.values.detach().cpu().tolist()
        rows = []
        for i, j in self.graph.edges:
            s, r = self.graph.senders[i].label, self.graph.receivers[j].label
            rows.append({"sender": s, "receiver": r, "edge": f"{s} -> {r}", "score": values[i][j]})
        return rows

    def to_mib(
        self, path: str | os.PathLike[str], circuit: Circuit | Sequence[str] | None = None
    ) -> Path:
        """Write every edge's score in MIB's circuit format (``.json``, or its ``.pt`` twin:
        :mod:`~multihead.circuits.edges.mib_file`), with ``circuit``'s edges (a
        :class:`Circuit` of this graph or edge labels) marked ``in_graph`` (default: none).
        The file is written atomically; returns its path.

        MIB's graph is the whole graph of edge attribution with ``receivers=("q", "k", "v",
        "mlp", "logits")`` (an attention-only model: without "mlp"), every sender and
        ``kv="query_head"``: for GPT-2 small 158 nodes and 32,491 edges. Scores are written as
        they are (summed over the batch; MIB's EAP-IG averages them, the same ranking).

        Raises:
            ValueError: scores of another graph (named), a path not ending in .json or .pt.
            FileNotFoundError: the path's directory does not exist.
        """
        chosen = () if circuit is None else self._indices_of(circuit)
        # the metric of the two runs when known (a file another tool wrote holds none)
        known = {
            k: v for k, v in (("clean", self.clean), ("corrupt", self.corrupt)) if math.isfinite(v)
        }
        extra = {
            **known,
            "ig_steps": self.ig_steps,
            "dtype": str(self.values.dtype).removeprefix("torch."),
            "kinds": list(self.kinds),
        }
        return MIBFile.of(self.graph, self.values, chosen, extra).save(path)

    @classmethod
    def from_mib(cls, path: str | os.PathLike[str], model: Any) -> EdgeScores:
        """The scores of a MIB circuit file (``.json``, or ``.pt`` read with
        ``weights_only=True``) on ``model``'s graph (every sender, receivers q, k, v, mlp,
        logits, ``kv="query_head"``). A file :meth:`to_mib` wrote reads back bit for bit,
        with its clean and corrupt metric; another tool's has NaN for them.

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a MIB circuit file, or one of another model (its config, or edges
                the model's graph lacks or has beyond it: named).
        """
        file, graph = _read_mib(path, model)
        values, _ = file.values_on(graph, repr(str(path)))
        extra = file.extra

        def number(key: str, default: float) -> float:
            value = extra.get(key, default)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"{str(path)!r}: multihead.{key} must be a number, got {value!r}")
            return float(value)

        steps = extra.get("ig_steps", 1)
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(
                f"{str(path)!r}: multihead.ig_steps must be a positive int, got {steps!r}"
            )
        return cls(graph, values, number("clean", math.nan), number("corrupt", math.nan), steps)

    def _indices_of(self, circuit: Circuit | Sequence[str]) -> tuple[Edge, ...]:
        """``circuit``'s edges as indices into this graph."""
        if isinstance(circuit, Circuit) and circuit.graph != self.graph:
            raise ValueError(
                "circuit must be a circuit of these scores' graph (EdgeScores.circuit(n)) or "
                f"edge labels, got one of another graph ({', '.join(circuit.receivers)} "
                f"receivers, kv={circuit.kv!r})"
            )
        return Circuit.of(circuit, self.graph).indices

    def plot(self, n: int = 20, *, prune: bool = True, method: str = "top", **kwargs: Any) -> Any:
        """The circuit of ``n`` edges (:meth:`circuit` by ``method``, pruned of its inert edges
        with ``prune``; at most every edge) as a graph picture (a matplotlib ``Figure``; the
        ``viz`` extra): :func:`multihead.viz.circuit_graph.circuit_figure`."""
        check_positive_int("n", n)
        circuit = self.circuit(min(n, len(self)), prune=prune, method=method)
        if method == "greedy":
            kwargs.setdefault("title", "Circuit: grown greedily from the logits")
        arrows = []
        for edge in circuit.indices:
            s, r = self.graph.nodes(edge)
            arrows.append(Arrow(s.label, r.node_label, r.via, self._value(edge), s.place, r.place))
        return circuit_figure(arrows, **kwargs)

    def __repr__(self) -> str:
        method = "EAP" if self.ig_steps == 1 else f"EAP-IG ({self.ig_steps} steps)"
        return (
            f"EdgeScores({len(self)} edges, {len(self.senders)} senders x "
            f"{len(self.receivers)} receivers, {method}; clean {self.clean:.4g}, corrupt "
            f"{self.corrupt:.4g})"
        )


def _read_mib(path: str | os.PathLike[str], model: Any) -> tuple[MIBFile, Graph]:
    """A MIB file and ``model``'s graph it is read on: every sender, the receiver kinds a
    file multihead wrote names (else all), each query head's keys and values."""
    file = MIBFile.load(path)
    kinds = file.extra.get("kinds")
    if not (isinstance(kinds, list) and kinds and all(k in RECEIVER_KINDS for k in kinds)):
        kinds = list(RECEIVER_KINDS)
    chosen = tuple(k for k in RECEIVER_KINDS if k in kinds)
    return file, Graph.of(model_map(model), chosen, "query_head", caller="a MIB circuit file")


def _spread(
    graph: Graph, node: Node, live: set[Node], into: dict[Node, list[Sender]]
) -> list[Node]:
    """Add to ``live`` ``node`` and every component with a path to it, through circuit edges
    (``into``: component -> the senders of its edges) or through receivers the graph did not
    score (a component reading through one reads every earlier write); returns the components
    added. Components already in ``live`` are not walked again."""
    added: list[Node] = []
    todo = [node]
    while todo:
        m = todo.pop()
        if m in live:
            continue
        live.add(m)
        added.append(m)
        todo.extend(into.get(m, ()))
        if graph.open(m):
            todo.extend(k for k in graph.components if k.stage < m.stage)
    return added
