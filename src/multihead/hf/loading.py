"""Reading a transformers model from local files only: what
:func:`multihead.pretrained.load_text_model` runs through transformers.

Never downloads: a directory is read as it is, a name is looked up in the local Hugging Face
cache only (:func:`from_cache`). Every refusal (a name not in the cache, sizes in config.json that
the weights don't have (:mod:`multihead.hf.sizes`, before transformers builds anything), a config
transformers cannot read or build, a family the interface does not route) is told here, in the
words of the name or path the caller gave. The tokenizer is the text floor's
(:mod:`multihead.pretrained.text_loader`), read the same way whichever model runs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from multihead._files import TensorInfo, few, read_json
from multihead.devices import resolve_device, resolve_dtype
from multihead.hf.forward import NAME
from multihead.hf.sites import attention_sites, routed
from multihead.hf.sizes import (
    check_epsilons,
    check_sizes,
    read_weight_headers,
    shape_disagreements,
)

__all__ = ["from_cache", "load_model", "quiet", "read_config", "tensor_parallel_options"]


def load_model(
    directory: Path,
    *,
    given: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    stacklevel: int = 2,
    causal_lm: bool = False,
    tensor_parallel: bool = False,
) -> Any:
    """The transformers model of a local directory, on ``attn_implementation="multihead"`` (a
    family computing its attention in the module keeps its own), in eval mode (an
    encoder-decoder model whole: the caller takes its encoder).

    Args:
        directory: a directory holding ``config.json`` and the weights.
        given: the directory or model name as the caller gave it, for messages.
        device: where the model runs (``"auto"``: the GPU if any); default CPU. With accelerate
            installed the weights are read straight onto it.
        dtype: a floating torch.dtype or its name; default the one config.json declares, except
            that half types load as float32 on the CPU.
        stacklevel: where the warning about missing weights points, as for ``warnings.warn``
            called here (2: the caller of this function).
        causal_lm: load the model with its language-modelling head
            (``AutoModelForCausalLM``: logits, as ``multihead patch`` needs).
        tensor_parallel: split the model over every rank of ``torch.distributed``'s default
            group (as under ``torchrun``) by the family's own tensor-parallel plan
            (transformers' ``tp_plan="auto"``): each rank holds a slice of every layer's heads,
            which transformers places on the machine's accelerator at ``LOCAL_RANK``
            (``cuda:LOCAL_RANK``), or the CPU without one; ``device`` is not used. Every rank
            must call this together: it is collective.

    Raises:
        FileNotFoundError: no ``config.json``.
        ImportError: transformers is not installed.
        ValueError: a config transformers cannot read, or whose sizes the weights don't have
            (checked before anything is built); a config that builds no model; a family not
            routed through transformers' AttentionInterface; a device this machine lacks;
            ``tensor_parallel`` without a process group of 2 ranks or more, or for a family
            transformers has no tensor-parallel plan for.
        TypeError: a bad ``dtype``.

    Warns:
        UserWarning: weights the model needs are missing from the files (initialised at random).
    """
    try:
        import transformers
    except ImportError as e:  # removed after multihead.hf was imported
        raise ImportError(f"model {given!r} needs transformers: pip install 'multihead[hf]'") from e
    ranks = _tensor_parallel_ranks(given) if tensor_parallel else 1
    if ranks > 1:
        # transformers places each rank's slice on the machine's accelerator at LOCAL_RANK (the
        # CPU without one): the default dtype is the one for that device
        where = resolve_device("auto", int(os.environ.get("LOCAL_RANK", "0")))
    else:
        where = resolve_device("cpu" if device is None else device)
    resolve_dtype(dtype, None, where)  # a bad dtype fails before any file is read
    config, tensors = read_config(directory, given)
    with quiet(transformers):
        dtype = resolve_dtype(dtype, getattr(config, "dtype", None), where)
        placed: dict[str, Any] = {"dtype": dtype}
        if ranks > 1:
            placed.update(tensor_parallel_options(config, given, ranks))
        elif where.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
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
    if ranks == 1:
        model.to(where)  # without accelerate, loaded on the CPU first
    # transformers initialises weights missing from the files at random, and says so only in a
    # log line we silenced: say it as a warning (BERT's pooler is never read here).
    missing = [k for k in info.get("missing_keys", ()) if not k.startswith("pooler.")]
    if missing:
        warnings.warn(
            f"model {given!r}: {len(missing)} weights are not in its files and were initialised "
            f"at random ({', '.join(sorted(missing)[:4])}{', ...' if len(missing) > 4 else ''})",
            UserWarning,
            stacklevel=stacklevel,
        )
    sites = attention_sites(model.get_encoder() if config.is_encoder_decoder else model)
    if any(routed(type(site.module)) for _, site in sites):
        # a family computing attention in the module (GPT-Neo, MPNet, ...) keeps its own
        model.set_attn_implementation(NAME)
    return model.eval()


def _tensor_parallel_ranks(given: str) -> int:
    """The ranks a tensor-parallel load splits the model over: every rank of the default
    process group, which must exist and hold 2 ranks or more."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    if world < 2:
        raise ValueError(
            f"model {given!r}: tensor parallelism splits the model over the ranks of a process "
            f"group, and this process is alone ({'a group of 1' if grouped else 'no group'}): "
            f"run it under torchrun with 2 processes or more (torchrun --nproc-per-node 2 ...)"
        )
    return world


def tensor_parallel_options(config: Any, given: str, ranks: int) -> dict[str, Any]:
    """``from_pretrained``'s keywords splitting the model over ``ranks`` ranks by its family's
    own plan: ``distributed_config`` where transformers has it, else ``tp_plan="auto"``.

    Raises:
        ValueError: transformers has no tensor-parallel plan for the family.
    """
    import transformers

    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"model {given!r} ({getattr(config, 'model_type', type(config).__name__)}): "
            f"transformers {transformers.__version__} has no tensor-parallel plan for this "
            f"family, so it cannot be split over ranks: load it without tensor parallelism"
        )
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # a transformers before DistributedConfig
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_size=ranks)}


