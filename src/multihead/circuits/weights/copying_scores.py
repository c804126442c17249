"""Which heads copy: the eigenvalues of each head's OV circuit read from tokens to tokens.

A head's full OV circuit W_E W_V W_O W_U (V, V) says, for each token it attends to, how it moves
every logit. A head that copies (an induction head's OV circuit) raises the attended token's own
logit: the circuit's eigenvalues are mostly positive. Elhage et al. (2021) score that as
``Σ λ / Σ |λ|`` over the eigenvalues λ: 1 for a pure copier, -1 for a head that suppresses what
it reads, near 0 for neither. The (V, V) matrix has rank at most Dv, and its nonzero eigenvalues
are those of the (Dv, Dv) matrix W_O W_U W_E W_V (the factors turned round), so no (V, V)
matrix is formed: W_U W_E (E, E) once per model, then one (Dv, Dv) matrix per head.

Shapes: L layers, H heads (the most of any layer), V vocabulary, E width, Dv head width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from multihead._checks import check_positive_int
from multihead.heads import head_label
from multihead.viz.plots import effects_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["CopyingScores", "full_ov_cores"]


@dataclass(frozen=True)
class CopyingScores:
    """Each head's copying score (module docstring).

    Attributes:
        values: (L, H) ``Σ λ / Σ |λ|`` of each head's full OV circuit; NaN for heads a layer
            does not have.
        eigenvalues: per layer, (H_l, Dv) complex: each head's nonzero eigenvalues (and
            zeros: the circuit's rank may be below Dv), those of W_O W_U W_E W_V.
        heads: each layer's number of heads.
    """

    values: Tensor
    eigenvalues: tuple[Tensor, ...]
    heads: tuple[int, ...]

    @staticmethod
    def ratio(eigenvalues: Tensor) -> Tensor:
        """(...,) ``Σ λ / Σ |λ|`` (its real part) over the last axis of ``eigenvalues``."""
        return eigenvalues.sum(-1).real / eigenvalues.abs().sum(-1)

    def _cells(self) -> list[tuple[int, int, float]]:
        values = self.values.detach().double().cpu()
        return [
            (layer, h, float(values[layer, h]))
            for layer, n in enumerate(self.heads)
            for h in range(n)
        ]

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` heads that copy most: ``(label, score)``, highest first."""
        check_positive_int("n", n)
        cells = sorted(self._cells(), key=lambda c: -c[2])[:n]
        return [(head_label(layer, h), score) for layer, h, score in cells]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per head: layer, head, label, score."""
        return [
            {"layer": layer, "head": h, "label": head_label(layer, h), "score": score}
            for layer, h, score in self._cells()
        ]

    def plot(self, *, title: str | None = None) -> Figure:
        """The scores as a layers × heads heatmap, on a diverging scale around 0.

        Raises:
            ImportError: matplotlib is missing (the ``viz`` extra).
        """
        values = self.values.detach().double().cpu()
        rows = [f"L{layer}" for layer in range(values.shape[0])]
        columns = [f"H{h}" for h in range(values.shape[1])]
        title = title or "Copying scores (Σλ / Σ|λ| of each head's full OV circuit)"
        return effects_figure(
            values, rows, columns, title=title, label="copying score", xlabel="head",
            ylabel="layer",
        )  # fmt: skip


def full_ov_cores(o_unembedded: Tensor, v: Tensor) -> Tensor:
    """(H, Dv, Dv): W_O[h] (W_U W_E) W_V[g] per query head h, from ``o_unembedded`` (H, Dv, E)
    = W_O[h] W_U W_E and the key/value heads' ``v`` (Hk, E, Dv); query head h reads key/value
    head h // G (broadcast, not copied)."""
    heads, dv, width = o_unembedded.shape
    kv = v.shape[0]
    grouped = o_unembedded.view(kv, heads // kv, dv, width)
    return (grouped @ v[:, None]).view(heads, dv, -1)
