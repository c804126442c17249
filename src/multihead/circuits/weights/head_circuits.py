"""What the weights alone say about every head: its QK and OV circuits, how heads compose, which
copy, and their singular directions (Elhage et al., "A Mathematical Framework for Transformer
Circuits", 2021).

Head h of layer l, read as linear maps of the attention's input x (1, E)
(:class:`~multihead.circuits.weights.layer_weights.LayerWeights`), scores a key for a query as
``scale · (x_q W_Q + b_Q) · (x_k W_K + b_K)`` and writes ``Σ_k a_k (x_k W_V + b_V) W_O`` into
the stream. Its **QK circuit** W_Q W_Kᵀ (E, E) is the bilinear form of the scores, its **OV
circuit** W_V W_O (E, E) what it writes for what it attends to; both are kept factored
(:class:`~multihead.circuits.weights.factored_matrix.FactoredMatrix`, rank ≤ D), biases apart.
A grouped-query head's circuits hold its key/value head's weights, the tensor itself, not a
copy per query head.

Positions. A rotary model turns each query and key by its position, so the score of a query Δ
positions after its key is ``x_q W_Q R(Δ) W_Kᵀ x_kᵀ``-shaped, not W_Q W_Kᵀ: ``qk(layer, head,
offset=Δ)`` reads the queries at position Δ and the keys at position 0 and is that circuit
exactly (what a forward computes for a query at i and a key at i - Δ); without ``offset`` the
circuit is read at position 0, where rotary turns nothing, and says it is position-free
(:attr:`HeadCircuit.position_free`). A position bias added to the scores (ALiBi, T5's buckets)
is not part of any QK circuit.

Norms. ``fold="none"``: the circuits act on the attention's input (the pre-norm's output).
``fold="norm"``: each block's pre-attention norm's scale γ is folded into W_Q, W_K, W_V (its
bias β into their biases) and, for a LayerNorm, their rows are centred (its output has mean 0):
the circuits act on the normalised stream, as TransformerLens's ``fold_ln`` gives them; the
final norm is folded into the unembedding the same way. Writes are not centred.

Shapes: L layers, H heads, Hk key/value heads, E width, D query/key width, Dv value width, V
vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_index, check_positive_int, describe, is_int
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.weights.composition_scores import (
    COMPOSITION_KINDS,
    CompositionScores,
    product_norms,
    random_baseline,
)
from multihead.circuits.weights.copying_scores import CopyingScores, full_ov_cores
from multihead.circuits.weights.head_circuit import HeadCircuit
from multihead.circuits.weights.head_svd import HeadSVD
from multihead.circuits.weights.layer_weights import LayerWeights
from multihead.devices import placement
from multihead.heads import head_label
from multihead.map_types import ModelMap
from multihead.mapping import model_heads, model_map

__all__ = ["FOLDS", "HeadCircuits", "head_circuits"]

# what is folded into the circuits: nothing, or each block's pre-attention norm (and the final
# norm into the unembedding)
FOLDS = ("none", "norm")
_BASELINES = (None, "random")
_UNREAD = object()  # an embedding not read yet


class HeadCircuits:
    """Every head's circuits of one model, read from its weights (module docstring).

    Made by :func:`head_circuits`; the weights are read when it is made (a later change to the
    model's weights is not seen), and at another query-key distance when a rotary model's
    ``qk(offset=...)`` first asks for it.

    Attributes:
        fold: ``"none"`` or ``"norm"`` (module docstring).
        layers: per layer, its heads' weights (folded as ``fold`` says).
        heads: each layer's number of query heads.
    """

    def __init__(
        self,
        model: nn.Module,
        mapped: ModelMap,
        layers: tuple[LayerWeights, ...],
        fold: str,
        norms: tuple[FrozenNorm | None, ...],
        dtype: torch.dtype,
    ) -> None:
        self._model = model
        self._mapped = mapped
        self.fold = fold
        self._norms = norms
        self._dtype = dtype
        self.layers = tuple(self._folded(w, n) for w, n in zip(layers, norms, strict=True))
        self.heads = tuple(w.q.shape[0] for w in layers)
        self._at: dict[int, tuple[LayerWeights, ...]] = {}
        self._embed: Tensor | object | None = _UNREAD
        self._unembed: Tensor | object | None = _UNREAD

    @property
    def num_layers(self) -> int:
        """L."""
        return len(self.layers)

    def labels(self) -> list[list[str]]:
        """Per layer, its heads' labels."""
        return [[head_label(layer, h) for h in range(n)] for layer, n in enumerate(self.heads)]

    # -- one head ---------------------------------------------------------------------------------

    def qk(self, layer: int, head: int, offset: int | None = None) -> HeadCircuit:
        """Head ``(layer, head)``'s QK circuit W_Q W_Kᵀ (E, E), factored: at ``offset`` (a
        query that many positions after its key; negative: before it, on a model that is not
        causal) with the rotary turn in it, else position-free.

        Raises:
            ValueError: the layer's queries or keys are not linear in its input (a norm on
                them), or ``offset`` is not a distance the model can place.
        """
        layer, head = self._head(layer, head)
        self._linear(layer, ("q", "k"), "qk()")
        weights = self.layers[layer] if offset is None else self._offset(offset)[layer]
        g = head // weights.group
        return HeadCircuit(
            weights.q[head], weights.k[g].mT, head=head_label(layer, head), kind="qk",
            biases={"q": weights.q_bias[head], "k": weights.k_bias[g]}, scale=weights.scale,
            offset=offset, rotary=self.layers[layer].rotary,
        )  # fmt: skip

    def ov(self, layer: int, head: int) -> HeadCircuit:
        """Head ``(layer, head)``'s OV circuit W_V W_O (E, E), factored.

        Raises:
            ValueError: the layer's values are not linear in its input, or no output
                projection was found.
        """
        layer, head = self._head(layer, head)
        weights = self._with_output(layer, "ov()")
        assert weights.o is not None and weights.o_bias is not None
        g = head // weights.group
        return HeadCircuit(
            weights.v[g], weights.o[head], head=head_label(layer, head), kind="ov",
            biases={"v": weights.v_bias[g], "o": weights.o_bias}, rotary=weights.rotary,
        )  # fmt: skip

    def svd(
        self,
        layer: int,
        head: int,
        which: str = "ov",
        k: int | None = None,
        *,
        top: int = 10,
        tolerance: float = 1e-5,
        decode: Any = None,
    ) -> HeadSVD:
        """Head ``(layer, head)``'s OV or QK circuit's ``k`` strongest singular directions
        (default all D), equal singular values (within ``tolerance`` of the largest) grouped
        into one subspace, each side read through the unembedding (``top`` tokens; none on a
        model without one). ``decode``: a function from a token id to its text (a tokenizer's
        ``decode``), to name the tokens."""
        check_choice("which", which, ("ov", "qk"))
        circuit = self.ov(layer, head) if which == "ov" else self.qk(layer, head)
        rank = min(circuit.inner, *circuit.shape[-2:])
        k = rank if k is None else check_positive_int("k", k)
        if k > rank:
            raise ValueError(f"k must be at most the circuit's rank bound {rank}, got {k}")
        check_positive_int("top", top)
        if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
            raise ValueError(f"tolerance must be a number in [0, 1), got {describe(tolerance)}")
        return HeadSVD.of(
            circuit.head, which, circuit.svd(), k, float(tolerance), self._unembedding(), top,
            decode,
        )  # fmt: skip

    # -- every head -------------------------------------------------------------------------------

    def composition_scores(self, kind: str = "k", baseline: str | None = None) -> CompositionScores:
        """Every (earlier, later) pair's ``kind`` composition score (``"q"``, ``"k"``, ``"v"``:
        what of the later head reads the earlier one's write; see
        :mod:`~multihead.circuits.weights.composition_scores`), (L, H, L, H); with
        ``baseline="random"`` less the mean score of random factors of the same shapes."""
        check_choice("kind", kind, COMPOSITION_KINDS)
        check_choice("baseline", baseline, _BASELINES)
        n = self.num_layers
        device = self.layers[0].q.device
        size = (n, max(self.heads), n, max(self.heads))
        scores = torch.full(size, float("nan"), dtype=self._dtype, device=device)
        reads = ("q", "k") if kind != "v" else ("v",)
        senders: list[tuple[Tensor, Tensor, Tensor]] = []
        for layer in range(n - 1):
            weights = self._with_output(layer, "composition_scores")
            assert weights.o is not None
            gram_v = _per_query(weights.v.mT @ weights.v, weights.group)  # (H, Dv, Dv)
            gram_o = weights.o @ weights.o.mT
            senders.append((gram_v, weights.o, (gram_v * gram_o).sum((-2, -1)).sqrt()))
        shapes: set[tuple[int, int, int]] = set()
        for receiver in range(1, n):
            self._linear(receiver, reads, "composition_scores")
            right_a, right_gram, right_norm = self._right(receiver, kind)
            h2 = self.heads[receiver]
            for sender in range(receiver):
                gram_a, b, left_norm = senders[sender]
                h1 = self.heads[sender]
                norms = product_norms(gram_a, b, right_a, right_gram)  # (H1, H2)
                scores[sender, :h1, receiver, :h2] = norms / left_norm[:, None] / right_norm
                shapes.add((b.shape[-1], b.shape[-2], right_a.shape[-1]))
        mean = None
        if baseline == "random":
            means = {shape: random_baseline(shape, self._dtype) for shape in shapes}
            if len(means) > 1:
                raise ValueError(
                    "composition_scores(baseline='random') needs every pair of one shape; this "
                    f"model's pairs come in {len(means)}: {sorted(means)}"
                )
            mean = next(iter(means.values()), 0.0)
            scores = scores - mean
        return CompositionScores(scores, kind, mean, self.heads)

    def copying_scores(self) -> CopyingScores:
        """Each head's copying score ``Σ λ / Σ |λ|`` over the eigenvalues λ of its full OV
        circuit W_E W_V W_O W_U (see :mod:`~multihead.circuits.weights.copying_scores`),
        in each head's (Dv, Dv) space.

        Raises:
            ValueError: the model has no unembedding or no token embedding the map knows.
        """
        unembed = self._unembedding()
        embed = self._embedding()
        if unembed is None or embed is None:
            raise ValueError(
                "copying_scores reads each head from tokens to tokens; the map of this model "
                f"({self._mapped.family}) knows no "
                f"{'unembedding' if unembed is None else 'token embedding'}"
            )
        through = unembed @ embed  # (E, E): W_U W_E
        values = torch.full(
            (self.num_layers, max(self.heads)), float("nan"), dtype=self._dtype,
            device=through.device,
        )  # fmt: skip
        eigenvalues = []
        for layer in range(self.num_layers):
            weights = self._with_output(layer, "copying_scores")
            assert weights.o is not None
            cores = full_ov_cores(weights.o @ through, weights.v)  # (H, Dv, Dv)
            found = torch.linalg.eigvals(cores)
            eigenvalues.append(found)
            values[layer, : self.heads[layer]] = CopyingScores.ratio(found).to(self._dtype)
        return CopyingScores(values, tuple(eigenvalues), self.heads)

    # -- reading ----------------------------------------------------------------------------------

    def _head(self, layer: int, head: int) -> tuple[int, int]:
        layer = check_index("layer", layer, self.num_layers, "layers")
        return layer, check_index("head", head, self.heads[layer], f"heads in layer {layer}")

    def _linear(self, layer: int, kinds: tuple[str, ...], caller: str) -> None:
        bad = [k for k in kinds if k in self.layers[layer].not_affine]
        if bad:
            random = " or dropout (the model is in training mode)" if self._model.training else ""
            raise ValueError(
                f"{caller}: layer {layer}'s {' and '.join(_NAMES[k] for k in bad)} are not a "
                f"linear function of its input (a norm on them, as Qwen3's and OLMo-2's q/k "
                f"norms{random}?): they have no circuit"
            )

    def _with_output(self, layer: int, caller: str) -> LayerWeights:
        self._linear(layer, ("v",), caller)
        weights = self.layers[layer]
        if weights.o is None:
            raise ValueError(
                f"{caller}: no output projection (a module given the heads' outputs) was found "
                f"in layer {layer} ({self._mapped.sites[layer].name})"
            )
        return weights

    def _right(self, layer: int, kind: str) -> tuple[Tensor, Tensor, Tensor]:
        """The receivers' (right_a (R', E, k'), right_gram (H, k', k'), norms (H,)) of one
        layer for ``kind``: R' = H for queries, Hk for keys and values (per query head after)."""
        w = self.layers[layer]
        gram_q = w.q.mT @ w.q  # (H, D, D)
        gram_k = _per_query(w.k.mT @ w.k, w.group)
        if kind == "q":
            return w.q, gram_k, (gram_q * gram_k).sum((-2, -1)).sqrt()
        if kind == "k":
            return w.k, gram_q, (gram_q * gram_k).sum((-2, -1)).sqrt()
        weights = self._with_output(layer, "composition_scores")
        assert weights.o is not None
        gram_v = _per_query(w.v.mT @ w.v, w.group)
        gram_o = weights.o @ weights.o.mT
        return w.v, gram_o, (gram_v * gram_o).sum((-2, -1)).sqrt()

    def _offset(self, offset: int) -> tuple[LayerWeights, ...]:
        """Every layer's weights with queries ``offset`` positions after the keys."""
        if not is_int(offset) or isinstance(offset, bool):
            raise TypeError(f"offset must be an int or None, got {describe(offset)}")
        offset = int(offset)
        if offset < 0 and self._mapped.causal:
            raise ValueError(
                f"offset must be >= 0 on a causal model (a query never reads a later key), "
                f"got {offset}"
            )
        limit = self._mapped.position_limit
        if limit is not None and abs(offset) >= limit:
            raise ValueError(
                f"offset must be less than the {limit} positions the model embeds, got {offset}"
            )
        if not any(w.rotary for w in self.layers):
            return self.layers
        if offset not in self._at:
            read, _ = LayerWeights.read_all(
                self._model, self._mapped, query_position=max(offset, 0),
                key_position=max(-offset, 0), dtype=self._dtype, caller="qk(offset=...)",
            )  # fmt: skip
            self._at[offset] = tuple(
                self._folded(w, n) for w, n in zip(read, self._norms, strict=True)
            )
        return self._at[offset]

    def _folded(self, weights: LayerWeights, norm: FrozenNorm | None) -> LayerWeights:
        """``weights`` with ``norm``'s scale folded into its q, k, v (module docstring)."""
        if norm is None:
            return weights
        q, q_bias = _fold(weights.q, weights.q_bias, norm, dim=-2)
        k, k_bias = _fold(weights.k, weights.k_bias, norm, dim=-2)
        v, v_bias = _fold(weights.v, weights.v_bias, norm, dim=-2)
        return dataclasses.replace(
            weights, q=q, q_bias=q_bias, k=k, k_bias=k_bias, v=v, v_bias=v_bias
        )

    def _embedding(self) -> Tensor | None:
        """(V, E) the token embedding's rows, as the model's embedding module gives them (a
        scaled embedding's scale included)."""
        if self._embed is _UNREAD:
            self._embed = None
            if self._mapped.embeddings:
                module = self._mapped.embeddings[0]
                unembedding = self._mapped.unembedding
                rows = (
                    module.num_embeddings
                    if isinstance(module, nn.Embedding)
                    else unembedding.out_features
                    if unembedding is not None
                    else None
                )
                if rows is not None:
                    ids = torch.arange(rows, device=placement(module)[0])
                    with torch.no_grad():
                        self._embed = module(ids).to(self._dtype)
        return self._embed if isinstance(self._embed, Tensor) else None

    def _unembedding(self) -> Tensor | None:
        """(E, V) the unembedding as x ↦ x W_U, the final norm folded in with ``fold="norm"``."""
        if self._unembed is _UNREAD:
            self._unembed = None
            linear = self._mapped.unembedding
            if linear is not None:
                found = linear.weight.detach().to(self._dtype).mT
                norm = self._mapped.final_norm
                if self.fold == "norm" and norm is not None:
                    frozen = _frozen(norm, self._mapped.norm_eps, found.shape[0], "the final norm")
                    found, _ = _fold(found, torch.zeros_like(found[0]), frozen, dim=0)
                self._unembed = found
        return self._unembed if isinstance(self._unembed, Tensor) else None


_NAMES = {"q": "queries", "k": "keys", "v": "values"}


def _per_query(per_kv: Tensor, group: int) -> Tensor:
    """(H, ...) from (Hk, ...): each key/value head's small matrix for each query head reading
    it (query head h reads h // G)."""
    return per_kv if group == 1 else per_kv.repeat_interleave(group, 0)


def _fold(w: Tensor, b: Tensor, norm: FrozenNorm, dim: int) -> tuple[Tensor, Tensor]:
    """(w, b) read after ``norm``: rows of ``w`` along ``dim`` (the input axis E) scaled by γ,
    β taken into the bias, and, for a LayerNorm, the rows centred."""
    shape = [1] * w.dim()
    shape[dim] = -1
    gamma = norm.gamma.detach().to(w.dtype).view(shape)  # the circuits are no graph of the model
    if norm.beta is not None:
        b = b + (norm.beta.detach().to(w.dtype).view(shape) * w).sum(dim)
    w = gamma * w
    if norm.centred:
        w = w - w.mean(dim, keepdim=True)
    return w, b


def _frozen(norm: nn.Module, eps: float | None, width: int, what: str) -> FrozenNorm:
    """``norm``'s γ, β and kind, read off one call (a LayerNorm or RMSNorm, γ or 1 + γ)."""
    caller = f"head_circuits(fold='norm') ({what})"
    if eps is None:
        raise ValueError(f"{caller}: the map knows no epsilon for {type(norm).__name__}")
    device, dtype = placement(norm)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, width, generator=generator).to(dtype=dtype, device=device)
    with torch.no_grad():
        y = norm(x)
    return FrozenNorm.of(norm, eps, x, y, caller, torch.finfo(dtype).eps)


