"""What happens without a head: the effects on a sentence that :func:`multihead.explain` reports.

Attention maps show where a head looks, not whether it matters. A head matters as much as
removing it moves what the model puts out, measured by :func:`multihead.head_importance`
(``method="ablation"``: head (l, h)'s output zeroed):

- a causal language model with its head (``TextModel.head == "lm"``) predicts the next token:
  the KL divergence, in nats, of the next-token distribution at the focus token,

      importance[l, h] = KL(p_clean || p_{without head (l, h)}),  p = softmax(logits[focus]);

  the cosine distance of a hidden state follows the prediction poorly (on SmolLM2-135M the head
  that moves the next-token distribution most ranked 160th of 270 by it);
- any other text model (an encoder such as MiniLM, whose output is a sentence embedding: the
  mean over real tokens, L2-normalised; a decoder without its head: the last real token's
  state, see :mod:`multihead.text.model`): the cosine distance of that embedding,

      importance[l, h] = 1 - cos(e_clean, e_{without head (l, h)}).

0 means the head changes nothing; MiniLM's largest cosine distances are a few hundredths.
Zeroing acts on the per-head output before the output projection (:func:`multihead.intervene`),
where a head exists as itself. :func:`importance_measure` says in words which is measured.
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

# What importance() measures, in words (importance_measure).
NEXT_TOKEN_KL = "KL divergence (nats) of the next-token distribution at the focus, head zeroed"
EMBEDDING_COSINE = "cosine distance of the sentence embedding, head zeroed"

__all__ = [
    "embedding_distance",
    "next_token_divergence",
    "every_head",
    "importance",
    "importance_measure",
    "predicts_next_token",
    "NEXT_TOKEN_KL",
    "EMBEDDING_COSINE",
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


def next_token_divergence(
    model: TextModel, batch: TokenBatch, position: int
) -> tuple[Tensor, Callable[[], Tensor]]:
    """The clean next-token log-probabilities (B, V) at ``position`` and a metric for
    :func:`multihead.head_importance`: the mean over the batch of KL(p_clean || p_current) in
    nats, as a scalar tensor (0 for the clean model). ``model`` keeps its language-model head
    (``head="lm"``: its forward gives logits)."""

    # A causal model's logits at ``position`` do not depend on the tokens after it: the runs
    # stop there and unembed that position alone.
    position = check_index("position", position, batch.input_ids.shape[1], "tokens")
    cut = slice(0, position + 1)
    ids, mask = batch.input_ids[:, cut], batch.attention_mask[:, cut]
    types = None if batch.token_type_ids is None else batch.token_type_ids[:, cut]

    def log_probs() -> Tensor:
        output = model(ids, mask, types, last_logits_only=True)
        return output.logits[:, -1].float().log_softmax(-1)  # (B, V)

    with torch.no_grad():
        clean = log_probs()

    def metric() -> Tensor:
        return (clean.exp() * (clean - log_probs())).sum(-1).mean()

    return clean, metric


def predicts_next_token(model: TextModel) -> bool:
    """Whether :func:`importance` measures ``model``'s next-token distribution (a causal
    language model with its head) rather than its sentence embedding."""
    return model.causal and model.head == "lm"


def importance_measure(model: TextModel) -> str:
    """What :func:`importance` measures for ``model``, in words (for titles and reports)."""
    return NEXT_TOKEN_KL if predicts_next_token(model) else EMBEDDING_COSINE


def importance(model: TextModel, batch: TokenBatch, focus: int) -> Tensor:
    """(L, H) how far zeroing each head moves what the model puts out (float32, CPU): for a
    causal language model with its head, the KL divergence of the next-token distribution at
    the token ``focus``; else the cosine distance of the sentence embedding
    (:func:`importance_measure` says which).

    Args:
        model: a TextModel in eval mode.
        batch: its tokenized text.
        focus: the position whose next-token distribution is measured (0 ≤ focus < T).
    """
    if predicts_next_token(model):
        _, metric = next_token_divergence(model, batch, focus)
    else:
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
