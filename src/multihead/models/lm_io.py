"""The files a saved :class:`~multihead.models.TransformerLM` lives in: safetensors with a
checksum, and JSON.

On disk a model is a directory with ``config.json`` (``"model_type"``, its :class:`LMConfig`
under ``"model"``, plus whatever the caller adds, e.g. the task) and ``model.safetensors``.
Never pickle. Each file is replaced atomically; the weights carry a SHA-256 of their tensors in
the safetensors metadata, verified on read. :func:`rename_legacy_keys` maps the names of earlier
versions (``layers.layers.{i}.…``, ``layers.norm.…``) to today's (``blocks.{i}.…``, ``norm.…``).

Files only: building the model and checking its tensors against a file are
:class:`~multihead.models.TransformerLM`'s methods (``save``, ``load``, ``check_weights``), which
use this module. Training checkpoints write the same ``config.json`` (:func:`config_json`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from multihead._files import (
    atomic_write,
    checksummed_safetensors,
    json_bytes,
    read_json,
    read_tensors,
)
from multihead.models.lm_config import LMConfig

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "MODEL_TYPE",
    "config_json",
    "write_files",
    "read_config",
    "read_model_config",
    "read_weights",
    "rename_legacy_keys",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# config.json's "model_type": what marks a directory (or checkpoint) as a saved TransformerLM.
MODEL_TYPE = "multihead.TransformerLM"

V = TypeVar("V")

# Before the LM's stack was its own (blocks + final norm) it was a TransformerEncoder named
# "layers": checkpoints of that time hold "layers.layers.{i}.…" and "layers.norm.…".
_LEGACY = (
    (re.compile(r"^layers\.layers\.(\d+)\."), r"blocks.\1."),
    (re.compile(r"^layers\.norm\."), "norm."),
)


def rename_legacy_keys(tensors: Mapping[str, V]) -> dict[str, V]:
    """A TransformerLM state dict (or a header's entries) under today's names; names already
    current are kept."""
    out: dict[str, V] = {}
    for name, value in tensors.items():
        for pattern, replacement in _LEGACY:
            name = pattern.sub(replacement, name)
        out[name] = value
    return out


def config_json(config: LMConfig, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What ``config.json`` holds: the model type, ``config`` under ``"model"``, and ``extra``.

    Raises:
        ValueError: ``extra`` redefines ``"model"`` or ``"model_type"``.
    """
    extra = dict(extra or {})
    clash = {"model", "model_type"} & set(extra)
    if clash:
        raise ValueError(f"extra must not redefine the keys {sorted(clash)}")
    return {"model_type": MODEL_TYPE, "model": config.to_dict(), **extra}


def write_files(
    directory: str | os.PathLike[str], config: Mapping[str, Any], tensors: Mapping[str, Tensor]
) -> Path:
    """Write ``config.json`` (``config``, see :func:`config_json`) and ``model.safetensors``
    (``tensors``, checksummed) into ``directory``, created if needed; each file atomically.

    Both files are encoded before anything is written: a config that is not JSON writes
    nothing.
    """
    path = Path(directory)
    config_bytes = json_bytes(config)
    weights = checksummed_safetensors(
        {k: v.detach().contiguous() for k, v in tensors.items()}, {"format": "pt"}
    )
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / WEIGHTS_NAME, weights)
    atomic_write(path / CONFIG_NAME, config_bytes)
    return path


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``config.json`` of a saved model directory.

    Raises:
        FileNotFoundError: no such directory or no config.json in it.
        ValueError: the file is not a TransformerLM config.
    """
    path = Path(directory)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} {what}")
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{str(file)!r} is missing: not a saved TransformerLM")
    config = read_json(file)
    if not isinstance(config, dict) or config.get("model_type") != MODEL_TYPE:
        raise ValueError(
            f"{str(file)!r} is not a TransformerLM config (model_type must be {MODEL_TYPE!r})"
        )
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(file)!r} has no 'model' entry (a JSON object)")
    return config


def read_model_config(file: Path, config: Mapping[str, Any]) -> LMConfig:
    """The :class:`LMConfig` under a parsed config.json's ``"model"`` (``file`` names it in
    errors).

    Raises:
        ValueError: a missing, unknown or invalid field (names ``file``).
    """
    try:
        return LMConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{str(file)!r}: {e}") from None


def read_weights(file: Path, *, device: torch.device | str | None = None) -> dict[str, Tensor]:
    """The tensors of a model file, checksum verified, under today's names.

    Read only after the file's header was checked against the config: this allocates the model.

    Raises:
        ValueError: a corrupt file (a failed checksum included), or weights that are not finite
            (the run that wrote them diverged).
    """
    tensors = rename_legacy_keys(read_tensors(file, device=device))
    bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"the weights in {str(file)!r} are not finite (nan or inf in {bad[:4]}): the "
            f"run that wrote them diverged"
        )
    return tensors
