"""The one loader of sparse autoencoders: :func:`load` (a SAELens directory, a Gemma Scope file).

Every format is read header first: the tensors' names, shapes and dtypes (a safetensors header,
each ``.npy`` header of an ``.npz``) are compared with what the config (or, without one, the
shapes themselves) says before any tensor is read, so a load's memory is bounded by the file
whatever ``cfg.json`` claims. Pickles (``.pt``, ``.pkl``, ...; a torch zip) are never opened.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zipfile
from pathlib import Path

import torch
from torch import Tensor

from multihead._checks import describe
from multihead._files import (
    TensorInfo,
    check_regular_file,
    few,
    read_header,
    read_json,
    read_tensors,
)
from multihead.sae.gemma_scope import EMBEDDING_RESCALED, gemma_scope_config, gemma_scope_names
from multihead.sae.npz_file import npz_shapes, read_npz
from multihead.sae.sae import SAE
from multihead.sae.sae_config import SAE_DTYPES, sae_lens_config

__all__ = ["load", "PICKLE_SUFFIXES"]

CONFIG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
# what torch.save and pickle write; refused by name, never opened
PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".bin")
_FLOATS = ("float16", "bfloat16", "float32", "float64")
# SAELens < 6's decoder scale of fine-tuned SAEs (a per-feature factor on f before W_dec)
_SCALES = ("scaling_factor", "finetuning_scaling_factor")


def _pickle_refusal(path: Path) -> ValueError:
    return ValueError(
        f"{str(path)!r} is a pickle (torch.save) file, which multihead never opens (loading one "
        "runs its code): save the SAE as safetensors (SAELens: sae.save_model(dir))"
    )


def _refuse_pickles_in(folder: Path) -> None:
    """A folder holding weights only as pickles (SAELens < 3's sae_weights.pt) is refused."""
    pickles = sorted(p for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_refusal(pickles[0])


def _is_pickle(path: Path) -> bool:
    """By its name, a pickle's first bytes (protocol 2-5: 0x80 and the protocol) or a torch
    zip's data.pkl. A safetensors file is never sniffed: its first 8 bytes are its header's
    length, which may start with those bytes; its header is read as JSON or refused."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return True
    if path.suffix.lower() in (".safetensors", ".json"):
        return False
    with open(path, "rb") as f:
        first = f.read(2)
    if len(first) == 2 and first[0] == 0x80 and 2 <= first[1] <= 5:
        return True
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                return any(n.endswith(".pkl") for n in archive.namelist())
        except zipfile.BadZipFile:
            return False
    return False


def _dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) and value in SAE_DTYPES.values():
        return value
    if isinstance(value, str) and value in SAE_DTYPES:
        return SAE_DTYPES[value]
    raise ValueError(
        f"dtype must be None, a floating torch.dtype or one of {', '.join(SAE_DTYPES)}, "
        f"got {describe(value)}"
    )


def _check_shapes(
    file: Path, expected: dict[str, tuple[int, ...]], found: dict[str, TensorInfo], sae: str
) -> None:
    """ValueError naming what differs between the tensors ``found`` and those of ``expected``,
    the tensors of the SAE ``sae`` describes."""
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    if missing:
        problems.append(f"missing {few(missing)}")
    if unexpected:
        problems.append(f"unexpected {few(unexpected)}")
    for name in sorted(set(expected) & set(found)):
        if found[name].shape != expected[name]:
            problems.append(f"{name} has shape {found[name].shape}, not {expected[name]}")
        elif found[name].dtype not in _FLOATS:
            problems.append(f"{name} has dtype {found[name].dtype}, not a float")
    if problems:
        raise ValueError(f"{str(file)!r} does not hold the {sae}: {'; '.join(problems[:4])}")


def _cast(
    tensors: dict[str, Tensor], dtype: torch.dtype, device: torch.device | str | None
) -> dict[str, Tensor]:
    return {name: t.to(device=device or t.device, dtype=dtype) for name, t in tensors.items()}


def _sae_lens(folder: Path, dtype: torch.dtype | None, device: torch.device | str | None) -> SAE:
    """A directory SAELens's save_model wrote (sae_lens_disk_loader, read_sae_components_from_
    disk)."""
    config_file, weights = folder / CONFIG, folder / WEIGHTS
    raw = read_json(config_file)
    config = sae_lens_config(raw, repr(str(config_file)))
    if not weights.is_file():
        _refuse_pickles_in(folder)
        raise FileNotFoundError(f"{str(weights)!r} is missing (SAELens writes it beside {CONFIG})")
    header = read_header(weights)
    expected = config.tensor_shapes()
    scales = [name for name in _SCALES if name in header.tensors]
    expected.update({name: (config.d_sae,) for name in scales})
    sizes = f"d_in={config.d_in}, d_sae={config.d_sae}"
    if config.is_transcoder:
        sizes += f", d_out={config.d_out}"
    _check_shapes(
        weights, expected, header.tensors, f"{config.architecture} SAE of {CONFIG} ({sizes})"
    )
    config = dataclasses.replace(config, dtype=dtype or config.dtype)
    tensors = _cast(read_tensors(weights, device=device), config.dtype, device)
    for name in scales:
        scale = tensors.pop(name)
        if torch.all(scale == 1):
            continue
        if raw.get("finetuning_scaling_factor") is not True:
            raise ValueError(
                f"{str(weights)!r} holds a {name} that is not all ones, but {CONFIG}'s "
                "finetuning_scaling_factor is not true (SAELens refuses it too)"
            )
        # SAELens 5's decode: (f * scale) @ W_dec + b_dec, the scale folded into W_dec's rows
        tensors["W_dec"] = tensors["W_dec"] * scale[:, None]
    return SAE(config, tensors)


def _gemma_scope(
    file: Path, scope: int, dtype: torch.dtype | None, device: torch.device | str | None
) -> SAE:
    """Gemma Scope 1's params.npz or Gemma Scope 2's params.safetensors."""
    found = npz_shapes(file) if scope == 1 else read_header(file).tensors
    names = gemma_scope_names(list(found))
    shapes = {names[n]: info for n, info in found.items()}
    if "W_skip" in shapes:  # stored (E, O), SAELens's W_skip is (O, E)
        shapes["W_skip"] = TensorInfo(shapes["W_skip"].shape[::-1], shapes["W_skip"].dtype)
    config = gemma_scope_config(file, shapes, scope)
    sizes = f"d_in={config.d_in}, d_sae={config.d_sae}, d_out={config.d_out}"
    _check_shapes(
        file,
        config.tensor_shapes(),
        shapes,
        f"{config.architecture} SAE of W_enc's shape ({sizes})",
    )
    # SAELens reads Gemma Scope in float32 (its configs' dtype)
    config = dataclasses.replace(config, dtype=dtype or torch.float32)
    read = read_npz(file, list(found)) if scope == 1 else read_tensors(file)
    tensors = _cast({names[n]: t for n, t in read.items()}, config.dtype, device)
    if "W_skip" in tensors:
        tensors["W_skip"] = tensors["W_skip"].T.contiguous()
    if config.metadata.get(EMBEDDING_RESCALED):
        root = math.sqrt(config.d_in)
        tensors["W_enc"], tensors["W_dec"] = tensors["W_enc"] / root, tensors["W_dec"] * root
    return SAE(config, tensors)


def _neither(path: Path) -> ValueError:
    return ValueError(
        f"{str(path)!r} is neither a SAELens directory ({CONFIG} and {WEIGHTS}) nor a Gemma "
        "Scope file (params.npz, params.safetensors)"
    )


def load(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> SAE:
    """The sparse autoencoder (or transcoder) stored at ``path``.

    Accepted, side by side:

    - a SAELens directory (``cfg.json`` + ``sae_weights.safetensors``, as ``SAE.save_model``
      writes it; or either file in it): architectures standard, topk, abstopk, jumprelu,
      gated, transcoder, skip_transcoder, jumprelu_transcoder, jumprelu_skip_transcoder;
      configs from before SAELens 6.0 converted as SAELens converts them;
    - Gemma Scope 1's ``params.npz`` (JumpReLU; ``W_enc, W_dec, b_enc, b_dec, threshold``);
    - Gemma Scope 2's ``params.safetensors`` (lower-case ``w_enc, w_dec, ...``; a transcoder's
      ``affine_skip_connection``), or a directory holding either.

    Sizes come from the config and are checked against the tensors' headers, or (Gemma Scope)
    from the headers, before any tensor is read. The hook the SAE reads is the config's
    ``metadata.hook_name`` (Gemma Scope: its folder names), mapped to multihead's site
    (``sae.site``).

    Args:
        path: a directory or file, as above.
        dtype: the dtype to compute in; default the config's (Gemma Scope: float32).
        device: where the tensors go; default the CPU.

    Raises:
        FileNotFoundError: nothing at ``path``, or a SAELens directory without its weights.
        ValueError: a pickle (``.pt``, ``.pkl``, a torch zip: never opened), neither format,
            an architecture multihead does not compute, or sizes or names the config and the
            tensors disagree on (one line each).
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{str(path)!r} is missing")
    wanted = _dtype(dtype)
    if path.is_dir():
        if (path / CONFIG).is_file():
            return _sae_lens(path, wanted, device)
        for name, scope in (("params.safetensors", 2), ("params.npz", 1)):
            if (path / name).is_file():
                return _gemma_scope(path / name, scope, wanted, device)
        _refuse_pickles_in(path)
        raise _neither(path)
    check_regular_file(path)
    if _is_pickle(path):
        raise _pickle_refusal(path)
    if path.name in (CONFIG, WEIGHTS):
        return _sae_lens(path.parent, wanted, device)
    if path.suffix == ".npz":
        return _gemma_scope(path, 1, wanted, device)
    if path.suffix == ".safetensors":
        tensors = read_header(path).tensors
        if "w_enc" in tensors:
            return _gemma_scope(path, 2, wanted, device)
    raise _neither(path)
