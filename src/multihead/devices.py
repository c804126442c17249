"""Where a model runs and in what precision: the device (``"auto"``: the local GPU if any) and
the dtype (default: the one the model directory declares; float32 on the CPU for half types).

``multihead train`` and the loaders (``multihead explain --device/--dtype``,
:func:`~multihead.pretrained.load_bert`, :func:`~multihead.pretrained.load_text_model`) share these
rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = [
    "DTYPES", "check_device", "resolve_device", "declared_dtype", "resolve_dtype", "placement",
]  # fmt: skip

# Device types a model can run on: real memory. ("meta" has no data.)
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
_DEVICE_HINT = "'auto' or a torch device such as 'cpu', 'cuda' or 'cuda:0'"
# The dtypes a model may be loaded in, by name (``--dtype``).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# Half types run slowly (or not at all) on many CPUs: a directory declaring one loads as float32
# there unless a dtype is asked for.
_HALF = (torch.float16, torch.bfloat16)


def check_device(device: object) -> str:
    """``device`` must be ``"auto"`` or a torch device string of a type with memory.

    Whether the device exists on this machine is :func:`resolve_device`'s question.

    Raises:
        TypeError: not a string.
        ValueError: not a device string, or a device type without memory (``"meta"``).
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be a str ({_DEVICE_HINT}), got {device!r}")
    if device == "auto":
        return device
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {_DEVICE_HINT}, got {device!r}") from None
    if dev.type not in _DEVICE_TYPES:
        raise ValueError(
            f"device must be one of the types {', '.join(_DEVICE_TYPES)} (or 'auto'), got "
            f"{device!r}"
        )
    return device


def resolve_device(device: str | torch.device, local_rank: int = 0) -> torch.device:
    """The torch device to run on; ``"auto"`` is the local rank's GPU if any, else the CPU.

    Raises:
        TypeError, ValueError: as :func:`check_device`; the device is not available on this
            machine.
    """
    if isinstance(device, torch.device):
        device = str(device)
    check_device(device)
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cpu":
        return dev
    backend: Any = getattr(torch, dev.type, None)
    if dev.type == "mps":
        available, count = torch.backends.mps.is_available(), 1
    elif backend is None or not backend.is_available():
        available, count = False, 0
    else:
        available, count = True, int(backend.device_count())
    if not available:
        raise ValueError(f"device {device!r} is not available on this machine (try 'cpu')")
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"device {device!r} does not exist: this machine has {count} {dev.type} device(s)"
        )
    return dev


def declared_dtype(config: Mapping[str, Any]) -> Any:
    """The dtype a model directory's ``config.json`` declares (``"dtype"``, formerly
    ``"torch_dtype"``), as written; None when it declares none."""
    declared = config.get("dtype")
    return config.get("torch_dtype") if declared is None else declared


def resolve_dtype(
    dtype: torch.dtype | str | None, declared: Any, device: torch.device
) -> torch.dtype:
    """The floating dtype to load a model in.

    Args:
        dtype: the one asked for: a floating torch.dtype or its name (``"bfloat16"``); None for
            the default.
        declared: what the model directory declares (:func:`declared_dtype`): a name or a
            torch.dtype; None, or anything else than one of :data:`DTYPES`, means float32.
        device: where the model goes.

    Returns:
        ``dtype`` when given; else the declared dtype, except float16 and bfloat16 on the CPU,
        which become float32.

    Raises:
        TypeError: ``dtype`` is neither None, a floating torch.dtype nor one of :data:`DTYPES`.
    """
    if dtype is not None:
        if isinstance(dtype, str) and dtype in DTYPES:
            return DTYPES[dtype]
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            return dtype
        raise TypeError(
            f"dtype must be a floating point torch.dtype, got {dtype!r} (or a name: "
            f"{', '.join(DTYPES)})"
        )
    if isinstance(declared, str):
        declared = DTYPES.get(declared.removeprefix("torch."))
    if not isinstance(declared, torch.dtype) or declared not in DTYPES.values():
        return torch.float32
    if device.type == "cpu" and declared in _HALF:
        return torch.float32
    return declared


def placement(module: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, dtype) of ``module``'s first parameter: where a probe of it is made; the CPU
    and float32 for a module without parameters."""
    first = next(iter(module.parameters()), None)
    if first is None:
        return torch.device("cpu"), torch.float32
    return first.device, first.dtype
