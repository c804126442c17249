"""A matrix kept as the product of its two factors, M = A B, never formed unless asked.

A head's QK circuit W_Q W_Kᵀ and OV circuit W_V W_O are (E, E) matrices of rank at most the
head's width D (Elhage et al. 2021); kept as their (E, D) and (D, E) factors, everything asked
of them costs O(E D²) instead of O(E² D) and E² memory: the product (:meth:`ab`, when it is
really wanted), its Frobenius norm (:meth:`norm`, from the factors' Gram matrices), its thin SVD
(:meth:`svd`, through the factors' QR decompositions), its nonzero eigenvalues
(:meth:`eigenvalues`, those of the (D, D) matrix B A), products with matrices and with other
factored matrices (``@``: still factored, through the smaller inner width) and the transpose
(:attr:`T`). Leading axes batch (one matrix per head: (H, E, D) and (H, D, E)), as in torch.

Shapes: m rows, n columns, k the inner width (m × k times k × n); ... leading axes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["FactoredMatrix"]


@dataclass(frozen=True, eq=False)
class FactoredMatrix:
    """M = A B, with A (..., m, k) and B (..., k, n) (leading axes broadcast).

    Attributes:
        a: the left factor (..., m, k).
        b: the right factor (..., k, n).

    Raises:
        ValueError: either factor is not at least 2-D, or A's columns are not B's rows.
    """

    a: Tensor
    b: Tensor

    def __post_init__(self) -> None:
        if self.a.dim() < 2 or self.b.dim() < 2:
            raise ValueError(
                f"FactoredMatrix: the factors must be at least 2-D, got a of shape "
                f"{tuple(self.a.shape)} and b of shape {tuple(self.b.shape)}"
            )
        if self.a.shape[-1] != self.b.shape[-2]:
            raise ValueError(
                f"FactoredMatrix: a's columns must be b's rows, got a of shape "
                f"{tuple(self.a.shape)} and b of shape {tuple(self.b.shape)}"
            )

    @property
    def shape(self) -> torch.Size:
        """(..., m, n): the product's shape."""
        lead = torch.broadcast_shapes(self.a.shape[:-2], self.b.shape[:-2])
        return torch.Size((*lead, self.a.shape[-2], self.b.shape[-1]))

    @property
    def inner(self) -> int:
        """k, the factors' shared width (an upper bound on the rank)."""
        return self.a.shape[-1]

    def ab(self) -> Tensor:
        """(..., m, n): the product itself (the one call that forms it)."""
        return self.a @ self.b

    def ba(self) -> Tensor:
        """(..., k, k): B A, the factors multiplied the other way round (square M only): it has
        M's nonzero eigenvalues."""
        self._square("ba()")
        return self.b @ self.a

    @property
    def T(self) -> FactoredMatrix:  # noqa: N802 (torch's name)
        """Mᵀ = Bᵀ Aᵀ, still factored."""
        return FactoredMatrix(self.b.mT, self.a.mT)

    def __matmul__(self, other: Tensor | FactoredMatrix) -> FactoredMatrix:
        """M @ other, still factored: with a matrix (..., n, p), A (B other); with another
        factored matrix A' B', through the smaller of the two inner widths."""
        if isinstance(other, FactoredMatrix):
            if self.inner <= other.inner:
                return FactoredMatrix(self.a, (self.b @ other.a) @ other.b)
            return FactoredMatrix(self.a @ (self.b @ other.a), other.b)
        if isinstance(other, Tensor):
            return FactoredMatrix(self.a, self.b @ other)
        return NotImplemented

    def __rmatmul__(self, other: Tensor) -> FactoredMatrix:
        """other @ M, still factored: (other A) B, other (..., p, m)."""
        if isinstance(other, Tensor):
            return FactoredMatrix(other @ self.a, self.b)
        return NotImplemented

    def norm(self) -> Tensor:
        """(...): the Frobenius norm ‖A B‖, from the factors: ‖A B‖² = Σ (AᵀA) ⊙ (B Bᵀ), two
        (k, k) Gram matrices (no m × n product)."""
        gram_a = self.a.mT @ self.a
        gram_b = self.b @ self.b.mT
        return (gram_a * gram_b).sum((-2, -1)).clamp(min=0).sqrt()

    def svd(self) -> tuple[Tensor, Tensor, Tensor]:
        """(U (..., m, r), S (..., r), Vh (..., r, n)), the thin SVD of A B with r = min(m, k,
        n) singular values, largest first, as :func:`torch.linalg.svd` gives it
        (``U @ diag(S) @ Vh == A B``): A = Qa Ra and Bᵀ = Qb Rb, so A B = Qa (Ra Rbᵀ) Qbᵀ and
        the SVD is the small core's, turned by Qa and Qb."""
        qa, ra = torch.linalg.qr(self.a)  # (..., m, k'), (..., k', k)
        qb, rb = torch.linalg.qr(self.b.mT)  # (..., n, k''), (..., k'', k)
        u, s, vh = torch.linalg.svd(ra @ rb.mT, full_matrices=False)
        return qa @ u, s, vh @ qb.mT

    def eigenvalues(self) -> Tensor:
        """(..., k) complex: the eigenvalues of B A, which are A B's nonzero eigenvalues (and
        zeros) — A B's own m eigenvalues are these and m - k zeros (square M only)."""
        return torch.linalg.eigvals(self.ba())

    def _square(self, what: str) -> None:
        m, n = self.shape[-2:]
        if m != n:
            raise ValueError(f"FactoredMatrix.{what} needs a square matrix, got {m} × {n}")

    def __repr__(self) -> str:
        return (
            f"FactoredMatrix(shape={tuple(self.shape)}, inner={self.inner}, dtype={self.a.dtype})"
        )
