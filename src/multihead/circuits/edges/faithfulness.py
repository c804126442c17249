"""Faithfulness: how much of the behaviour a circuit of edges carries on its own.

The circuit run (EAP-IG's and the MIB benchmark's edge patching; Hanna et al. 2024) is the
clean input in which every receiver of the graph reads, in place of its input x_r,

    x_r + Σ_{s -> r not in the circuit} (w_s(corrupt) - w_s(this run))

where w_s is the sender's write (B, T, E): an edge in the circuit carries what its sender writes
in this very run (computed from its own, partly corrupted, inputs), every other edge the
corrupt run's write. With no edge in the circuit every receiver reads the corrupt run's stream
and the run is the corrupt run; with every edge, the clean run. A head's queries, keys and values
are three receivers, each with its own input: the head's columns of the projections are
recomputed from its own copy of the stream (the attention module called again, its kernel not
run). Receiver kinds the circuit's graph did not score read their input unchanged.

    faithfulness = (m(circuit) - m(corrupt)) / (m(clean) - m(corrupt))

Shapes: B batch, T tokens, E residual width, H query heads, Hk key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.edges.edge_model import EdgeModel
from multihead.circuits.edges.edge_scores import Circuit, edge_labels
from multihead.circuits.graph import KV_MODES, LOGITS, Receiver, Sender
from multihead.circuits.runs.experiment import Experiment, warn_if_random
from multihead.circuits.runs.metric import Metric
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["DEFAULT_KINDS", "CircuitRuns", "faithfulness"]

#: the receiver kinds of a circuit given as edge labels (edge_attribution's default)
DEFAULT_KINDS = ("q", "k", "v", LOGITS)


def faithfulness(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    circuit: Circuit | Sequence[str] | None = None,
) -> float:
    """The share of the clean metric the circuit's edges bring back on their own (module
    docstring): 1 with every edge, 0 with none.

    Args:
        model, clean, corrupt, metric: as for :func:`~multihead.edge_attribution` (an
            :class:`~multihead.Experiment` shares the graph and runs edge attribution read).
        circuit: a :class:`~multihead.Circuit` (``EdgeScores.circuit(n)``)
            or a sequence of edge labels (``"L0H1 -> L1H3.k"``; receivers q, k, v and the logits).

    Returns:
        ``(m(circuit) - m(corrupt)) / (m(clean) - m(corrupt))``.

    Raises:
        ValueError: an edge the model's graph does not have, clean and corrupt metrics that are
            equal (nothing to bring back), and as :func:`~multihead.edge_attribution`.
    """
    if circuit is None:
        raise TypeError("circuit is required: a Circuit or a sequence of edge labels, got None")
    edges: Circuit | tuple[str, ...]
    if isinstance(circuit, Circuit):
        kinds, kv, edges = circuit.graph.kinds, circuit.graph.kv, circuit
    else:  # labels, checked before any run: of the default graph
        kinds, kv, edges = DEFAULT_KINDS, KV_MODES[0], edge_labels(circuit)
    runs = CircuitRuns.of(model, clean, corrupt, metric, kinds, kv)
    return runs.faithfulness(Circuit.of(edges, runs.whole))


class CircuitRuns:
    """The clean and corrupt runs of one model and pair, and circuit runs against them."""

    def __init__(self, graph: EdgeModel, kinds: tuple[str, ...]) -> None:
        self.graph = graph
        self.whole = graph.graph(kinds)  # every sender, the receivers of kinds
        experiment = graph.experiment
        # the graph's probe is the corrupt run: its writes, while it holds them (else a run)
        if graph.holds_writes:
            self.corrupt_writes: dict[Sender, Tensor] = {}
            graph.probe_writes(self.corrupt_writes.__setitem__, release=False)
        else:
            self.corrupt_writes, _ = graph.writes_of(experiment.inputs("corrupt"), "corrupt run")
        with torch.no_grad():
            clean = experiment.run("clean", caller="faithfulness").value
            corrupt = experiment.run("corrupt", caller="faithfulness").value
        self.clean, self.corrupt = float(clean), float(corrupt)
        if self.clean == self.corrupt:
            raise ValueError(
                f"faithfulness needs the metric to differ between the clean and the corrupt "
                f"run, got {self.clean} on both"
            )
        # every edge of the graph as its nodes, receiver-major (the random circuits' order)
        self.all_edges = tuple(
            (s, r) for r in self.whole.receivers for s in self.whole.senders if s.stage < r.stage
        )
        self.edges = set(self.all_edges)

    @classmethod
    def of(
        cls,
        model: nn.Module | Experiment,
        clean: Any,
        corrupt: Any,
        metric: Metric | None,
        kinds: tuple[str, ...],
        kv: str,
    ) -> CircuitRuns:
        """The runs of the graph of receiver ``kinds`` and key/value mode ``kv``."""
        experiment = Experiment.of(model, clean, corrupt, metric)
        warn_if_random(experiment.model, "faithfulness")
        return cls(EdgeModel.shared(experiment, kv, "faithfulness"), kinds)

    def faithfulness(self, circuit: Circuit) -> float:
        """The circuit run's metric, normalised (module docstring)."""
        return (self.metric(circuit) - self.corrupt) / (self.clean - self.corrupt)

    def metric(self, circuit: Circuit) -> float:
        """The metric on the circuit run."""
        kept = set(circuit.nodes)
        unknown = [f"{s.label} -> {r.label}" for s, r in circuit.nodes if (s, r) not in self.edges]
        if unknown:
            first = self.all_edges[0] if self.all_edges else None
            example = f"{first[0].label} -> {first[1].label}" if first else ""
            raise ValueError(
                f"circuit has edges the model's graph does not ({len(unknown)}: "
                f"{', '.join(repr(e) for e in unknown[:3])}); edges are 'sender -> receiver', "
                f"e.g. {example!r}"
            )
        # receiver -> the senders whose edges into it carry the corrupt run's write
        cut: dict[Receiver, list[Sender]] = {}
        for sender, receiver in self.all_edges:
            if (sender, receiver) not in kept:
                cut.setdefault(receiver, []).append(sender)
        graph = self.graph
        with torch.no_grad(), graph.recorded_writes() as writes:
            delta = _Differences(self.corrupt_writes, writes, graph.senders)
            with registered(self._hooks(cut, delta)):
                value = graph.experiment.value(graph.experiment.pair.clean, "circuit run")
        return float(value)

    def _hooks(self, cut: dict[Receiver, list[Sender]], delta: _Differences) -> Iterator[Removable]:
        graph = self.graph
        for layer, parts in enumerate(graph.layers):
            heads = {r: s for r, s in cut.items() if r.layer == layer and r.kind in "qkv"}
            if heads:
                yield from _HeadInputs(graph, layer, heads, delta).hooks()
            mlp = Receiver("mlp", layer)
            if mlp in cut and parts.mlp_norm is not None:
                yield parts.mlp_norm.register_forward_pre_hook(_adding(delta, mlp, cut[mlp]))
        logits = Receiver(LOGITS, graph.mapped.num_layers)
        if logits in cut:
            assert graph.mapped.final_norm is not None
            hook = _adding(delta, logits, cut[logits])
            yield graph.mapped.final_norm.register_forward_pre_hook(hook)


