"""The one vocabulary of argument checks, shared by every public function and module.

Each check raises at the public boundary with one message style: the argument's name, what it
got and what was expected ("num_heads must be a positive int, got 0"). TypeError for a value of
the wrong kind, ValueError for a value of the right kind out of range. Internal invariants use
``assert`` instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "describe",
    "is_int",
    "check_positive_int",
    "check_non_negative_int",
    "check_optional_positive_int",
    "check_probability",
    "check_finite_float",
    "check_choice",
    "check_index",
    "check_indices",
    "check_tensor",
]

T = TypeVar("T")


def describe(value: Any) -> str:
    """A short description of ``value`` for an error message: a tensor's dtype and shape, a
    short repr otherwise."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: Any) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_int(name: str, value: Any) -> int:
    """``value`` must be an int > 0."""
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {describe(value)}")
    return int(value)


def check_non_negative_int(name: str, value: Any) -> int:
    """``value`` must be an int >= 0."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {describe(value)}")
    return int(value)


def check_optional_positive_int(name: str, value: Any) -> int | None:
    """``value`` must be None or an int > 0."""
    if value is not None and (not is_int(value) or value <= 0):
        raise ValueError(f"{name} must be a positive int or None, got {describe(value)}")
    return value


def check_probability(name: str, value: Any) -> float:
    """A dropout rate: a real number in [0, 1)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0.0 <= float(value) < 1.0
    ):
        raise ValueError(f"{name} must be a float in [0, 1), got {describe(value)}")
    return float(value)


def check_finite_float(name: str, value: Any, *, minimum: float | None = None) -> float:
    """A finite real number, optionally >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)


def check_choice(name: str, value: Any, choices: Iterable[T]) -> T:
    """``value`` must be one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, options))}, got {describe(value)}"
        )
    return value  # type: ignore[no-any-return]


def check_index(name: str, value: Any, count: int, what: str) -> int:
    """An index into ``count`` things called ``what`` (negative counts from the end).

    Returns the index in [0, count).
    """
    if not is_int(value):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    if not -count <= value < count:
        last = f"0..{count - 1}" if count else "none"
        raise ValueError(
            f"{name} {value} is out of range: there are {count} {what} ({last})"
        )
    return int(value) % count


def check_indices(
    name: str, value: int | Sequence[int] | None, count: int, what: str
) -> list[int] | None:
    """An int or a sequence of ints, each an index into ``count`` ``what``; None stays None.

    Returns the indices in [0, count), in the order given.
    """
    if value is None:
        return None
    if is_int(value):
        items: list[Any] = [value]
    elif isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be an int, a sequence of ints or None, got {describe(value)}")
    else:
        items = list(value)
    if not items:
        raise ValueError(f"{name} must name at least one of the {what}, got an empty sequence")
    return [check_index(name, item, count, what) for item in items]


def check_tensor(
    name: str,
    value: Any,
    *,
    dims: int | Sequence[int] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    floating: bool = False,
    integer: bool = False,
) -> Tensor:
    """``value`` must be a tensor, with one of ``dims`` dimensions and an allowed dtype.

    ``floating`` asks for a floating point dtype, ``integer`` for an integer dtype (not bool);
    ``dtypes`` lists the allowed dtypes exactly.
    """
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dims is not None:
        allowed = (dims,) if is_int(dims) else tuple(dims)  # type: ignore[arg-type]
        if value.dim() not in allowed:
            want = " or ".join(f"{d}-D" for d in allowed)
            raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}")
    if floating and not value.is_floating_point():
        raise TypeError(f"{name} must have a floating point dtype, got {value.dtype}")
    if integer and (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool):
        raise TypeError(f"{name} must have an integer dtype, got {value.dtype}")
    if dtypes is not None and value.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}, got {value.dtype}")
    return value
