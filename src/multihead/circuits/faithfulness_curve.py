"""The faithfulness curve: the top-n edges' faithfulness over circuit sizes n, against random
circuits of the same sizes (:func:`~multihead.circuits.faithfulness.faithfulness` each).

The areas are taken over the fraction of the graph's edges (0 … 1), so a method whose top
edges carry the behaviour early has a larger area than random circuits, which carry it only
when they hold most edges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from multihead._checks import check_positive_int
from multihead.circuits.edge_scores import Circuit, EdgeScores
from multihead.circuits.faithfulness import CircuitRuns
from multihead.circuits.input_pair import Metric
from multihead.viz.circuit_graph import faithfulness_figure

__all__ = ["FaithfulnessCurve", "default_sizes", "faithfulness_curve"]


@dataclass(frozen=True)
class FaithfulnessCurve:
    """Faithfulness of the top-n edges over circuit sizes n, beside random circuits of the same
    sizes.

    Attributes:
        sizes: the circuit sizes (edges), increasing, from 0 to every edge.
        values: the top-n circuit's faithfulness at each size.
        random: the mean faithfulness of ``draws`` random circuits of each size (uniform over
            the graph's edges).
        total: every edge of the graph.
        area, random_area: the areas under the two curves over the fraction of edges (0 … 1,
            trapezoids).
    """

    sizes: tuple[int, ...]
    values: tuple[float, ...]
    random: tuple[float, ...]
    total: int
    clean: float
    corrupt: float

    @property
    def area(self) -> float:
        return _area(self.sizes, self.values, self.total)

    @property
    def random_area(self) -> float:
        return _area(self.sizes, self.random, self.total)

    def smallest(self, reach: float = 0.9) -> int | None:
        """The smallest size whose circuit reaches ``reach``, or None."""
        return next((n for n, v in zip(self.sizes, self.values, strict=True) if v >= reach), None)

    def plot(self, *, title: str | None = None, other: FaithfulnessCurve | None = None,
             labels: tuple[str, str] = ("top edges", "other")) -> Any:  # fmt: skip
        """The curves (a matplotlib ``Figure``; the ``viz`` extra): faithfulness against the
        fraction of edges, this curve, ``other`` (another method's) and the random circuits'."""
        curves = [(labels[0], self.sizes, self.values)]
        if other is not None:
            curves.append((labels[1], other.sizes, other.values))
        curves.append(("random circuits", self.sizes, self.random))
        return faithfulness_figure(curves, self.total, title=title)


def _area(sizes: Sequence[int], values: Sequence[float], total: int) -> float:
    x = [n / total for n in sizes]
    return sum((x[i + 1] - x[i]) * (values[i] + values[i + 1]) / 2 for i in range(len(x) - 1))


def default_sizes(total: int) -> list[int]:
    """0, every edge, and the fractions 1, 2, 5, 10, 15, 20, 30, 50, 75 % of them."""
    fractions = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75)
    return sorted({0, total, *(max(1, round(f * total)) for f in fractions)})


def faithfulness_curve(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    scores: EdgeScores,
    *,
    sizes: Sequence[int] | None = None,
    draws: int = 5,
    seed: int = 0,
) -> FaithfulnessCurve:
    """:func:`faithfulness` of ``scores``' top-n edges for each size n, and of ``draws`` random
    circuits of each size (one random order of the edges per draw, its first n edges).

    Args:
        scores: :func:`~multihead.edge_attribution`'s result on the same inputs.
        sizes: circuit sizes (default :func:`default_sizes`: 0 to every edge).
        draws: random circuits per size; seed: their generator's seed.

    Raises:
        ValueError: sizes out of [0, edges], draws < 1, and as :func:`faithfulness`.
    """
    check_positive_int("draws", draws)
    runs = CircuitRuns.of(model, clean, corrupt, metric, scores.circuit(0))
    total = len(runs.all_edges)
    if total != len(scores):
        raise ValueError(
            f"scores has {len(scores)} edges and the model's graph {total}: give "
            f"edge_attribution's result of every sender on this model"
        )
    chosen = default_sizes(total) if sizes is None else sorted(set(sizes))
    if not chosen or chosen[0] < 0 or chosen[-1] > total:
        raise ValueError(f"sizes must be in [0, {total}] (the edges), got {sizes!r}")
    generator = torch.Generator().manual_seed(seed)
    orders = [torch.randperm(total, generator=generator).tolist() for _ in range(draws)]
    values, random = [], []
    for n in chosen:
        values.append(runs.faithfulness(scores.circuit(n)))
        drawn = [
            runs.faithfulness(
                Circuit(tuple(runs.all_edges[i] for i in order[:n]), scores.kinds, scores.kv)
            )
            for order in orders
        ]
        random.append(sum(drawn) / draws)
    return FaithfulnessCurve(
        tuple(chosen), tuple(values), tuple(random), total, runs.clean, runs.corrupt
    )
