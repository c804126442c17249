"""Where the graph's nodes (:mod:`multihead.circuits.graph`) live in a model, for edge
attribution and faithfulness:

    senders     "embed"            what block 0 is given (token + position embeddings)
                "L0H1"             a head's write: its output through its slice of the
                                   output projection, no bias (B, T, E)
                "MLP0"             what block 0's feed-forward network adds (B, T, E)
    receivers   "L1H3.q" .k .v     a head's queries, keys or values: each reads the residual
                                   stream through the block's norm and its own columns of the
                                   projections; with kv="shared" a grouped model's key/value
                                   head, "L1KV0.k"
                "MLP1"             block 1's feed-forward network, through its norm
                "logits"           the final residual stream, through the final norm

:class:`EdgeModel` reads, from the model's :class:`~multihead.circuits.runs.wiring.Wiring`
(found in its probe run when no earlier run has), what each receiver's input is (the module of
the block whose output the attention or the feed-forward network is given: the pre-LN norm) and
each layer's output projection, so that a run can record the senders' writes and change the
receivers' inputs one by one.

Shapes: B batch, T tokens, E residual width, H query heads, Hk key/value heads, Dv head width,
n senders.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, describe
from multihead.circuits.graph import EMBED, KV_MODES, Graph, Sender
from multihead.circuits.runs.experiment import Experiment
from multihead.circuits.runs.head_writes import head_writes, projection_rows
from multihead.circuits.runs.wiring import WiringRun
from multihead.heads import mlp_layer, parse_head
from multihead.map_types import ModelMap, output_tensor
from multihead.mapping import model_map
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["EdgeModel"]


@dataclass
class _Layer:
    """What one attention layer's block holds for the graph."""

    norm: nn.Module  # the module whose output the attention is given (its input: the stream)
    projection: nn.Module  # the module inside the attention fed its heads' outputs
    mlp: nn.Module | None  # the block's feed-forward network
    mlp_norm: nn.Module | None  # the module whose output it is given
    # the attention's q/k/v projections: modules given the norm's output itself, each with its
    # matrix M (out, E), the projection read per token as x ↦ x Mᵀ + bias
    inputs: tuple[tuple[nn.Module, Tensor], ...] = ()
    norm_eps: float | None = None  # the attention norm's epsilon, where the map knows it