def read_config(directory: Path, given: str) -> tuple[Any, dict[str, TensorInfo] | None]:
    """The directory's transformers config and its safetensors headers (None without
    safetensors weights), every size in config.json checked against the weights: all a process
    can check alone before a model is built (under tensor parallelism the build is collective,
    so every rank checks this first and the ranks agree before any of them builds).

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: a config transformers cannot read, sizes the weights don't have.
        ImportError: transformers is not installed.
    """
    import transformers

    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"model {given!r} has no config.json: expected a Hugging Face model directory "
            f"(config.json, the weights, tokenizer.json)"
        )
    tensors = _check_files(directory, given)
    with quiet(transformers):
        try:
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        except MemoryError:
            raise
        except Exception as e:  # transformers' config validation raises several kinds
            raise ValueError(
                f"model {given!r}: transformers cannot read its config.json: "
                f"{type(e).__name__}: {e}"
            ) from None
    return config, tensors


def _check_files(directory: Path, given: str) -> dict[str, TensorInfo] | None:
    """Compare config.json's sizes with the weights' headers before anything is built; returns
    the headers' tensors (None without safetensors weights: transformers reads those)."""
    try:
        config = read_json(directory / "config.json")
        if isinstance(config, dict):
            check_epsilons(config)
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


def from_cache(given: str, cache_dir: str | None = None) -> Path:
    """The snapshot directory of the model named ``given`` ("owner/name") in the local Hugging
    Face cache (``cache_dir``, default ``HF_HOME`` / ``HF_HUB_CACHE``), never downloaded.

    Raises:
        FileNotFoundError: the name is not in the cache.
    """
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


@contextlib.contextmanager
def quiet(transformers: Any) -> Iterator[None]:
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
