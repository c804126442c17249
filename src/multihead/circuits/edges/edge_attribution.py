"""Edge attribution patching (EAP; Syed et al., 2023) and its integrated-gradients form (EAP-IG;
Hanna et al., "Have Faith in Faithfulness", 2024): every edge of the graph at once.

With the graph of :mod:`~multihead.circuits.edges.edge_model` (senders write into the residual
stream, receivers read it), an edge's score is

    S(s -> r) = Σ_{b, t, e} (w_s(corrupt) - w_s(clean))[b, t, e] · ∂m/∂x_r[b, t, e]

where w_s is the sender's write (B, T, E) and x_r the receiver's own copy of the residual stream
it reads (before its norm): the gradient reaches x_r only through that receiver (a head's
queries, keys or values through the norm and that head's columns of the projection; a
feed-forward network through its norm; the logits through the final norm). S estimates, to
first order, how much the metric moves when that one edge carries the corrupt run's value in
the clean run. With ``ig_steps = m > 1`` the gradient is the mean over the points
``x_α = corrupt + α (clean - corrupt)``, ``α = k / m``, k = 1 … m, of the embeddings
(:mod:`~multihead.circuits.runs.embedding_path`).

The gradients at the receivers' inputs come from ``ig_steps`` gradient runs
(:class:`~multihead.circuits.edges.receiver_gradients.ReceiverGradients`, which says how they are
taken; the model's parameters ask for no gradient meanwhile, so the runs keep nothing for
theirs), the senders' differences from the corrupt run (the graph's probe) and the clean one,
which is the first gradient run (α = 1): a call is ``ig_steps + 1`` forwards.

Shapes: B batch, T tokens, E residual width, N senders, R receivers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_positive_int, describe
from multihead.circuits.edges.edge_model import EdgeModel
from multihead.circuits.edges.edge_scores import EdgeScores
from multihead.circuits.edges.receiver_gradients import ReceiverGradients
from multihead.circuits.graph import RECEIVER_KINDS, Receiver, Sender
from multihead.circuits.runs.embedding_path import (
    interpolated_embeddings,
    path_points,
)
from multihead.circuits.runs.experiment import Experiment, warn_if_random
from multihead.circuits.runs.metric import Metric

__all__ = ["edge_attribution", "parse_kinds"]


def parse_kinds(receivers: object) -> tuple[str, ...]:
    """The receiver kinds asked for, checked (a non-empty sequence of q, k, v, mlp, logits)."""
    if isinstance(receivers, str) or not isinstance(receivers, Sequence) or not receivers:
        raise TypeError(
            f"receivers must be a non-empty sequence of {', '.join(RECEIVER_KINDS)}, got "
            f"{describe(receivers)}"
        )
    for kind in receivers:
        if kind not in RECEIVER_KINDS:
            raise ValueError(
                f"receivers items must be one of {', '.join(RECEIVER_KINDS)}, got {kind!r}"
            )
    return tuple(k for k in RECEIVER_KINDS if k in receivers)


def edge_attribution(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    *,
    ig_steps: int = 1,
    senders: Sequence[Any] | None = None,
    receivers: Sequence[str] = ("q", "k", "v", "logits"),
    kv: str = "query_head",
) -> EdgeScores:
    """Score every edge from a sender to a receiver (module docstring), from one recording
    forward (the corrupt input) and ``ig_steps`` forwards and backwards.

    Args:
        model: a pre-LN stack (multihead's ``TransformerLM``, a transformers causal LM through
            :mod:`multihead.hf`) with a final norm.
        clean, corrupt: as for :func:`~multihead.patch_heads` (token ids (B, T) or keyword
            dicts of one shape).
        metric: ``metric(logits) -> () or (B,)``, differentiable.
        ig_steps: m, the integrated-gradient points (1: EAP, the gradient at the clean run).
        senders: None (every sender) or the senders to score: ``"embed"``, heads (``"L0H1"``,
            ``(0, 1)``), feed-forward networks (``"MLP0"``, ``("mlp", 0)``).
        receivers: the receiver kinds: any of ``"q"``, ``"k"``, ``"v"``, ``"mlp"``,
            ``"logits"``.
        kv: on grouped-query models, ``"query_head"`` (each query head's own keys and values,
            the default) or ``"shared"`` (the key/value head, read by its whole group).

    Returns:
        :class:`~multihead.EdgeScores`: values (N, R) in the metric's
        dtype (float32 at least), NaN where there is no edge.

    Raises:
        ValueError, TypeError: bad arguments (named), a model the graph cannot be read from, a
            metric that does not depend on the model through autograd.

    Example:
        >>> scores = multihead.edge_attribution(lm, clean, corrupt, metric, ig_steps=16)
        >>> scores.top(5)  # [("L0H1 -> L1H1.k", -0.8), ...]
        >>> multihead.faithfulness(lm, clean, corrupt, metric, scores.circuit(20))
    """
    check_positive_int("ig_steps", ig_steps)
    kinds = parse_kinds(receivers)
    # an experiment the caller holds keeps what is read once on it, for the functions after
    shared = isinstance(model, Experiment)
    experiment = Experiment.of(model, clean, corrupt, metric)
    warn_if_random(experiment.model, "edge_attribution")
    # the probe run that reads the graph is the corrupt run (its writes kept); the clean run's
    # writes are read in the first gradient run, α = 1, which is the clean run itself
    graph = EdgeModel.shared(experiment, kv, "edge_attribution")
    chosen = graph.parse_senders(senders)
    scored = graph.graph(kinds, chosen)
    readers = list(scored.receivers)
    # the senders' differences (N, B, T, E) built in place as the runs write: the corrupt
    # run's writes, then less the clean run's
    index = {s: i for i, s in enumerate(chosen)}
    held: list[Tensor] = []
    embedded: dict[str, Tensor] = {}  # what block 0 is given in each run

    def corrupt_write(sender: Sender, write: Tensor) -> None:
        if sender.kind == "embed":
            embedded["corrupt"] = write
        if sender in index:
            if not held:  # the metric's dtype, float32 at least
                dtype = torch.promote_types(graph.probe_value.dtype, write.dtype)
                dtype = torch.promote_types(dtype, torch.float32)
                held.append(write.new_empty((len(chosen), *write.shape), dtype=dtype))
            held[0][index[sender]] = write

    def clean_write(sender: Sender, write: Tensor) -> None:
        if sender.kind == "embed":
            embedded["clean"] = write
        if sender in index:
            row = held[0][index[sender]]
            torch.sub(row, write.to(row.dtype), out=row)

    # an experiment the caller holds keeps the corrupt writes for faithfulness after
    corrupt_value = graph.probe_writes(corrupt_write, release=not shared)
    assert held, "the corrupt run wrote none of the senders"
    delta = held[0]
    stages = [s.stage for s in chosen]  # forward order: the senders before a receiver, a prefix
    scores = torch.zeros(len(chosen), len(readers), dtype=delta.dtype, device=delta.device)
    column = {r: j for j, r in enumerate(readers)}

    def add(receiver: Receiver, values: Tensor) -> None:
        scores[: values.shape[0], column[receiver]] += values

    gradients = ReceiverGradients(graph, readers, delta, stages, add)
    *points, last = path_points(ig_steps)
    with experiment.activation_gradients():
        # α = 1 first: its forward completes the differences the backwards read
        with interpolated_embeddings(graph.mapped, None, None, last, "edge_attribution"):
            clean_value = gradients.step(graph.recorded_writes(clean_write))
        experiment.adopt("clean", experiment.last_output, clean_value)
        for alpha in points:
            with interpolated_embeddings(
                graph.mapped, embedded["corrupt"], embedded["clean"], alpha, "edge_attribution"
            ):
                gradients.step()
    gradients.finish()
    scores /= ig_steps
    before = torch.tensor(stages, device=scores.device)[:, None]
    after = torch.tensor([r.stage for r in readers], device=scores.device)[None, :]
    scores = scores.masked_fill(before >= after, float("nan"))
    return EdgeScores(scored, scores, float(clean_value), float(corrupt_value), ig_steps)
