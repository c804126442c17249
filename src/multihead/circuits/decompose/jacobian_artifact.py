"""A Jacobian lens's file: the reference implementation's artifact, and its safetensors twin.

Anthropic's reference implementation (anthropics/jacobian-lens) and TransformerLens 4.3
(``JacobianLens.save`` / ``load``) write a ``torch.save`` dict::

    {"J": {layer: (E, E) tensor}, "n_prompts": int, "source_layers": [int],
     "d_model": int, "metadata": {str: None | bool | int | float | str | list | dict}}

(``metadata`` is TransformerLens's addition, absent from the reference's own artifacts). The
reference's fit checkpoint, running sums of an unfinished fit (``jacobian_sum``, ``n_done``,
``target_layer``, flat ``model_name`` / ``model_revision`` / ``corpus``, ...), is read as
TransformerLens's ``_from_checkpoint_payload`` reads it: the sums divided by ``n_done``, its
fit's own keys dropped, ``converted_from: "jacobian_lens_checkpoint"`` added. Files are read
with ``torch.load(weights_only=True)`` alone (:func:`multihead._files.read_torch_weights`).

The safetensors twin holds the same: tensors ``J.{layer}``, and in the header's metadata
``"lens": "jacobian_lens"`` and the other four keys as JSON strings (checksummed, as every
safetensors file multihead writes). Its header is read and checked before any tensor.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from multihead._checks import describe
from multihead._files import (
    atomic_write,
    checksummed_safetensors,
    few,
    read_header,
    read_tensors,
    read_torch_weights,
)

__all__ = ["ESTIMATOR", "SUFFIXES", "JacobianArtifact", "check_metadata", "suffix_of"]

# the estimator a fit records, and the safetensors twin's marker
ESTIMATOR = "jacobian_lens"
SUFFIXES = (".pt", ".pth", ".safetensors")
# a fit checkpoint's keys that TransformerLens drops when converting one (its own fit's)
_CHECKPOINT_DROPPED = frozenset(
    {"transformer_lens_fit", "transformer_lens_version", "model_system", "processing",
     "hook_convention", "fit_dtype", "dim_batch", "max_seq_len", "skip_first_positions"}
)  # fmt: skip
_FLAT_PROVENANCE = ("model_name", "model_revision", "corpus", "target_layer")


def check_metadata(value: Any, where: str) -> None:
    """``value`` must be what ``torch.load(weights_only=True)`` and JSON both read back: None,
    bools, ints, floats, strs, lists and tuples of them, dicts with str keys.

    Raises:
        ValueError: a dict key that is not a str.
        TypeError: a value of another type.
    """
    if value is None or type(value) in (bool, int, float, str):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_metadata(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise ValueError(f"{where} must have str keys, got {key!r}")
            check_metadata(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} must hold None, bools, numbers, strs, lists and dicts, got "
        f"{type(value).__name__} {describe(value)}"
    )


def suffix_of(path: Path) -> str:
    """The format a lens file's name chooses (``.pt``, ``.pth``, ``.safetensors``).

    Raises:
        ValueError: another suffix.
    """
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"a Jacobian lens file must end in {', '.join(SUFFIXES)} (the format), got "
            f"{str(path)!r}"
        )
    return suffix


class JacobianArtifact(NamedTuple):
    """A Jacobian lens as its file holds it (module docstring): what
    :class:`~multihead.circuits.decompose.jacobian_lens.JacobianLens` is built from, unchecked
    beyond the file's own layout."""

    jacobians: dict[int, Tensor]
    n_prompts: int
    d_model: int
    metadata: dict[str, Any]

    def write(self, path: Path, dtype: torch.dtype) -> None:
        """Write to ``path`` (atomically), the format by its suffix, the matrices in ``dtype``.

        Raises:
            ValueError: another suffix.
        """
        matrices = {layer: m.to(dtype).contiguous() for layer, m in self.jacobians.items()}
        fields: dict[str, Any] = {
            "n_prompts": self.n_prompts,
            "source_layers": list(matrices),
            "d_model": self.d_model,
        }
        if suffix_of(path) == ".safetensors":
            fields["metadata"] = self.metadata
            strings = {"lens": ESTIMATOR, **{k: json.dumps(v) for k, v in fields.items()}}
            tensors = {f"J.{layer}": m for layer, m in matrices.items()}
            atomic_write(path, checksummed_safetensors(tensors, strings))
            return
        payload = {"J": matrices, **fields}
        if self.metadata:
            payload["metadata"] = self.metadata
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        atomic_write(path, buffer.getvalue())

    @classmethod
    def read(cls, path: Path) -> JacobianArtifact:
        """Read ``path``, the format by its suffix.

        Raises:
            FileNotFoundError: no such file.
            ValueError: another suffix, a file ``torch.load(weights_only=True)`` refuses, one
                that is not a Jacobian lens's (names the path and what is wrong).
        """
        where = str(path)
        try:
            if suffix_of(path) == ".safetensors":
                return cls._of_safetensors(path)
            payload = read_torch_weights(path, "a Jacobian lens")
            if not isinstance(payload, dict) or not ("J" in payload or "jacobian_sum" in payload):
                raise ValueError(
                    "it holds no 'J' (an artifact) nor 'jacobian_sum' (a fit checkpoint)"
                )
            if "jacobian_sum" in payload and "J" not in payload:
                return cls._of_checkpoint(payload)
            return cls(
                _layer_keyed(payload["J"]),
                int(payload.get("n_prompts", 0)),
                int(payload["d_model"]),
                dict(payload.get("metadata") or {}),
            )
        except (ValueError, TypeError, KeyError, AttributeError, json.JSONDecodeError) as e:
            if where in str(e):  # the file's own reader named it already
                raise
            raise ValueError(f"{where!r} is not a Jacobian lens: {_reason(e)}") from None

    @classmethod
    def _of_checkpoint(cls, payload: dict[str, Any]) -> JacobianArtifact:
        """The reference's fit checkpoint (running sums over ``n_done`` prompts) as a lens,
        converted as TransformerLens's ``_from_checkpoint_payload`` converts one."""
        n = int(payload.get("n_done", payload.get("n_prompts", 0)))
        if n <= 0:
            raise ValueError(f"a fit checkpoint of {n} prompts (n_done): nothing to average")
        sums = _layer_keyed(payload["jacobian_sum"])
        if not sums:
            raise ValueError("a fit checkpoint with an empty jacobian_sum")
        raw = dict(payload.get("metadata") or {})
        for key in _FLAT_PROVENANCE:
            if key in payload and key not in raw:
                raw[key] = payload[key]
        kept: dict[str, Any] = {}
        dropped = []
        for key, value in raw.items():
            if key in _CHECKPOINT_DROPPED:
                continue
            try:
                check_metadata({key: value}, "metadata")
            except (ValueError, TypeError):
                dropped.append(
                    f"{key}: shape={tuple(value.shape)} dtype={value.dtype}"
                    if isinstance(value, Tensor)
                    else key
                )
                continue
            kept[key] = value
        kept["converted_from"] = "jacobian_lens_checkpoint"
        if dropped:
            kept["dropped_fields"] = dropped
        width = next(iter(sums.values())).shape[0]
        return cls({k: v.float() / n for k, v in sums.items()}, n, width, kept)

    @classmethod
    def _of_safetensors(cls, path: Path) -> JacobianArtifact:
        header = read_header(path)
        if header.metadata.get("lens") != ESTIMATOR:
            raise ValueError(f"its metadata has no 'lens': {ESTIMATOR!r}")
        strings = header.metadata
        fields = {key: json.loads(strings[key]) for key in ("n_prompts", "source_layers")}
        width, metadata = json.loads(strings["d_model"]), json.loads(strings["metadata"])
        layers = fields["source_layers"]
        expected = {f"J.{layer}" for layer in layers}
        problems = []
        if set(header.tensors) != expected:
            problems.append(
                f"tensors {few(sorted(header.tensors))}, its source_layers {layers} need "
                f"{few(sorted(expected))}"
            )
        problems += [
            f"{name} has shape {info.shape}, d_model {width} needs ({width}, {width})"
            for name, info in header.tensors.items()
            if info.shape != (width, width)
        ]
        if problems:
            raise ValueError("; ".join(problems))
        tensors = read_tensors(path)
        jacobians = {int(name.removeprefix("J.")): t for name, t in tensors.items()}
        return cls(jacobians, fields["n_prompts"], width, metadata)


def _layer_keyed(value: Any) -> dict[int, Tensor]:
    if not isinstance(value, dict):
        raise TypeError(f"its matrices are a {type(value).__name__}, not a dict of layers")
    return {int(layer): matrix for layer, matrix in value.items()}


def _reason(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"it has no {error.args[0]!r}"
    text = str(error).strip().splitlines()
    return text[0] if text and text[0] else type(error).__name__
