"""What happens without a head: the effects on a sentence that :func:`multihead.explain` reports.

Attention maps show where a head looks, not whether it matters. For an encoder such as MiniLM
whose output is a sentence embedding (mean over real tokens, L2-normalised), a head matters as
much as removing it moves that embedding (for a decoder, the last real token's state,
L2-normalised: what its next-token prediction reads; see :mod:`multihead.text.model`):

    importance[l, h] = 1 - cos(e_clean, e_{without head (l, h)})

the cosine distance between the clean embedding and the embedding with head (l, h)'s output
zeroed (:func:`multihead.head_importance`, ``method="ablation"``). 0 means the head changes
nothing; MiniLM's largest values are a few hundredths. Zeroing acts on the per-head output
before the output projection (:func:`multihead.intervene`), where a head exists as itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from multihead._checks import check_index, describe
from multihead.circuits.importance import head_importance
from multihead.circuits.steering import intervene
from multihead.observe.recorder import capture
from multihead.sites import parse_head
from multihead.text.model import TextModel
from multihead.text.tokenization import TokenBatch

__all__ = [
    "embedding_distance",
    "every_head",
    "importance",
    "ablated_weights",
    "check_heads",
    "Ablation",
]


@dataclass(frozen=True)
class Ablation:
    """A text run with some heads zero-ablated, beside the clean run.

    Attributes:
        heads: the (layer, head) pairs zeroed.
        weights: (L, H, T, T) every head's weights in the ablated run (float32, CPU).
        cosine: cosine similarity of the ablated sentence embedding to the clean one.
    """

    heads: tuple[tuple[int, int], ...]
    weights: Tensor
    cosine: float


def check_heads(
    name: str, heads: Sequence[tuple[int, int]], num_layers: int, num_heads: int
) -> list[tuple[int, int]]:
    """(layer, head) pairs, each in range; returns them normalised (negative from the end)."""
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence) or not heads:
        raise TypeError(
            f"{name} must be a non-empty sequence of (layer, head) pairs, got {describe(heads)}"
        )
    out = []
    for item in heads:
        pair = parse_head(f"{name} item", item)  # "L0H1" or (0, 1)
        layer = check_index(f"{name} layer", pair[0], num_layers, "layers")
        head = check_index(f"{name} head", pair[1], num_heads, "heads")
        out.append((layer, head))
    if len(set(out)) != len(out):
        raise ValueError(f"{name} names a head twice: {out}")
    return out


def _embedding(model: TextModel, batch: TokenBatch) -> Tensor:
    """The sentence embedding (B, E), L2-normalised (the model's ``sentence_embedding``)."""
    hidden = model.hidden_states(batch.input_ids, batch.attention_mask, batch.token_type_ids)
    return model.sentence_embedding(hidden, batch.attention_mask)


def embedding_distance(model: TextModel, batch: TokenBatch) -> tuple[Tensor, Callable[[], Tensor]]:
    """The clean embedding (B, E) and a metric for :func:`multihead.head_importance`: the mean
    over the batch of 1 - cos(clean, current), as a scalar tensor (0 for the clean model)."""
    with torch.no_grad():
        clean = _embedding(model, batch)

    def metric() -> Tensor:
        return 1.0 - (_embedding(model, batch) * clean).sum(-1).mean()

    return clean, metric


def importance(model: TextModel, batch: TokenBatch) -> Tensor:
    """(L, H) cosine distance of the sentence embedding when each head is zeroed (float32, CPU).

    Args:
        model: a TextModel in eval mode.
        batch: its tokenized text.
    """
    _, metric = embedding_distance(model, batch)
    return head_importance(model, metric, method="ablation").float().cpu()


def every_head(model: TextModel, batch: TokenBatch) -> tuple[Tensor, Tensor]:
    """Run one text under :func:`multihead.capture`: every layer's and head's weights
    (L, H, T, T), float32 on the CPU, and the sentence embedding (E,)."""
    if batch.input_ids.shape[0] != 1:
        raise ValueError(f"batch must hold one text, got {batch.input_ids.shape[0]}")
    with torch.no_grad(), capture(model, device="cpu") as rec:
        embedding = _embedding(model, batch)[0]
    return torch.stack([w[0] for w in rec.weights]).float(), embedding


def ablated_weights(
    model: TextModel, batch: TokenBatch, heads: Sequence[tuple[int, int]]
) -> Ablation:
    """Run ``batch`` with ``heads`` zero-ablated: every head's weights and the embedding's cosine
    similarity to the clean one. The model is left exactly as it was."""
    clean, _ = embedding_distance(model, batch)
    pairs = tuple((int(layer), int(head)) for layer, head in heads)
    with intervene(model, dict.fromkeys(pairs, 0.0)):
        weights, ablated = every_head(model, batch)
    cosine = float(ablated @ clean[0])
    return Ablation(heads=pairs, weights=weights, cosine=cosine)
