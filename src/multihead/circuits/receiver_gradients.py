"""One gradient run of edge attribution
(:func:`~multihead.circuits.edge_attribution.edge_attribution`): the gradient of the metric at
every receiver's own input, scored against the senders before it.

One forward and one backward from the metric to zeros ξ added to each head's queries, keys and
values (a q/k/v editor), to each feed-forward norm's input and to the final norm's input; then,
per layer and kind, the gradient at the queries (keys, values) goes back to the q/k/v
projections' outputs, each receiving head takes its own columns of them times the same rows of
the projection's matrix (:mod:`~multihead.circuits.projection_columns`: over all heads, one
projection's backward), and the norm's backward runs for all of them at once, vmapped
(``is_grads_batched``); the gradients (R, B, T, E) are then scored against all the senders
before them in one product (a layer that no chosen sender writes before gets no product at all).
Where the projections cannot be read as matrices, or a path passes by them, each head's
cotangent goes through the whole backward instead (batched the same way). On a grouped-query
model with ``kv="query_head"``, the key and value gradients of each query head come from its own
attention recomputed from the recorded q, k and v with the gradient at the heads' outputs (under
the call's score modifications, softcap or sinks, where it has any:
:func:`~multihead.score_mods.modified_attention`), one query head of every group at a time: keys
and values are never repeated per query head.

Shapes: B batch, T tokens, S keys, E residual width, H query heads, Hk key/value heads, D head
dim, N senders, R receivers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.edge_graph import LOGITS, EdgeModel, Receiver
from multihead.circuits.projection_columns import ProjectionColumns
from multihead.kernels import allowed, causal_mask, combine_masks, math_attention
from multihead.observers import AttentionCall, Removable, registered
from multihead.score_mods import modified_attention

__all__ = ["ReceiverGradients"]


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


class ReceiverGradients:
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
    recorded q, k, v with the gradient at their outputs (B, T, H, Dv); keys and values stay
    grouped. A call with score modifications (softcap, sinks, a score_mod or block mask) is
    recomputed under them (:func:`~multihead.score_mods.modified_attention`), a plain one by
    the plain formula (:func:`~multihead.kernels.math_attention`, which costs less)."""
    q, k, v = (t.detach() for t in qkv)
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    mask = call.mask
    if call.is_causal and not call.mods:
        mask = combine_masks(mask, causal_mask(q.shape[2], k.shape[2], device=q.device))
    out = {"k": [], "v": []}  # type: dict[str, list[Tensor]]
    d_out = out_grad.transpose(1, 2)  # (B, H, T, Dv)
    for member in range(group):
        rows = slice(member, heads, group)
        m = mask
        if m is not None and m.dim() == 4 and m.shape[1] == heads:
            m = m[:, rows]
        if m is not None and m.dtype != torch.bool and not bool(allowed(m).any(-1).all()):
            raise ValueError("edge_attribution: a query sees no key (a fully masked row)")
        with torch.enable_grad():
            keys, values = k.clone().requires_grad_(), v.clone().requires_grad_()
            if call.mods:
                chosen = torch.arange(member, heads, group, device=q.device)
                o, _ = modified_attention(
                    q, keys, values, call.mods, mask=call.mask, is_causal=call.is_causal,
                    scale=call.scale, heads=chosen,
                )  # fmt: skip
                assert o is not None
            else:
                o, _ = math_attention(q[:, rows], keys, values, m, call.scale)  # (B, Hk, T, Dv)
            dk, dv = torch.autograd.grad(o, (keys, values), d_out[:, rows].to(o.dtype))
        out["k"].append(dk)
        out["v"].append(dv)
    return out
