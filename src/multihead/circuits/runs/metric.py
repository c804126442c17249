"""What a metric is given: the model's logits or its whole output, and the scalar it returns.

A metric takes the model's output and returns a scalar tensor (a (B,) tensor is averaged).
:func:`metric_reader` wraps it as every circuit function calls it, and :func:`metric_value`
checks and reduces what it returned.

Shapes: B batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from multihead._checks import check_choice

__all__ = ["logits_of", "METRIC_INPUTS", "Metric", "metric_reader", "metric_value"]

# metric(logits or output) -> () or (B,) floating tensor
Metric = Callable[[Any], Tensor]


# what a metric is given: the model's logits (TransformerLens's convention), or its whole output
METRIC_INPUTS = ("logits", "output")


def logits_of(output: Any) -> Tensor | None:
    """A model output's logits: the output itself when it is a tensor, else its ``logits``
    field or key; None when it has none."""
    if isinstance(output, Tensor):
        return output
    found = output.get("logits") if isinstance(output, Mapping) else None
    found = getattr(output, "logits", found)
    return found if isinstance(found, Tensor) else None


def metric_reader(metric: Metric, metric_input: str) -> Metric:
    """``metric`` as the patching functions call it on a model's output: given the logits
    (``"logits"``: an output's ``logits`` field, a tensor output as it is, any other output
    whole) or the whole output (``"output"``). An exception inside the metric carries a note
    naming what it was given.

    Raises:
        ValueError: an unknown ``metric_input``.
    """
    check_choice("metric_input", metric_input, METRIC_INPUTS)

    def read(output: Any) -> Tensor:
        given, what = output, f"the model's output ({_describe(output)})"
        if metric_input == "logits" and not isinstance(output, Tensor):
            logits = logits_of(output)
            if logits is not None:
                given, what = logits, f"the logits ({_describe(logits)}), the output's .logits"
            else:
                what += ", which carries no logits"
        elif metric_input == "logits":
            what = f"the model's output, its logits ({_describe(output)})"
        try:
            return metric(given)
        except Exception as e:
            switch = (
                "metric_input='output' gives it the whole output"
                if metric_input == "logits"
                else "metric_input='logits' gives it the logits"
            )
            e.add_note(f"metric was given {what}; {switch}")
            raise

    return read


def metric_value(metric: Metric, output: Any, batch: int, what: str) -> Tensor:
    """``metric(output)`` as a () tensor: a (B,) result averaged (``what`` names the run)."""
    value = metric(output)
    if (
        not isinstance(value, Tensor)
        or not value.is_floating_point()
        or not (value.dim() == 0 or value.shape == (batch,) or value.numel() == 1)
    ):
        raise ValueError(
            f"metric must return a scalar floating point tensor (or one per example, "
            f"({batch},), which is averaged), got {_describe(value)} ({what})"
        )
    return value.mean() if value.dim() and value.numel() > 1 else value.reshape(())


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__
