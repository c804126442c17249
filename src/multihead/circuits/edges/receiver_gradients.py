"""The gradient runs of edge attribution
(:func:`~multihead.edge_attribution`): the gradient of the metric at
every receiver's own input, summed over the runs and scored against the senders before it.

Each run is one forward and one backward from the metric to zeros ξ added to each head's
queries, keys and values (a q/k/v editor), to each feed-forward norm's input and to the final
norm's input, and to the q/k/v projections' outputs. A feed-forward network's and the logits'
gradients are summed over the runs and scored once. A head's gradient at the stream is its own
columns g of the projections' outputs
(:mod:`~multihead.circuits.edges.projection_columns`) times the same rows of the
projections' matrices M, then the norm's backward. Where the norm is a LayerNorm
or RMSNorm, y = γ ⊙ c / σ (+ β) with c the stream x (less its mean for a LayerNorm),
that backward is written out,

    Jᵀu = v - mean(v) - c ⟨v, c⟩ / (E σ²),    v = γ ⊙ u / σ,    u = g M

(no mean for an RMSNorm), and it splits the runs apart: the first two terms are linear in g / σ,
so ``g / σ`` is summed over the runs on the heads' columns (the size of q, k and v) and taken
through M, γ and the centring once, after the last run; the third is scored in each run as
⟨δ, c⟩ ⟨g, σ (y - β) Mᵀ⟩ / (E σ³) per token, (y - β) Mᵀ being the projection's output less its
constant (bias + β Mᵀ). Integrated gradients' runs then cost little beyond their forward and
backward. Elsewhere (a norm of another kind, or one that computes in a lower precision than the
stream, as transformers' RMSNorms do in float32 on a float64 model) each run takes every head's
u through the norm's recorded backward, vmapped (``is_grads_batched``), and scores it; where the
projections cannot be read as matrices, or a path passes by them, each head's cotangent goes
through the whole backward instead (batched the same way).

A head's columns of the projections' outputs are read off the run's own backward where they
feed that head alone (shown in the first run from the graph: no path reaches the projections'
outputs but through the layers' q, k and v, and no column feeds two heads). What needs a
layer's graph from its q, k and v back to the stream (the heads' columns, found in the first
run; a cotangent that is not q, k or v's whole gradient; a norm not read in closed form) is
taken inside the run's backward, as the gradients of q, k and v arrive (hooks on their ξ) and
before the backward reaches their projections: the backward keeps no graph, so a run's memory
is its forward's, freed as the backward goes.

On a grouped-query model with ``kv="query_head"``, the key and value gradients of each query
head come from its own attention recomputed from the recorded q, k and v
(:mod:`~multihead.circuits.edges.query_head_kv`): keys and values are never repeated per query head.

Shapes: B batch, T tokens, E residual width, N senders (n: those before a receiver), R
receivers, BT = B·T.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.edges.edge_model import EdgeModel
from multihead.circuits.edges.projection_columns import ProjectionColumns, walked
from multihead.circuits.edges.query_head_kv import query_head_kv_grads
from multihead.circuits.graph import LOGITS, Receiver
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["ReceiverGradients"]


@dataclass
class _LayerRun:
    """What one attention layer's gradient run keeps: the norm's input and output, the
    projections' outputs, the q/k/v the kernel was given (and their ξ), the call, the per-head
    output's ξ (and its gradient), the norm's reading and what waits for the backward's end."""

    stream: Tensor | None = None
    normed: Tensor | None = None  # the norm's output, the projections' input
    projected: dict[int, Tensor] = field(default_factory=dict)  # projection i -> (B, T, out)
    qkv: tuple[Tensor, Tensor, Tensor] | None = None
    xis: tuple[Tensor, Tensor, Tensor] | None = None
    call: AttentionCall | None = None
    out_xi: Tensor | None = None
    out_grad: Tensor | None = None  # the metric's gradient at the heads' outputs
    per_query: dict[str, list[Tensor]] | None = None  # keys' and values' (query_head_kv)
    mlp_xi: Tensor | None = None
    reading: _NormedRun | None = None  # the norm read in closed form (this run's), if it is
    read: bool = False  # whether ``reading`` was looked for
    # per q/k/v: what waits for the backward's end (the gradients at the projections' outputs)
    pending: list[_Pending] = field(default_factory=list)


