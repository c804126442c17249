"""Saving and loading a :class:`~multihead.models.TransformerLM`; safetensors with a checksum.

On disk a model is a directory with ``config.json`` (its :class:`LMConfig` under ``"model"``,
plus whatever the caller adds, e.g. the task) and ``model.safetensors``. Never pickle. Each file
is replaced atomically; the weights carry a SHA-256 of their tensors in the safetensors
metadata, verified on load. :func:`rename_legacy_keys` maps the names of earlier versions
(``layers.layers.{i}.…``, ``layers.norm.…``) to today's (``blocks.{i}.…``, ``norm.…``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from multihead.models.lm_config import LMConfig

if TYPE_CHECKING:
    from multihead.models.lm import TransformerLM

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "save_lm", "read_config", "load_lm", "rename_legacy_keys"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_MODEL_TYPE = "multihead.TransformerLM"

M = TypeVar("M", bound="TransformerLM")

# Before the LM's stack was its own (blocks + final norm) it was a TransformerEncoder named
# "layers": checkpoints of that time hold "layers.layers.{i}.…" and "layers.norm.…".
_LEGACY = (
    (re.compile(r"^layers\.layers\.(\d+)\."), r"blocks.\1."),
    (re.compile(r"^layers\.norm\."), "norm."),
)


def rename_legacy_keys(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A TransformerLM state dict under today's names; names already current are kept."""
    out: dict[str, Tensor] = {}
    for name, value in tensors.items():
        for pattern, replacement in _LEGACY:
            name = pattern.sub(replacement, name)
        out[name] = value
    return out


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "saving and loading models needs safetensors: pip install 'multihead[cli]'"
        ) from e
    return safetensors.torch


def _payload_digest(header: Mapping[str, Any], data: bytes) -> str:
    """SHA-256 of a safetensors file's tensor entries (names, dtypes, shapes, offsets) and data."""
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    digest = hashlib.sha256(json.dumps(entries, sort_keys=True).encode())
    digest.update(data)
    return digest.hexdigest()


def _split_safetensors(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header, data) of safetensors bytes; ValueError when the header is unreadable."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes, shorter than the 8-byte header size")
    size = int.from_bytes(blob[:8], "little")
    if size > len(blob) - 8:
        raise ValueError(f"the header claims {size} bytes, the file has {len(blob) - 8} after it")
    header = json.loads(blob[8 : 8 + size])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, blob[8 + size :]


def _safetensors_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str]) -> bytes:
    """``tensors`` as safetensors bytes whose metadata also holds their SHA-256 (``sha256``).

    The checksum covers the tensor entries and the data, so a flipped bit anywhere but in the
    metadata is found when :func:`_read_safetensors` reads the file back.
    """
    st = _safetensors()
    header, data = _split_safetensors(st.save(dict(tensors), metadata=dict(metadata)))
    # The metadata lives in the header only: adding the checksum leaves entries and data as is.
    checksum = _payload_digest(header, data)
    blob: bytes = st.save(dict(tensors), metadata={**metadata, "sha256": checksum})
    return blob


def _read_safetensors(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file, its checksum verified when it has one.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is truncated, corrupt or fails its checksum (names the file).
    """
    st = _safetensors()
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is missing")
    blob = path.read_bytes()
    try:
        header, data = _split_safetensors(blob)
        metadata = header.get("__metadata__") or {}
        if not isinstance(metadata, dict):
            raise ValueError("its __metadata__ is not a JSON object")
        tensors = st.load(blob)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{str(path)!r} is not a valid safetensors file ({e})") from None
    expected = metadata.get("sha256")
    if expected is not None and expected != _payload_digest(header, data):
        raise ValueError(
            f"{str(path)!r} is corrupt: its tensors do not match the checksum stored with them"
        )
    return tensors, metadata


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
    weights = _safetensors_bytes(tensors, {"format": "pt"})
    path.mkdir(parents=True, exist_ok=True)
    _atomic_write(path / WEIGHTS_NAME, weights)
    _atomic_write(path / CONFIG_NAME, config_bytes)
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
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("model_type") != _MODEL_TYPE:
        raise ValueError(
            f"{str(file)!r} is not a TransformerLM config (model_type must be {_MODEL_TYPE!r})"
        )
    if not isinstance(config.get("model"), dict):
        raise ValueError(f"{str(file)!r} has no 'model' entry (a JSON object)")
    return config


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
    tensors, _ = _read_safetensors(weights)
    tensors = rename_legacy_keys(tensors)
    mismatch = f"the weights in {str(weights)!r} don't match its config"
    if config.num_layers > len(tensors):  # each layer holds tensors: don't build millions
        raise ValueError(
            f"{mismatch}: num_layers={config.num_layers} but the file holds only "
            f"{len(tensors)} tensors"
        )
    # Compare on the meta device first: a config edited to absurd widths allocates nothing.
    expected = cls.from_config(config, device="meta").state_dict()
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        problems.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    if unexpected:
        problems.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
    for name in sorted(set(expected) & set(tensors)):
        want, got = expected[name], tensors[name]
        if want.shape != got.shape:
            problems.append(
                f"{name} has shape {tuple(got.shape)}, the config needs {tuple(want.shape)}"
            )
        elif want.dtype != got.dtype:
            problems.append(f"{name} has dtype {got.dtype}, the model needs {want.dtype}")
    if problems:
        raise ValueError(f"{mismatch}: " + "; ".join(problems[:4]))
    bad = [name for name, t in tensors.items() if not bool(torch.isfinite(t).all())]
    if bad:
        raise ValueError(
            f"the weights in {str(weights)!r} are not finite (nan or inf in {bad[:4]}): the "
            f"run that wrote them diverged"
        )
    model = cls(**config.to_dict(), device=device)
    model.load_state_dict(tensors)
    return model
