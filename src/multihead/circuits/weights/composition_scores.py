"""How much one head's write is read by a later head: composition scores (Elhage et al. 2021).

A sender head's OV circuit W_V W_O (E, E) writes into the residual stream; a later head reads it
through its queries (Q-composition: the sender's write in the receiver's QK circuit's query
side), its keys (K-composition) or its values (V-composition). The score is how much of the
product survives, relative to the two alone::

    q:  ‖OV_s · QK_r‖ / (‖OV_s‖ ‖QK_r‖)      k:  ‖OV_s · QK_rᵀ‖ / …      v:  ‖OV_s · OV_r‖ / …

(Frobenius norms; QK_r = W_Q W_Kᵀ, a bilinear form x_q QK x_kᵀ). Every product is a product of
factors, ‖A₁ B₁ A₂ B₂‖² = Σ (G_A M G_B) ⊙ M with M = B₁ A₂ (D × D) and the Gram matrices
G_A = A₁ᵀ A₁, G_B = B₂ B₂ᵀ: per pair of heads one (D, E) × (E, D) product and no (E, E)
matrix. ``baseline="random"`` subtracts the mean score of random factors of the same shapes
(:func:`random_baseline`), the usual correction: random matrices of these shapes already score
well above 0.

Shapes: L layers, H heads (the most of any layer), E width, D and Dv head widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead._checks import check_index, check_positive_int
from multihead.heads import head_label
from multihead.viz.head_pairs_figure import head_pairs_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["COMPOSITION_KINDS", "CompositionScores", "product_norms", "random_baseline"]

# how the receiver reads the sender's write: through its queries, keys or values
COMPOSITION_KINDS = ("q", "k", "v")

_SAMPLES = 200  # random factor sets behind baseline="random"


def product_norms(left_gram: Tensor, left_b: Tensor, right_a: Tensor, right_gram: Tensor) -> Tensor:
    """(S, R): ‖A_s B_s A_r B_r‖ for every sender s and receiver r, from the senders' Gram
    matrices ``left_gram`` = A_sᵀ A_s (S, k, k) and right factors ``left_b`` = B_s (S, k, E),
    the receivers' left factors ``right_a`` = A_r (R, E, k'), or (R / G, E, k') for a grouped
    layer's key/value heads (receiver r reads r // G), and Gram matrices ``right_gram`` =
    B_r B_rᵀ (R, k', k')."""
    mid = torch.einsum("ske,rej->srkj", left_b, right_a)  # (S, R or R / G, k, k')
    if mid.shape[1] != right_gram.shape[0]:  # right_a per key/value head: per query head now
        mid = mid.repeat_interleave(right_gram.shape[0] // mid.shape[1], 1)
    weighted = left_gram[:, None] @ mid @ right_gram[None]
    return (weighted * mid).sum((-2, -1)).clamp(min=0).sqrt()


def random_baseline(
    shapes: tuple[int, int, int], dtype: torch.dtype, samples: int = _SAMPLES
) -> float:
    """The mean composition score of ``samples`` sets of four random factors of ``shapes``
    (E, k, k'): A₁ (E, k), B₁ (k, E), A₂ (E, k'), B₂ (k', E), each entry standard normal (the
    score does not depend on their scale), drawn from a generator seeded with 0."""
    width, k, k2 = shapes
    generator = torch.Generator().manual_seed(0)
    a1 = torch.randn(samples, width, k, generator=generator, dtype=dtype)
    b1 = torch.randn(samples, k, width, generator=generator, dtype=dtype)
    a2 = torch.randn(samples, width, k2, generator=generator, dtype=dtype)
    b2 = torch.randn(samples, k2, width, generator=generator, dtype=dtype)
    gram_a, gram_b = a1.mT @ a1, b2 @ b2.mT
    mid = b1 @ a2  # (samples, k, k')
    product = ((gram_a @ mid @ gram_b) * mid).sum((-2, -1)).sqrt()
    left = (gram_a * (b1 @ b1.mT)).sum((-2, -1)).sqrt()
    right = ((a2.mT @ a2) * gram_b).sum((-2, -1)).sqrt()
    return float((product / (left * right)).mean())


@dataclass(frozen=True)
class CompositionScores:
    """Every (sender, receiver) pair's composition score of one kind (module docstring).

    Attributes:
        scores: (L, H, L, H): ``scores[l1, h1, l2, h2]`` is sender L{l1}H{h1}'s score into
            receiver L{l2}H{h2}; NaN where the receiver is not in a later layer (or a layer
            has fewer heads).
        kind: ``"q"``, ``"k"`` or ``"v"``: what of the receiver reads the sender's write.
        baseline: None, or the mean random score subtracted (``baseline="random"``).
        heads: each layer's number of heads.
    """

    scores: Tensor
    kind: str
    baseline: float | None
    heads: tuple[int, ...]

    def label(self, sender: tuple[int, int], receiver: tuple[int, int]) -> str:
        """``"L0H1 -> L1H3.k"``."""
        return f"{head_label(*sender)} -> {head_label(*receiver)}.{self.kind}"

    def _pairs(self) -> list[tuple[tuple[int, int], tuple[int, int], float]]:
        """Every scored pair, in (sender, receiver) order."""
        flat = self.scores.detach().double().cpu()
        out = []
        for l1, n1 in enumerate(self.heads):
            for h1 in range(n1):
                for l2 in range(l1 + 1, len(self.heads)):
                    for h2 in range(self.heads[l2]):
                        out.append(((l1, h1), (l2, h2), float(flat[l1, h1, l2, h2])))
        return out

    def top(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` pairs with the highest scores: ``(label, score)``, highest first."""
        check_positive_int("n", n)
        pairs = sorted(self._pairs(), key=lambda p: -p[2])[:n]
        return [(self.label(s, r), score) for s, r, score in pairs]

    def into(self, layer: int, head: int) -> Tensor:
        """(L, H): every sender's score into receiver ``(layer, head)`` (NaN for senders not
        in an earlier layer)."""
        layer = check_index("layer", layer, len(self.heads), "layers")
        head = check_index("head", head, self.heads[layer], f"heads in layer {layer}")
        return self.scores[:, :, layer, head]

    def partners(self, layer: int, head: int, n: int = 3) -> list[tuple[str, float]]:
        """The ``n`` senders that score highest into receiver ``(layer, head)``:
        ``(sender label, score)``, highest first."""
        check_positive_int("n", n)
        into = self.into(layer, head).detach().double().cpu()
        found = [
            (head_label(l1, h1), float(into[l1, h1]))
            for l1 in range(layer)
            for h1 in range(self.heads[l1])
        ]
        return sorted(found, key=lambda p: -p[1])[:n]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per scored pair, for a table (``pandas.DataFrame(scores.to_rows())``)."""
        return [
            {
                "sender_layer": s[0],
                "sender_head": s[1],
                "receiver_layer": r[0],
                "receiver_head": r[1],
                "kind": self.kind,
                "label": self.label(s, r),
                "score": score,
            }  # fmt: skip
            for s, r, score in self._pairs()
        ]

    def plot(self, *, title: str | None = None) -> Figure:
        """Every pair as one square heatmap: senders down, receivers across, both in layer
        order with a line between layers (:func:`~multihead.viz.head_pairs_figure.
        head_pairs_figure`); unscored pairs blank.

        Raises:
            ImportError: matplotlib is missing (the ``viz`` extra).
        """
        index = [(layer, h) for layer, n in enumerate(self.heads) for h in range(n)]
        rows = torch.tensor([layer for layer, _ in index])
        cols = torch.tensor([h for _, h in index])
        grid = self.scores.detach().double().cpu()[rows, cols][:, rows, cols]  # (N, N)
        less = " less the random baseline" if self.baseline is not None else ""
        if title is None:
            title = f"{self.kind.upper()}-composition scores{less}"
        return head_pairs_figure(
            grid, self.heads, title=title, label=f"composition score{less}",
            xlabel=f"receiver (reads through its {_READS[self.kind]})", ylabel="sender (writes)",
        )  # fmt: skip


_READS = {"q": "queries", "k": "keys", "v": "values"}