@dataclass
class _ColumnSums:
    """One layer's q, k or v receivers whose gradients are summed over the runs on their
    heads' columns, each run's divided by its σ, and taken to the stream once (module
    docstring)."""

    receivers: list[Receiver]
    slots: list[int]  # each receiver's slot (head) of the tensor
    columns: ProjectionColumns
    sums: list[Tensor | None]  # per projection (BT, R, width)


@dataclass
class _NormedRun:
    """One run's reading of a layer's attention norm in closed form (module docstring)."""

    norm: FrozenNorm  # frozen at this run (its σ (B, T, 1))
    along: Tensor  # (n, BT): each sender's difference against the stream c the norm read
    shifted: list[Tensor]  # per projection (BT, out): its output less its constant (y - β) Mᵀ


@dataclass
class _Pending:
    """One layer's q, k or v (``index``) as its gradient arrived in the run's backward: the
    rounds, the heads' columns and, where they were taken back through the layer's graph then,
    their gradients on those columns (None: to be read off the projections' outputs)."""

    index: int
    rounds: list[tuple[Tensor, list[Receiver], list[int]]]
    columns: ProjectionColumns
    parts: list[Tensor | None] | None


# A run's norm is taken in closed form where its rebuild is this many rounding steps of its
# output from the output (a norm that computes in a lower precision than the stream, as
# transformers' RMSNorms do in float32 on a float64 model, goes through autograd instead).
_EXACT_STEPS = 64
# The most elements a temporary product over the senders' differences holds at once.
_CHUNK = 1 << 18


