"""The run directory: what is in it, what a new run may do with it, and restoring a checkpoint.

Everything here only reads, except :func:`prepare_out`, which :func:`~multihead.training.train`
calls once every check has passed (the configuration, the device, the directory, the whole
checkpoint to resume from): a run that fails a check leaves the disk as it found it.

What a run directory can hold, and what each kind of run does with it:

- nothing, or only a crash's leftovers (hidden ``checkpoints/.step-*.tmp``, from a run killed
  before its first checkpoint): a new run starts; ``resume`` says there is nothing to resume;
- a checkpoint: ``resume`` continues it, ``overwrite`` replaces it, a new run refuses;
- a trained model without a checkpoint: ``overwrite`` replaces it, the others refuse;
- files with a run's names that ``multihead train`` did not write: every run refuses (nothing a
  user wrote is deleted or overwritten).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from multihead._checks import describe, is_int
from multihead._files import TensorInfo, few, read_json, tensor_problems
from multihead.models.lm_config import LMConfig
from multihead.models.lm_io import CONFIG_NAME, MODEL_TYPE, WEIGHTS_NAME, rename_legacy_keys
from multihead.training.checkpoint import (
    CHECKPOINTS,
    has_leftovers,
    latest_checkpoint,
    load_checkpoint,
    remove_checkpoints,
)
from multihead.training.config import TrainConfig
from multihead.training.tasks import TaskLike

__all__ = ["RunPlan", "check_out", "resume_config", "plan_run", "restore", "prepare_out"]

# The files a finished run writes beside checkpoints/.
RUN_FILES = (CONFIG_NAME, WEIGHTS_NAME, "loss.png", "attention.png", "induction.png")


@dataclass
class RunPlan:
    """What a checked run will do with its directory."""

    out: Path
    checkpoint: Path | None = None  # the checkpoint to resume from
    loaded: dict[str, Any] | None = None  # its contents (load_checkpoint)
    clear: bool = False  # overwrite: delete the earlier run once everything is checked


def check_out(out: str | os.PathLike[str]) -> Path:
    """``out`` must be a directory, or a path where one can be created, that we may write to.

    Raises:
        ValueError: ``out`` (or the nearest existing parent) is a file.
        PermissionError: the directory (or the parent it would be made in) is not writable.
    """
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"out {os.fspath(out)!r} is a file, not a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"out {os.fspath(out)!r} cannot be created: {str(existing)!r} is not a directory"
        )
    for directory in (existing, path / CHECKPOINTS):
        if directory.is_dir() and not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(f"out {os.fspath(out)!r}: {str(directory)!r} is not writable")
    return path


def _written_by_us(file: Path) -> bool:
    try:
        config = read_json(file)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type") == MODEL_TYPE


def _no_checkpoint(out: Path) -> Exception:
    """The error for ``resume`` when ``out`` holds no checkpoint, with what to do instead (the
    same advice a new run in ``out`` gets from :func:`plan_run`)."""
    if (out / CONFIG_NAME).is_file() and _written_by_us(out / CONFIG_NAME):
        return FileNotFoundError(
            f"--resume: {str(out)!r} holds a trained model but no checkpoint to resume: pass "
            f"--overwrite instead of --resume to start over"
        )
    if has_leftovers(out):
        return FileNotFoundError(
            f"--resume: {str(out)!r} holds no checkpoint: its run stopped before saving the "
            f"first one, so start it afresh (the same command without --resume)"
        )
    return FileNotFoundError(
        f"--resume: there is no checkpoint in {str(out / CHECKPOINTS)!r}, so nothing to resume: "
        f"start a run there without --resume"
    )


def _saved_config(path: Path, config: Any) -> TrainConfig:
    """The training configuration a checkpoint's config.json holds."""
    file = path / CONFIG_NAME
    if not isinstance(config, dict) or not isinstance(config.get("training"), dict):
        raise ValueError(
            f"checkpoint file {str(file)!r} has no 'training' entry: it was not written by "
            f"'multihead train'"
        )
    try:
        return TrainConfig.from_dict(config["training"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"checkpoint file {str(file)!r}, its 'training' entry: {e}") from None


def resume_config(out: str | os.PathLike[str], **changes: Any) -> TrainConfig:
    """The configuration of the run in ``out``, with ``changes``, set to resume it.

    Args:
        out: the run directory.
        changes: fields to change (the ones in :attr:`TrainConfig.RESUMABLE`; others must
            equal the checkpoint's, which :func:`train` checks).

    Raises:
        FileNotFoundError: no checkpoint to resume (the message says what to do instead).
        ValueError: a damaged checkpoint (names the file), or a bad change.
    """
    if not os.fspath(out):
        raise ValueError("out must name a directory, got ''")
    path = check_out(out)
    checkpoint = latest_checkpoint(path)
    if checkpoint is None:
        raise _no_checkpoint(path)
    loaded = load_checkpoint(checkpoint)
    saved = _saved_config(checkpoint, loaded["config"])
    # Before the run is sized from it: the 'training' entry must describe the saved model.
    _check_model_entry(checkpoint, loaded["config"], saved.model_config)
    fields = {**saved.to_dict(), "out": os.fspath(out), "resume": True, "overwrite": False}
    return TrainConfig(**{**fields, **changes})


def plan_run(config: TrainConfig, task: TaskLike) -> RunPlan:
    """Check ``config.out`` for this run, and load (and check) the checkpoint to resume from.

    Raises:
        ValueError, PermissionError: ``out`` is unusable, holds another run (without
            ``resume`` or ``overwrite``) or files this library did not write.
        FileNotFoundError: ``resume`` without a checkpoint, or one with a file missing.
        ValueError: a damaged checkpoint, or one trained with other settings.
    """
    out = check_out(config.out)
    if config.resume:
        checkpoint = latest_checkpoint(out)
        if checkpoint is None:
            raise _no_checkpoint(out)
        loaded = load_checkpoint(checkpoint)
        _check_resumable(config, task, checkpoint, loaded)
        return RunPlan(out, checkpoint, loaded)
    checkpoint = latest_checkpoint(out)
    ours = (out / CONFIG_NAME).is_file() and _written_by_us(out / CONFIG_NAME)
    present = [name for name in (*RUN_FILES, CHECKPOINTS) if (out / name).exists()]
    if checkpoint is None and not ours and not has_leftovers(out) and present:
        raise ValueError(
            f"out {str(out)!r} holds {', '.join(present)}, which 'multihead train' did not "
            f"write: choose another --out (nothing there is deleted or overwritten)"
        )
    if config.overwrite:
        return RunPlan(out, clear=checkpoint is not None or ours or has_leftovers(out))
    if checkpoint is not None:
        raise ValueError(
            f"{str(out)!r} already holds a training run (its newest checkpoint is "
            f"{checkpoint.name}): pass --resume to continue it, --overwrite to start over, or "
            f"another --out"
        )
    if ours:
        raise ValueError(
            f"{str(out)!r} already holds a trained model but no checkpoint to resume: pass "
            f"--overwrite to start over, or another --out"
        )
    return RunPlan(out)


def _check_model_entry(
    checkpoint: Path, config: dict[str, Any], model_config: Callable[[], LMConfig]
) -> None:
    """The checkpoint's 'model' entry must be the model its training configuration builds."""
    try:  # through LMConfig: a config written before a field existed has its default
        same_model = LMConfig.from_dict(config.get("model", {})) == model_config()
    except (TypeError, ValueError):
        same_model = False
    if not same_model:
        raise ValueError(
            f"checkpoint file {str(checkpoint / CONFIG_NAME)!r}: its 'model' entry does not "
            f"match its 'training' one"
        )


def _check_resumable(
    config: TrainConfig, task: TaskLike, checkpoint: Path, loaded: dict[str, Any]
) -> None:
    """The checkpoint's files must describe this run, and agree with each other."""
    saved = _saved_config(checkpoint, loaded["config"])
    for f in dataclasses.fields(TrainConfig):
        if f.name not in TrainConfig.RESUMABLE and getattr(saved, f.name) != getattr(
            config, f.name
        ):
            raise ValueError(
                f"--resume: the checkpoint in {str(config.out)!r} was trained with {f.name}="
                f"{getattr(saved, f.name)!r}, got {getattr(config, f.name)!r}"
            )
    _check_model_entry(checkpoint, loaded["config"], lambda: config.model_config(task))
    file = checkpoint / CONFIG_NAME
    if loaded["config"].get("task") != task.to_dict():
        raise ValueError(
            f"checkpoint file {str(file)!r}: its 'task' entry does not match its 'training' one"
        )
    state, state_file = loaded["state"], checkpoint / "state.json"
    step, history = state["step"], state.get("history")
    if not (
        isinstance(history, list)
        and len(history) == step
        and all(
            isinstance(h, list)
            and len(h) == 3
            and h[0] == i + 1
            and is_int(h[0])
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in h[1:])
            for i, h in enumerate(history)
        )
    ):
        raise ValueError(
            f"checkpoint file {str(state_file)!r}: history must list [step, loss, accuracy] for "
            f"steps 1..{step}, got {describe(history)}"
        )
    if step > config.steps:
        raise ValueError(
            f"steps must be at least the checkpoint's step {step} to resume it, got {config.steps}"
        )