def head_circuits(model: nn.Module, *, fold: str = "none") -> HeadCircuits:
    """Every head's QK and OV circuits, composition, copying and SVD, from ``model``'s weights
    (module docstring): any model the map knows (multihead's own, every routed transformers
    family).

    Args:
        model: the model (read in the dtype of its parameters, at least float32).
        fold: ``"none"`` (the raw projections, acting on the attention's input) or ``"norm"``
            (each block's pre-attention norm folded in, as TransformerLens's ``fold_ln``).

    Returns:
        A :class:`HeadCircuits`.

    Raises:
        ValueError: ``fold`` is not one of ``"none"``, ``"norm"``; the model has no attention
            the map knows; with ``fold="norm"``, a pre-norm that is not a LayerNorm or RMSNorm.
    """
    check_choice("fold", fold, FOLDS)
    model_heads(model)
    mapped = model_map(model)
    dtype = torch.promote_types(placement(model)[1], torch.float32)
    layers, wiring = LayerWeights.read_all(model, mapped, dtype=dtype, caller="head_circuits")
    norms: list[FrozenNorm | None] = []
    for wired, weights in zip(wiring.layers, layers, strict=True):
        if fold == "norm" and wired.norm is not None:
            width = weights.q.shape[1]
            norms.append(_frozen(wired.norm, wired.norm_eps, width, "a block's pre-norm"))
        else:
            norms.append(None)
    return HeadCircuits(model, mapped, layers, fold, tuple(norms), dtype)