class EdgeModel:
    """A model's senders and receivers, and the modules that make and read them.

    Built by :meth:`of` from a checked :class:`~multihead.circuits.runs.experiment.Experiment` (one
    probe forward of the clean or the corrupt input, with no gradient).

    Raises:
        ValueError: a model the graph cannot be read from (no stack of one attention layer per
            block, a block that does not give its attention a module's output, no final norm).
    """

    def __init__(
        self,
        experiment: Experiment,
        mapped: ModelMap,
        layers: list[_Layer],
        kv: str,
        probe: _ProbeRun,
    ) -> None:
        self.experiment = experiment
        self.mapped = mapped
        self.layers = layers
        self.kv = kv
        assert probe.value is not None
        self.probe_value: Tensor = probe.value  # the metric on the probe's input
        self._probe: _ProbeRun | None = probe if probe.writes else None
        self.sites = [site.attention for site in experiment.found]
        self.senders = list(self.graph(()).senders)

    @classmethod
    def of(
        cls,
        experiment: Experiment,
        kv: str,
        caller: str,
        *,
        keep_writes: bool = False,
        on: str = "clean",
    ) -> EdgeModel:
        """The graph of ``experiment``'s model, read in one probe run of its ``on`` input
        (``"clean"`` or ``"corrupt"``; the run's metric: :attr:`probe_value`; with
        ``keep_writes``, its writes: :meth:`probe_writes`)."""
        check_choice("kv", kv, KV_MODES)
        check_choice("on", on, ("clean", "corrupt"))
        model = experiment.model
        mapped = model_map(model)
        if mapped.final_norm is None:
            raise ValueError(
                f"{caller} needs the model's final norm (the logits' input); the map of "
                f"{mapped.family} knows none"
            )
        if any(s.shard is not None for s in mapped.sites):
            raise ValueError(f"{caller} does not support a tensor-parallel model")
        blocks = [mapped.stack_block(layer, caller) for layer in range(mapped.num_layers)]
        probe = _ProbeRun()
        wiring_run = WiringRun(mapped)
        hooks = [*wiring_run.hooks()]
        if keep_writes:
            hooks += _write_hooks(blocks, experiment, probe.write, probe.head_outputs)
        with torch.no_grad(), registered(iter(hooks)):
            probe.value = experiment.value(experiment.inputs(on), f"{on} run").detach()
        # the probe is an unpatched run of its input (its hooks only read): the experiment's
        experiment.adopt(on, experiment.last_output, probe.value)
        layers = []
        for layer, (block, wired) in enumerate(zip(blocks, wiring_run.wiring.layers, strict=True)):
            norm, projection = wired.norm, wired.projection
            if norm is None or projection is None:
                what = "a module's output as its input" if norm is None else "an output projection"
                raise ValueError(
                    f"{caller} reads each head's input through its block's norm and its write "
                    f"through its output projection; block {layer} of {mapped.family} gives its "
                    f"attention no {what} the graph can find (a pre-LN block is needed)"
                )
            if block.mlp is not None and wired.mlp_norm is None:
                raise ValueError(
                    f"{caller}: block {layer} of {mapped.family} gives its feed-forward network "
                    f"no module's output as its input (a pre-LN block is needed)"
                )
            inputs = tuple(
                (m, matrix)
                for m in wired.inputs
                if wired.width is not None
                and (matrix := _linear_matrix(m, wired.width)) is not None
            )
            layers.append(
                _Layer(norm, projection, block.mlp, wired.mlp_norm, inputs, wired.norm_eps)
            )
        return cls(experiment, mapped, layers, kv, probe)

    @classmethod
    def shared(cls, experiment: Experiment, kv: str, caller: str) -> EdgeModel:
        """The graph of ``experiment``'s model, read once per experiment (and ``kv``) and kept
        on it for every function after: its probe is the corrupt run, whose writes are kept
        (:meth:`probe_writes`) and which is the experiment's corrupt run."""
        key = ("edge graph", kv)
        graph = experiment.kept.get(key)
        if not isinstance(graph, EdgeModel):
            graph = cls.of(experiment, kv, caller, keep_writes=True, on="corrupt")
            experiment.kept[key] = graph
        return graph

    # -- the graph ------------------------------------------------------------------------------

    def graph(self, kinds: Sequence[str], senders: Sequence[Sender] | None = None) -> Graph:
        """The :class:`~multihead.circuits.graph.Graph` of ``senders`` (default: every
        sender) and the receivers of ``kinds``."""
        return Graph.of(self.mapped, kinds, self.kv, senders, caller="the edge graph")

    def parse_senders(self, senders: object) -> list[Sender]:
        """``None`` (every sender) or a sequence of "embed", heads (``"L0H1"``, ``(0, 1)``) and
        feed-forward networks (``"MLP0"``, ``("mlp", 0)``), in forward order."""
        if senders is None:
            return list(self.senders)
        if isinstance(senders, (str, bytes, Tensor)) or not isinstance(senders, Sequence):
            raise TypeError(
                f"senders must be None or a sequence of 'embed', heads ('L0H1') and feed-forward "
                f"networks ('MLP0'), got {describe(senders)}"
            )
        wanted: set[Sender] = set()
        for item in senders:
            wanted.add(self._sender(item))
        if not wanted:
            raise ValueError("senders must name at least one sender, got none")
        return [s for s in self.senders if s in wanted]

    def _sender(self, item: object) -> Sender:
        if isinstance(item, str) and item.strip().lower() == EMBED:
            return Sender("embed")
        layer = mlp_layer(item)
        if layer is not None:
            sender = Sender("mlp", layer) if isinstance(layer, int) else None
            if sender is None or sender not in self.senders:
                raise ValueError(
                    f"senders item {item!r}: no such feed-forward network (the model has "
                    f"{self.mapped.num_layers} blocks; attention-only blocks have none)"
                )
            return sender
        layer, head = parse_head("senders item", item)
        n = self.mapped.num_layers
        if not -n <= layer < n:
            raise ValueError(f"senders item {item!r}: layer must be in [{-n}, {n}), got {layer}")
        layer %= n
        heads = self.mapped.sites[layer].num_heads
        if not -heads <= head < heads:
            raise ValueError(
                f"senders item {item!r}: head must be in [{-heads}, {heads}), got {head}"
            )
        return Sender("head", layer, head % heads)

    # -- runs -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def recorded_writes(
        self, keep: Callable[[Sender, Tensor], None] | None = None
    ) -> Iterator[dict[Sender, Tensor]]:
        """Within the block, every run records each sender's write (B, T, E), detached: the
        embeddings as block 0 is given them, each head's output through its slice of the
        output projection, each feed-forward network's output. With ``keep``, each write is
        handed to ``keep(sender, write)`` as it is made instead (the dict stays empty)."""
        writes: dict[Sender, Tensor] = {}
        store = keep or writes.__setitem__
        blocks = [self.mapped.stack_block(layer, "") for layer in range(len(self.layers))]

        def heads(layer: int, z: Tensor) -> None:
            with torch.no_grad():  # in a gradient run too: the writes record no graph
                _store_heads(store, layer, self.layers[layer].projection, z)

        with registered(_write_hooks(blocks, self.experiment, store, heads)):
            yield writes

    @property
    def holds_writes(self) -> bool:
        """Whether the probe run's writes are still held (:meth:`probe_writes`)."""
        return self._probe is not None

    def probe_writes(
        self, keep: Callable[[Sender, Tensor], None], *, release: bool = True
    ) -> Tensor:
        """The probe run's writes (as :meth:`recorded_writes` records them), each handed to
        ``keep(sender, write)``, and its metric: what a run of the probe's input would give,
        without one. With ``release`` the probe lets its writes go (a later call raises): a
        graph on an experiment the caller holds keeps them for the next function."""
        probe = self._probe
        if probe is None:
            raise RuntimeError(
                "EdgeModel.probe_writes: the probe run kept no writes (keep_writes=False), or "
                "has handed them over already"
            )
        if release:
            self._probe = None
        for sender, write in probe.writes:
            keep(sender, write)
        with torch.no_grad():  # as in the run: the heads' writes record no graph
            for layer, z in probe.outputs:
                _store_heads(keep, layer, self.layers[layer].projection, z)
        return self.probe_value

    def writes_of(
        self, inputs: Any, what: str, keep: Callable[[Sender, Tensor], None] | None = None
    ) -> tuple[dict[Sender, Tensor], Tensor]:
        """Every sender's write on ``inputs`` (no gradient; to ``keep`` as made, if given:
        :meth:`recorded_writes`), and the metric there."""
        with torch.no_grad(), self.recorded_writes(keep) as writes:
            value = self.experiment.value(inputs, what)
        return dict(writes), value.detach()


