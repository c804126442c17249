"""A head's circuit through its singular value decomposition, each direction read as tokens.

A head's OV circuit (what it writes for what it reads) or QK circuit (which query directions
look for which key directions) is an (E, E) matrix of rank at most D; its thin SVD
``U diag(S) Vh`` lists the directions it reads (U's columns, for OV; query directions, for QK)
and those it writes (Vh's rows; key directions for QK), strongest first (Millidge & Black,
"The Singular Value Decompositions of Transformer Weight Matrices are Highly Interpretable",
2022). Read through the unembedding, a direction is the tokens whose logits it moves most.

Singular values that are equal (within ``tolerance`` of the largest) span a subspace in which
no direction is special: any rotation of its vectors is as good an SVD. Such a group is reported
as one :class:`SingularSubspace` (its projectors are unique; the vectors are not), and its
tokens are those whose unembedding vectors lie most in it.

Shapes: E width, r singular values kept, m one subspace's dimension, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

__all__ = ["HeadSVD", "SingularSubspace"]


@dataclass(frozen=True)
class SingularSubspace:
    """Singular directions sharing one singular value (m = 1 for a distinct value).

    Attributes:
        values: (m,) the singular values (equal within the tolerance).
        left: (E, m) an orthonormal basis of the input side (OV: what the head reads; QK: the
            query side).
        right: (E, m) of the output side (OV: what it writes; QK: the key side).
        left_tokens, right_tokens: the token ids read off each side through the unembedding,
            strongest first (empty without an unembedding): for m = 1 the tokens whose logits
            the direction raises most, then ``negative_*`` those it lowers most; for m > 1 the
            tokens whose unembedding vectors lie most in the subspace.
        left_scores, right_scores: the same tokens' readings (dot products with the direction,
            or the length of the projection into the subspace).
        negative_left_tokens, negative_right_tokens: for m = 1, the tokens the direction lowers
            most (empty for m > 1, where a subspace has no sign).
    """

    values: Tensor
    left: Tensor
    right: Tensor
    left_tokens: tuple[int, ...] = ()
    right_tokens: tuple[int, ...] = ()
    left_scores: tuple[float, ...] = ()
    right_scores: tuple[float, ...] = ()
    negative_left_tokens: tuple[int, ...] = ()
    negative_right_tokens: tuple[int, ...] = ()

    @property
    def dim(self) -> int:
        """m, the subspace's dimension."""
        return self.values.shape[0]

    def projector(self, side: str = "right") -> Tensor:
        """(E, E): the orthogonal projector onto the ``"left"`` or ``"right"`` side (formed
        on request)."""
        if side not in ("left", "right"):
            raise ValueError(f"side must be 'left' or 'right', got {side!r}")
        basis = self.left if side == "left" else self.right
        return basis @ basis.mT


@dataclass(frozen=True)
class HeadSVD:
    """One head's OV or QK circuit as singular subspaces, strongest first.

    Attributes:
        head: the head's label (``"L1H3"``).
        which: ``"ov"`` or ``"qk"``.
        values: (r,) the singular values kept, largest first.
        subspaces: the values grouped into :class:`SingularSubspace` s (module docstring).
        tokens: the token strings of every id in the subspaces, where a tokenizer was given.
    """

    head: str
    which: str
    values: Tensor
    subspaces: tuple[SingularSubspace, ...]
    tokens: dict[int, str] | None = None

    @classmethod
    def of(
        cls,
        head: str,
        which: str,
        svd: tuple[Tensor, Tensor, Tensor],
        k: int,
        tolerance: float,
        unembedding: Tensor | None,
        top: int,
        decode: Any = None,
    ) -> HeadSVD:
        """The first ``k`` of ``svd`` (U (E, r), S (r,), Vh (r, E)), grouped and read through
        ``unembedding`` (E, V) ``top`` tokens per side; ``decode`` (token id -> string), if
        given, names them."""
        u, s, vh = svd[0][:, :k], svd[1][:k], svd[2][:k]
        groups = _groups(s, tolerance)
        subspaces = []
        for start, stop in groups:
            left, right = u[:, start:stop], vh[start:stop].mT
            reading: dict[str, Any] = {}
            if unembedding is not None:
                for side, basis in (("left", left), ("right", right)):
                    ids, scores, negative = _read(basis, unembedding, top)
                    reading[f"{side}_tokens"], reading[f"{side}_scores"] = ids, scores
                    reading[f"negative_{side}_tokens"] = negative
            subspaces.append(SingularSubspace(s[start:stop], left, right, **reading))
        names = None
        if decode is not None:
            seen = {
                t
                for sub in subspaces
                for side in (
                    sub.left_tokens,
                    sub.right_tokens,
                    sub.negative_left_tokens,
                    sub.negative_right_tokens,
                )  # fmt: skip
                for t in side
            }
            names = {t: str(decode(t)) for t in sorted(seen)}
        return cls(head, which, s, tuple(subspaces), names)

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per subspace: its index, dimension, singular value(s) and top tokens."""
        rows = []
        for i, sub in enumerate(self.subspaces):
            row: dict[str, Any] = {
                "head": self.head, "which": self.which, "subspace": i, "dim": sub.dim,
                "value": float(sub.values[0]),
            }  # fmt: skip
            for side in ("left", "right"):
                ids = getattr(sub, f"{side}_tokens")
                row[f"{side}_tokens"] = [self._name(t) for t in ids]
            rows.append(row)
        return rows

    def _name(self, token: int) -> Any:
        return self.tokens.get(token, token) if self.tokens is not None else token


def _groups(values: Tensor, tolerance: float) -> list[tuple[int, int]]:
    """[start, stop) runs of ``values`` (descending) whose neighbours differ by at most
    ``tolerance`` times the largest."""
    if values.numel() == 0:
        return []
    gap = tolerance * float(values[0])
    listed = values.tolist()
    runs, start = [], 0
    for i in range(1, len(listed)):
        if listed[i - 1] - listed[i] > gap:
            runs.append((start, i))
            start = i
    runs.append((start, len(listed)))
    return runs


def _read(
    basis: Tensor, unembedding: Tensor, top: int
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...]]:
    """(ids, readings, negative ids) of the ``top`` tokens a basis (E, m) reads through the
    unembedding (E, V): for m = 1 signed dot products (and the most negative), else the length
    of each token's unembedding vector projected into the span."""
    logits = basis.mT.to(unembedding.dtype) @ unembedding  # (m, V)
    n = min(top, logits.shape[-1])
    if basis.shape[1] == 1:
        values, ids = logits[0].topk(n)
        negative = (-logits[0]).topk(n).indices
        return tuple(ids.tolist()), tuple(values.tolist()), tuple(negative.tolist())
    lengths = logits.norm(dim=0)
    values, ids = lengths.topk(n)
    return tuple(ids.tolist()), tuple(values.tolist()), ()
