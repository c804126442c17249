"""How a circuit matches a reference circuit of the same graph: :class:`CircuitComparison`
(:meth:`multihead.Circuit.compare`): MIB's ``compare_graphs`` counts, and the AUROC of the
scores a circuit was chosen by.

Shapes: N senders, R receivers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["CircuitComparison"]

Edge = tuple[int, int]  # (sender index, receiver index) in a Graph


@dataclass(frozen=True)
class CircuitComparison:
    """A circuit against a reference circuit of the same graph (:meth:`Circuit.compare`).

    Attributes:
        precision: of the circuit's edges, the share in the reference (0 for an empty
            circuit, as MIB's ``compare_graphs`` gives).
        recall: of the reference's edges, the share in the circuit (NaN for an empty
            reference).
        auroc: the area under the ROC curve of the circuit's scores against the reference:
            the chance that a reference edge has a larger ``|score|`` than an edge outside it
            (ties count half; every edge of the graph ranked, not only the circuit's). MIB's
            ``evaluate_area_under_roc`` instead lists (TPR, FPR) points of greedy circuits at
            its ten edge fractions and gives no area: this is the Mann-Whitney AUROC of
            ``|score|`` thresholds, a related but different curve. NaN when the reference
            holds no edge or every edge, None when the circuit holds no scores (given as
            labels).
        true_positives, false_positives, false_negatives, true_negatives: edges in both, in
            the circuit only, in the reference only, in neither.
    """

    precision: float
    recall: float
    auroc: float | None
    true_positives: int
    false_positives: int
    false_negatives: int
    true_negatives: int

    @classmethod
    def of(
        cls,
        edges: Sequence[Edge],
        mine: set[Edge],
        truth: set[Edge],
        values: Tensor | None,
    ) -> CircuitComparison:
        """A circuit's edges ``mine`` against ``truth``, both of the graph's ``edges``, and the
        AUROC of ``values`` (N, R) ranking every edge by ``|score|`` (None without values)."""
        tp = len(mine & truth)
        fp, fn = len(mine - truth), len(truth - mine)
        auroc = None
        if values is not None:
            index = torch.tensor(edges, dtype=torch.long, device=values.device).reshape(-1, 2)
            scores = values.detach()[index[:, 0], index[:, 1]].abs().double().cpu()
            labels = torch.tensor([e in truth for e in edges], dtype=torch.bool)
            auroc = _auroc(scores, labels)
        return cls(
            precision=tp / (tp + fp) if tp + fp else 0.0,
            recall=tp / (tp + fn) if tp + fn else math.nan,
            auroc=auroc,
            true_positives=tp,
            false_positives=fp,
            false_negatives=fn,
            true_negatives=len(edges) - tp - fp - fn,
        )


def _auroc(scores: Tensor, labels: Tensor) -> float:
    """The Mann-Whitney AUROC of ``scores`` (n,) against bool ``labels`` (n,), ties half."""
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return math.nan
    order = scores.argsort()
    _, inverse, counts = torch.unique_consecutive(
        scores[order], return_inverse=True, return_counts=True
    )
    ends = counts.cumsum(0).double()
    mean_rank = ends - (counts.double() - 1) / 2  # a tie's ranks' mean, ranks from 1
    ranks = torch.empty(scores.shape, dtype=torch.float64)
    ranks[order] = mean_rank[inverse]
    total = float(ranks[labels].sum())
    return (total - positives * (positives + 1) / 2) / (positives * negatives)
