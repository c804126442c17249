"""The training loop: AdamW with warmup and cosine decay, checkpoints, Ctrl-C, resume, DDP.

Reproducibility is by construction rather than by saved generator state:

- the batch of step s is a pure function of ``(seed, s)`` (see :mod:`multihead.training.tasks`);
- torch's generator is reseeded from ``(seed, s, rank)`` before each step, so dropout too
  depends only on the step;
- the learning rate is a function of s; the model and AdamW's moments are saved exactly.

So a run stopped after step s and resumed ends with bit-identical weights to a run that never
stopped (same seed, same thread count, same device).

Data parallel: when the environment says ``WORLD_SIZE > 1`` (as ``torchrun`` sets it) the model
runs under :class:`~torch.nn.parallel.DistributedDataParallel` (gloo on CPU, nccl on GPU).
``batch_size`` stays the global batch: rank r draws rows [r·b, (r+1)·b) of it, b = batch_size /
world, and DDP averages the gradients, which equals the gradient of the global batch's mean loss.
Only rank 0 reports progress and writes files.

Stopping: SIGINT (Ctrl-C) and SIGTERM ask the loop to stop after the current step; it saves a
checkpoint and returns with ``interrupted=True``. A second Ctrl-C in a single process stops at
once (the last complete checkpoint stays). Ranks agree on stopping through the per-step
all-reduce, so they always stop at the same step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from multihead.models.lm import CONFIG_NAME, WEIGHTS_NAME, TransformerLM
from multihead.training.checkpoint import (
    CHECKPOINTS,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from multihead.training.tasks import VOCAB, Task, _key

__all__ = ["TrainConfig", "StepInfo", "TrainResult", "train", "evaluate", "lr_at"]


@dataclass
class TrainConfig:
    """Everything that defines a training run (the CLI's flags).

    Args:
        task: ``"copy"``, ``"reverse"``, ``"sort"`` or ``"add"``.
        seq_len: L, input digits per example (per operand for ``add``).
        steps: optimizer steps in total (a resumed run continues up to this number).
        batch_size: the global batch, split across data-parallel ranks.
        lr: peak learning rate of AdamW.
        seed: seeds the initial weights and every batch.
        out: the run directory.
        resume: continue from the newest checkpoint in ``out``.
        overwrite: start afresh in an ``out`` that holds an earlier run (deleting it).
        embed_dim, num_heads, num_layers, ff_dim, num_kv_heads, dropout: the model.
        warmup_steps: linear warmup; default 5% of ``steps``.
        min_lr_ratio: the cosine decays to ``lr · min_lr_ratio`` at the last step.
        weight_decay: AdamW's decoupled weight decay (not on biases, norms and embeddings).
        grad_clip: clip the gradients' global norm to this (0 disables).
        save_every: checkpoint every this many steps (0: only at the end and on interrupt).
        eval_size: held-out sequences for the final exact-match accuracy.
        threads: torch's intra-op threads (default: torch's choice).
        device: ``"auto"`` (the local GPU if any, else CPU), or a torch device string.
        plots: write loss.png and attention.png at the end.
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
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    save_every: int = 100
    eval_size: int = 1000
    threads: int | None = None
    device: str = "auto"
    plots: bool = True

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
        }
    )

    def __post_init__(self) -> None:
        Task(self.task, self.seq_len)  # validates both
        for name in ("steps", "batch_size", "embed_dim", "num_heads", "num_layers", "ff_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive float, got {self.lr!r}")
        for name in ("save_every", "eval_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be a positive int, got {self.threads}")

    @property
    def warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return max(1, self.steps // 20)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
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
    checkpoint: Path | None = None
    model: TransformerLM | None = None


# -- distributed -------------------------------------------------------------------------------


@dataclass
class _World:
    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False


def _setup_world(device: str) -> _World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        dev = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if size <= 1:
        return _World(device=dev)
    import torch.distributed as dist

    owns = False
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        owns = True
    return _World(rank=dist.get_rank(), size=dist.get_world_size(), device=dev, owns_group=owns)


# -- stopping ----------------------------------------------------------------------------------


class _StopRequest:
    """SIGINT/SIGTERM set a flag the loop checks between steps."""

    def __init__(self, *, escalate: bool) -> None:
        self.requested = False
        self.escalate = escalate

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.escalate and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


# -- model and optimizer -----------------------------------------------------------------------


def _build_model(config: TrainConfig, task: Task, device: torch.device) -> TransformerLM:
    torch.manual_seed(config.seed)
    return TransformerLM(
        len(VOCAB),
        config.embed_dim,
        config.num_heads,
        config.num_layers,
        config.ff_dim,
        max_len=task.total_len,
        num_kv_heads=config.num_kv_heads,
        dropout=config.dropout,
        device=device,
    )


def _optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only; biases, norms and embeddings keep their scale (GPT-2's recipe).
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        is_matrix = p.dim() >= 2 and "embedding" not in name
        (decay if is_matrix else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.98), eps=1e-8)


def _run_config(config: TrainConfig, task: Task, model: TransformerLM) -> dict[str, Any]:
    """config.json's extra entries: the task (with its vocabulary) and the training flags."""
    return {"task": task.to_dict(), "training": config.to_dict()}


def _prepare_out(config: TrainConfig, world: _World) -> dict[str, Any] | None:
    """Check the run directory; load the checkpoint to resume from (or clear an old run)."""
    out = Path(config.out)
    if config.resume:
        path = latest_checkpoint(out)
        if path is None:
            raise FileNotFoundError(
                f"--resume: no complete checkpoint in {str(out / CHECKPOINTS)!r}"
            )
        ckpt = load_checkpoint(path)
        saved = TrainConfig.from_dict(ckpt["config"].get("training", {}))
        for f in dataclasses.fields(TrainConfig):
            if f.name in TrainConfig.RESUMABLE:
                continue
            if getattr(saved, f.name) != getattr(config, f.name):
                raise ValueError(
                    f"--resume: the checkpoint in {str(out)!r} was trained with {f.name}="
                    f"{getattr(saved, f.name)!r}, got {getattr(config, f.name)!r}"
                )
        return ckpt
    ours = [out / CHECKPOINTS, out / CONFIG_NAME, out / WEIGHTS_NAME]
    if any(p.exists() for p in ours):
        if not config.overwrite:
            raise ValueError(
                f"{str(out)!r} already holds a training run: pass --resume to continue it, "
                f"--overwrite to start over, or another --out"
            )
        if world.rank == 0:
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
            for p in (
                out / CONFIG_NAME,
                out / WEIGHTS_NAME,
                out / "loss.png",
                out / "attention.png",
            ):
                p.unlink(missing_ok=True)
    return None


# -- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: TransformerLM, task: Task, *, seed: int = 0, n: int = 1000, batch_size: int = 500
) -> float:
    """Exact-match accuracy of greedy generation on ``n`` held-out sequences.

    A sequence counts only when every answer token and the final ``<eos>`` are right.
    """
    if n <= 0:
        raise ValueError(f"n must be a positive int, got {n}")
    data = task.held_out(seed, n).to(model.head.weight.device)
    p = task.prompt_len
    correct = 0
    for chunk in data.split(batch_size):
        out = model.generate(chunk[:, :p], task.answer_len)
        correct += int((out[:, p:] == chunk[:, p:]).all(dim=1).sum())
    return correct / n


