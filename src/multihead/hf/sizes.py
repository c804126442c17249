"""What a Hugging Face model directory's ``config.json`` promises, against what its weights hold:
checked from the safetensors headers (shapes only, no tensor) before transformers builds a
model, whatever the family.

transformers builds the model the config describes and initialises at random whatever the files
lack: a config that says 2000 layers over weights holding 2 costs minutes and gives a model that
is 99.9 % random, one that says 10**6 layers never ends, and sizes whose product overflows fail
deep inside torch. Here each size is compared in a way that holds for every family:

- layer counts (``num_hidden_layers``, ``n_layer``, ``decoder_layers``, ...) against the layer
  stacks in the weight names (``h.N.``, ``layer.N.``, ``layers.N.``, ``block.N.``);
- ``vocab_size`` against the rows of the token embedding (``wte``, ``embed_tokens``,
  ``word_embeddings``, ``shared``, ...), position limits against a position table's rows;
- the width (``hidden_size``, ``n_embd``, ``d_model``) must be the size of some tensor, and no
  other width or head count may exceed every size in the weights.

Keys are read from the JSON as written (before transformers derives anything from them, such as
a list per layer), and named as written in the messages.
"""

from __future__ import annotations

import math
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from multihead._checks import is_int
from multihead._files import TensorInfo, few, layer_counts, read_header, read_json

__all__ = ["read_weight_headers", "check_sizes", "check_epsilons", "shape_disagreements"]

_LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model", "dim")
_POSITION_KEYS = ("max_position_embeddings", "n_positions")
# Widths and head counts: each is the size of some tensor when the model uses it.
_BOUNDED_KEYS = (
    "intermediate_size",
    "n_inner",
    "d_ff",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "num_attention_heads",
    "n_head",
    "num_heads",
    "num_key_value_heads",
    "head_dim",
    "d_kv",
)
# The names of token and position tables (the segment before ".weight").
_EMBEDDINGS = (
    "wte",
    "embed_tokens",
    "word_embeddings",
    "shared",
    "embed_in",
    "tok_embeddings",
    "word_embedding",
)
_POSITIONS = ("wpe", "position_embeddings", "embed_positions")
# The norms' epsilons, as families spell them: each must be a finite number >= 0 (a negative one
# makes every norm of a near-constant row NaN).
_EPSILON_KEYS = (
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "norm_eps",
    "norm_epsilon",
    "rms_norm_epsilon",
    "layernorm_epsilon",
)


def read_weight_headers(directory: Path) -> dict[str, TensorInfo] | None:
    """Every tensor's shape and dtype in ``model.safetensors``, or in the shards that
    ``model.safetensors.index.json`` lists, or else in ``pytorch_model.bin`` (and the shards
    of its index; read as shapes on the meta device, no tensor loaded); None when the
    directory has none of them.

    Raises:
        FileNotFoundError: a shard the index names is missing.
        ValueError: a corrupt file or index (names it).
    """
    single = directory / "model.safetensors"
    if single.is_file():
        return read_header(single).tensors
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return _pickled_shapes(directory)
    weight_map = read_json(index)
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()
    ):
        raise ValueError(
            f"{str(index)!r} has no weight_map of tensor names to shard files in its directory"
        )
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(read_header(directory / shard).tensors)
    return tensors


def _pickled_shapes(directory: Path) -> dict[str, TensorInfo] | None:
    """The shapes in ``pytorch_model.bin`` (or its index's shards), read on the meta device
    from the memory-mapped archive: no tensor's bytes are read. None without such files, or
    for the legacy (non-zip) format, which cannot be mapped."""
    single = directory / "pytorch_model.bin"
    index = directory / "pytorch_model.bin.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v and Path(v).name == v for v in weight_map.values()
        ):
            raise ValueError(
                f"{str(index)!r} has no weight_map of tensor names to shard files in its directory"
            )
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        return None
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        if not zipfile.is_zipfile(file):
            return None  # the legacy format: transformers reads it, unchecked here
        try:
            found = torch.load(file, map_location="meta", weights_only=True, mmap=True)
        except Exception as e:  # a damaged archive: torch raises several kinds
            raise ValueError(f"{str(file)!r} could not be read: {type(e).__name__}: {e}") from None
        if not isinstance(found, Mapping):
            raise ValueError(f"{str(file)!r} holds no state dict of tensors")
        tensors.update(
            {k: TensorInfo.of(v) for k, v in found.items() if isinstance(v, torch.Tensor)}
        )
    return tensors