def _adding(delta: _Differences, receiver: Receiver, senders: list[Sender]) -> Any:
    """A forward pre-hook adding the cut senders' differences to a module's input."""

    def hook(m: nn.Module, args: Any) -> Any:
        return (args[0] + delta(receiver, senders).to(args[0].dtype), *args[1:])

    return hook


class _Differences:
    """One circuit run's Σ (corrupt write - this run's write) over a receiver's cut senders
    (B, T, E), as the writes are made. Where the cut senders outnumber the kept ones (a small
    circuit cuts most edges of a large graph) the sum is taken as the sum over every earlier
    sender, built once per stage and shared by the stage's receivers, less the kept ones."""

    def __init__(
        self, corrupt: dict[Sender, Tensor], writes: dict[Sender, Tensor], senders: list[Sender]
    ) -> None:
        self.corrupt, self.writes, self.senders = corrupt, writes, senders
        self.totals: dict[int, Tensor] = {}  # stage -> the sum over the senders before it

    def __call__(self, receiver: Receiver, cut: list[Sender]) -> Tensor:
        before = [s for s in self.senders if s.stage < receiver.stage]
        if 2 * len(cut) <= len(before):
            return self._sum(cut)
        cutting = set(cut)
        kept = [s for s in before if s not in cutting]
        total = self._total(receiver.stage)
        return total - self._sum(kept) if kept else total

    def _sum(self, senders: list[Sender]) -> Tensor:
        total = self.corrupt[senders[0]] - self.writes[senders[0]]
        for s in senders[1:]:
            total = total + (self.corrupt[s] - self.writes[s])
        return total

    def _total(self, stage: int) -> Tensor:
        if stage not in self.totals:
            start = max((t for t in self.totals if t < stage), default=None)
            senders = [
                s for s in self.senders if s.stage < stage and (start is None or s.stage >= start)
            ]
            if start is None:
                self.totals[stage] = self._sum(senders)
            else:
                self.totals[stage] = self.totals[start]
                if senders:
                    self.totals[stage] = self.totals[stage] + self._sum(senders)
        return self.totals[stage]


