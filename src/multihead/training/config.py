"""What defines a training run (:class:`TrainConfig`), its schedule, and what the loop reports.

:class:`TrainConfig` validates every field when it is made (and :func:`~multihead.training.train`
validates it again), so a bad setting fails before anything is read, built or written.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from multihead._checks import (
    check_finite_float,
    check_non_negative_int,
    check_optional_positive_int,
    check_positive_int,
    check_probability,
    describe,
    is_int,
)
from multihead.devices import check_device
from multihead.models.lm import TransformerLM
from multihead.models.lm_config import LMConfig
from multihead.training.induction import InductionProbe
from multihead.training.tasks import Task, TaskLike, get_task

__all__ = [
    "TrainConfig",
    "TASK_DEFAULTS",
    "StartInfo",
    "StepInfo",
    "TrainResult",
    "DivergenceError",
    "lr_at",
    "check_seed",
]

_SEED_LIMIT = 2**64  # torch.manual_seed and the data's hash take seeds in [0, 2**64)
# eval_size may reach the held-out inputs of the task, or this many when they are fewer (a
# small task's default evaluation draws some of them more than once).
_EVAL_FLOOR = 1000


def check_seed(name: str, value: Any) -> int:
    """A seed: an int in [0, 2**64)."""
    if not is_int(value) or not 0 <= value < _SEED_LIMIT:
        raise ValueError(f"{name} must be an int in [0, 2**64), got {describe(value)}")
    return int(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {describe(value)}")
    return value


# The settings a task starts from when not given (TrainConfig.for_task and the CLI). The induction
# recipe (docs/induction.md): an attention-only model with N(0, 1) embeddings, a short warmup.
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "induction": {
        "seq_len": 32,
        "steps": 1200,
        "batch_size": 32,
        "warmup_steps": 30,
        "attn_only": True,
        "embedding_std": 1.0,
    },
}


@dataclass
class TrainConfig:
    """Everything that defines a training run (the CLI's flags).

    Args:
        task: ``"copy"``, ``"reverse"``, ``"sort"``, ``"add"`` or ``"induction"`` (use
            :meth:`for_task` to start from the task's defaults, :data:`TASK_DEFAULTS`).
        seq_len: L, input digits per example (per operand for ``add``, at most 17); for
            ``induction`` the tokens per sequence (at least 11).
        steps: optimizer steps in total (a resumed run continues up to this number).
        batch_size: the global batch, split across data-parallel ranks.
        lr: peak learning rate of AdamW (> 0).
        seed: seeds the initial weights and every batch; an int in [0, 2**64).
        out: the run directory.
        resume: continue from the newest checkpoint in ``out``.
        overwrite: start afresh in an ``out`` that holds an earlier run (deleting it); not
            together with ``resume``.
        embed_dim, num_heads, num_layers, ff_dim, num_kv_heads, dropout: the model.
        attn_only: decoder blocks without feed-forward networks.
        embedding_std: std of the initial token and position embeddings (see
            :class:`~multihead.models.TransformerLM`).
        probe_every: for ``induction``, measure the first/repeated-token losses and every
            head's induction score on held-out sequences every this many steps.
        warmup_steps: linear warmup; default 5% of ``steps``.
        min_lr_ratio: the cosine decays to ``lr · min_lr_ratio`` at the last step; in [0, 1].
        weight_decay: AdamW's decoupled weight decay (not on biases, norms and embeddings); ≥ 0.
        grad_clip: clip the gradients' global norm to this (0 disables).
        save_every: checkpoint every this many steps (0: only at the end and on interrupt).
        eval_size: held-out sequences for the final exact-match accuracy; at most the task's
            held-out inputs (``Task.held_out_size``), or 1000 when those are fewer.
        threads: torch's intra-op threads, at most the CPU count (default: torch's choice).
        device: ``"auto"`` (the local GPU if any, else CPU), or a torch device string.
        plots: write loss.png and attention.png at the end.

    Raises:
        ValueError, TypeError: a field out of range or of the wrong type; the message names it.
    """

    task: str = "sort"
    seq_len: int = 8
    steps: int = 250
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    out: str = "runs/sort"
    resume: bool = False
    overwrite: bool = False
    embed_dim: int = 128
    num_heads: int = 4
    num_layers: int = 2
    ff_dim: int = 512
    num_kv_heads: int | None = None
    dropout: float = 0.0
    attn_only: bool = False
    embedding_std: float = 0.02
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 100
    eval_size: int = 1000
    threads: int | None = None
    device: str = "auto"
    plots: bool = True
    probe_every: int = 20

    # Fields that may differ when resuming; every other field must match the checkpoint's.
    RESUMABLE: ClassVar[frozenset[str]] = frozenset(
        {
            "steps",
            "out",
            "resume",
            "overwrite",
            "save_every",
            "eval_size",
            "threads",
            "device",
            "plots",
            "probe_every",
        }
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (done on construction; :func:`train` does it again)."""
        task = get_task(self.task, self.seq_len)  # validates both
        for name in ("steps", "batch_size", "embed_dim", "num_heads", "num_layers", "ff_dim"):
            check_positive_int(name, getattr(self, name))
        if check_finite_float("lr", self.lr) <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        check_seed("seed", self.seed)
        if not isinstance(self.out, (str, os.PathLike)):
            raise TypeError(f"out must be a path (str), got {describe(self.out)}")
        if not os.fspath(self.out):
            raise ValueError("out must name a directory, got ''")
        for name in ("resume", "overwrite", "plots", "attn_only"):
            _check_bool(name, getattr(self, name))
        if self.resume and self.overwrite:
            raise ValueError(
                "resume and overwrite exclude each other: continue a run or replace it"
            )
        check_optional_positive_int("num_kv_heads", self.num_kv_heads)
        check_probability("dropout", self.dropout)
        if check_finite_float("embedding_std", self.embedding_std) <= 0:
            raise ValueError(f"embedding_std must be > 0, got {self.embedding_std!r}")
        check_positive_int("probe_every", self.probe_every)
        self.model_config(task)  # the widths and heads must fit together
        if self.warmup_steps is not None:
            check_non_negative_int("warmup_steps", self.warmup_steps)
        ratio = check_finite_float("min_lr_ratio", self.min_lr_ratio, minimum=0.0)
        if ratio > 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {ratio!r}")
        check_finite_float("weight_decay", self.weight_decay, minimum=0.0)
        check_finite_float("grad_clip", self.grad_clip, minimum=0.0)
        check_non_negative_int("save_every", self.save_every)
        check_non_negative_int("eval_size", self.eval_size)
        if isinstance(task, Task):  # induction evaluates with its probes, not eval_size
            most = max(_EVAL_FLOOR, task.held_out_size)
            if self.eval_size > most:
                raise ValueError(
                    f"eval_size must be at most {most} (the {task.name} task at seq_len "
                    f"{task.seq_len} holds out about {task.held_out_size} inputs; more would "
                    f"draw the same ones again, for longer), got {self.eval_size}"
                )
        # Whether the threads and the device exist here is train()'s question: a checkpoint
        # made on another machine must still be readable.
        check_optional_positive_int("threads", self.threads)
        check_device(self.device)

    @classmethod
    def for_task(cls, task: str, **changes: Any) -> TrainConfig:
        """A run of ``task`` from its defaults (:data:`TASK_DEFAULTS`), with ``changes``."""
        return cls(**{"task": task, **TASK_DEFAULTS.get(task, {}), **changes})

    def model_config(self, task: TaskLike | None = None) -> LMConfig:
        """The model this run trains (validates the model's fields together)."""
        task = task or get_task(self.task, self.seq_len)
        return LMConfig(
            task.vocab_size,
            self.embed_dim,
            self.num_heads,
            self.num_layers,
            self.ff_dim,
            max_len=task.total_len,
            num_kv_heads=self.num_kv_heads,
            dropout=float(self.dropout),
            attn_only=self.attn_only,
            embedding_std=float(self.embedding_std),
        )

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, self.steps // 20)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from a mapping (e.g. a checkpoint's ``"training"`` entry); unknown keys are
        ignored, missing ones take their defaults.

        Raises:
            ValueError, TypeError: ``data`` is not a mapping, or a value is bad.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a TrainConfig must be a JSON object, got {describe(data)}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def lr_at(config: TrainConfig, step: int) -> float:
    """The learning rate of step ``step`` (0-based): linear warmup, then cosine decay."""
    warmup = config.warmup
    if step < warmup:
        return config.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine)