@dataclass
class _ProbeRun:
    """A graph's probe run (the clean input): its writes, kept until its output projections
    are known (the embeddings' and feed-forward networks' ``(sender, write)``, each layer's
    heads' outputs ``(layer, z)`` (B, T, H, Dv)), and its metric."""

    writes: list[tuple[Sender, Tensor]] = field(default_factory=list)
    outputs: list[tuple[int, Tensor]] = field(default_factory=list)
    value: Tensor | None = None

    def write(self, sender: Sender, x: Tensor) -> None:
        self.writes.append((sender, x))

    def head_outputs(self, layer: int, z: Tensor) -> None:
        self.outputs.append((layer, z))


def _write_hooks(
    blocks: list[Any],
    experiment: Experiment,
    write: Callable[[Sender, Tensor], None],
    heads: Callable[[int, Tensor], None],
) -> Iterator[Removable]:
    """Hooks handing a run's writes on, detached: what block 0 is given and each feed-forward
    network's output to ``write(sender, x)`` (B, T, E), each layer's heads' outputs to
    ``heads(layer, z)`` (B, T, H, Dv)."""
    mapped = model_map(experiment.model)

    def embed(m: nn.Module, args: Any, kwargs: Any) -> None:
        write(Sender("embed"), mapped.stream_of(args, kwargs).detach())

    def observer_of(layer: int) -> Any:
        def observer(call: AttentionCall, out: Tensor) -> None:
            heads(layer, out.detach())

        return observer

    def mlp(layer: int) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            write(Sender("mlp", layer), output_tensor(out).detach())

        return hook

    yield blocks[0].module.register_forward_pre_hook(embed, with_kwargs=True)
    for layer, block in enumerate(blocks):
        yield experiment.found[layer].attention.register_observer(observer_of(layer))
        if block.mlp is not None:
            yield block.mlp.register_forward_hook(mlp(layer))


def _store_heads(
    store: Callable[[Sender, Tensor], None], layer: int, projection: nn.Module, z: Tensor
) -> None:
    """Each head's write (B, T, E) from the heads' outputs z (B, T, H, Dv) to ``store``."""
    result = head_writes(projection, z)  # (B, T, H, E)
    for h in range(result.shape[2]):
        store(Sender("head", layer, h), result[:, :, h])


def _linear_matrix(module: nn.Module, width: int) -> Tensor | None:
    """M (out, E) of a module read as the per-token linear map x ↦ x Mᵀ + bias
    (:func:`~multihead.circuits.runs.head_writes.projection_rows`, transposed); None unless it
    has a 2-D weight and maps inputs of ``width`` (E) per token."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        return None
    like = torch.zeros(1, width, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        rows = projection_rows(module, like)
    return rows.T.contiguous() if rows.dim() == 2 and rows.shape[0] == width else None
