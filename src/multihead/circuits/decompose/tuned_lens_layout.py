"""tuned-lens's files: a directory of ``config.json`` and the translators' parameters.

tuned-lens 0.2.0 (``TunedLens.save``, ``from_unembed_and_pretrained``; 0.1 is the same) writes

- ``config.json``: its ``TunedLensConfig`` (``base_model_name_or_path``, ``d_model``,
  ``num_hidden_layers``, ``bias``, ``base_model_revision``, ``unembed_hash``, ``lens_type``
  ``"linear_tuned_lens"``);
- ``params.pt``: the translators' ``ModuleList`` state dict, ``{i}.weight`` (E, E) and
  ``{i}.bias`` (E,) for i in 0 .. L - 1 (translator i reads ``hidden_states[i]``).

multihead reads ``params.pt`` with ``torch.load(weights_only=True)`` alone, and writes and
reads a twin ``params.safetensors`` (the same names, checksummed; its header checked before any
tensor is read). tuned-lens 0.0.x's layout is read too: the whole lens's state dict,
``input_translator`` (``hidden_states[0]``, the embeddings; absent without ``include_input``:
then that translator is zero, the logit lens), ``layer_translators.{i}`` (``hidden_states[i +
1]``, i < L - 1) and the lens's own copies of the norm and unembedding (``layer_norm.*``,
``unembedding.*``: not read, the model's own are); its config has ``num_layers``,
``include_input``, ``reuse_unembedding`` (must be true) and ``extra_layers`` (must be 0).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead._checks import describe, is_int
from multihead._files import (
    atomic_write,
    checksummed_safetensors,
    few,
    json_bytes,
    read_header,
    read_json,
    read_tensors,
    read_torch_weights,
)

__all__ = ["LENS_TYPE", "PARAMS", "TunedLensLayout"]

LENS_TYPE = "linear_tuned_lens"
PARAMS = ("params.pt", "params.safetensors")
# the 0.0.x lens's own copies of the model's norm and unembedding: not read
_LEGACY_IGNORED = ("unembedding.", "layer_norm.")


@dataclass(frozen=True)
class TunedLensLayout:
    """What a config says the parameters hold: the names (tuned-lens 0.1+ or 0.0.x), the
    number of streams, the width, whether there are biases."""

    count: int
    width: int
    bias: bool
    legacy: bool
    include_input: bool
    config: dict[str, Any]

    @classmethod
    def of(cls, config: dict[str, Any]) -> TunedLensLayout:
        width = config["d_model"]
        if not is_int(width) or width <= 0:
            raise ValueError(f"d_model must be a positive int, got {describe(width)}")
        bias = config.get("bias", True)
        if not isinstance(bias, bool):
            raise ValueError(f"bias must be true or false, got {describe(bias)}")
        if "num_hidden_layers" in config:  # tuned-lens 0.1 and later
            lens_type = config.get("lens_type", LENS_TYPE)
            if lens_type != LENS_TYPE:
                raise ValueError(f"lens_type must be {LENS_TYPE!r}, got {describe(lens_type)}")
            count = config["num_hidden_layers"]
            if not is_int(count) or count <= 0:
                raise ValueError(f"num_hidden_layers must be a positive int, got {describe(count)}")
            keys = ("base_model_name_or_path", "base_model_revision", "unembed_hash")
            kept = {key: config[key] for key in keys if key in config}
            return cls(count, width, bias, False, True, kept)
        layers = config["num_layers"]  # tuned-lens 0.0.x
        if not is_int(layers) or layers <= 1:
            raise ValueError(f"num_layers must be an int > 1, got {describe(layers)}")
        if config.get("reuse_unembedding", True) is not True or config.get("extra_layers", 0):
            raise ValueError(
                "a lens with its own unembedding (reuse_unembedding false) or extra layers "
                "is not a translator of the stream: not read"
            )
        include = config.get("include_input", True)
        return cls(layers, width, bias, True, bool(include), {})

    def expected(self) -> dict[str, tuple[int, ...]]:
        """name -> shape of every tensor the parameters must hold."""
        e = self.width
        parts = [("weight", (e, e))] + ([("bias", (e,))] if self.bias else [])
        if not self.legacy:
            prefixes = [f"{i}." for i in range(self.count)]
        else:
            prefixes = [f"layer_translators.{i}." for i in range(self.count - 1)]
            prefixes += ["input_translator."] if self.include_input else []
        return {prefix + part: shape for prefix in prefixes for part, shape in parts}

    def check(self, path: Path, found: dict[str, tuple[int, ...]]) -> None:
        expected = self.expected()
        missing = sorted(set(expected) - set(found))
        extra = sorted(
            name
            for name in set(found) - set(expected)
            if not (self.legacy and name.startswith(_LEGACY_IGNORED))
        )
        shapes = [
            f"{name} has shape {found[name]}, not {shape}"
            for name, shape in expected.items()
            if name in found and tuple(found[name]) != shape
        ]
        problems = (
            ([f"missing {few(missing)}"] if missing else [])
            + ([f"unexpected {few(extra)}"] if extra else [])
            + shapes[:3]
        )
        if problems:
            raise ValueError(
                f"{str(path)!r} is not the parameters its config.json describes "
                f"({self.count} streams {self.width} wide): {'; '.join(problems)}"
            )

    def arrays(self, tensors: dict[str, Tensor]) -> tuple[Tensor, Tensor | None]:
        """(weights (L, E, E), biases (L, E) or None) in tuned-lens 0.1's order, float32 at
        least, on the CPU."""
        e = self.width

        def get(prefix: str, part: str) -> Tensor:
            name = prefix + part
            if name in tensors:
                return tensors[name].detach().cpu()
            return torch.zeros((e, e) if part == "weight" else (e,))  # the identity

        if self.legacy:
            prefixes = ["input_translator."] + [
                f"layer_translators.{i}." for i in range(self.count - 1)
            ]
        else:
            prefixes = [f"{i}." for i in range(self.count)]
        weights = torch.stack([get(p, "weight") for p in prefixes])
        dtype = torch.promote_types(weights.dtype, torch.float32)
        biases = torch.stack([get(p, "bias") for p in prefixes]).to(dtype) if self.bias else None
        return weights.to(dtype), biases

    @classmethod
    def read(cls, path: Path, ckpt: str | None) -> tuple[Tensor, Tensor | None, dict[str, Any]]:
        """(weights, biases, config) of the tuned lens in the directory ``path``, its
        parameters in ``ckpt`` (default whichever of ``params.pt`` and ``params.safetensors``
        is there).

        Raises:
            FileNotFoundError: no such directory, config or parameters.
            ValueError: a config or parameters that are not a tuned lens's (names the file and
                what is wrong), both parameter files and no ckpt.
        """
        if not path.is_dir():
            raise FileNotFoundError(
                f"{str(path)!r} is not a directory: a tuned lens is one, holding config.json "
                f"and params.pt"
            )
        if ckpt is None:
            present = [name for name in PARAMS if (path / name).is_file()]
            if len(present) != 1:
                raise (FileNotFoundError if not present else ValueError)(
                    f"{str(path)!r} must hold one of {' or '.join(PARAMS)}, it holds "
                    f"{' and '.join(present) or 'neither'}"
                    f"{'; name one with ckpt=' if present else ''}"
                )
            ckpt = present[0]
        _check_name(ckpt)
        file = path / "config.json"
        config = read_json(file)
        try:
            if not isinstance(config, dict):
                raise ValueError("it is not a JSON object")
            layout = cls.of(config)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{str(file)!r} is not a tuned lens's config: {e}") from None
        except KeyError as e:
            raise ValueError(f"{str(file)!r} is not a tuned lens's config: no {e}") from None
        params = path / ckpt
        if ckpt.endswith(".safetensors"):
            layout.check(params, {n: i.shape for n, i in read_header(params).tensors.items()})
            tensors = read_tensors(params)
        else:
            loaded = read_torch_weights(params, "a tuned lens's parameters")
            if not isinstance(loaded, dict) or not all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in loaded.items()
            ):
                raise ValueError(f"{str(params)!r} is not a state dict of named tensors")
            layout.check(params, {name: tuple(t.shape) for name, t in loaded.items()})
            tensors = loaded
        weights, biases = layout.arrays(tensors)
        return weights, biases, dict(layout.config)

    @staticmethod
    def write(
        path: Path, ckpt: str, weights: Tensor, biases: Tensor | None, config: dict[str, Any]
    ) -> None:
        """Write a tuned lens to the directory ``path`` (made if missing): ``config.json`` and
        ``ckpt`` (``.pt``, or the twin ``.safetensors``), each atomically.

        Raises:
            ValueError: a ckpt that is not a file name ending in .pt or .safetensors, a path
                that is a file.
        """
        _check_name(ckpt)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{str(path)!r} is a file: a tuned lens is a directory")
        try:  # encoded before anything is written: a config JSON cannot hold fails first
            config_bytes = json_bytes(config)
        except (TypeError, ValueError) as e:
            raise TypeError(f"the tuned lens's config must hold JSON values only: {e}") from None
        path.mkdir(parents=True, exist_ok=True)
        state = {}
        for i in range(weights.shape[0]):
            state[f"{i}.weight"] = weights[i].contiguous()
            if biases is not None:
                state[f"{i}.bias"] = biases[i].contiguous()
        if ckpt.endswith(".safetensors"):
            atomic_write(path / ckpt, checksummed_safetensors(state, {"format": "pt"}))
        else:
            buffer = io.BytesIO()
            torch.save(state, buffer)
            atomic_write(path / ckpt, buffer.getvalue())
        atomic_write(path / "config.json", config_bytes)


def _check_name(ckpt: Any) -> None:
    if (
        not isinstance(ckpt, str)
        or not ckpt.endswith((".pt", ".safetensors"))
        or Path(ckpt).name != ckpt
    ):
        raise ValueError(
            f"ckpt must be a file name ending in .pt or .safetensors, got {describe(ckpt)}"
        )