# -- the loop ----------------------------------------------------------------------------------


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(_key(seed, 2, step, rank)) & 0x7FFF_FFFF_FFFF_FFFF


def train(
    config: TrainConfig,
    *,
    on_step: Callable[[StepInfo], None] | None = None,
) -> TrainResult:
    """Train a :class:`~multihead.models.TransformerLM` on a synthetic task.

    Writes, into ``config.out`` (rank 0): ``config.json`` and ``model.safetensors`` (the latest
    weights), ``checkpoints/step-N/`` (atomic, for ``resume``), and at the end ``loss.png`` and
    ``attention.png``.

    Args:
        config: the run.
        on_step: called on rank 0 after every step with a :class:`StepInfo` (the CLI draws its
            progress bar with it). If it raises KeyboardInterrupt, the loop saves and stops as
            for Ctrl-C.

    Returns:
        A :class:`TrainResult`; ``accuracy`` is the held-out exact match (None when interrupted
        or ``eval_size`` is 0).

    Raises:
        ValueError: a bad configuration, an ``out`` holding another run, or a resume whose
            configuration differs from the checkpoint's.
        FileNotFoundError: ``resume`` without a checkpoint.
    """
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    task = Task(config.task, config.seq_len)
    world = _setup_world(config.device)
    try:
        return _train(config, task, world, on_step)
    finally:
        if world.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(
    config: TrainConfig, task: Task, world: _World, on_step: Callable[[StepInfo], None] | None
) -> TrainResult:
    if config.batch_size % world.size != 0:
        raise ValueError(
            f"batch_size {config.batch_size} (the global batch) must be divisible by the world "
            f"size {world.size}"
        )
    out = Path(config.out)
    ckpt = _prepare_out(config, world)
    model = _build_model(config, task, world.device)
    optimizer = _optimizer(model, config)
    history: list[tuple[int, float, float]] = []
    start_step = 0
    if ckpt is not None:
        model.load_state_dict(ckpt["model_state"])
        optimizer.load_state_dict(ckpt["optimizer_state"])
        start_step = int(ckpt["state"]["step"])
        history = [(int(s), float(a), float(b)) for s, a, b in ckpt["state"]["history"]]
    extra = _run_config(config, task, model)

    trained: nn.Module = model
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [world.device.index] if world.device.type == "cuda" else None
        trained = DistributedDataParallel(model, device_ids=ids)

    def save(step: int) -> Path | None:
        if world.rank != 0:
            return None
        state = {"history": history, "rng": {"seed": config.seed, "next_step": step}}
        path = save_checkpoint(
            out,
            step,
            config={
                "model_type": "multihead.TransformerLM",
                "model": model.config.to_dict(),
                **extra,
            },
            model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(),
            state=state,
        )
        model.save(out, extra=extra)
        return path

    shard = config.batch_size // world.size
    rows = range(world.rank * shard, (world.rank + 1) * shard)
    p = task.prompt_len
    tokens_per_step = config.batch_size * (task.total_len - 1)
    stop = _StopRequest(escalate=world.size == 1)
    step = start_step
    interrupted = torn = False
    checkpoint: Path | None = None
    model.train()
    t0 = time.perf_counter()
    with stop.installed():
        try:
            while step < config.steps:
                lr = lr_at(config, step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                torch.manual_seed(_step_seed(config.seed, step, world.rank))  # dropout
                batch = task.batch(config.seed, step, rows).to(world.device)  # (b, total_len)
                # Position t predicts token t+1; only the answer (and <eos>) is scored.
                logits = trained(batch[:, :-1])[:, p - 1 :]  # (b, answer_len, V)
                targets = batch[:, p:]  # (b, answer_len)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip > 0:
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                torn = True  # an interrupt inside the update would leave weights half-stepped
                optimizer.step()
                torn = False
                step += 1

                with torch.no_grad():
                    accuracy = (logits.argmax(-1) == targets).float().mean()
                stats = torch.stack([loss.detach(), accuracy, torch.tensor(float(stop.requested))])
                if world.size > 1:
                    import torch.distributed as dist

                    dist.all_reduce(stats)  # sums: one collective per step, stop flag included
                    stats[:2] /= world.size
                loss_v, acc_v, stop_v = stats.tolist()
                history.append((step, loss_v, acc_v))
                if world.rank == 0 and on_step is not None:
                    elapsed = time.perf_counter() - t0
                    on_step(
                        StepInfo(
                            step=step,
                            steps=config.steps,
                            start_step=start_step,
                            loss=loss_v,
                            accuracy=acc_v,
                            lr=lr,
                            tokens_per_s=tokens_per_step * (step - start_step) / elapsed,
                            elapsed=elapsed,
                        )
                    )
                if stop_v > 0:
                    interrupted = True
                    break
                if config.save_every and step % config.save_every == 0 and step < config.steps:
                    checkpoint = save(step)
        except KeyboardInterrupt:
            interrupted = True
        train_seconds = time.perf_counter() - t0
        if not torn:
            checkpoint = save(step)

    result = TrainResult(
        step=step,
        interrupted=interrupted,
        out=out,
        start_step=start_step,
        train_seconds=train_seconds,
        history=history,
        checkpoint=checkpoint,
        model=model,
    )
    if interrupted or world.rank != 0:
        return result
    model.eval()
    if config.plots:
        from multihead.training.plots import plot_attention, plot_loss

        plot_loss(history, out / "loss.png", title=f"{task.name}, L={task.seq_len}")
        example = task.held_out(config.seed, 1).to(world.device)
        plot_attention(model, task, example[0], out / "attention.png")
    if config.eval_size:
        result.accuracy = evaluate(model, task, seed=config.seed, n=config.eval_size)
    return result
