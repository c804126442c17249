"""Edge attribution patching (EAP; Syed et al., 2023) and its integrated-gradients form (EAP-IG;
Hanna et al., "Have Faith in Faithfulness", 2024): every edge of the graph at once.

With the graph of :mod:`~multihead.circuits.edge_graph` (senders write into the residual
stream, receivers read it), an edge's score is

    S(s -> r) = Σ_{b, t, e} (w_s(corrupt) - w_s(clean))[b, t, e] · ∂m/∂x_r[b, t, e]

where w_s is the sender's write (B, T, E) and x_r the receiver's own copy of the residual stream
it reads (before its norm): the gradient reaches x_r only through that receiver (a head's
queries, keys or values through the norm and that head's columns of the projection; a
feed-forward network through its norm; the logits through the final norm). S estimates, to
first order, how much the metric moves when that one edge carries the corrupt run's value in
the clean run. With ``ig_steps = m > 1`` the gradient is the mean over the points
``x_α = corrupt + α (clean - corrupt)``, ``α = k / m``, k = 1 … m, of the embeddings
(:mod:`~multihead.circuits.embedding_path`).

How the gradients are taken: one backward from the metric to zeros ξ added to each head's
queries, keys and values (a q/k/v editor), to each feed-forward norm's input and to the final
norm's input; then, per layer and kind, the gradient at the queries (keys, values) goes back to
the q/k/v projections' outputs, each receiving head takes its own columns of them times the
same rows of the projection's matrix (:mod:`~multihead.circuits.projection_columns`: over all
heads, one projection's backward), and the norm's backward runs for all of them at once, vmapped
(``is_grads_batched``); the gradients (R, B, T, E) are then scored against all the senders
before them in one product (a layer that no chosen sender writes before gets no product at all).
Where the projections cannot be read as matrices, or a path passes by them, each head's
cotangent goes through the whole backward instead (batched the same way). On a grouped-query
model with ``kv="query_head"``, the key and value gradients of each query head come from its
own attention recomputed (:func:`~multihead.score_mods.modified_attention` on the recorded q, k,
v under the call's mask and score modifications, and the gradient at the heads' outputs), one
query head of every group at a time: keys and values are never repeated per query head.

Shapes: B batch, T tokens, S keys, E residual width, H query heads, Hk key/value heads, D head
dim, N senders, R receivers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_positive_int, describe
from multihead.circuits.edge_graph import (
    LOGITS,
    RECEIVER_KINDS,
    EdgeModel,
    Receiver,
    Sender,
)
from multihead.circuits.edge_scores import EdgeScores
from multihead.circuits.embedding_path import (
    interpolated_embeddings,
    path_points,
)
from multihead.circuits.experiment import Experiment, warn_if_random
from multihead.circuits.input_pair import Metric
from multihead.circuits.projection_columns import ProjectionColumns
from multihead.observers import AttentionCall, Removable, registered
from multihead.score_mods import ScoreMods, modified_attention

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
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    ig_steps: int = 1,
    senders: Sequence[Any] | None = None,
    receivers: Sequence[str] = ("q", "k", "v", "logits"),
    kv: str = "query_head",
) -> EdgeScores:
    """Score every edge from a sender to a receiver (module docstring), from two recording
    forwards and ``ig_steps`` forwards and backwards.

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
        :class:`~multihead.circuits.edge_scores.EdgeScores`: values (N, R) in the metric's
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
    experiment = Experiment.of(model, clean, corrupt, metric)
    warn_if_random(model, "edge_attribution")
    # the probe run that reads the graph is the clean run: its writes are kept
    graph = EdgeModel.of(experiment, kv, "edge_attribution", keep_writes=True)
    chosen = graph.parse_senders(senders)
    readers = graph.receivers(kinds)
    pair = experiment.pair
    # the senders' differences (N, B, T, E) built in place as the runs write: the clean run's
    # writes, then the corrupt run's less them
    index = {s: i for i, s in enumerate(chosen)}
    held: list[Tensor] = []
    embedded: list[Tensor] = []  # what block 0 is given: the clean run's, the corrupt run's

    def clean_write(sender: Sender, write: Tensor) -> None:
        if sender.kind == "embed":
            embedded.append(write)
        if sender in index:
            if not held:
                dtype = torch.promote_types(write.dtype, torch.float32)
                held.append(write.new_empty((len(chosen), *write.shape), dtype=dtype))
            held[0][index[sender]] = write

    def corrupt_write(sender: Sender, write: Tensor) -> None:
        if sender.kind == "embed":
            embedded.append(write)
        if sender in index:
            row = held[0][index[sender]]
            torch.sub(write.to(row.dtype), row, out=row)

    clean_value = graph.clean_writes(clean_write)
    _, corrupt_value = graph.writes_of(pair.corrupt, "corrupt run", corrupt_write)
    assert held, "the clean run wrote none of the senders"
    dtype = torch.promote_types(clean_value.dtype, held[0].dtype)
    delta = held.pop().to(dtype)
    clean_embed, corrupt_embed = embedded
    stages = [s.stage for s in chosen]  # forward order: the senders before a receiver, a prefix
    scores = torch.zeros(len(chosen), len(readers), dtype=dtype, device=delta.device)
    column = {r: j for j, r in enumerate(readers)}
    columns: dict[tuple[int, int], ProjectionColumns | None] = {}  # found in the first run

    def add(receiver: Receiver, values: Tensor) -> None:
        scores[: values.shape[0], column[receiver]] += values

    for alpha in path_points(ig_steps):
        with interpolated_embeddings(
            graph.mapped, corrupt_embed, clean_embed, alpha, "edge_attribution"
        ):
            _ReceiverGradients(graph, readers, delta, stages, columns).run(add)
    scores /= ig_steps
    before = torch.tensor(stages, device=scores.device)[:, None]
    after = torch.tensor([r.stage for r in readers], device=scores.device)[None, :]
    scores = scores.masked_fill(before >= after, float("nan"))
    return EdgeScores(
        tuple(s.label for s in chosen), tuple(r.label for r in readers), scores,
        float(clean_value), float(corrupt_value), ig_steps, kinds, kv,
    )  # fmt: skip


