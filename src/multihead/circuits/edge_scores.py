"""Edge scores and circuits: what :func:`~multihead.edge_attribution` returns and
:func:`~multihead.faithfulness` takes.

Shapes: N senders, R receivers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from multihead._checks import check_positive_int, describe
from multihead.viz.circuit_graph import circuit_figure

__all__ = ["Circuit", "EdgeScores", "circuit_edges"]


@dataclass(frozen=True)
class Circuit:
    """A set of edges, written ``"L0H1 -> L1H3.k"``, and the receivers of the graph they were
    chosen from: in a faithfulness run every edge into those receivers that is not in the
    circuit carries the corrupt run's value, and receivers of other kinds are left alone.

    Attributes:
        edges: the edges' labels.
        receivers: the receiver kinds of the graph (of "q", "k", "v", "mlp", "logits").
        kv: ``"query_head"`` or ``"shared"``: what a key/value receiver is (see
            :func:`~multihead.edge_attribution`).
    """

    edges: tuple[str, ...]
    receivers: tuple[str, ...] = ("q", "k", "v", "logits")
    kv: str = "query_head"

    def __len__(self) -> int:
        return len(self.edges)


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

    def circuit(self, n: int) -> Circuit:
        """The top ``n`` edges (by ``|score|``) as a :class:`Circuit`, what
        :func:`~multihead.faithfulness` takes."""
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(self):
            raise ValueError(f"n must be an int in [0, {len(self)}] (the edges), got {n!r}")
        edges = tuple(label for label, _ in self.top(len(self))[:n]) if n else ()
        return Circuit(edges, self.kinds, self.kv)

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

    def plot(self, n: int = 20, **kwargs: Any) -> Any:
        """The top ``n`` edges as a graph picture (a matplotlib ``Figure``; the ``viz``
        extra): :func:`multihead.viz.circuit_graph.circuit_figure`."""
        return circuit_figure(self.top(n), **kwargs)

    def __repr__(self) -> str:
        method = "EAP" if self.ig_steps == 1 else f"EAP-IG ({self.ig_steps} steps)"
        return (
            f"EdgeScores({len(self)} edges, {len(self.senders)} senders x "
            f"{len(self.receivers)} receivers, {method}; clean {self.clean:.4g}, corrupt "
            f"{self.corrupt:.4g})"
        )


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
