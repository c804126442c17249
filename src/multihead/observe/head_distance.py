"""How alike two heads attend: Jensen–Shannon distances between heads, and a 2-D map of them.

Clark et al., "What Does BERT Look At?" (2019, section 6) compare two heads by the
Jensen–Shannon divergence between their attention distributions on the same tokens, summed over
a corpus, and lay the heads out in 2-D with multidimensional scaling. Here:

- per query q, ``JS(p, r) = sqrt(½ KL(p ‖ m) + ½ KL(r ‖ m))``, m = ½ (p + r), in **base 2** (the
  Jensen–Shannon *distance*: the square root of the divergence in bits, a metric in [0, 1]; 0 for
  the same distribution, 1 for disjoint supports; scipy's ``jensenshannon(p, r, base=2)``);
- between heads i and j, ``D[i, j]`` = the mean over every real query token of the corpus of
  ``JS(p_i(q), p_j(q))`` (a mean of metrics, so a metric too; Clark et al. sum the divergence
  instead, which changes the scale, not who is near whom);
- the layout: classical (Torgerson) multidimensional scaling of D, by an eigendecomposition.
  No randomness: each axis' sign is fixed so that its largest-magnitude coordinate is positive,
  so the same D always gives the same picture.

Shapes: N = L'·H' heads (layer-major: head h of the l-th chosen layer is ``l·H' + h``), Q real
queries, S keys.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from multihead._checks import check_positive_int
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.heads import head_label
from multihead.memory_budget import FLOAT32_BYTES
from multihead.observe.corpus import BatchBytes, chosen_size
from multihead.observe.recorder import capture

__all__ = [
    "js_distance",
    "pairwise_js_sums",
    "classical_mds",
    "head_distances_over_batches",
    "distances_batch_bytes",
    "HeadMap",
]

# A chunk of queries holds (Q_chunk, N, S) float64 temporaries; this bounds them to ~32 MB.
_CHUNK_ELEMENTS = 1 << 22


def js_distance(p: Tensor, r: Tensor) -> Tensor:
    """The Jensen–Shannon distance (base 2) between distributions along the last dimension.

    Args:
        p, r: (..., S) distributions (non-negative, each summing to 1), broadcastable.

    Returns:
        (...) float64 in [0, 1]: ``sqrt((KL(p ‖ m) + KL(r ‖ m)) / 2)`` in bits, m = (p + r) / 2.
    """
    p, r = p.double(), r.double()
    m = (p + r) / 2
    # xlogy: 0·log 0 = 0, so keys a distribution gives no weight cost nothing
    kl_pm = (torch.special.xlogy(p, p) - torch.special.xlogy(p, m)).sum(-1)
    kl_rm = (torch.special.xlogy(r, r) - torch.special.xlogy(r, m)).sum(-1)
    divergence = (kl_pm + kl_rm) / (2 * math.log(2))
    return divergence.clamp(min=0.0).sqrt()  # rounding can leave -1e-17 for equal rows


def pairwise_js_sums(weights: Tensor) -> Tensor:
    """For every pair of heads, the Jensen–Shannon distance summed over queries.

    Args:
        weights: (Q, N, S): per query, every head's distribution over the S keys.

    Returns:
        (N, N) float64, symmetric with a zero diagonal: ``[i, j] = Σ_q JS(w[q, i], w[q, j])``.
    """
    if weights.dim() != 3:
        raise ValueError(f"weights must be (Q, N, S), got shape {tuple(weights.shape)}")
    q, n, s = weights.shape
    sums = torch.zeros(n, n, dtype=torch.float64, device=weights.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, n * s))
    for start in range(0, q, step):
        w = weights[start : start + step].double()  # (Qc, N, S)
        # ½ KL(p ‖ m) + ½ KL(r ‖ m) = ½ (Σ p log p + Σ r log r) - Σ m log m: the first two
        # once per head, only the last per pair (a third of the work of the KL form). The
        # logarithms are what a pair costs: entr (-m log m, 0 at 0) takes them in one pass.
        neg_entropy = -torch.special.entr(w).sum(-1)  # (Qc, N)
        for i in range(n - 1):
            # head i against every later head; the lower triangle is the mirror (exactly)
            m = (w[:, i : i + 1] + w[:, i + 1 :]).mul_(0.5)  # (Qc, N-i-1, S)
            own = (neg_entropy[:, i : i + 1] + neg_entropy[:, i + 1 :]) / 2
            divergence = (own + torch.special.entr(m).sum(-1)) / math.log(2)
            # rounding can leave -1e-17 where two heads agree
            sums[i, i + 1 :] += divergence.clamp(min=0.0).sqrt().sum(0)
    return sums + sums.T


def classical_mds(distances: Tensor | np.ndarray, dims: int = 2) -> Tensor:
    """Points in ``dims`` dimensions whose Euclidean distances approximate ``distances``.

    Classical (Torgerson) scaling: B = -½ J D² J with J = I - 11ᵀ/N, and the coordinates are the
    top ``dims`` eigenvectors of B scaled by the square roots of their eigenvalues (negative
    eigenvalues, from distances no Euclidean set of points has, count as 0). Exact when the
    distances are those of points in ``dims`` dimensions (up to a rotation or reflection).

    Args:
        distances: (N, N) symmetric, zero diagonal.
        dims: the dimension of the layout.

    Returns:
        (N, dims) float64, centred at the origin; each axis' sign chosen so that its
        largest-magnitude coordinate is positive (a deterministic layout).
    """
    check_positive_int("dims", dims)
    d = np.asarray(
        distances.detach().cpu().numpy() if isinstance(distances, Tensor) else distances,
        dtype=np.float64,
    )
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"distances must be a square (N, N) matrix, got shape {d.shape}")
    if not np.isfinite(d).all():
        raise ValueError("distances must be finite, got NaN or infinity")
    if not np.allclose(d, d.T, atol=1e-9):
        raise ValueError("distances must be symmetric")
    n = d.shape[0]
    if dims > n:
        raise ValueError(f"dims must be at most N={n} (the number of points), got {dims}")
    j = np.eye(n) - np.full((n, n), 1.0 / n)
    b = -0.5 * j @ (d**2) @ j  # (N, N) the centred Gram matrix
    eigenvalues, vectors = np.linalg.eigh((b + b.T) / 2)  # ascending
    top = np.argsort(eigenvalues)[::-1][:dims]
    coords = vectors[:, top] * np.sqrt(np.clip(eigenvalues[top], 0.0, None))  # (N, dims)
    signs = np.sign(coords[np.abs(coords).argmax(axis=0), range(dims)])
    coords = coords * np.where(signs == 0, 1.0, signs)
    return torch.from_numpy(np.ascontiguousarray(coords))


@dataclass
class HeadMap:
    """Heads placed in 2-D by how alike they attend (see the module docstring).

    Attributes:
        layers, heads: the layer (L') and head (H') indices; head n is
            ``(layers[n // H'], heads[n % H'])``.
        distances: (N, N) float64, the mean Jensen–Shannon distance (base 2) between heads.
        positions: (N, 2) float64, the classical MDS layout of ``distances``.
        num_queries: the real query tokens averaged over.
    """

    layers: list[int]
    heads: list[int]
    distances: Tensor
    positions: Tensor
    num_queries: int

    def names(self) -> list[str]:
        """ "L{l}H{h}" for each of the N heads, in order."""
        return [head_label(layer, head) for layer in self.layers for head in self.heads]


def distances_batch_bytes(
    model: nn.Module,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
) -> BatchBytes:
    """What :func:`head_distances_over_batches` holds for a batch of B texts padded to T
    tokens: its weights (L', B, H', T, T) float32, the real queries' copy of them and their
    concatenation, ``3 · 4 · L'·B·H'·T²`` bytes (checks ``layers`` and ``heads``)."""
    num_layers, num_heads = chosen_size(model, layers, heads)

    def batch_bytes(b: int, t: int) -> int:
        return 3 * FLOAT32_BYTES * num_layers * num_heads * b * t * t

    return batch_bytes


def head_distances_over_batches(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    split: DataParallelGroup | None = None,
) -> HeadMap:
    """The mean Jensen–Shannon distance between every pair of heads over a corpus, and its map.

    Each batch runs once inside :func:`~multihead.observe.capture` (every chosen head's weights
    of that batch, on the CPU: O(L'·B·H'·T²) memory, :func:`distances_batch_bytes`); its real
    queries' pairwise distances are added to an (N, N) sum and the weights dropped before the
    next batch. Padding is neither a query nor a key. Time: O(N²·Q·S) for Q real queries.
    :func:`multihead.text.head_distances` is the loop over texts.

    Args:
        model: a module whose attention layers are observable.
        batches: tokenized batches (``input_ids`` (B, T), ``attention_mask`` (B, T), and
            optionally ``token_type_ids``); at least one (over all ranks, with ``split``).
        layers, heads: which heads to compare (as for ``capture``).
        split: the ranks the texts were shared out over
            (:class:`~multihead.distributed.DataParallelGroup`): each rank passes the batches
            of its own texts, every rank calls this, and every rank gets the map of all of them
            (the sums meet in one all-reduce). None: these batches are all.

    Returns:
        A :class:`HeadMap`.

    Raises:
        ValueError: no batch; indices out of range. With ``split``, an error on any rank is
            raised on every rank.
    """
    split = DataParallelGroup.single() if split is None else split
    sums: Tensor | None = None
    count = 0
    chosen: list[int] = []
    head_ids: list[int] = []
    error: Exception | None = None
    try:
        for batch in batches:
            weights, chosen, head_ids = _batch_weights(model, batch, layers, heads)  # (Q, N, S)
            part = pairwise_js_sums(weights)
            sums = part if sums is None else sums + part
            count += weights.shape[0]
            del weights
    except Exception as e:  # every rank must hear of it before the all-reduce
        error = e
    found = [about for about in split.gather((chosen, head_ids), error) if about[0]]
    if not found:
        raise ValueError("batches must hold at least one batch, got none")
    chosen, head_ids = found[0]
    n = len(chosen) * len(head_ids)
    if sums is None:  # this rank had no batch
        sums = torch.zeros(n, n, dtype=torch.float64)
    totals = split.sum(torch.cat([sums.flatten(), sums.new_tensor([count])]))
    count = int(totals[-1])
    distances = totals[:-1].view(n, n) / max(count, 1)
    return HeadMap(chosen, head_ids, distances, classical_mds(distances), count)


def _batch_weights(
    model: nn.Module,
    batch: Any,
    layers: int | Sequence[int] | None,
    heads: int | Sequence[int] | None,
) -> tuple[Tensor, list[int], list[int]]:
    """Every chosen head's weights on a batch's real queries: (Q, N, S), layers, heads."""
    kwargs: dict[str, Any] = {"attention_mask": batch.attention_mask}
    if getattr(batch, "token_type_ids", None) is not None:
        kwargs["token_type_ids"] = batch.token_type_ids
    with capture(model, layers=layers, heads=heads, device="cpu") as rec, torch.no_grad():
        model(batch.input_ids, **kwargs)
    if not rec.records:
        raise ValueError("the model's forward called none of the chosen attention layers")
    chosen = list(dict.fromkeys(rec.layers))
    head_ids = list(rec.records[0].heads)
    real = batch.attention_mask.bool().cpu()  # (B, T)
    # Layer by layer into the real queries' rows, dropping each record once it is copied, so
    # the batch's weights are not held twice over.
    records = rec.records[: len(chosen)]
    rec.clear()
    per_layer = []
    while records:
        record = records.pop(0)
        per_layer.append(record.weights.transpose(1, 2)[real])  # (B, H', T, S) -> (Q, H', S)
        del record
    return torch.cat(per_layer, dim=1), chosen, head_ids  # (Q, N, S), layer-major
