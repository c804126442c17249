"""Load BERT encoders from Hugging Face style directories onto multihead's layers.

Every check runs before the model is built: the config's values, and the checkpoint's tensor
names, shapes and dtypes from the safetensors header (read without reading the data). So a config
that promises sizes the file doesn't hold (say ``max_position_embeddings: 10**12``) fails with a
message, not in the allocator, and the memory a load takes is bounded by the file's size.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from multihead._files import few, layer_counts, read_header, read_json, read_tensors
from multihead.devices import declared_dtype, resolve_device, resolve_dtype
from multihead.models.bert import BertModel
from multihead.models.bert_config import BertConfig
from multihead.pretrained.config import read_bert_config

__all__ = ["load_bert", "hf_to_multihead_names", "hf_shapes"]

_PICKLES = ("pytorch_model.bin", "model.bin", "model.pt", "pytorch_model.pt", "model.ckpt")
# Buffers that Hugging Face saves with the embeddings; they hold no learned values.
_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")


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


def hf_shapes(config: BertConfig) -> dict[str, tuple[int, ...]]:
    """Each Hugging Face weight's shape (unprefixed names), from the config alone."""
    e, f = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (config.vocab_size, e),
        "embeddings.position_embeddings.weight": (config.max_position_embeddings, e),
        "embeddings.token_type_embeddings.weight": (config.type_vocab_size, e),
        "embeddings.LayerNorm.weight": (e,),
        "embeddings.LayerNorm.bias": (e,),
    }
    for i in range(config.num_hidden_layers):
        hf = f"encoder.layer.{i}."
        # (out, in) for each linear layer; all heads together are E wide.
        for name, out, inp in (
            *((f"attention.self.{part}", e, e) for part in ("query", "key", "value")),
            ("attention.output.dense", e, e),
            ("intermediate.dense", f, e),
            ("output.dense", e, f),
        ):
            shapes[f"{hf}{name}.weight"], shapes[f"{hf}{name}.bias"] = (out, inp), (out,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{hf}{norm}.weight"], shapes[f"{hf}{norm}.bias"] = (e,), (e,)
    return shapes


def _check_header(path: Path, config: BertConfig) -> dict[str, str]:
    """Check the checkpoint's names, shapes and dtypes against the config.

    Returns:
        The Hugging Face name (unprefixed) -> its name in the file, for every weight we load.
    """
    header = read_header(path).tensors
    # Task models (BertForMaskedLM, ...) put the encoder under "bert.".
    stored = {(n[len("bert.") :] if n.startswith("bert.") else n): n for n in header}
    # The layers first: hf_shapes lists 16 names a layer, and a config may claim millions.
    layers = layer_counts(stored).get("encoder.layer", 0)
    if layers != config.num_hidden_layers:
        raise ValueError(
            f"{path} holds {layers} encoder layers (encoder.layer.N), but config.json's "
            f"num_hidden_layers is {config.num_hidden_layers}"
        )
    expected = hf_shapes(config)
    missing = [name for name in expected if name not in stored]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} weight(s) the encoder needs: {few(missing)}")
    unknown = [
        n
        for n in stored
        if n not in expected and n not in _BUFFERS and n.startswith(("embeddings.", "encoder."))
    ]
    if unknown:
        raise ValueError(
            f"{path} holds encoder weight(s) this BERT has no place for (another "
            f"architecture?): {few(sorted(unknown))}"
        )
    for name, want in expected.items():
        shape, dtype = header[stored[name]]
        if shape != want:
            raise ValueError(
                f"{path}: weight {name!r} has shape {shape}, expected {want} from config.json"
            )
        if not dtype.startswith(("float", "bfloat")):
            raise ValueError(
                f"{path}: weight {name!r} has dtype {dtype}, expected a floating point dtype"
            )
    return {name: stored[name] for name in expected}


def _state_dict(tensors: dict[str, Tensor], num_layers: int) -> dict[str, Tensor]:
    """Our state dict from the checkpoint's tensors (Hugging Face names)."""
    state: dict[str, Tensor] = {}
    for ours, hfs in hf_to_multihead_names(num_layers).items():
        parts = [tensors[hf] for hf in hfs]
        # The packed projection stacks q, k and v along dim 0 (H·D rows each).
        state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return state


def load_bert(
    path: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> BertModel:
    """Load a BERT encoder from a Hugging Face style directory, onto multihead's layers.

    The model alone (ids in, hidden states out); :func:`~multihead.pretrained.load_text_model`
    reads the same directory with its tokenizer, as a :class:`~multihead.text.TextModel`.

    Args:
        path: a directory with ``config.json`` and ``model.safetensors``.
        device: where to put the model (``"auto"``: the GPU if any); default CPU. The weights
            are read straight onto it.
        dtype: the parameters' floating dtype (or its name, ``"bfloat16"``); default the one
            ``config.json`` declares (``dtype`` / ``torch_dtype``), except that half types load
            as float32 on the CPU; float32 when it declares none.

    Returns:
        A :class:`~multihead.models.bert.BertModel` in eval mode.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or lacks ``config.json`` or
            ``model.safetensors`` (a pickle checkpoint is named but never loaded).
        ValueError: an empty ``path``; an invalid or unsupported config; a corrupt safetensors
            file; a layer count, weight names (a few listed, then how many more), a shape
            (named, with the shape the config implies) or an integer dtype that disagrees with
            the config; a device this machine lacks. Nothing is half-loaded and nothing is
            allocated for the model until every check has passed.
        TypeError: ``path`` is not a str or path, ``dtype`` not a floating torch.dtype; a config
            value of the wrong kind.
        ImportError: safetensors is not installed.

    Example:
        >>> model = load_bert("path/to/all-MiniLM-L6-v2")  # doctest: +SKIP
        >>> model(torch.tensor([[101, 7592, 102]])).last_hidden_state.shape  # doctest: +SKIP
        torch.Size([1, 3, 384])
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or a path, got {type(path).__name__}")
    if not os.fspath(path):  # Path("") would be the current directory
        raise ValueError("path must be a model directory, got ''")
    where = resolve_device("cpu" if device is None else device)
    resolve_dtype(dtype, None, where)  # a bad dtype fails before any file is read
    directory = Path(path)
    try:
        is_dir = directory.is_dir()
    except OSError as e:  # a name too long, a loop of links
        raise ValueError(f"path {os.fspath(path)!r} cannot be used: {e.strerror or e}") from None
    if not is_dir:
        raise FileNotFoundError(
            f"path must be a model directory, got {os.fspath(path)!r} (not a directory)"
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

    config = read_bert_config(config_file)
    dtype = resolve_dtype(dtype, declared_dtype(read_json(config_file)), where)
    names = _check_header(weights_file, config)
    # Only now is anything the size of the model allocated: the header matched the config.
    stored = read_tensors(weights_file, names.values(), device=where)
    tensors = {name: stored[key] for name, key in names.items()}

    # Built directly, not on the meta device: `torch.device("meta")` imports torch._dynamo,
    # which costs more (about 1.5 s) than the random initialisation it would save (0.2 s).
    model = BertModel(config, device=where, dtype=dtype)
    state = _state_dict(tensors, config.num_hidden_layers)
    assert {k: tuple(v.shape) for k, v in state.items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()
    }, "hf_shapes / hf_to_multihead_names out of date with BertModel"
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval()
