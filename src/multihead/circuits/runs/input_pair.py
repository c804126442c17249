"""The two inputs a patching experiment compares, run alone or stacked, and the metric on them.

Activation patching, attribution patching and direct logit attribution run a model on inputs
the user gives as the model takes them: a tensor of token ids (B, T) (the model's first
positional argument, batch first), or a dict of keyword arguments (``input_ids``,
``attention_mask``, ...). :class:`InputPair` checks a clean and a corrupt input against each
other (the same kind, keys and shapes) and runs the model on either, or on ``n`` copies of one
stacked along the batch (variant-major: rows ``i·B … (i+1)·B - 1`` are variant i), which is how
:func:`~multihead.patch_heads` runs many patched variants in one forward.

A metric takes the model's output and returns a scalar tensor (a (B,) tensor is averaged).
On a stacked run it is called once per variant on that variant's own output
(:func:`split_output`: every tensor of the output cut to the variant's rows), so it sees
exactly what an unstacked run returns.

Shapes: B batch, T tokens, n stacked variants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from multihead._checks import describe
from multihead.mapping import model_map

__all__ = [
    "DIRECTIONS",
    "InputPair",
    "model_inputs",
    "reduced_fields",
    "run_model",
    "split_output",
]


# a patch's direction: "denoise" runs corrupt with clean's activations, "noise" the reverse
DIRECTIONS = ("denoise", "noise")

_KINDS = (
    "a tensor of token ids (B, T) or a dict of keyword arguments for the model (for a text "
    "model, also a text or a list of texts)"
)


@runtime_checkable
class Tokenizes(Protocol):
    """A model that reads text itself (:class:`multihead.TextModel`): its ``tokenize(texts)``
    gives a batch with ``input_ids`` and ``attention_mask`` (B, T) on the model's device."""

    def tokenize(self, texts: str | Sequence[str]) -> Any: ...


def _from_texts(model: nn.Module, name: str, value: object) -> object:
    """``value`` as the model's keyword arguments when it is a text or texts and the model
    tokenizes them itself; anything else as it is."""
    texts = isinstance(value, str) or (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, str) for v in value)
    )
    if not texts:
        return value
    if not isinstance(model, Tokenizes):
        raise TypeError(
            f"{name} is text, and {type(model).__name__} does not read text: give token ids "
            f"(B, T), or a text model (multihead.load_text_model(..., head='lm'))"
        )
    batch = model.tokenize(value)  # type: ignore[arg-type]
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}


