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

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from multihead._checks import check_index, describe
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.steering import intervene
from multihead.head_shard import held_heads
from multihead.heads import head_table, parse_head
from multihead.mapping import model_heads
from multihead.observe.recorder import capture
from multihead.observers import AttentionCall, ObservableAttention, registered
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
    return _embedding_of(model, batch.input_ids, batch.attention_mask, batch.token_type_ids)


def _embedding_of(
    model: TextModel, ids: Tensor | None, mask: Tensor | None, types: Tensor | None
) -> Tensor:
    """The sentence embedding (B, E) of (B, T) ids, mask and token types."""
    assert ids is not None and mask is not None
    return model.sentence_embedding(model.hidden_states(ids, mask, types), mask)


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
        return output.logits[:, -1].log_softmax(
            -1, dtype=_at_least_float32(output.logits)
        )  # (B, V)

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
        focus = check_index("focus", focus, batch.input_ids.shape[1], "tokens")
        cut = slice(0, focus + 1)  # the logits at the focus do not depend on later tokens
        ids, mask = batch.input_ids[:, cut], batch.attention_mask[:, cut]
        types = None if batch.token_type_ids is None else batch.token_type_ids[:, cut]

        def outputs(copies: int) -> Tensor:  # (copies·B, V) log-probabilities at the focus
            output = model(*_stacked((ids, mask, types), copies), last_logits_only=True)
            return output.logits[:, -1].log_softmax(-1, dtype=_at_least_float32(output.logits))

        def distance(clean: Tensor, ablated: Tensor) -> Tensor:  # KL(p_clean || p_ablated)
            return (clean.exp() * (clean - ablated)).sum(-1)
    else:

        def outputs(copies: int) -> Tensor:  # (copies·B, E) sentence embeddings
            stacked = _stacked(
                (batch.input_ids, batch.attention_mask, batch.token_type_ids), copies
            )
            return _embedding_of(model, *stacked)

        def distance(clean: Tensor, ablated: Tensor) -> Tensor:
            return 1.0 - (ablated * clean).sum(-1)

    return _stacked_ablation(model, outputs, distance).float().cpu()


def _stacked(inputs: tuple[Tensor | None, ...], copies: int) -> list[Tensor | None]:
    """The inputs repeated ``copies`` times along the batch (variant-major)."""
    return [None if x is None else x.repeat(copies, *([1] * (x.dim() - 1))) for x in inputs]


def _stacked_ablation(
    model: TextModel,
    outputs: Callable[[int], Tensor],
    distance: Callable[[Tensor, Tensor], Tensor],
) -> Tensor:
    """(L, H): per head, the batch mean of ``distance(clean, ablated)`` ((B, ...) → (B,)) with
    the head's output zeroed at every position, ``outputs(n)`` giving the (n·B, ...) outputs of
    n stacked copies of the input.

    The same scores as :func:`multihead.head_importance` by ablation of that metric, with
    every head of a layer ablated in one forward: copy h of the H stacked copies runs without
    head h, and the blocks before the layer hand back their outputs from the clean run
    (:class:`~multihead.circuits.runs.prefix_reuse.PrefixCache`). One forward of H copies reads the
    weights once where H forwards read them H times.
    """
    found = model_heads(model)
    recorded: list[Tensor] = []

    def run(what: str) -> Tensor:
        recorded.append(outputs(1))
        return recorded[-1].sum()

    with torch.no_grad():
        prefix = PrefixCache.build(model, found, run, caller="importance")
        # (a model whose blocks cannot be reused is refused before the clean run is recorded)
        clean = recorded[0] if recorded else outputs(1)
        rows = clean.shape[0]
        scores = head_table(found, clean, None)
        for layer, site in enumerate(s.attention for s in found):
            heads = site.num_heads
            result = _ablated_layer(prefix, layer, site, outputs, compare_first=False)
            if prefix is not None and not prefix.agreed():
                # a reused block's arguments differed from the recorded ones: compare first
                result = _ablated_layer(prefix, layer, site, outputs, compare_first=True)
            per_head = distance(clean.repeat(heads, *([1] * (clean.dim() - 1))), result)
            scores[layer, :heads] = per_head.reshape(heads, rows).mean(-1)
    return scores


def _ablated_layer(
    prefix: PrefixCache | None,
    layer: int,
    site: ObservableAttention,
    outputs: Callable[[int], Tensor],
    *,
    compare_first: bool,
) -> Tensor:
    """``outputs(H)`` of H stacked copies, copy h with head h of ``layer`` (``site``) zeroed."""
    heads = site.num_heads
    keep = torch.ones(heads, 1, 1, heads, 1)
    keep[torch.arange(heads), 0, 0, torch.arange(heads)] = 0.0  # copy h without head h
    # under tensor parallelism a call holds this rank's heads only: their columns of the mask
    held = held_heads(heads, site.head_shard)
    keep = keep[:, :, :, held.start : held.stop]

    def zero(call: AttentionCall, out: Tensor) -> Tensor:
        # out (H·B, T, H_held, Dv): copy h's B rows lose head h (where this call holds it)
        per_copy = out.reshape(heads, -1, *out.shape[1:])
        return (per_copy * keep.to(out)).reshape(out.shape)

    skipping: Any = contextlib.nullcontext()
    if prefix is not None:
        prefix.compare_first = prefix.compare_first or compare_first
        skipping = prefix.skipping(layer, heads)
    with registered([site.register_observer(zero)]), skipping:
        return outputs(heads)


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


def _at_least_float32(x: Tensor) -> torch.dtype:
    """float32, or ``x``'s dtype where it is wider (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)