def _sizes(config: Mapping[str, Any], keys: tuple[str, ...]) -> list[tuple[str, int]]:
    return [(k, config[k]) for k in keys if is_int(config.get(k)) and config[k] >= 0]


def _table(name: str) -> str | None:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 and parts[-1] == "weight" else None


def check_sizes(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo]) -> None:
    """``config`` (a parsed ``config.json``) must describe the weights ``tensors`` hold.

    Raises:
        ValueError: what disagrees, in one short line (keys as written in config.json); a
            config with 0 layers.
    """
    problems = []
    stacks = layer_counts(tensors)
    held = few([f"{n} layers ({prefix}.N)" for prefix, n in sorted(stacks.items())])
    for key, value in _sizes(config, _LAYER_KEYS):
        if value == 0:
            problems.append(f"{key} is 0: a model without layers has no attention to look at")
        elif stacks and value not in stacks.values():
            problems.append(f"{key} is {value}, the weights hold {held}")
    vocab = dict(_sizes(config, ("vocab_size",))).get("vocab_size")
    positions = _sizes(config, _POSITION_KEYS)
    for name, info in tensors.items():
        table = _table(name)
        if len(info.shape) != 2 or table is None:
            continue
        if table in _EMBEDDINGS and vocab is not None and info.shape[0] != vocab:
            problems.append(f"vocab_size is {vocab}, {name} has {info.shape[0]} rows")
        if table in _POSITIONS:
            problems += [
                f"{key} is {value}, {name} has {info.shape[0]} rows"
                for key, value in positions
                if value > info.shape[0]
            ]
    sizes = {d for info in tensors.values() for d in info.shape}
    largest = max(sizes, default=0)
    if sizes:
        problems += [
            f"{key} is {value}, no tensor in the weights has that size"
            for key, value in _sizes(config, _WIDTH_KEYS)
            if value not in sizes
        ]
        problems += [
            f"{key} is {value}, more than any size in the weights (at most {largest})"
            for key, value in _sizes(config, _BOUNDED_KEYS)
            if value > largest
        ]
    if problems:
        raise ValueError(f"config.json disagrees with the weights: {few(problems, 3, sep='; ')}")


def check_epsilons(config: Mapping[str, Any]) -> None:
    """``config``'s norm epsilons (as written in config.json) must be finite numbers >= 0.

    Raises:
        ValueError: the first that is not, in one line.
    """
    for key in _EPSILON_KEYS:
        if key not in config or config[key] is None:
            continue
        value = config[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value) or value < 0:
            raise ValueError(
                f"config.json's {key} is {value!r}: expected a finite number >= 0 (a norm's "
                f"epsilon, such as 1e-05)"
            )


def shape_disagreements(
    expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, TensorInfo]
) -> list[str]:
    """The tensors whose stored shape differs from the one a model built from the config has
    (``expected``: its state dict's shapes). A stored name may carry the prefix of a task
    model (``transformer.``, ``model.``) that a base model's names lack.
    """
    by_suffix: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        parts = name.split(".")
        for i in range(min(3, len(parts))):
            by_suffix.setdefault(".".join(parts[i:]), info)
    return [
        f"{name} is {by_suffix[name].shape} in the weights, {shape} by config.json"
        for name, shape in expected.items()
        if name in by_suffix and by_suffix[name].shape != tuple(shape)
    ]