def _batched(name: str, value: object) -> Tensor | dict[str, Any]:
    """One input, checked: a tensor with a batch dimension, or a str-keyed dict holding one."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            raise ValueError(f"{name} must be {_KINDS}, got a 0-d tensor")
        _check_not_empty(name, value)
        return value
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{name} must have str keys (the model's keyword arguments)")
        if not any(isinstance(v, Tensor) and v.dim() > 0 for v in value.values()):
            raise ValueError(f"{name} must hold at least one tensor with a batch dimension")
        for key, item in value.items():
            if isinstance(item, Tensor) and item.dim() > 0:
                _check_not_empty(f"{name}[{key!r}]", item)
        return dict(value)
    raise TypeError(f"{name} must be {_KINDS}, got {type(value).__name__} {describe(value)}")


def _check_not_empty(name: str, value: Tensor) -> None:
    """A batch of at least one sequence of at least one position: an empty one has no heads'
    outputs to patch and no metric to average."""
    if value.shape[0] == 0 or (value.dim() > 1 and value.shape[1] == 0):
        raise ValueError(
            f"{name} must hold at least one sequence (B >= 1) of at least one token (T >= 1), "
            f"got shape {tuple(value.shape)}"
        )


def _first_batched(value: dict[str, Any]) -> Tensor:
    return next(v for v in value.values() if isinstance(v, Tensor) and v.dim() > 0)


def _batch_size(value: Tensor | dict[str, Any]) -> int:
    if isinstance(value, Tensor):
        return value.shape[0]
    return _first_batched(value).shape[0]


def _tile(value: Any, copies: int, batch: int) -> Any:
    """A tensor whose first dimension is the batch repeated ``copies`` times (variant-major);
    anything else (a shared (1, T) tensor, a flag) as it is."""
    if copies == 1 or not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if value.shape[0] != batch:
        return value
    return value.repeat(copies, *(1,) * (value.dim() - 1))


class InputPair:
    """A clean and a corrupt input of one model, checked to match.

    Args:
        model: the model both run through.
        clean, corrupt: token ids (B, T) (any tensor the model takes first, batch first), or
            dicts of keyword arguments; both of one kind, with the same keys, the same shapes
            and dtypes, and equal non-tensor values. For a model that reads text (a
            :class:`multihead.TextModel`), a text or a list of texts each, tokenized by the
            model (padded on the right; the two must give as many tokens).

    A model runs with the call options of its map (:func:`multihead.model_map`:
    ``use_cache=False`` for a model that would keep a cache) unless the inputs say otherwise:
    no run here needs a cache, and a stacked run's cache would hold every variant's keys and
    values.

    Raises:
        TypeError: an input of another kind, or the two of different kinds.
        ValueError: shapes, dtypes, keys or values that differ (naming the first difference).
    """

    def __init__(self, model: nn.Module, clean: object, corrupt: object) -> None:
        self.model = model
        self.clean = _batched("clean", _from_texts(model, "clean", clean))
        self.corrupt = _batched("corrupt", _from_texts(model, "corrupt", corrupt))
        _check_alike(self.clean, self.corrupt)
        self.batch = _batch_size(self.clean)
        self.extra = _cache_off(model, self.clean)

    def pick(self, direction: str) -> tuple[Tensor | dict[str, Any], Tensor | dict[str, Any]]:
        """(source, target) of a patch: ``"denoise"`` runs corrupt with clean's activations,
        ``"noise"`` runs clean with corrupt's."""
        return (self.clean, self.corrupt) if direction == "denoise" else (self.corrupt, self.clean)

    def run(self, inputs: Tensor | dict[str, Any], copies: int = 1) -> Any:
        """The model's output on ``inputs``, or on ``copies`` of them stacked along the batch."""
        return _call(self.model, inputs, self.extra, copies, self.batch)

    @property
    def length(self) -> int:
        """T, the positions of each sequence (the inputs' second dimension)."""
        first = self.clean if isinstance(self.clean, Tensor) else _first_batched(self.clean)
        return first.shape[1] if first.dim() > 1 else 1

    def suffix_refusal(self, inputs: Tensor | dict[str, Any]) -> str | None:
        """Why ``inputs`` cannot be run from a later position on alone (:meth:`run_suffix`),
        or None when they can: every tensor is (B, T, ...) and cut along T, but an attention
        mask, which is dropped and so must let every token be seen."""
        if isinstance(inputs, Tensor):
            return None if inputs.dim() >= 2 else "the input has no positions to cut"
        for key, value in inputs.items():
            if not isinstance(value, Tensor):
                continue
            if key == "attention_mask":
                if not bool(value.bool().all()):
                    return "the inputs hold padding (an attention_mask with zeros)"
            elif value.dim() < 2 or value.shape[:2] != (self.batch, self.length):
                return f"inputs[{key!r}] is not (B, T, ...) = ({self.batch}, {self.length}, ...)"
        return None

    def run_suffix(
        self,
        inputs: Tensor | dict[str, Any],
        start: int,
        copies: int,
        positions_argument: str,
        stop: int | None = None,
    ) -> Any:
        """The model's output on positions ``start`` … ``stop`` - 1 (default T - 1) of
        ``inputs`` (``copies`` stacked), given their positions as ``positions_argument``
        (B·copies, stop - start): what the run of the whole input gives there, once each
        attention call is also given the keys and values of the earlier positions (the
        caller's q/k/v editors do that). Inputs as :meth:`suffix_refusal` allows."""
        stop = self.length if stop is None else stop
        if isinstance(inputs, Tensor):
            given: dict[str, Any] = {"": inputs}
        else:
            given = {k: v for k, v in inputs.items() if k != "attention_mask"}
        cut = {
            k: _tile(v[:, start:stop], copies, self.batch) if isinstance(v, Tensor) else v
            for k, v in given.items()
        }
        if positions_argument not in cut:
            device = next(v.device for v in cut.values() if isinstance(v, Tensor))
            positions = torch.arange(start, stop, device=device)
            cut[positions_argument] = positions.expand(self.batch * copies, -1)
        extra = {k: v for k, v in self.extra.items() if k not in cut}
        ids = cut.pop("", None)
        if ids is not None:
            return self.model(ids, **cut, **extra)
        return self.model(**cut, **extra)


def model_inputs(model: nn.Module, inputs: object, name: str = "inputs") -> Tensor | dict[str, Any]:
    """One input of the kinds :class:`InputPair` takes, checked (``name`` in errors) and as the
    model is called with it: a tensor of ids, or a dict of keyword arguments (a text model's
    texts tokenized: ``input_ids`` and ``attention_mask``)."""
    return _batched(name, _from_texts(model, name, inputs))


def run_model(model: nn.Module, inputs: object, name: str = "inputs") -> tuple[Any, int]:
    """(the model's output, B) for one input of the kinds :class:`InputPair` takes (checked
    and named ``name`` in errors), run without a cache as there."""
    checked = model_inputs(model, inputs, name)
    return _call(model, checked, _cache_off(model, checked), 1, 1), _batch_size(checked)


def _cache_off(model: nn.Module, inputs: Tensor | dict[str, Any]) -> dict[str, Any]:
    """The call options of the model's map (``use_cache=False`` for a model that would keep a
    cache), less those the inputs set themselves."""
    given = inputs.keys() if isinstance(inputs, dict) else ()
    return {k: v for k, v in model_map(model).call_options.items() if k not in given}


def _call(
    model: nn.Module,
    inputs: Tensor | dict[str, Any],
    extra: dict[str, Any],
    copies: int,
    batch: int,
) -> Any:
    if isinstance(inputs, Tensor):
        return model(_tile(inputs, copies, batch), **extra)
    return model(**{k: _tile(v, copies, batch) for k, v in inputs.items()}, **extra)


