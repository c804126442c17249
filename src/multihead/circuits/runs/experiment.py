"""One model on one clean/corrupt pair: the experiment every circuit function runs on.

:func:`~multihead.patch`, :func:`~multihead.patch_heads`, :func:`~multihead.attribution_patching`,
:func:`~multihead.path_patching` and the edge functions each start the same way: the model's
heads (its :func:`multihead.model_map`), a clean and a corrupt input checked against each other
(texts through a text model's tokenizer), a metric that must be callable. :class:`Experiment`
is that, checked once; every function takes either ``(model, clean, corrupt, metric)`` or an
experiment, so that several functions on one pair share its runs.

Each input runs unpatched at most once, lazily (:meth:`Experiment.run`): its first run records
what the caller asks for (the output and metric value always; activations by
:func:`~multihead.cache`'s names; every block's calls for prefix reuse; the heads' gradients),
and a later need that was not recorded runs the input once more and is merged into the record.
Whatever asks for the same thing later gets the recorded one: :func:`~multihead.patch` and the
``patch_heads`` it calls read one clean and one corrupt run, and the command line's several
functions on one pair read the same two.

Shapes: B batch, T tokens, H heads, Dv one head's width.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, describe
from multihead.circuits.runs.input_pair import DIRECTIONS, InputPair, reduced_fields
from multihead.circuits.runs.metric import Metric, metric_reader, metric_value
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.runs.site_names import SiteKey
from multihead.circuits.runs.site_recorder import SiteRecorder
from multihead.circuits.runs.stacked_runs import variants_per_forward
from multihead.circuits.runs.suffix_runs import SuffixRuns
from multihead.map_types import Site
from multihead.mapping import model_heads, model_map
from multihead.memory_budget import DEFAULT_MEMORY_LIMIT
from multihead.observers import AttentionCall, registered

__all__ = ["Experiment", "INPUTS", "Recorded", "warn_if_random"]

logger = logging.getLogger(__name__)

# the two inputs of a pair, by name
INPUTS = ("clean", "corrupt")


def warn_if_random(model: nn.Module, caller: str) -> None:
    """Warn when ``model`` has active dropout (training mode, p > 0): every run then differs,
    by more than most effects (``patch_heads`` says so in its log, the gradient functions here)."""
    dropout = any(m.training and isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())
    if dropout or any(s.module.training and s.dropout > 0 for s in model_map(model).sites):
        warnings.warn(
            f"{caller}: the model is in training mode with dropout, so every run differs (by "
            f"more than most effects); call model.eval() first",
            UserWarning,
            stacklevel=3,
        )


@dataclass
class Recorded:
    """One unpatched run of an input of the pair, and what was recorded on it.

    Attributes:
        name: ``"clean"`` or ``"corrupt"``.
        inputs: the input, as the model is called with it.
        output: the model's output on it.
        value: the metric on it, a () tensor (detached).
        sites: the activations recorded, ``(site, layer)`` -> tensor as :func:`multihead.cache`
            keeps them (whole positions).
        asked: every ``(site, layer)`` a run of this input was asked to record (a layer the
            model did not call is asked and absent).
        prefix: the blocks' calls recorded for prefix reuse, or None (not asked, or refused:
            the reason was logged).
        prefixed: whether prefix recording was asked (and so tried) on a run of this input.
        gradients: per attention layer, ∂metric/∂(its heads' output) (B, T, H, Dv) on this
            run, or None where the metric does not depend on it; None until asked.
        suffix: the runs of this input from a later position on
            (:meth:`Experiment.suffix_runs`), or None (refused: the reason was logged).
        suffixed: whether they were built (and so tried).
    """

    name: str
    inputs: Any
    output: Any
    value: Tensor
    sites: dict[SiteKey, Tensor] = field(default_factory=dict)
    asked: set[SiteKey] = field(default_factory=set)
    prefix: PrefixCache | None = None
    prefixed: bool = False
    gradients: dict[int, Tensor | None] | None = None
    suffix: SuffixRuns | None = None
    suffixed: bool = False


@dataclass
class Experiment:
    """A model, its heads, a clean and a corrupt input and a metric, checked; and the
    unpatched runs of the two inputs, each made at most once (module docstring).

    Attributes:
        model: the model.
        found: its attention sites (the map's :class:`~multihead.map_types.Site`), in layer
            order.
        pair: the two inputs (:class:`~multihead.circuits.runs.input_pair.InputPair`).
        metric: ``metric(output) -> () or (B,)``, reading the logits or the whole output as
            the caller's ``metric_input`` said.
        metric_input: that: ``"logits"`` or ``"output"``.
        records: the unpatched runs made so far, by input name.
        kept: what functions built from the experiment once, by key, for the next to read
            (the edge graph: its probe run and wiring).
    """

    model: nn.Module
    found: list[Site]
    pair: InputPair
    metric: Metric
    metric_input: str = "logits"
    outputs: list[Any] = field(default_factory=list, repr=False)
    records: dict[str, Recorded] = field(default_factory=dict, repr=False)
    # what a function built from this experiment once, for the next one (the edge graph)
    kept: dict[Hashable, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def of(
        cls,
        model: nn.Module | Experiment,
        clean: object = None,
        corrupt: object = None,
        metric: object = None,
        metric_input: str = "logits",
    ) -> Experiment:
        """Check the model (it has heads), the inputs (alike) and the metric (callable); the
        metric is then given what ``metric_input`` says (see
        :func:`~multihead.circuits.runs.metric.metric_reader`). An experiment given as
        ``model`` is returned as it is (its runs shared), with nothing else given.

        Raises:
            ValueError, TypeError: as the patching functions document for these arguments;
                an experiment given with inputs or a metric, or with another metric_input.
        """
        if isinstance(model, Experiment):
            beside = (("clean", clean), ("corrupt", corrupt), ("metric", metric))
            given = [n for n, v in beside if v is not None]
            if given:
                raise TypeError(
                    f"an Experiment holds its inputs and metric: give it alone, got "
                    f"{', '.join(given)} beside it"
                )
            if metric_input != "logits" and metric_input != model.metric_input:
                raise ValueError(
                    f"metric_input={metric_input!r}: the Experiment's metric reads "
                    f"{model.metric_input!r} (give metric_input to Experiment.of)"
                )
            return model
        found = model_heads(model)
        for name, value in (("clean", clean), ("corrupt", corrupt)):
            if value is None:
                raise TypeError(f"{name} is required (an input of the model), got None")
        pair = InputPair(model, clean, corrupt)
        if not callable(metric):
            raise TypeError(f"metric must be a callable metric(logits), got {describe(metric)}")
        return cls(model, found, pair, metric_reader(metric, metric_input), metric_input)

    @staticmethod
    def ends(direction: str) -> tuple[str, str]:
        """(source, target) input names of a patch: ``"denoise"`` runs corrupt with clean's
        activations, ``"noise"`` clean with corrupt's."""
        check_choice("direction", direction, DIRECTIONS)
        return ("clean", "corrupt") if direction == "denoise" else ("corrupt", "clean")

    def inputs(self, name: str) -> Any:
        """The input named ``name`` (``"clean"`` or ``"corrupt"``), as the model takes it."""
        check_choice("input", name, INPUTS)
        return self.pair.clean if name == "clean" else self.pair.corrupt

    def run(
        self,
        name: str,
        *,
        sites: Iterable[SiteKey] = (),
        prefix: bool = False,
        gradients: bool = False,
        caller: str = "Experiment.run",
        log: logging.Logger = logger,
    ) -> Recorded:
        """The unpatched run of input ``name``, with at least what is asked recorded on it.

        The first call runs the input once; a later one that asks for something no earlier
        run recorded runs it once more, recording only that, and merges it in.

        Args:
            name: ``"clean"`` or ``"corrupt"``.
            sites: ``(site, layer)`` keys to record (:func:`multihead.cache`'s sites).
            prefix: record every block's calls for prefix reuse (checked by a replay of the
                recorded run; refused with the reason logged on ``log``, naming ``caller``).
            gradients: the heads' gradients of the metric on this run (the run made with
                gradients enabled, the parameters asking for none), and the heads' outputs
                (the ``z`` sites) with them.

        Raises:
            ValueError: a metric that does not return a scalar (or (B,)) floating point tensor;
                with ``gradients``, a metric that does not depend on the heads through
                autograd.
        """
        wanted = set(sites)
        record = self.records.get(name)
        if record is not None:
            wanted -= record.asked
            prefix = prefix and not record.prefixed
            gradients = gradients and record.gradients is None
            if not (wanted or prefix or gradients):
                return record
        made = self._record(name, wanted, prefix, gradients, caller, log)
        if record is None:
            self.records[name] = made
            return made
        record.sites.update(made.sites)
        record.asked |= made.asked
        if made.prefixed:
            record.prefix, record.prefixed = made.prefix, True
        if made.gradients is not None:
            record.gradients = made.gradients
        return record

    def adopt(self, name: str, output: Any, value: Tensor) -> None:
        """Keep an unpatched run of input ``name`` that a function made itself (a probe with
        its own hooks, a gradient run whose added zeros change nothing) as the input's run,
        when none was recorded yet: its output (detached) and metric are what later needs of
        them read."""
        if name not in self.records:
            self.records[name] = Recorded(
                name, self.inputs(name), _detached(output), value.detach()
            )

    def _record(
        self,
        name: str,
        sites: set[SiteKey],
        prefix: bool,
        gradients: bool,
        caller: str,
        log: logging.Logger,
    ) -> Recorded:
        """One run of input ``name`` recording what is asked (see :meth:`run`)."""
        inputs = self.inputs(name)
        recorder = SiteRecorder(self.model, inputs, names=sorted(sites)) if sites else None
        xis: dict[int, Tensor] = {}
        heads: dict[SiteKey, Tensor] = {}  # a gradient run's heads' outputs, recorded with it
        made: list[tuple[Any, Tensor]] = []

        def leaf(layer: int) -> Any:
            def observer(call: AttentionCall, out: Tensor) -> Tensor:
                xi = xis.get(layer)
                if xi is None or xi.shape != out.shape:
                    xi = xis[layer] = torch.zeros_like(out, requires_grad=True)
                heads["z", layer] = out.detach()
                return out + xi

            return observer

        def record(what: str) -> Tensor:
            """The recording run (the first call), then the prefix's check run (the model
            alone, its blocks handed back)."""
            if made:
                with torch.no_grad():
                    return self.value(inputs, what)
            with contextlib.ExitStack() as stack:
                if recorder is not None:
                    stack.enter_context(recorder.recording())
                if gradients:
                    stack.enter_context(self.activation_gradients())
                    stack.enter_context(torch.enable_grad())
                    stack.enter_context(
                        registered(
                            s.attention.register_observer(leaf(i)) for i, s in enumerate(self.found)
                        )
                    )
                else:
                    stack.enter_context(torch.no_grad())
                value = self.value(inputs, f"{name} run")
            made.append((self.last_output, value))
            return value.detach()

        cache = (
            PrefixCache.build(self.model, self.found, record, caller=caller, log=log)
            if prefix
            else None
        )
        if not made:
            record(f"{name} run")
        output, value = made[0]
        found_grads = None
        if gradients:
            found_grads = self._gradients(value, xis, caller)
        recorded = Recorded(name, inputs, output, value.detach(), prefix=cache, prefixed=prefix)
        if recorder is not None:
            recorded.sites = dict(recorder.result())
            recorded.asked = set(sites)
        if gradients:  # the heads whose gradients are taken: their outputs too (the z sites)
            recorded.sites.update(heads)
            recorded.asked |= {("z", layer) for layer in range(len(self.found))}
        recorded.gradients = found_grads
        return recorded

    def _gradients(
        self, value: Tensor, xis: dict[int, Tensor], caller: str
    ) -> dict[int, Tensor | None]:
        """∂value/∂ξ per layer that ran (the backward frees the run's graph)."""
        if not value.requires_grad:
            raise ValueError(
                f"{caller} needs metric(output) to depend on the heads through "
                "autograd: its result does not require grad (does it detach the output or run "
                "under torch.no_grad()?)"
            )
        ran = sorted(xis)
        grads = torch.autograd.grad(value, [xis[layer] for layer in ran], allow_unused=True)
        return dict(zip(ran, grads, strict=True))

    def checked_value(self, record: Recorded, what: str) -> Tensor:
        """``record``'s metric, checked not NaN: it is what every patch is measured against.

        Raises:
            ValueError: the metric is NaN there.
        """
        if math.isnan(float(record.value)):
            raise ValueError(
                f"metric(output) is NaN on the {what} (the input every patch is measured "
                f"against): every effect would be NaN"
            )
        return record.value

    def value(self, inputs: Any, what: str, copies: int = 1) -> Tensor:
        """The metric on the model's output for ``inputs`` with whatever is registered on it
        (a () tensor; ``what`` names the run in errors); the output is kept as
        :attr:`last_output`."""
        self.outputs[:] = [self.pair.run(inputs, copies)]
        return metric_value(self.metric, self.outputs[0], self.pair.batch, what)

    @contextlib.contextmanager
    def activation_gradients(self) -> Iterator[None]:
        """Within the block the model's parameters ask for no gradient (each one's
        ``requires_grad`` set back after): runs whose gradients are taken at activations alone
        then keep nothing the weights' gradients alone would need (a matrix product's input)."""
        asking = [p for p in self.model.parameters() if p.requires_grad]
        for parameter in asking:
            parameter.requires_grad_(False)
        try:
            yield
        finally:
            for parameter in asking:
                parameter.requires_grad_(True)

    @property
    def last_output(self) -> Any:
        """The output of the latest :meth:`value` run."""
        return self.outputs[0]

    def suffix_runs(self, name: str, *, caller: str, log: logging.Logger) -> SuffixRuns | None:
        """Runs of input ``name`` from a later position on, for a per-position sweep on it
        (:mod:`~multihead.circuits.runs.suffix_runs`), or None (the reason logged on ``log``).
        Built once per input, on its recorded run (prefix, keys and values: asked here when
        not recorded yet)."""
        layers = range(len(self.found))
        record = self.run(
            name, prefix=True, sites=[(s, la) for la in layers for s in ("k", "v")],
            caller=caller, log=log,
        )  # fmt: skip
        if not record.suffixed:
            keys = [record.sites.get(("k", layer)) for layer in layers]
            values = [record.sites.get(("v", layer)) for layer in layers]
            record.suffix = SuffixRuns.build(
                self.pair, record.inputs, self.metric, self.metric_input, record.output,
                record.prefix, keys, values, caller=caller, log=log,
            )  # fmt: skip
            record.suffixed = True
        return record.suffix

    def stack_size(
        self, batch_size: int | None, output: Any, recorded: list[Tensor], log: logging.Logger
    ) -> int:
        """How many patched variants one forward stacks: ``batch_size``, or as many as the
        memory budget holds beside ``recorded`` (the per-head outputs kept for patching); one
        when the output holds a number reduced over the whole batch (a loss), which stacked
        variants would share.

        Raises:
            ValueError: ``batch_size`` > 1 with such an output (the field is named).
        """
        reduced = reduced_fields(output)
        if reduced:
            if batch_size is not None and batch_size > 1:
                raise ValueError(
                    f"batch_size={batch_size} stacks patched variants along the batch, and the "
                    f"model's {reduced[0]} is one number for the whole batch (reduced over it, "
                    f"as a loss is): every variant would get the stack's; give batch_size=1 or "
                    f"None, or a metric of per-example outputs"
                )
            log.info(
                "one variant per forward: the model's %s is reduced over the batch", reduced[0]
            )
            return 1
        if batch_size is not None:
            return batch_size
        return variants_per_forward(output, recorded, DEFAULT_MEMORY_LIMIT, self.found)


def _detached(value: Any) -> Any:
    """``value`` with every tensor in it detached (a gradient run's output keeps no graph)."""
    if isinstance(value, Tensor):
        return value.detach()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(
            value,
            **{
                f.name: _detached(getattr(value, f.name))
                for f in dataclasses.fields(value)
                if f.init
            },
        )
    if isinstance(value, dict):
        return type(value)({k: _detached(v) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value
