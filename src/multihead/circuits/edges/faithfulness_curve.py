"""The faithfulness curve: the faithfulness of a method's circuits of n edges (the top n, or
the greedy search's n: :meth:`~multihead.EdgeScores.circuit`) over circuit
sizes n, against random circuits of the same sizes (:func:`~multihead.faithfulness` each).

The areas are taken over the fraction of the graph's edges (0 … 1), so a method whose top
edges carry the behaviour early has a larger area than random circuits, which carry it only
when they hold most edges. With ``prune`` (the default) every circuit, top-n or random, is
pruned of its inert edges (:meth:`~multihead.circuits.edges.edge_scores.EdgeScores.inert`: its
faithfulness is unchanged) and counted by the edges it keeps: the x axis is the pruned size.

The Mechanistic Interpretability Benchmark (MIB, circuit-localization track) reads the curve at
its ten edge fractions (:data:`MIB_FRACTIONS`; ``sizes="mib"``: the top ``int(f · edges)``
edges, pruned) and scores it by two areas over those fractions (trapezoids on a linear axis,
as its ``evaluate_area_under_curve`` takes them)::

    CPR = Σ_i (f_{i+1} - f_i) (F_i + F_{i+1}) / 2                    higher is better
    CMD = Σ_i (f_{i+1} - f_i) (|1 - F_i| + |1 - F_{i+1}|) / 2        lower is better

with F the faithfulness (the empty circuit 0, the clean run 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import nn

from multihead._checks import check_choice, check_non_negative_int, describe
from multihead.circuits.edges.edge_scores import METHODS, Circuit, EdgeScores
from multihead.circuits.edges.faithfulness import CircuitRuns
from multihead.circuits.runs.experiment import Experiment
from multihead.circuits.runs.metric import Metric
from multihead.viz.circuit_graph import faithfulness_figure

__all__ = ["MIB_FRACTIONS", "FaithfulnessCurve", "default_sizes", "faithfulness_curve", "mib_sizes"]

#: the fractions of the graph's edges MIB reads a faithfulness curve at
MIB_FRACTIONS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass(frozen=True)
class FaithfulnessCurve:
    """Faithfulness of the circuits of n edges over n, beside random circuits of n edges.

    Attributes:
        sizes: the n chosen (the method's and random edges), increasing, from 0 to every edge.
        values: the method's circuit's faithfulness at each n.
        edges: the method's circuit's edges at each n, after pruning its inert ones when
            ``pruned`` (else ``sizes``): the x axis.
        random: the mean faithfulness of ``draws`` random circuits of n edges (uniform over
            the graph's edges); empty with ``draws=0``.
        random_edges: their mean number of edges after pruning when ``pruned`` (else
            ``sizes``): the random curve's x axis.
        total: every edge of the graph.
        pruned: whether the circuits were pruned of their inert edges.
        method: how the circuits were chosen (``EdgeScores.circuit``'s ``method``: ``"top"``
            or ``"greedy"``).
        area, random_area: the areas under the two curves over the fraction of edges (their x
            axes over ``total``, 0 … 1, trapezoids).
    """

    sizes: tuple[int, ...]
    values: tuple[float, ...]
    edges: tuple[int, ...]
    random: tuple[float, ...]
    random_edges: tuple[float, ...]
    total: int
    clean: float
    corrupt: float
    pruned: bool = True
    method: str = "top"

    @property
    def area(self) -> float:
        return _area(self.edges, self.values, self.total)

    @property
    def random_area(self) -> float:
        return _area(self.random_edges, self.random, self.total)

    @property
    def cpr(self) -> float:
        """MIB's CPR: the area under the faithfulness at :data:`MIB_FRACTIONS` of the edges
        (module docstring); higher is better.

        Raises:
            ValueError: a curve without MIB's sizes (take it with ``sizes="mib"``).
        """
        return _trapezoids(MIB_FRACTIONS, self._at_mib_sizes("cpr"))

    @property
    def cmd(self) -> float:
        """MIB's CMD: the area between the faithfulness at :data:`MIB_FRACTIONS` of the edges
        and 1 (module docstring); lower is better.

        Raises:
            ValueError: a curve without MIB's sizes (take it with ``sizes="mib"``).
        """
        return _trapezoids(MIB_FRACTIONS, [abs(1.0 - v) for v in self._at_mib_sizes("cmd")])

    def _at_mib_sizes(self, what: str) -> list[float]:
        at = dict(zip(self.sizes, self.values, strict=True))
        wanted = mib_sizes(self.total)
        missing = sorted({n for n in wanted if n not in at})
        if missing:
            raise ValueError(
                f"{what} reads the faithfulness at MIB's sizes (the top int(f * {self.total}) "
                f"edges for f in {MIB_FRACTIONS}); this curve lacks {missing}: take it with "
                f"sizes='mib'"
            )
        return [at[n] for n in wanted]

    def smallest(self, reach: float = 0.9) -> int | None:
        """The fewest edges (``edges``: after pruning when ``pruned``) of the method's circuits
        that reach ``reach``, or None."""
        return next((e for e, v in zip(self.edges, self.values, strict=True) if v >= reach), None)

    def plot(self, *, title: str | None = None, other: FaithfulnessCurve | None = None,
             labels: tuple[str, str] | None = None) -> Any:  # fmt: skip
        """The curves (a matplotlib ``Figure``; the ``viz`` extra): faithfulness against the
        fraction of edges, this curve, ``other`` (another method's) and the random circuits'.
        ``labels`` name the first two (default: this curve's method, "top edges" or "greedy
        circuits", and "other")."""
        if labels is None:
            labels = ("greedy circuits" if self.method == "greedy" else "top edges", "other")
        curves: list[tuple[str, Sequence[float], Sequence[float]]] = [
            (labels[0], self.edges, self.values)
        ]
        if other is not None:
            curves.append((labels[1], other.edges, other.values))
        if self.random:
            curves.append(("random circuits", self.random_edges, self.random))
        return faithfulness_figure(curves, self.total, title=title)


def mib_sizes(total: int) -> list[int]:
    """The circuit sizes MIB reads a curve of ``total`` edges at: ``int(f * total)`` for each of
    :data:`MIB_FRACTIONS`, in order (repeats on a small graph kept)."""
    return [int(f * total) for f in MIB_FRACTIONS]


def _area(sizes: Sequence[float], values: Sequence[float], total: int) -> float:
    return _trapezoids([n / total for n in sizes], values)


def _trapezoids(x: Sequence[float], y: Sequence[float]) -> float:
    """The area under ``y`` over ``x`` by trapezoids (as MIB's ``evaluate_area_under_curve``
    sums them)."""
    return sum((x2 - x1) * ((y[i] + y[i + 1]) / 2) for i, (x1, x2) in enumerate(pairwise(x)))


def default_sizes(total: int) -> list[int]:
    """0, every edge, the fractions 1, 2, 5, 10, 15, 20, 30, 50, 75 % of them, and on a large
    graph (a model's circuits are a few hundred of its tens of thousands of edges) the sizes
    10, 20, 50, 100, 200, 500, … below 1 %."""
    fractions = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)
    small = [m * 10**p for p in range(1, len(str(total))) for m in (1, 2, 5)]
    return sorted(
        {
            0,
            total,
            *(max(1, round(f * total)) for f in fractions),
            *(n for n in small if n < 0.01 * total),
        }
    )


def faithfulness_curve(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    scores: EdgeScores | None = None,
    *,
    sizes: Sequence[int] | str | None = None,
    draws: int = 5,
    seed: int = 0,
    prune: bool = True,
    method: str = "top",
) -> FaithfulnessCurve:
    """:func:`faithfulness` of ``scores``' circuit of n edges for each n (the top n, or the
    greedy search's: ``method``), and of ``draws`` random circuits of n edges (one random order
    of the edges per draw, its first n edges).

    Args:
        scores: :func:`~multihead.edge_attribution`'s result on the same inputs.
        sizes: the n (default :func:`default_sizes`: 0 to every edge), or ``"mib"``: MIB's
            (:func:`mib_sizes`), which :attr:`FaithfulnessCurve.cpr` and ``cmd`` read (any
            curve holding them can give both).
        draws: random circuits per n (0: none); seed: their generator's seed.
        prune: prune every circuit of its inert edges and count it by the edges it keeps
            (``EdgeScores.circuit(n)``'s default, and for the same reason: the values do not
            change, the sizes become the edges a circuit uses); False: the top n edges as they
            are, counted as n.
        method: ``"top"`` (the n edges of largest ``|score|``) or ``"greedy"`` (grown from the
            logits: ``EdgeScores.circuit``); the random circuits are the same for both.

    Raises:
        ValueError: sizes out of [0, edges] or a string other than "mib", draws < 0, method
            not "top" or "greedy", and as :func:`faithfulness`.
        TypeError: prune not a bool.
    """
    check_non_negative_int("draws", draws)
    if isinstance(sizes, str) and sizes != "mib":
        raise ValueError(f"sizes must be circuit sizes or 'mib', got {sizes!r}")
    if not isinstance(prune, bool):
        raise TypeError(f"prune must be True or False, got {describe(prune)}")
    check_choice("method", method, METHODS)
    if not isinstance(scores, EdgeScores):
        raise TypeError(
            f"scores must be the EdgeScores of edge_attribution, got {describe(scores)}"
        )
    runs = CircuitRuns.of(model, clean, corrupt, metric, scores.kinds, scores.kv)
    total = len(runs.all_edges)
    if total != len(scores):
        raise ValueError(
            f"scores has {len(scores)} edges and the model's graph {total}: give "
            f"edge_attribution's result of every sender on this model"
        )
    if sizes is None:
        chosen = default_sizes(total)
    elif isinstance(sizes, str):
        chosen = sorted(set(mib_sizes(total)))
    else:
        chosen = sorted(set(sizes))
    if not chosen or chosen[0] < 0 or chosen[-1] > total:
        raise ValueError(f"sizes must be in [0, {total}] (the edges), got {sizes!r}")
    # each of the model's edges in scores' graph (the same senders: checked above)
    where = {scores.graph.nodes(e): e for e in scores.graph.edges}
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(total, generator=generator).tolist() for _ in range(draws)]
    values, edges, random, random_edges = [], [], [], []
    for n in chosen:
        circuit = scores.circuit(n, prune=prune, method=method)
        values.append(runs.faithfulness(circuit))
        edges.append(len(circuit))
        drawn = []
        for order in orders:
            picked = [where[runs.all_edges[i]] for i in order[:n]]
            inert = set(scores.inert_of(picked)) if prune else set()
            drawn.append(Circuit(scores.graph, tuple(e for e in picked if e not in inert)))
        if draws:
            faithful = [runs.faithfulness(c) for c in drawn]
            random.append(sum(faithful) / draws)
            random_edges.append(sum(len(c) for c in drawn) / draws)
    return FaithfulnessCurve(
        tuple(chosen), tuple(values), tuple(edges), tuple(random), tuple(random_edges), total,
        runs.clean, runs.corrupt, prune, method,
    )  # fmt: skip