class _Captured(Exception):
    """Raised by the editor inside a second call of the attention, once q, k, v are read."""


class _HeadInputs:
    """One layer's q/k/v receivers with their own inputs: the attention module called again on
    the norm of each receiver's stream, its q, k, v read and the call stopped before the kernel;
    the first call's q, k, v replaced head by head."""

    def __init__(
        self,
        graph: EdgeModel,
        layer: int,
        cut: dict[Receiver, list[Sender]],
        delta: _Differences,
    ) -> None:
        self.parts = graph.layers[layer]
        self.site = graph.sites[layer]
        self.attention = graph.mapped.blocks[layer].attention if graph.mapped.blocks else None
        self.cut = cut
        self.delta = delta
        self.stream: Tensor | None = None
        self.normed: Tensor | None = None
        self.call_args: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self.capturing = False
        self.captured: tuple[Tensor, Tensor, Tensor] | None = None

    def hooks(self) -> Iterator[Removable]:
        def keep_stream(m: nn.Module, args: Any, out: Any) -> None:
            if not self.capturing:
                self.stream, self.normed = args[0], out

        def keep_call(m: nn.Module, args: Any, kwargs: Any) -> None:
            if not self.capturing:
                self.call_args = (args, kwargs)

        assert self.attention is not None
        yield self.parts.norm.register_forward_hook(keep_stream)
        yield self.attention.register_forward_pre_hook(keep_call, with_kwargs=True)
        yield self.site.register_qkv_editor(self.edit)

    def edit(self, call: AttentionCall) -> tuple[Tensor, Tensor, Tensor] | None:
        if self.capturing:
            self.captured = (call.q, call.k, call.v)
            raise _Captured
        q, k, v = call.q, call.k, call.v
        heads, kv_heads = q.shape[1], k.shape[1]
        grouped = {r for r in self.cut if r.kind != "q" and not r.shared and kv_heads != heads}
        if grouped:  # a query head's own keys and values: one per query head
            k = k.repeat_interleave(heads // kv_heads, 1)
            v = v.repeat_interleave(heads // kv_heads, 1)
        new = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        variants: dict[tuple[Sender, ...], tuple[Tensor, Tensor, Tensor]] = {}
        for receiver, senders in self.cut.items():
            key = tuple(senders)
            if key not in variants:
                variants[key] = self._qkv_of(self.delta(receiver, senders))
            index = "qkv".index(receiver.kind)
            source = variants[key][index]
            h = receiver.head
            if receiver.kind != "q" and receiver in grouped:
                source = source[:, h // (heads // kv_heads)]
            else:
                source = source[:, h]
            new[receiver.kind][:, h] = source
        return new["q"], new["k"], new["v"]

    def _qkv_of(self, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v the attention computes from the norm of this run's stream + ``delta``."""
        assert self.stream is not None and self.call_args is not None
        assert self.attention is not None
        args, kwargs = self.call_args
        self.capturing = True  # the hooks above keep the first call's stream and arguments
        try:
            normed = self.parts.norm(self.stream + delta.to(self.stream.dtype))
            args = tuple(normed if a is self.normed else a for a in args)
            kwargs = {key: normed if a is self.normed else a for key, a in kwargs.items()}
            self.attention(*args, **kwargs)
        except _Captured:
            pass
        finally:
            self.capturing = False
        if self.captured is None:
            raise ValueError(
                f"faithfulness: calling the attention of layer {self.site!r} again did not reach "
                f"its q/k/v editors"
            )  # pragma: no cover - every site runs its editors
        captured, self.captured = self.captured, None
        return captured