class ReceiverGradients:
    """The gradient runs of one edge attribution: :meth:`step` once per run (on whatever
    block 0 is given), then :meth:`finish`; each hands receivers' scores against the senders
    before them (n,) to ``add``, their sum over the runs the edges' scores."""

    def __init__(
        self,
        graph: EdgeModel,
        receivers: list[Receiver],
        delta: Tensor,
        stages: list[int],
        add: Callable[[Receiver, Tensor], None],
    ) -> None:
        self.graph = graph
        self.receivers = receivers
        self.delta = delta  # (N, B, T, E): the senders' corrupt - clean writes, forward order
        self.stages = stages
        self.add = add
        self.kinds = {r.kind for r in receivers}
        self.columns: dict[tuple[int, int], ProjectionColumns | None] = {}  # found in run 1
        self.sums: dict[tuple[int, int], _ColumnSums] = {}  # (layer, q/k/v index) -> sums
        self.summed: dict[Receiver, Tensor] = {}  # a feed-forward's or the logits' gradient
        self.norms: dict[int, FrozenNorm | None] = {}  # layer -> its attention norm (run 1's)
        self.constants: dict[tuple[int, int], Tensor] = {}  # (layer, projection) -> (out,)
        self.direct: dict[tuple[int, int], bool] = {}  # (layer, q/k/v index): _check_direct
        self.checked = False  # whether the first run has filled ``direct``

    def _before(self, stage: int) -> int:
        """How many senders write before ``stage`` (a prefix of ``delta``)."""
        return sum(1 for s in self.stages if s < stage)

    def _dot(self, n: int, gradients: Tensor) -> Tensor:
        """(n, R): each sender's difference against each gradient (R, B, T, E)."""
        return self.delta[:n].flatten(1) @ gradients.to(self.delta.dtype).flatten(1).T

    def _add_columns(self, receivers: list[Receiver], values: Tensor) -> None:
        """Hand each receiver its column of ``values`` (n, R)."""
        for j, receiver in enumerate(receivers):
            self.add(receiver, values[:, j])

    def step(self, recording: AbstractContextManager[Any] | None = None) -> Tensor:
        """One forward and backward on the clean input (whatever block 0 is given), the
        forward within ``recording`` if given (the senders' differences are read only in the
        backward); the metric on it, detached. What needs a layer's graph from its q, k and v
        back to the stream is done as their gradients arrive in the backward, before it passes
        them (and frees that graph): the backward keeps no graph."""
        graph = self.graph
        experiment = graph.experiment
        runs = [_LayerRun() for _ in graph.layers]
        logits_xi: list[Tensor] = []
        with registered(self._hooks(runs, logits_xi)) as made:
            with recording or contextlib.nullcontext():
                value = experiment.value(experiment.pair.clean, "clean run")
            if not value.requires_grad:
                raise ValueError(
                    "edge_attribution needs metric(logits) to depend on the model through "
                    "autograd: its result does not require grad (does it detach the logits?)"
                )
            counts = {layer: self._watched(layer, run) for layer, run in enumerate(runs)}
            watched = {layer: n for layer, n in counts.items() if n}
            if not self.checked:
                self._check_direct(value, runs, watched)
            leaves: list[Tensor] = []
            for layer, run in enumerate(runs):
                leaves += [
                    *(run.xis or ()),
                    *(x for x in (run.out_xi, run.mlp_xi) if x is not None),
                ]
                if layer in watched:  # removed on exit: they hold the run
                    made += self._watch(layer, run, watched[layer])
            leaves += logits_xi
            # the projections' outputs too: where a head's columns of them feed nothing but
            # that head (_check_direct), the gradient there is its own
            leaves += [p for run in runs if run.qkv is not None for p in run.projected.values()]
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        found = dict(zip(map(id, leaves), grads, strict=True))
        value = value.detach()

        def grad_of(x: Tensor | None) -> Tensor | None:
            return None if x is None else found[id(x)]

        for receiver in self.receivers:
            g = None
            if receiver.kind == LOGITS:
                g = grad_of(logits_xi[0] if logits_xi else None)
            elif receiver.kind == "mlp":
                g = grad_of(runs[receiver.layer].mlp_xi)
            if g is not None and self._before(receiver.stage):
                g = g.to(self.delta.dtype)
                held = self.summed.get(receiver)
                self.summed[receiver] = g if held is None else held.add_(g)
        for layer, run in enumerate(runs):
            projected_grads = {i: grad_of(p) for i, p in run.projected.items()}
            for pending in run.pending:
                self._sum(layer, run, pending, self._parts(pending, projected_grads))
        return value

    def finish(self) -> None:
        """Score what the runs summed: a feed-forward's and the logits' gradients, and the q,
        k and v receivers' sums taken to the stream (module docstring)."""
        for receiver, g in self.summed.items():
            self.add(receiver, self._dot(self._before(receiver.stage), g[None])[:, 0])
        for (layer, _), entry in self.sums.items():
            # the norm's backward with each run's σ already in the sums: γ, then the centring,
            # both maps of the last axis alone, taken to the rows of the projections
            first = self.norms[layer]
            assert first is not None, "a layer summed without its norm"
            read = replace(first, sigma=first.sigma.new_ones(1, 1, 1))
            at_stream = entry.columns.to_input(entry.sums, entry.slots, read.read)  # (R, BT, E)
            values = self._dot(self._before(2 * layer + 1), at_stream)
            self._add_columns(entry.receivers, values)

    def _watched(self, layer: int, run: _LayerRun) -> int:
        """How many senders write before layer ``layer``'s attention where the run recorded
        it and receivers of its q, k or v are scored against them; else 0."""
        if run.qkv is None or run.stream is None or run.xis is None:
            return 0
        if not any(r.layer == layer and r.kind in ("q", "k", "v") for r in self.receivers):
            return 0
        return self._before(2 * layer + 1)

    def _check_direct(self, value: Tensor, runs: list[_LayerRun], watched: dict[int, int]) -> None:
        """Which watched layers' q, k and v take their heads' whole gradients off the
        backward's own gradient at the projections' outputs (in the first run, before its
        backward): those whose projections' outputs no path from ``value`` reaches but through
        the layers' q, k and v, and whose columns no two of q, k and v read (each column feeds
        one head: :meth:`ProjectionColumns.find`). There the gradient at a head's columns is
        what its own cotangent gives them."""
        self.checked = True
        cuts = [t for run in runs if run.qkv is not None for t in run.qkv]
        before = walked([value], cuts)
        for layer in watched:
            run = runs[layer]
            found = [self._columns(layer, run, index) for index in range(3)]
            for index, columns in enumerate(found):
                self.direct[layer, index] = (
                    columns is not None
                    and not any(id(run.projected[i].grad_fn) in before for i in columns.used)
                    and all(
                        other is not None and not columns.overlaps(other)
                        for j, other in enumerate(found)
                        if j != index
                    )
                )

    def _watch(self, layer: int, run: _LayerRun, n: int) -> list[Removable]:
        """Hooks on the run's ξ of layer ``layer``'s q, k, v (and heads' outputs) that take
        each gradient as the backward reaches it (:meth:`_arrived`)."""
        assert run.xis is not None
        handles = []
        if run.out_xi is not None:
            # reached before the kernel's backward, so before any of q, k, v
            handles.append(run.out_xi.register_hook(lambda g: setattr(run, "out_grad", g)))
        for index, xi in enumerate(run.xis):
            handles.append(
                xi.register_hook(lambda g, index=index: self._arrived(layer, run, n, index, g))
            )
        return handles

    def _arrived(self, layer: int, run: _LayerRun, n: int, index: int, grad: Tensor) -> None:
        """Within the run's backward, the gradient ``grad`` at q, k or v (``index``) of layer
        ``layer``, before the backward goes on to their projections and norm: its receiving
        heads split apart (on a grouped model with ``kv="query_head"``, at the keys or values
        as one query head per group reads them, a round per group member) and, where the norm
        is read in closed form, what needs the layer's graph taken now (the heads' columns,
        found in the first run; a cotangent that is not the whole gradient), the rest when
        the backward ends (:meth:`step`); else taken to the stream and scored now, against the
        ``n`` senders before the layer."""
        assert run.qkv is not None
        kind = "qkv"[index]
        mine = [r for r in self.receivers if r.layer == layer and r.kind == kind]
        if not mine:
            return
        kv_heads = run.qkv[index].shape[1]
        rounds = [(grad, mine, [r.head for r in mine])]
        if kind != "q" and not mine[0].shared and kv_heads != run.qkv[0].shape[1]:
            # the heads' outputs' gradient arrived first (before the kernel's backward)
            assert run.out_grad is not None and run.call is not None
            if run.per_query is None:  # the keys' and the values' at once
                run.per_query = query_head_kv_grads(run.call, run.qkv, run.out_grad)
            group = run.qkv[0].shape[1] // kv_heads
            rounds = []
            for member, cotangent in enumerate(run.per_query[kind]):
                members = [r for r in mine if r.head % group == member]
                rounds.append((cotangent, members, [r.head // group for r in members]))
        rounds = [(c, members, slots) for c, members, slots in rounds if members]
        if not run.read:
            run.reading, run.read = self._normed_run(layer, run, n), True
        columns = self._columns(layer, run, index)
        if columns is not None and run.reading is not None:
            whole = len(rounds) == 1 and rounds[0][0] is grad  # q, k or v's whole gradient
            parts = None
            if not (whole and self.direct.get((layer, index))):
                outputs = [run.projected[i] for i in range(len(run.projected))]
                cotangents = [(c, s) for c, _, s in rounds]
                parts = columns.at_columns(run.qkv[index], outputs, cotangents)
            run.pending.append(_Pending(index, rounds, columns, parts))
            return
        values = self._dot(n, self._stream_gradients(layer, run, index, rounds, columns))
        self._add_columns([r for _, members, _ in rounds for r in members], values)

    def _normed_run(self, layer: int, run: _LayerRun, n: int) -> _NormedRun | None:
        """This run's reading of layer ``layer``'s attention norm in closed form, where it is
        a LayerNorm or RMSNorm that the first run's output rebuilds to a few rounding steps
        (checked once); else None."""
        parts = self.graph.layers[layer]
        if parts.norm_eps is None or run.stream is None or run.normed is None:
            return None
        if not parts.inputs or len(run.projected) != len(parts.inputs):
            return None  # the projections' columns cannot be read either
        dtype = self.delta.dtype
        x, y = run.stream.detach().to(dtype), run.normed.detach()
        if layer not in self.norms:
            self.norms[layer] = self._checked_norm(layer, x, y)
        first = self.norms[layer]
        if first is None:
            return None
        c = x - x.mean(-1, keepdim=True) if first.centred else x  # the stream the norm reads
        norm = replace(first, sigma=FrozenNorm.scale(c, parts.norm_eps, centred=False))
        c = c.flatten(0, 1)  # (BT, E)
        along = c.new_empty(n, c.shape[0])  # (n, BT): ⟨δ, c⟩, by chunks of senders (the
        # product's temporary bounded: the whole one is as large as the differences)
        chunk = max(1, _CHUNK // c.numel())
        for start in range(0, n, chunk):
            part = self.delta[start : min(n, start + chunk)].flatten(1, 2)
            torch.sum(part * c, -1, out=along[start : start + part.shape[0]])
        shifted = []  # per projection (BT, out): its output less its constant, (y - β) Mᵀ
        for i, (_, matrix) in enumerate(parts.inputs):
            out = run.projected[i].detach().to(dtype).flatten(0, 1)
            if (layer, i) not in self.constants:
                given = y[0, 0].to(dtype) - (norm.beta if norm.beta is not None else 0.0)
                self.constants[layer, i] = out[0] - given @ matrix.to(dtype).T
            shifted.append(out - self.constants[layer, i])
        return _NormedRun(norm, along, shifted)

    def _checked_norm(self, layer: int, x: Tensor, y: Tensor) -> FrozenNorm | None:
        """The attention norm of ``layer`` frozen at the run that mapped ``x`` to ``y`` (B, T,
        E), where it is a LayerNorm or RMSNorm whose rebuild is within a few rounding steps of
        ``y``; else None."""
        parts = self.graph.layers[layer]
        rounding = torch.finfo(y.dtype).eps
        dtype = self.delta.dtype
        try:
            with torch.no_grad():
                norm = FrozenNorm.of(parts.norm, parts.norm_eps, x, y.to(dtype), "", rounding)
        except ValueError:
            return None
        beta = None if norm.beta is None else norm.beta.detach()
        norm = replace(norm, gamma=norm.gamma.detach(), beta=beta)  # the weights' values
        rebuilt = norm.linear(x) + (beta if beta is not None else 0.0)
        tolerance = _EXACT_STEPS * rounding * max(1.0, float(y.abs().max()))
        return norm if float((rebuilt - y.to(dtype)).abs().max()) <= tolerance else None

    def _columns(self, layer: int, run: _LayerRun, index: int) -> ProjectionColumns | None:
        """The heads' columns of the projections that made q, k or v (``index``), found for all
        three in the first run that recorded them all (None where they cannot be read)."""
        assert run.qkv is not None
        count = len(self.graph.layers[layer].inputs)
        if run.normed is None or not count or len(run.projected) != count:
            return None
        if (layer, index) not in self.columns:  # q's, k's and v's in one backward
            outputs = [run.projected[i] for i in range(count)]
            matrices = [matrix for _, matrix in self.graph.layers[layer].inputs]
            found = ProjectionColumns.find(list(run.qkv), run.normed, outputs, matrices)
            for i, columns in enumerate(found):
                self.columns[layer, i] = columns
        return self.columns[layer, index]

    def _sum(
        self, layer: int, run: _LayerRun, pending: _Pending, parts: list[Tensor | None]
    ) -> None:
        """This run's gradients of q, k or v on each receiving head's columns (``parts``, per
        projection (BT, R, width)), divided by the run's σ, added to the layer's sums; the
        norm's third term (σ's own dependence on the stream) scored now (module docstring)."""
        reading, columns, rounds = run.reading, pending.columns, pending.rounds
        assert reading is not None
        dtype = self.delta.dtype
        slots = [s for _, _, round_slots in rounds for s in round_slots]
        sigma = reading.norm.sigma.flatten(0, 1)  # (BT, 1)
        entry = self.sums.get((layer, pending.index))
        if entry is None:
            receivers = [r for _, members, _ in rounds for r in members]
            entry = _ColumnSums(receivers, slots, columns, [None] * len(parts))
            self.sums[layer, pending.index] = entry
        reach: Tensor | None = None  # (BT, R): ⟨g, (y - β) Mᵀ⟩ on each receiver's columns
        for i, part in enumerate(parts):
            if part is None:
                continue
            part = part.to(dtype)
            held = entry.sums[i]
            scaled = part / sigma[:, :, None]
            entry.sums[i] = scaled if held is None else held.add_(scaled)
            seen = columns.gather(i, reading.shifted[i], slots)  # (BT, R, width)
            term = (part * seen).sum(-1)
            reach = term if reach is None else reach.add_(term)
        assert reach is not None, "a cotangent reached no projection"
        width = reading.norm.gamma.shape[-1]
        values = -reading.along @ (reach / (width * sigma**2))  # (n, R)
        self._add_columns(entry.receivers, values)

    def _parts(
        self, pending: _Pending, projected_grads: dict[int, Tensor | None]
    ) -> list[Tensor | None]:
        """Per projection (BT, R, width): the pending rounds' gradients on each receiving
        head's columns: those taken through the layer's graph as they arrived, else (a whole
        gradient, :meth:`_check_direct`) its columns of the gradient the backward left at the
        projections' outputs."""
        if pending.parts is not None:
            return pending.parts
        columns = pending.columns
        slots = [s for _, _, round_slots in pending.rounds for s in round_slots]
        found: list[Tensor | None] = []
        for i, cols in enumerate(columns.columns):
            held = projected_grads.get(i)
            found.append(None if cols is None or held is None else columns.gather(i, held, slots))
        return found

    def _stream_gradients(
        self,
        layer: int,
        run: _LayerRun,
        index: int,
        rounds: list[tuple[Tensor, list[Receiver], list[int]]],
        columns: ProjectionColumns | None,
    ) -> Tensor:
        """(R, B, T, E): per round ``(cotangent, receivers, slots)``, the part of the
        cotangent (on q, k or v: ``index``) on each of its slots (heads) at the stream, R the
        receivers of all rounds in order: through each head's own ``columns`` of the
        projections, then the norm's recorded backward for all of them at once; where the
        columns cannot be read, each head's cotangent through the whole backward."""
        assert run.qkv is not None and run.stream is not None
        tensor = run.qkv[index]
        if columns is None:
            slotted = [(c, s) for c, _, slots in rounds for s in slots]
            stacked = tensor.new_zeros(len(slotted), *tensor.shape)  # (R, B, H, T, D)
            for j, (cotangent, slot) in enumerate(slotted):
                stacked[j, :, slot] = cotangent[:, slot]
            (g,) = torch.autograd.grad(
                tensor, run.stream, stacked, retain_graph=True, is_grads_batched=True
            )
            return g
        assert run.normed is not None
        outputs = [run.projected[i] for i in range(len(self.graph.layers[layer].inputs))]
        at_normed = columns.backward(tensor, outputs, [(c, s) for c, _, s in rounds])
        (g,) = torch.autograd.grad(
            run.normed, run.stream, at_normed.to(run.normed.dtype), retain_graph=True,
            is_grads_batched=True,
        )  # fmt: skip
        return g

    def _hooks(self, runs: list[_LayerRun], logits_xi: list[Tensor]) -> Iterator[Removable]:
        graph = self.graph
        qkv_wanted = bool(self.kinds & {"q", "k", "v"})
        grouped_kv = (
            graph.kv == "query_head"
            and bool(self.kinds & {"k", "v"})
            and any(s.num_kv_heads != s.num_heads for s in graph.mapped.sites)
        )
        for layer, parts in enumerate(graph.layers):
            run = runs[layer]
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
            yield graph.mapped.final_norm.register_forward_pre_hook(_logits_xi(logits_xi))


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