@dataclass
class _LayerRun:
    """What one attention layer's gradient run keeps: the norm's input, the q/k/v the kernel
    was given (and their ξ), the call, and the per-head output's ξ."""

    stream: Tensor | None = None
    normed: Tensor | None = None  # the norm's output, the projections' input
    projected: dict[int, Tensor] = field(default_factory=dict)  # projection i -> (B, T, out)
    qkv: tuple[Tensor, Tensor, Tensor] | None = None
    xis: tuple[Tensor, Tensor, Tensor] | None = None
    call: AttentionCall | None = None
    out_xi: Tensor | None = None
    mlp_xi: Tensor | None = None


class _ReceiverGradients:
    """One forward and backward on the clean input (whatever block 0 is given), handing each
    receiver's scores against the senders before it (n,) to a callback."""

    def __init__(
        self,
        graph: EdgeModel,
        receivers: list[Receiver],
        delta: Tensor,
        stages: list[int],
        columns: dict[tuple[int, int], ProjectionColumns | None],
    ) -> None:
        self.graph = graph
        self.columns = columns  # (layer, q/k/v index) -> its heads' columns: shared by runs
        self.receivers = receivers
        self.delta = delta  # (N, B, T, E): the senders' corrupt - clean writes, forward order
        self.stages = stages
        self.kinds = {r.kind for r in receivers}
        self.runs = [_LayerRun() for _ in graph.layers]
        self.logits_xi: list[Tensor] = []

    def _before(self, stage: int) -> int:
        """How many senders write before ``stage`` (a prefix of ``delta``)."""
        return sum(1 for s in self.stages if s < stage)

    def _dot(self, n: int, gradients: Tensor) -> Tensor:
        """(n, R): each sender's difference against each gradient (R, B, T, E)."""
        return self.delta[:n].flatten(1) @ gradients.to(self.delta.dtype).flatten(1).T

    def run(self, add: Callable[[Receiver, Tensor], None]) -> None:
        graph = self.graph
        experiment = graph.experiment
        with registered(self._hooks()):
            value = experiment.value(experiment.pair.clean, "clean run")
            if not value.requires_grad:
                raise ValueError(
                    "edge_attribution needs metric(logits) to depend on the model through "
                    "autograd: its result does not require grad (does it detach the logits?)"
                )
            leaves: list[Tensor] = []
            for run in self.runs:
                leaves += [
                    *(run.xis or ()),
                    *(x for x in (run.out_xi, run.mlp_xi) if x is not None),
                ]
            leaves += self.logits_xi
            grads = torch.autograd.grad(value, leaves, retain_graph=True, allow_unused=True)
        found = dict(zip(map(id, leaves), grads, strict=True))

        def grad_of(x: Tensor | None) -> Tensor | None:
            return None if x is None else found[id(x)]

        for receiver in self.receivers:
            g = None
            if receiver.kind == LOGITS:
                g = grad_of(self.logits_xi[0] if self.logits_xi else None)
            elif receiver.kind == "mlp":
                g = grad_of(self.runs[receiver.layer].mlp_xi)
            n = self._before(receiver.stage)
            if g is not None and n:
                add(receiver, self._dot(n, g[None])[:, 0])
        for layer, run in enumerate(self.runs):
            if run.qkv is None or run.stream is None or run.xis is None:
                continue
            wanted = [r for r in self.receivers if r.layer == layer and r.kind in ("q", "k", "v")]
            n = self._before(2 * layer + 1)
            if not wanted or not n:
                continue
            self._backward(layer, run, n, [grad_of(x) for x in run.xis], grad_of(run.out_xi), add)

    def _backward(
        self,
        layer: int,
        run: _LayerRun,
        n: int,
        grads: list[Tensor | None],
        out_grad: Tensor | None,
        add: Callable[[Receiver, Tensor], None],
    ) -> None:
        """Per kind, every receiving head's gradient at the stream, scored against the ``n``
        senders before it: the gradient at q, k or v (on a grouped model with
        ``kv="query_head"``, at the keys or values as one query head per group reads them, a
        round per group member) split into the receivers' heads on the way back."""
        assert run.qkv is not None
        per_query: dict[str, list[Tensor]] | None = None
        for index, kind in enumerate("qkv"):
            mine = [r for r in self.receivers if r.layer == layer and r.kind == kind]
            grad = grads[index]
            if not mine or grad is None:
                continue
            kv_heads = run.qkv[index].shape[1]
            rounds = [(grad, mine, [r.head for r in mine])]
            if kind != "q" and not mine[0].shared and kv_heads != run.qkv[0].shape[1]:
                if out_grad is None or run.call is None:
                    continue
                if per_query is None:
                    per_query = _per_query_head_kv_grads(run.call, run.qkv, out_grad)
                group = run.qkv[0].shape[1] // kv_heads
                rounds = []
                for member, cotangent in enumerate(per_query[kind]):
                    members = [r for r in mine if r.head % group == member]
                    rounds.append((cotangent, members, [r.head // group for r in members]))
            rounds = [(c, members, slots) for c, members, slots in rounds if members]
            values = self._dot(n, self._stream_gradients(layer, run, index, rounds))  # (n, R)
            receivers = [r for _, members, _ in rounds for r in members]
            for j, receiver in enumerate(receivers):
                add(receiver, values[:, j])

    def _stream_gradients(
        self,
        layer: int,
        run: _LayerRun,
        index: int,
        rounds: list[tuple[Tensor, list[Receiver], list[int]]],
    ) -> Tensor:
        """(R, B, T, E): per round ``(cotangent, receivers, slots)``, the part of the
        cotangent (on q, k or v: ``index``) on each of its slots (heads) at the stream, R the
        receivers of all rounds in order: through each head's own columns of the projections
        (:class:`~multihead.circuits.projection_columns.ProjectionColumns`, found once per
        layer and kind), then the norm's backward for all of them at once; where the columns
        cannot be read, each head's cotangent through the whole backward."""
        assert run.qkv is not None and run.stream is not None
        tensor = run.qkv[index]
        inputs = self.graph.layers[layer].inputs
        outputs = [run.projected.get(i) for i in range(len(inputs))]
        present = [o for o in outputs if o is not None]
        ready = run.normed is not None and bool(present) and len(present) == len(outputs)
        if (layer, index) not in self.columns and ready:
            assert run.normed is not None
            matrices = [matrix for _, matrix in inputs]
            self.columns[layer, index] = ProjectionColumns.find(
                tensor, run.normed, present, matrices
            )
        columns = self.columns.get((layer, index))
        if columns is None or not ready:
            slotted = [(c, s) for c, _, slots in rounds for s in slots]
            stacked = tensor.new_zeros(len(slotted), *tensor.shape)  # (R, B, H, T, D)
            for j, (cotangent, slot) in enumerate(slotted):
                stacked[j, :, slot] = cotangent[:, slot]
            (g,) = torch.autograd.grad(
                tensor, run.stream, stacked, retain_graph=True, is_grads_batched=True
            )
            return g
        assert run.normed is not None
        at_normed = columns.backward(tensor, present, [(c, s) for c, _, s in rounds])
        return self._through_norm(run, at_normed)

    def _through_norm(self, run: _LayerRun, at_normed: Tensor) -> Tensor:
        """(R, B, T, E): gradients at the norm's output (R, B, T, E) taken to its input, the
        run's recorded norm backward batched over the R."""
        assert run.stream is not None and run.normed is not None
        (g,) = torch.autograd.grad(
            run.normed, run.stream, at_normed.to(run.normed.dtype), retain_graph=True,
            is_grads_batched=True,
        )  # fmt: skip
        return g

    def _hooks(self) -> Iterator[Removable]:
        graph = self.graph
        qkv_wanted = bool(self.kinds & {"q", "k", "v"})
        grouped_kv = graph.kv == "query_head" and bool(self.kinds & {"k", "v"})
        for layer, parts in enumerate(graph.layers):
            run = self.runs[layer]
            if qkv_wanted:
                yield parts.norm.register_forward_hook(_keep_stream(run))
                for i, (module, _) in enumerate(parts.inputs):
                    yield module.register_forward_hook(_keep_projected(run, i))
                yield graph.sites[layer].register_qkv_editor(_xi_editor(run))
                if grouped_kv:
                    yield graph.sites[layer].register_observer(_out_xi(run))
            if "mlp" in self.kinds and parts.mlp_norm is not None:
                yield parts.mlp_norm.register_forward_pre_hook(_add_xi(run, "mlp_xi"))
        if LOGITS in self.kinds:
            assert graph.mapped.final_norm is not None
            yield graph.mapped.final_norm.register_forward_pre_hook(_logits_xi(self.logits_xi))


def _keep_stream(run: _LayerRun) -> Any:
    def hook(m: nn.Module, args: Any, out: Any) -> None:
        run.stream = args[0]
        run.normed = out if isinstance(out, Tensor) else None

    return hook


def _keep_projected(run: _LayerRun, index: int) -> Any:
    def hook(m: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, Tensor) and args and args[0] is run.normed:
            run.projected[index] = out

    return hook


def _xi_editor(run: _LayerRun) -> Any:
    def editor(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = call.q, call.k, call.v
        xis = tuple(torch.zeros_like(t, requires_grad=True) for t in (q, k, v))
        run.qkv, run.xis, run.call = (q, k, v), xis, call  # type: ignore[assignment]
        return q + xis[0], k + xis[1], v + xis[2]

    return editor


def _out_xi(run: _LayerRun) -> Any:
    def observer(call: AttentionCall, out: Tensor) -> Tensor:
        run.out_xi = torch.zeros_like(out, requires_grad=True)
        return out + run.out_xi

    return observer


def _add_xi(run: _LayerRun, name: str) -> Any:
    def hook(m: nn.Module, args: Any) -> Any:
        xi = torch.zeros_like(args[0], requires_grad=True)
        setattr(run, name, xi)
        return (args[0] + xi, *args[1:])

    return hook


def _logits_xi(store: list[Tensor]) -> Any:
    def hook(m: nn.Module, args: Any) -> Any:
        xi = torch.zeros_like(args[0], requires_grad=True)
        store[:] = [xi]
        return (args[0] + xi, *args[1:])

    return hook


def _per_query_head_kv_grads(
    call: AttentionCall, qkv: tuple[Tensor, Tensor, Tensor], out_grad: Tensor
) -> dict[str, list[Tensor]]:
    """Per group member j, the gradients (B, Hk, S, D) of the keys and values as query heads
    j, G + j, 2G + j, … (one of each group) read them: their attention recomputed from the
    recorded q, k, v under the call's mask, causality and score modifications (softcap, sinks,
    a score_mod or block mask: :func:`~multihead.score_mods.modified_attention`) with the
    gradient at their outputs (B, T, H, Dv); keys and values stay grouped."""
    q, k, v = (t.detach() for t in qkv)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    mods = call.mods if call.mods is not None else ScoreMods()
    out = {"k": [], "v": []}  # type: dict[str, list[Tensor]]
    d_out = out_grad.transpose(1, 2)  # (B, H, T, Dv)
    for member in range(group):
        chosen = torch.arange(member, heads, group, device=q.device)
        with torch.enable_grad():
            keys, values = k.clone().requires_grad_(), v.clone().requires_grad_()
            o, _ = modified_attention(
                q, keys, values, mods, mask=call.mask, is_causal=call.is_causal,
                scale=call.scale, heads=chosen,
            )  # fmt: skip
            assert o is not None  # (B, Hk, T, Dv)
            dk, dv = torch.autograd.grad(o, (keys, values), d_out[:, chosen].to(o.dtype))
        out["k"].append(dk)
        out["v"].append(dv)
    return out