def restore(plan: RunPlan, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the planned checkpoint's weights and AdamW state; returns its step.

    Only the optimizer's per-parameter state (moments, step counts) comes from the checkpoint;
    its hyperparameters are the run's own (equal to the saved ones: the configuration matched).

    Raises:
        ValueError: tensors that don't fit the model, are not finite, or disagree on the step
            (names the file).
    """
    assert plan.checkpoint is not None and plan.loaded is not None
    step = int(plan.loaded["state"]["step"])
    weights_file = plan.checkpoint / "model.safetensors"
    model_state = rename_legacy_keys(plan.loaded["model_state"])  # an earlier version's names
    _check_tensors(weights_file, model_state, model.state_dict())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    opt_file = plan.checkpoint / "optimizer.safetensors"
    state = plan.loaded["optimizer_state"]["state"]
    bad = sorted(set(state) - set(range(len(params))))
    if bad:
        raise ValueError(
            f"checkpoint file {str(opt_file)!r} holds state for parameters {bad[:4]}, the model "
            f"has {len(params)}"
        )
    for index, entry in state.items():
        p = params[index]
        expected = {"exp_avg": p, "exp_avg_sq": p, "step": torch.tensor(float(step))}
        got = {k: v for k, v in entry.items() if k in expected}
        if got.keys() != expected.keys() or len(entry) != len(expected):
            raise ValueError(
                f"checkpoint file {str(opt_file)!r}: parameter {index} has state "
                f"{sorted(entry)}, AdamW keeps {sorted(expected)}"
            )
        _check_tensors(
            opt_file,
            {f"{index}.{k}": v for k, v in got.items()},
            {f"{index}.{k}": v for k, v in expected.items()},
        )
        if float(got["step"]) != step:
            raise ValueError(
                f"checkpoint file {str(opt_file)!r} counts {float(got['step']):g} AdamW steps, "
                f"state.json says step {step}"
            )
    model.load_state_dict(model_state)
    fresh = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": fresh["param_groups"]})
    return step


def _check_tensors(file: Path, tensors: dict[str, Any], expected: dict[str, torch.Tensor]) -> None:
    """``tensors`` must have exactly ``expected``'s names, shapes and dtypes, and be finite."""
    others = sorted(name for name, t in tensors.items() if not isinstance(t, torch.Tensor))
    problems = [f"{name} is {describe(tensors[name])}, not a tensor" for name in others[:4]]
    found = {k: TensorInfo.of(t) for k, t in tensors.items() if k not in others}
    want = {k: TensorInfo.of(t) for k, t in expected.items() if k not in others}
    problems += tensor_problems(want, found)
    if not problems:
        bad = sorted(name for name, t in tensors.items() if not bool(torch.isfinite(t).all()))
        if bad:
            problems.append(f"{few(bad)} hold nan or inf")
    if problems:
        raise ValueError(
            f"checkpoint file {str(file)!r} does not fit the model: " + "; ".join(problems[:4])
        )


def prepare_out(plan: RunPlan) -> None:
    """Create the run directory; with ``overwrite``, delete the earlier run's files first.

    Only the files a run writes are deleted (its checkpoints, config.json, model.safetensors,
    loss.png, attention.png); anything else in the directory stays.
    """
    if plan.clear:
        remove_checkpoints(plan.out)
        for name in RUN_FILES:
            (plan.out / name).unlink(missing_ok=True)
    plan.out.mkdir(parents=True, exist_ok=True)
