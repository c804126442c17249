"""Saving and loading a :class:`~multihead.models.TransformerLM`; safetensors with a checksum.

On disk a model is a directory with ``config.json`` (its :class:`LMConfig` under ``"model"``,
plus whatever the caller adds, e.g. the task) and ``model.safetensors``. Never pickle. Each file
is replaced atomically; the weights carry a SHA-256 of their tensors in the safetensors
metadata, verified on load. :func:`rename_legacy_keys` maps the names of earlier versions
(``layers.layers.{i}.…``, ``layers.norm.…``) to today's (``blocks.{i}.…``, ``norm.…``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from multihead._files import (
    TensorInfo,
    atomic_write,
    checksummed_safetensors,
    layer_counts,
    read_header,
    read_json,
    read_tensors,
    tensor_problems,
)
from multihead.models.lm_config import LMConfig

if TYPE_CHECKING:
    from multihead.models.lm import TransformerLM

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "save_lm",
    "read_config",
    "load_lm",
    "check_weights",
    "rename_legacy_keys",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MODEL_TYPE = "multihead.TransformerLM"

M = TypeVar("M", bound="TransformerLM")
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


def save_lm(
    model: TransformerLM,
    directory: str | os.PathLike[str],
    *,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """See :meth:`TransformerLM.save <multihead.models.TransformerLM.save>`."""
    path = Path(directory)
    extra = dict(extra or {})
    clash = {"model", "model_type"} & set(extra)
    if clash:
        raise ValueError(f"extra must not redefine the keys {sorted(clash)}")
    config = {"model_type": _MODEL_TYPE, "model": model.config.to_dict(), **extra}
    config_bytes = (json.dumps(config, indent=2) + "\n").encode()  # fails before any write
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    weights = checksummed_safetensors(tensors, {"format": "pt"})
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / WEIGHTS_NAME, weights)
    atomic_write(path / CONFIG_NAME, config_bytes)
    return path


def read_config(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """See :meth:`TransformerLM.read_config <multihead.models.TransformerLM.read_config>`."""
    path = Path(directory)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} {what}")
    file = path / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{str(file)!r} is missing: not a saved TransformerLM")
    config = read_json(file)
    if not isinstance(config, dict) or config.get("model_type") != _MODEL_TYPE:
        raise ValueError(
            f"{str(file)!r} is not a TransformerLM config (model_type must be {_MODEL_TYPE!r})"
        )
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(file)!r} has no 'model' entry (a JSON object)")
    return config


def check_weights(
    cls: type[TransformerLM], config: LMConfig, found: Mapping[str, TensorInfo], file: Path
) -> None:
    """The tensors a header describes (``found``, names as stored) must be exactly those
    ``config`` builds: names, shapes and dtypes. Nothing the size of the model is allocated.

    Raises:
        ValueError: one short line naming ``file`` and what disagrees.
    """
    found = rename_legacy_keys(found)
    mismatch = f"the weights in {str(file)!r} don't match its {CONFIG_NAME}"
    blocks = layer_counts(found).get("blocks", 0)
    if blocks != config.num_layers:  # millions of layers are not built to find this out
        raise ValueError(
            f"{mismatch}: it has {config.num_layers} layers, the file holds {blocks} (blocks.N)"
        )
    # The sizes that set the largest tensors, checked on the tensors that show them: a size
    # such as max_len=10**17 overflows even on the meta device.
    e = config.embed_dim
    direct = {
        "token_embedding.weight": TensorInfo((config.vocab_size, e), "float32"),
        "position_embedding.embedding.weight": TensorInfo((config.max_len, e), "float32"),
    }
    if not config.attn_only:
        direct["blocks.0.ff.linear1.weight"] = TensorInfo((config.ff_dim, e), "float32")
    needs = f"{CONFIG_NAME} needs"
    problems = tensor_problems(direct, found, needs=needs, extra=False)
    if not problems:  # every size now matches the file's: the meta model is as small as it
        meta = cls.from_config(config, device="meta").state_dict()
        expected = {k: TensorInfo.of(v) for k, v in meta.items()}
        problems = tensor_problems(expected, found, needs=needs)
    if problems:
        raise ValueError(f"{mismatch}: " + "; ".join(problems))


def load_lm(
    cls: type[M], directory: str | os.PathLike[str], *, device: torch.device | str | None = None
) -> M:
    """See :meth:`TransformerLM.load <multihead.models.TransformerLM.load>`."""
    path = Path(directory)
    raw = read_config(path)
    try:
        config = LMConfig.from_dict(raw["model"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{str(path / CONFIG_NAME)!r}: {e}") from None
    weights = path / WEIGHTS_NAME
    check_weights(cls, config, read_header(weights).tensors, weights)
    # Only now is anything the size of the model read: the header matched the config.
    tensors = rename_legacy_keys(read_tensors(weights, device=device))
    bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"the weights in {str(weights)!r} are not finite (nan or inf in {bad[:4]}): the "
            f"run that wrote them diverged"
        )
    model = cls(**config.to_dict(), device=device)
    model.load_state_dict(tensors)
    return model
