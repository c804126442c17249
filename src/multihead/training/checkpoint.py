"""Training checkpoints that are atomic as a whole: a reader sees a complete step or none.

Layout of a run directory::

    DIR/config.json, DIR/model.safetensors   the latest weights (TransformerLM.save: each file
                                             replaced atomically; the config never changes
                                             within a run)
    DIR/checkpoints/step-00001200/           one complete checkpoint:
        config.json                          model, task and training configuration
        model.safetensors                    the weights
        optimizer.safetensors                the optimizer's tensors (AdamW moments, step counts)
        state.json                           step, optimizer hyperparameters, loss history, RNG

A checkpoint is written into a fresh hidden directory ``checkpoints/.step-….tmp``, every file
and the directory are fsynced, and only then is it renamed to ``checkpoints/step-…`` (a rename
is atomic on POSIX file systems). A crash or a kill leaves at worst a hidden ``.tmp`` directory,
which readers ignore and the next save deletes. Older checkpoints are deleted after the new one
is in place (renamed to a hidden name first, then deleted), so some complete checkpoint exists
at every instant and no visible one ever lacks a file. Nothing is pickled: tensors go
to safetensors, everything else to JSON.

Damage from outside (a file deleted, truncated or edited) is found, never trained on: each
safetensors file carries the SHA-256 of its tensors, ``state.json`` the SHA-256 of
``config.json``, and :func:`load_checkpoint` checks every file's structure and that the files
agree on the step. Its errors name the damaged file.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from multihead._checks import describe, is_int
from multihead._files import (
    checksummed_safetensors,
    fsync_dir,
    json_bytes,
    read_header,
    read_json,
    read_tensors,
    sha256,
    write_synced,
)
from multihead.models.lm import TransformerLM
from multihead.models.lm_io import read_model_config

__all__ = [
    "CHECKPOINTS",
    "save_checkpoint",
    "latest_checkpoint",
    "has_leftovers",
    "remove_checkpoints",
    "load_checkpoint",
    "optimizer_to_tensors",
    "optimizer_from_tensors",
]

CHECKPOINTS = "checkpoints"
FILES = ("config.json", "model.safetensors", "optimizer.safetensors", "state.json")
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_LEFTOVER = re.compile(r"^\.step-.*\.tmp$")


def optimizer_to_tensors(state: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into tensors (for safetensors) and JSON.

    Returns:
        ``(tensors, meta)``: tensors named ``state.<param>.<name>``; ``meta`` holds the param
        groups and any non-tensor per-parameter state.
    """
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
        for group in state["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_from_tensors(
    tensors: Mapping[str, Tensor], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """Rebuild an ``optimizer.state_dict()`` from :func:`optimizer_to_tensors`'s output.

    Raises:
        ValueError: a tensor name that is not ``state.<int>.<name>``, or malformed ``meta``.
    """
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        parts = key.split(".", 2)
        if len(parts) != 3 or parts[0] != "state" or not parts[1].isdecimal() or not parts[2]:
            raise ValueError(f"optimizer tensor {key!r} is not named state.<index>.<name>")
        state.setdefault(int(parts[1]), {})[parts[2]] = value
    scalars = meta.get("scalars", {})
    groups = meta.get("param_groups")
    if not isinstance(scalars, Mapping) or not isinstance(groups, list):
        raise ValueError("the optimizer's scalars and param_groups are malformed")
    for index, entry in scalars.items():
        if not str(index).isdecimal() or not isinstance(entry, Mapping):
            raise ValueError(f"the optimizer's scalars for {index!r} are malformed")
        state.setdefault(int(index), {}).update(entry)
    if not all(isinstance(g, Mapping) for g in groups):
        raise ValueError("the optimizer's param_groups are malformed")
    restored = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": restored}


def save_checkpoint(
    run_dir: str | os.PathLike[str],
    step: int,
    *,
    config: Mapping[str, Any],
    model_state: Mapping[str, Tensor],
    optimizer_state: Mapping[str, Any],
    state: Mapping[str, Any],
    keep: int = 1,
) -> Path:
    """Write the checkpoint of ``step`` atomically; keep the newest ``keep`` checkpoints.

    Args:
        run_dir: the run directory; the checkpoint goes to ``run_dir/checkpoints/step-NNNNNNNN``.
        step: the number of optimizer steps taken.
        config: JSON-serialisable configuration (``config.json``).
        model_state: the model's ``state_dict()``.
        optimizer_state: the optimizer's ``state_dict()``.
        state: JSON-serialisable trainer state (loss history, RNG seeds, ...).
        keep: how many checkpoints to keep (≥ 1).

    Returns:
        The checkpoint's directory.
    """
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final = root / name
    if not final.exists():  # the same step saved twice holds the same state: write it once
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
        try:
            tensors = {k: v.detach().contiguous() for k, v in model_state.items()}
            opt_tensors, opt_meta = optimizer_to_tensors(optimizer_state)
            meta = {"step": str(step)}
            config_bytes = json_bytes(config)
            write_synced(tmp / "model.safetensors", checksummed_safetensors(tensors, meta))
            write_synced(tmp / "optimizer.safetensors", checksummed_safetensors(opt_tensors, meta))
            write_synced(tmp / "config.json", config_bytes)
            # state.json vouches for config.json; the safetensors files carry their own checksums.
            full_state = {
                "step": step,
                "optimizer": opt_meta,
                **state,
                "files": {"config.json": sha256(config_bytes)},
            }
            write_synced(tmp / "state.json", json_bytes(full_state, indent=None))
            fsync_dir(tmp)
            os.rename(tmp, final)
            fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # Only now, with the new checkpoint in place, remove older ones and leftovers of crashes.
    steps = sorted(_visible_steps(root))
    for old in steps[: max(0, len(steps) - max(1, keep))]:
        # Hide it first (one atomic rename), then delete: a kill during the deletion leaves a
        # hidden leftover, never a visible checkpoint with files missing.
        hidden = root / f".step-{old:08d}.old.tmp"
        try:
            os.rename(root / f"step-{old:08d}", hidden)
        except OSError:
            continue
        shutil.rmtree(hidden, ignore_errors=True)
    for leftover in root.glob(".step-*.tmp"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _visible_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return [
        int(m.group(1))
        for entry in root.iterdir()
        if (m := _STEP_DIR.match(entry.name)) and entry.is_dir()
    ]


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest checkpoint of a run, or None when there is none.

    Every visible checkpoint was complete when it was renamed into place; one that lacks a file
    now was damaged from outside, and is returned all the same so that :func:`load_checkpoint`
    names what is missing (falling back to an older one would resume from it silently).
    """
    root = Path(run_dir) / CHECKPOINTS
    steps = _visible_steps(root)
    return root / f"step-{max(steps):08d}" if steps else None


def has_leftovers(run_dir: str | os.PathLike[str]) -> bool:
    """True when ``run_dir/checkpoints`` holds only what a crash leaves (hidden ``.step-*.tmp``
    directories, or nothing): the run stopped before its first checkpoint."""
    root = Path(run_dir) / CHECKPOINTS
    return root.is_dir() and all(_LEFTOVER.match(entry.name) for entry in root.iterdir())


def remove_checkpoints(run_dir: str | os.PathLike[str]) -> None:
    """Delete a run's checkpoints and a crash's leftovers (and ``checkpoints/`` once empty);
    anything else in ``checkpoints/`` stays."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.is_dir() and (_STEP_DIR.match(entry.name) or _LEFTOVER.match(entry.name)):
            shutil.rmtree(entry, ignore_errors=True)
    try:
        root.rmdir()
    except OSError:  # not empty: someone else's files
        pass


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = read_json(file)
    except ValueError as e:
        raise ValueError(f"checkpoint file {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"checkpoint file {str(file)!r} must hold a JSON object, got {data!r:.40}")
    return data


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a checkpoint directory written by :func:`save_checkpoint`.

    Returns:
        ``{"config", "model_state", "optimizer_state", "state"}``.

    Raises:
        FileNotFoundError: the directory or a file is missing (names it).
        ValueError: a file is corrupt, fails its checksum, or disagrees with the others on the
            step (names it).
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    for f in FILES:
        if not (path / f).is_file():
            raise FileNotFoundError(f"checkpoint file {str(path / f)!r} is missing")
    state_file, config_file = path / "state.json", path / "config.json"
    state = _read_json(state_file)
    step: Any = state.get("step")
    if not is_int(step) or step < 0:
        raise ValueError(
            f"checkpoint file {str(state_file)!r}: step must be an int >= 0, got {describe(step)}"
        )
    files = state.get("files", {})  # absent in checkpoints written before checksums
    optimizer_meta = state.pop("optimizer", None)
    if not isinstance(files, dict) or not isinstance(optimizer_meta, dict):
        raise ValueError(
            f"checkpoint file {str(state_file)!r} is malformed: 'optimizer' and 'files' must be "
            f"JSON objects"
        )
    expected = files.get("config.json")
    if expected is not None and expected != sha256(config_file.read_bytes()):
        raise ValueError(
            f"checkpoint file {str(config_file)!r} was changed after it was saved: its SHA-256 "
            f"is not the one state.json recorded"
        )
    config = _read_json(config_file)
    if isinstance(config.get("model"), dict):  # the model's sizes against its weights, first
        try:
            model_config = read_model_config(config_file, config)
        except ValueError as e:
            raise ValueError(f"checkpoint file {e}") from None
        file = path / "model.safetensors"
        TransformerLM.check_weights(model_config, read_header(file).tensors, file)
    tensors = {}
    for name in ("model.safetensors", "optimizer.safetensors"):
        file = path / name
        meta = read_header(file).metadata
        tensors[name] = read_tensors(file)
        if meta.get("step", str(step)) != str(step):
            raise ValueError(
                f"checkpoint file {str(file)!r} holds step {meta['step']}, but state.json says "
                f"step {step}"
            )
    try:
        optimizer_state = optimizer_from_tensors(tensors["optimizer.safetensors"], optimizer_meta)
    except ValueError as e:
        raise ValueError(
            f"checkpoint files {str(path / 'optimizer.safetensors')!r} and {str(state_file)!r} "
            f"do not fit together: {e}"
        ) from None
    return {
        "config": config,
        "model_state": tensors["model.safetensors"],
        "optimizer_state": optimizer_state,
        "state": state,
    }