@dataclass(frozen=True)
class StartInfo:
    """What the loop reports once everything is checked, before the first step (on rank 0)."""

    start_step: int  # > 0 when resuming
    steps: int
    world_size: int
    out: Path


@dataclass(frozen=True)
class StepInfo:
    """What the loop reports after each step (on rank 0)."""

    step: int  # optimizer steps completed
    steps: int
    start_step: int  # where this invocation started (> 0 when resumed)
    loss: float  # mean cross-entropy over the global batch's answer tokens
    accuracy: float  # fraction of answer tokens predicted right (teacher forcing)
    lr: float
    tokens_per_s: float  # tokens processed per second (all ranks), since this invocation began
    elapsed: float
    probe: InductionProbe | None = None  # induction: measured at this step (every probe_every)


@dataclass
class TrainResult:
    """What :func:`train` returns (on every rank; files and accuracy on rank 0 only)."""

    step: int
    interrupted: bool
    out: Path
    start_step: int = 0  # > 0 when this invocation resumed a run
    accuracy: float | None = None  # exact match on held-out sequences
    train_seconds: float = 0.0
    history: list[tuple[int, float, float]] = field(default_factory=list)  # (step, loss, acc)
    checkpoint: Path | None = None  # the newest checkpoint (rank 0)
    model: TransformerLM | None = None
    probes: list[InductionProbe] = field(default_factory=list)  # induction, every probe_every


class DivergenceError(FloatingPointError):
    """The loss (or the weights) became nan or inf: training stopped without saving them.

    Attributes:
        step: the step whose loss or weights were not finite.
        loss: that step's loss.
        checkpoint: the last good checkpoint, left in place (None when there is none).
    """

    def __init__(self, message: str, *, step: int, loss: float, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.checkpoint = checkpoint
