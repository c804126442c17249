"""One head's QK or OV circuit: a factored (E, E) matrix that knows whose it is.

:func:`multihead.head_circuits` gives them (``qk(layer, head)``, ``ov(layer, head)``): the
factors are the head's own projections read as linear maps of the attention's input, the
biases and the score's scale kept apart, and for a rotary layer the query-key distance the
circuit was read at (none: position-free).

Shapes: E width, D query/key width, Dv value width.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from multihead.circuits.weights.factored_matrix import FactoredMatrix

__all__ = ["HeadCircuit"]


@dataclass(frozen=True, eq=False)
class HeadCircuit(FactoredMatrix):
    """One head's QK or OV circuit: a :class:`FactoredMatrix` (E, E) with what it belongs to.

    QK: ``a`` = W_Q (E, D), ``b`` = W_Kᵀ (D, E), and the score of query input x_q and key
    input x_k is ``scale · (x_q a + biases["q"]) · (x_k bᵀ + biases["k"])`` (:meth:`score`).
    OV: ``a`` = W_V (E, Dv), ``b`` = W_O (Dv, E); a value read at x is written as
    ``(x a + biases["v"]) b``, plus the layer's ``biases["o"]`` once.

    Attributes:
        head: the head's label (``"L1H3"``).
        kind: ``"qk"`` or ``"ov"``.
        biases: ``{"q": (D,), "k": (D,)}`` or ``{"v": (Dv,), "o": (E,)}``.
        scale: the factor on the scores (QK), else None.
        offset: the query's distance after the key it was read at (QK with ``offset``), else
            None.
        rotary: whether the layer turns queries and keys by their positions.
    """

    head: str = ""
    kind: str = ""
    biases: dict[str, Tensor] = field(default_factory=dict)
    scale: float | None = None
    offset: int | None = None
    rotary: bool = False

    @property
    def position_free(self) -> bool:
        """A QK circuit of a rotary layer read without ``offset``: W_Q W_Kᵀ with no rotation,
        not the score at any particular distance."""
        return self.kind == "qk" and self.rotary and self.offset is None

    def score(self, query: Tensor, key: Tensor) -> Tensor:
        """(...,) the pre-softmax score of query inputs ``query`` (..., E) against key inputs
        ``key`` (..., E) (QK circuits), biases and scale included: what a forward computes for
        a query ``offset`` positions after its key (at any distance, on a model without
        positions inside its attention)."""
        if self.kind != "qk" or self.scale is None:
            raise ValueError(f"score() is a QK circuit's; this is {self.head}'s {self.kind}")
        q = query.to(self.a.dtype) @ self.a + self.biases["q"]
        k = key.to(self.a.dtype) @ self.b.mT + self.biases["k"]
        return self.scale * (q * k).sum(-1)

    def __repr__(self) -> str:
        note = ""
        if self.position_free:
            note = ", position-free (no rotary turn; pass offset= for a distance)"
        elif self.offset is not None:
            note = f", query {self.offset} after its key"
        return f"HeadCircuit({self.head} {self.kind.upper()}, shape={tuple(self.shape)}{note})"