def _check_alike(clean: Tensor | dict[str, Any], corrupt: Tensor | dict[str, Any]) -> None:
    if isinstance(clean, Tensor) != isinstance(corrupt, Tensor):
        raise TypeError(
            f"clean and corrupt must be of one kind (both tensors or both dicts), got "
            f"{type(clean).__name__} and {type(corrupt).__name__}"
        )
    if isinstance(clean, Tensor):
        assert isinstance(corrupt, Tensor)
        pairs: list[tuple[str, Any, Any]] = [("", clean, corrupt)]
    else:
        assert isinstance(corrupt, dict)
        if clean.keys() != corrupt.keys():
            raise ValueError(
                f"clean and corrupt must have the same keys, got {sorted(clean)} and "
                f"{sorted(corrupt)}"
            )
        pairs = [(f"[{k!r}]", clean[k], corrupt[k]) for k in clean]
    for where, a, b in pairs:
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            if a.shape != b.shape:
                raise ValueError(
                    f"clean{where} and corrupt{where} must have the same shape, got "
                    f"{tuple(a.shape)} and {tuple(b.shape)}"
                )
            if a.dtype != b.dtype or a.device != b.device:
                raise ValueError(
                    f"clean{where} and corrupt{where} must have the same dtype and device, got "
                    f"{a.dtype} on {a.device} and {b.dtype} on {b.device}"
                )
        elif isinstance(a, Tensor) or isinstance(b, Tensor) or a != b:
            raise ValueError(
                f"clean{where} and corrupt{where} must be equal where they are not tensors, got "
                f"{describe(a)} and {describe(b)}"
            )


def reduced_fields(output: Any, where: str = "output") -> list[str]:
    """The fields of a model's output that are one number for the whole batch (a 0-d floating
    tensor: a loss the model reduced over the batch), named as a metric reads them
    (``output.loss``). Stacked variants cannot be told apart in such a field."""
    if isinstance(output, Tensor):
        return [where] if output.dim() == 0 and output.is_floating_point() else []
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return [
            found
            for f in dataclasses.fields(output)
            for found in reduced_fields(getattr(output, f.name), f"{where}.{f.name}")
        ]
    if isinstance(output, Mapping):
        return [found for k, v in output.items() for found in reduced_fields(v, f"{where}[{k!r}]")]
    if isinstance(output, (tuple, list)):
        return [found for i, v in enumerate(output) for found in reduced_fields(v, f"{where}[{i}]")]
    return []


def split_output(stacked: Any, single: Any, copies: int) -> list[Any]:
    """The outputs of ``copies`` stacked variants, one each, shaped like ``single`` (the
    output of one unstacked run): every tensor whose first dimension is ``copies`` times
    ``single``'s is cut into its variants' rows (views, no copies); a tensor of ``single``'s
    own shape (not batched), and anything that is not a tensor, tuple, list, dict or dataclass,
    is handed to every variant as it is.

    Raises:
        ValueError: a tensor whose shape is neither ``single``'s nor ``copies`` times it.
    """
    if copies == 1:
        return [stacked]
    if isinstance(stacked, Tensor) and isinstance(single, Tensor):
        if stacked.shape == single.shape:
            return [stacked] * copies
        if single.dim() and stacked.shape == (copies * single.shape[0], *single.shape[1:]):
            return list(stacked.unflatten(0, (copies, single.shape[0])).unbind(0))
        raise ValueError(
            f"cannot split the model's stacked output per variant: a tensor of shape "
            f"{tuple(stacked.shape)} where one run gives {tuple(single.shape)}"
        )
    if dataclasses.is_dataclass(stacked) and not isinstance(stacked, type):
        names = [f.name for f in dataclasses.fields(stacked) if f.init]
        parts = {
            n: split_output(getattr(stacked, n), getattr(single, n, None), copies) for n in names
        }
        return [
            dataclasses.replace(stacked, **{n: parts[n][i] for n in names}) for i in range(copies)
        ]
    if isinstance(stacked, Mapping) and isinstance(single, Mapping):
        split = {k: split_output(v, single.get(k), copies) for k, v in stacked.items()}
        kind: Any = type(stacked)
        return [kind({k: s[i] for k, s in split.items()}) for i in range(copies)]
    if isinstance(stacked, (tuple, list)) and isinstance(single, (tuple, list)):
        if len(stacked) != len(single):
            raise ValueError(
                f"cannot split the model's stacked output per variant: a {type(stacked).__name__} "
                f"of {len(stacked)} items where one run gives {len(single)}"
            )
        items = [split_output(a, b, copies) for a, b in zip(stacked, single, strict=True)]
        if hasattr(stacked, "_fields"):  # a named tuple takes its items as arguments
            return [type(stacked)(*(item[i] for item in items)) for i in range(copies)]
        return [type(stacked)(item[i] for item in items) for i in range(copies)]
    return [stacked] * copies
