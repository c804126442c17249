"""The one prologue of the patching functions: what every experiment checks and runs first.

:func:`~multihead.patch_heads`, :func:`~multihead.attribution_patching` and
:func:`~multihead.path_patching` each start the same way: the model's heads (its
:func:`multihead.model_map`), a clean and a corrupt input checked against each other (texts
through a text model's tokenizer), a metric that must be callable; then, for those that patch,
one unpatched run of the input that is patched (recorded by the prefix cache, which reuses the
blocks a patch cannot change) and how many patched variants fit one stacked forward.
:class:`Experiment` is that prologue, written once.

Shapes: B batch, T tokens, H heads, Dv one head's width.
"""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from multihead._checks import describe
from multihead.circuits.runs.input_pair import InputPair, reduced_fields
from multihead.circuits.runs.metric import Metric, metric_reader, metric_value
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.runs.stacked_runs import variants_per_forward
from multihead.circuits.runs.suffix_runs import SuffixRuns
from multihead.mapping import model_heads, model_map
from multihead.memory_budget import DEFAULT_MEMORY_LIMIT
from multihead.observers import ObservableAttention

__all__ = ["Experiment", "Unpatched", "warn_if_random"]


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
class Unpatched:
    """The run that patches are measured against.

    Attributes:
        value: the metric on it, a () tensor.
        output: the model's output on it (what a stacked run is split like).
        prefix: the recorded blocks for prefix reuse, or None (the reason was logged).
    """

    value: Tensor
    output: Any
    prefix: PrefixCache | None


@dataclass
class Experiment:
    """A model, its heads, a clean and a corrupt input and a metric, checked.

    Attributes:
        model: the model.
        found: its attention sites, ``(name, site)`` in layer order.
        pair: the two inputs (:class:`~multihead.circuits.runs.input_pair.InputPair`).
        metric: ``metric(output) -> () or (B,)``, reading the logits or the whole output as
            the caller's ``metric_input`` said.
        metric_input: that: ``"logits"`` or ``"output"``.
    """

    model: nn.Module
    found: list[tuple[str, ObservableAttention]]
    pair: InputPair
    metric: Metric
    metric_input: str = "logits"
    outputs: list[Any] = field(default_factory=list, repr=False)

    @classmethod
    def of(
        cls,
        model: nn.Module,
        clean: object,
        corrupt: object,
        metric: object,
        metric_input: str = "logits",
    ) -> Experiment:
        """Check the model (it has heads), the inputs (alike) and the metric (callable); the
        metric is then given what ``metric_input`` says (see
        :func:`~multihead.circuits.runs.metric.metric_reader`).

        Raises:
            ValueError, TypeError: as the patching functions document for these arguments.
        """
        found = model_heads(model)
        pair = InputPair(model, clean, corrupt)
        if not callable(metric):
            raise TypeError(f"metric must be a callable metric(logits), got {describe(metric)}")
        return cls(model, found, pair, metric_reader(metric, metric_input), metric_input)

    def value(self, inputs: Any, what: str, copies: int = 1) -> Tensor:
        """The metric on the model's output for ``inputs`` (a () tensor; ``what`` names the run
        in errors); the output is kept as :attr:`last_output`."""
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

    def unpatched(self, inputs: Any, what: str, *, caller: str, log: logging.Logger) -> Unpatched:
        """Run ``inputs`` unpatched, recording every block for prefix reuse (or, when reuse
        cannot serve, once without it: the reason is logged on ``log``)."""

        def first(name: str) -> Tensor:
            value = self.value(inputs, name)
            if self.outputs and not checked:
                checked.append(True)
                if math.isnan(float(value)):  # once per experiment, before any patch runs
                    raise ValueError(
                        f"metric(output) is NaN on the {what} (the input every patch is "
                        f"measured against): every effect would be NaN"
                    )
            return value

        checked: list[bool] = []
        prefix = PrefixCache.build(self.model, self.found, first, caller=caller, log=log)
        value = prefix.clean if prefix is not None else first(what)
        return Unpatched(value, self.last_output, prefix)

    def suffix_runs(
        self, inputs: Any, unpatched: Unpatched, *, caller: str, log: logging.Logger
    ) -> SuffixRuns | None:
        """Runs of ``inputs`` from a later position on, for a per-position sweep on it
        (:mod:`~multihead.circuits.runs.suffix_runs`), or None (the reason logged on ``log``)."""
        return SuffixRuns.build(
            self.pair, inputs, self.metric, self.metric_input, unpatched.output,
            unpatched.prefix, caller=caller, log=log,
        )  # fmt: skip

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
