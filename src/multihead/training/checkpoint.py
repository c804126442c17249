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
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CHECKPOINTS",
    "save_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "optimizer_to_tensors",
    "optimizer_from_tensors",
]

CHECKPOINTS = "checkpoints"
FILES = ("config.json", "model.safetensors", "optimizer.safetensors", "state.json")
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("checkpoints need safetensors: pip install 'multihead[cli]'") from e
    return safetensors.torch


def _fsync_dir(path: Path) -> None:
    # Makes the directory entries (new files, a rename) durable; not possible on every OS.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


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
    """Rebuild an ``optimizer.state_dict()`` from :func:`optimizer_to_tensors`'s output."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, entry in meta.get("scalars", {}).items():
        state.setdefault(int(index), {}).update(entry)
    groups = [
        {k: tuple(v) if k == "betas" else v for k, v in group.items()}
        for group in meta["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


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
    st = _safetensors()
    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final = root / name
    if not final.exists():  # the same step saved twice holds the same state: write it once
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=root))
        try:
            tensors = {k: v.detach().contiguous() for k, v in model_state.items()}
            opt_tensors, opt_meta = optimizer_to_tensors(optimizer_state)
            _write(tmp / "model.safetensors", st.save(tensors, metadata={"step": str(step)}))
            _write(
                tmp / "optimizer.safetensors", st.save(opt_tensors, metadata={"step": str(step)})
            )
            _write(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode())
            full_state = {"step": step, "optimizer": opt_meta, **state}
            _write(tmp / "state.json", (json.dumps(full_state) + "\n").encode())
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    # Only now, with the new checkpoint in place, remove older ones and leftovers of crashes.
    steps = sorted(_complete_steps(root))
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


def _complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and all((entry / f).is_file() for f in FILES):
            steps.append(int(match.group(1)))
    return steps


def latest_checkpoint(run_dir: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint of a run, or None when there is none."""
    root = Path(run_dir) / CHECKPOINTS
    steps = _complete_steps(root)
    return root / f"step-{max(steps):08d}" if steps else None


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint directory written by :func:`save_checkpoint`.

    Returns:
        ``{"config", "model_state", "optimizer_state", "state"}``.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file is corrupt.
    """
    st = _safetensors()
    path = Path(path)
    for f in FILES:
        if not (path / f).is_file():
            raise FileNotFoundError(f"checkpoint file {str(path / f)!r} is missing")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {str(path)!r} holds invalid JSON ({e})") from None
    try:
        model_state = st.load((path / "model.safetensors").read_bytes())
        opt_tensors = st.load((path / "optimizer.safetensors").read_bytes())
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(
            f"checkpoint {str(path)!r} holds a corrupt safetensors file ({e})"
        ) from None
    optimizer_state = optimizer_from_tensors(opt_tensors, state.pop("optimizer"))
    return {
        "config": config,
        "model_state": model_state,
        "optimizer_state": optimizer_state,
        "state": state,
    }


def to_device(tensors: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}
