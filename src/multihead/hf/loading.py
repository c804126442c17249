"""Reading a Hugging Face model and its fast tokenizer from local files only: what
:func:`multihead.hf.text.load_hf` wraps as an :class:`~multihead.hf.text.HFTextModel`.

Never downloads: a directory is read as it is, a name is looked up in the local Hugging Face
cache only. Every refusal (a path that does not exist, a name not in the cache, no
``config.json``, sizes in it that the weights don't have (:mod:`multihead.hf.sizes`, before
transformers builds anything), no fast tokenizer or one with ids beyond the embedding, a family
the interface does not route) is told here, in the words of the name or path the caller gave.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import string
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from multihead._checks import describe
from multihead._files import TensorInfo, few, read_json
from multihead.devices import resolve_device, resolve_dtype
from multihead.hf.sizes import check_sizes, read_weight_headers, shape_disagreements
from multihead.models.text import check_token_ids

__all__ = ["load_model_and_tokenizer"]


def load_model_and_tokenizer(
    dir_or_name: str | os.PathLike[str],
    *,
    cache_dir: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    causal_lm: bool = False,
) -> tuple[Any, Any, str]:
    """(model, fast tokenizer, name) from local files, the model on
    ``attn_implementation="multihead"`` in eval mode; the name is the directory's or the given
    model name. Arguments, errors and warnings: :func:`multihead.hf.text.load_hf`, which
    calls this (its warning points at load_hf's caller). ``causal_lm`` loads the model with its
    language-modelling head (``AutoModelForCausalLM``: logits, for ``multihead patch``)."""
    if not isinstance(dir_or_name, (str, os.PathLike)):
        raise TypeError(f"model must be a directory or a model name, got {describe(dir_or_name)}")
    given = os.fspath(dir_or_name)
    if not given:
        raise ValueError("model must be a directory or a model name, got ''")
    where = resolve_device("cpu" if device is None else device)
    resolve_dtype(dtype, None, where)  # a bad dtype fails before any file is read
    local = _local_directory(given)  # its mistakes are told before transformers is needed
    why = "" if local else f"model {given!r} is not a directory, and "
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            f"{why}a Hugging Face model needs transformers: pip install 'multihead[hf]'"
        ) from e
    try:
        import multihead.hf  # noqa: F401  (registers "multihead" in transformers)
    except ImportError as e:  # older than multihead.hf supports: the error names both versions
        raise ImportError(f"{why}{e}") from e

    directory = local or _from_cache(given, cache_dir)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"model {given!r} has no config.json: expected a Hugging Face model directory "
            f"(config.json, the weights, tokenizer.json)"
        )
    tensors = _check_files(directory, given)
    with _quiet(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        except MemoryError:
            raise
        except Exception as e:  # transformers' config validation raises several kinds
            raise ValueError(
                f"model {given!r}: transformers cannot read its config.json: "
                f"{type(e).__name__}: {e}"
            ) from None
        tokenizer = _tokenizer(transformers, directory, given)
        vocab_size = getattr(config, "vocab_size", None)
        if isinstance(vocab_size, int):  # the tokenizer's ids must have rows in the embedding
            try:
                check_token_ids(tokenizer.backend_tokenizer, vocab_size)
            except ValueError as e:
                raise ValueError(f"model {given!r}: {e}") from None
        dtype = resolve_dtype(dtype, getattr(config, "dtype", None), where)
        placed: dict[str, Any] = {"dtype": dtype}
        if where.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
            placed["device_map"] = {"": where}  # the weights go straight onto the device
        # Loaded on transformers' default implementation and switched after the check: a family
        # without the interface fails inside from_pretrained with a bare KeyError otherwise.
        try:
            auto: Any = transformers.AutoModelForCausalLM if causal_lm else transformers.AutoModel
            model, info = auto.from_pretrained(
                directory,
                config=config,
                local_files_only=True,
                output_loading_info=True,
                **placed,
            )
        except MemoryError:
            raise
        except Exception as e:  # a config that builds no model (0 heads, ...), bad weights
            differ = _disagreements(transformers, config, tensors) if tensors else []
            if differ:
                raise ValueError(
                    f"model {given!r}: config.json disagrees with the weights: "
                    f"{few(differ, 3, sep='; ')}"
                ) from None
            raise ValueError(
                f"model {given!r}: transformers cannot build it from its files: "
                f"{type(e).__name__}: {e}"
            ) from None
    model.to(where)  # without accelerate, loaded on the CPU first
    # transformers initialises weights missing from the files at random, and says so only in a
    # log line we silenced: say it as a warning (BERT's pooler is never read here).
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith("pooler.")]
    if missing:
        warnings.warn(
            f"model {given!r}: {len(missing)} weights are not in its files and were initialised "
            f"at random ({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''})",
            UserWarning,
            stacklevel=3,
        )
    from multihead.hf.sites import attention_sites

    attention_sites(model.get_encoder() if config.is_encoder_decoder else model)
    model.set_attn_implementation(multihead.hf.NAME)
    name = local.resolve().name if local else given
    return model.eval(), tokenizer, name


def _check_files(directory: Path, given: str) -> dict[str, TensorInfo] | None:
    """Compare config.json's sizes with the weights' headers before anything is built; returns
    the headers' tensors (None without safetensors weights: transformers reads those)."""
    try:
        config = read_json(directory / "config.json")
        tensors = read_weight_headers(directory)
        if tensors is not None and isinstance(config, dict):
            check_sizes(config, tensors)
    except ValueError as e:
        raise ValueError(f"model {given!r}: {e}") from None
    return tensors


def _disagreements(transformers: Any, config: Any, tensors: dict[str, TensorInfo]) -> list[str]:
    """The tensors whose shape in the files differs from the model ``config`` builds, found on
    the meta device (nothing allocated); empty when none can be named."""
    try:
        with torch.device("meta"):
            built = transformers.AutoModel.from_config(config)
    except Exception:  # the config builds no model at all: transformers' own words then
        return []
    return shape_disagreements({k: tuple(v.shape) for k, v in built.state_dict().items()}, tensors)


def _looks_like_path(given: str) -> bool:
    # Hub names are "name" or "owner/name"; anything else can only be a path.
    return (
        given.startswith((".", "/", "~"))
        or given.count("/") > 1
        or os.sep in given.replace("/", "")
        or bool(set(given) - set(string.ascii_letters + string.digits + "-_./"))
    )


def _local_directory(given: str) -> Path | None:
    """``given`` as a directory; None for what can only be a model name."""
    path = Path(given).expanduser()
    try:
        exists = path.exists()
    except OSError as e:  # a name too long, ...
        raise ValueError(f"model path {given!r} cannot be used: {e.strerror or e}") from None
    if exists:
        if not path.is_dir():
            raise NotADirectoryError(
                f"model must be a directory or a model name, got {given!r} (not a directory)"
            )
        return path
    if _looks_like_path(given):
        raise FileNotFoundError(f"model directory {given!r} does not exist")
    return None


def _from_cache(given: str, cache_dir: str | None) -> Path:
    """The snapshot directory of the model named ``given`` in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(given, "config.json", cache_dir=cache_dir)
    except ValueError:  # not a valid repo id
        found = None
    if not isinstance(found, str):
        raise FileNotFoundError(
            f"model {given!r} is neither a directory nor a model in the local Hugging Face "
            f"cache; multihead never downloads: fetch it first (hf download {given}) or pass "
            f"its directory"
        )
    return Path(found).parent


def _tokenizer(transformers: Any, directory: Path, given: str) -> Any:
    need = (
        f"model {given!r} needs a fast tokenizer (tokenizer.json) to read text, got "
        f"{{}} in {str(directory)!r}"
    )
    if not (directory / "tokenizer.json").is_file():
        raise ValueError(need.format("no tokenizer.json"))
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise ValueError(need.format(f"a tokenizer transformers cannot load ({e})")) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(need.format(f"a slow tokenizer ({type(tokenizer).__name__})"))
    return tokenizer


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """transformers' progress bars and config notes off while loading (the caller's terminal
    is the CLI's); both come back as they were."""
    logging = transformers.utils.logging
    bars = logging.is_progress_bar_enabled()
    verbosity = logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()
