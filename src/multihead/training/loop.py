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
checkpoint and returns with ``interrupted=True``. A second Ctrl-C in a single process abandons
the step in progress if it is still in its forward or backward pass (the weights are untouched
then), and otherwise lets the update finish: either way the checkpoint saved on the way out
holds a whole step. Ranks agree on stopping through the per-step all-reduce, so they always stop
at the same step.

Divergence: a non-finite loss stops the run at once with :class:`DivergenceError`, and weights
that are not finite are never saved, so a diverged run leaves its last good checkpoint in place.

Order: the configuration, the device, the memory the run needs, the run directory and the whole
checkpoint to resume from are all checked (and the model built) before anything is written.
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from multihead.devices import resolve_device
from multihead.models.lm import TransformerLM
from multihead.models.lm_io import config_json
from multihead.training.checkpoint import save_checkpoint
from multihead.training.config import (
    DivergenceError,
    StartInfo,
    StepInfo,
    TrainConfig,
    TrainResult,
    lr_at,
)
from multihead.training.ddp import World, check_fits, check_threads, setup_world
from multihead.training.draws import SEED_STREAM, key
from multihead.training.induction import InductionProbe, InductionTask, probe_induction
from multihead.training.plots import plot_attention, plot_induction, plot_loss
from multihead.training.rundir import RunPlan, plan_run, prepare_out, restore
from multihead.training.stopping import StopRequest
from multihead.training.tasks import Task, TaskLike, get_task

__all__ = ["train", "evaluate"]


# -- model and optimizer -----------------------------------------------------------------------


def _build_model(config: TrainConfig, task: TaskLike, device: torch.device) -> TransformerLM:
    torch.manual_seed(config.seed)
    return TransformerLM.from_config(config.model_config(task), device=device)


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


# -- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: TransformerLM, task: Task, *, seed: int = 0, n: int = 1000, batch_size: int = 500
) -> float:
    """Exact-match accuracy of greedy generation on ``n`` held-out sequences.

    A sequence counts only when every answer token and the final ``<eos>`` are right. The
    held-out set is drawn ``batch_size`` rows at a time, so memory does not grow with ``n``.
    """
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    p = task.prompt_len
    correct = 0
    for start in range(0, n, batch_size):
        chunk = task.held_out(seed, min(batch_size, n - start), start=start)
        chunk = chunk.to(model.head.weight.device)  # (b, total_len)
        out = model.generate(chunk[:, :p], task.answer_len)
        correct += int((out[:, p:] == chunk[:, p:]).all(dim=1).sum())
    return correct / n


# -- the loop ----------------------------------------------------------------------------------


def _step_seed(seed: int, step: int, rank: int) -> int:
    return int(key(seed, SEED_STREAM, step, rank)) & 0x7FFF_FFFF_FFFF_FFFF


def train(
    config: TrainConfig,
    *,
    on_step: Callable[[StepInfo], None] | None = None,
    on_start: Callable[[StartInfo], None] | None = None,
) -> TrainResult:
    """Train a :class:`~multihead.models.TransformerLM` on a synthetic task.

    Writes, into ``config.out`` (rank 0): ``config.json`` and ``model.safetensors`` (the latest
    weights), ``checkpoints/step-N/`` (atomic, for ``resume``), and at the end ``loss.png`` and
    ``attention.png`` (and for ``induction``, ``induction.png``: the first/repeated-token losses
    and each head's induction score against the step, measured every ``probe_every`` steps).
    Nothing is written, or deleted (``overwrite``), before every check has passed.

    Args:
        config: the run.
        on_step: called on rank 0 after every step with a :class:`StepInfo` (the CLI draws its
            progress bar with it). If it raises KeyboardInterrupt, the loop saves and stops as
            for Ctrl-C.
        on_start: called on rank 0 once everything is checked, before the first step.

    Returns:
        A :class:`TrainResult`; ``accuracy`` is the held-out exact match (None when interrupted
        or ``eval_size`` is 0).

    Raises:
        ValueError, TypeError: a bad configuration; a device this machine lacks; a run too big
            for its memory; an ``out`` that is a file, holds another run or files this library
            did not write; a damaged checkpoint or one trained with other settings.
        PermissionError: ``out`` is not writable.
        FileNotFoundError: ``resume`` without a checkpoint, or with a file of it missing.
        DivergenceError: the loss became nan or inf (nothing of that step is saved).
    """
    config.validate()
    task = get_task(config.task, config.seq_len)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config.device, local_rank)
    check_threads(config.threads)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    world = setup_world(device)
    try:
        return _train(config, task, world, on_step, on_start)
    except BaseException as e:
        if world.size > 1:
            # The traceback keeps _train's DDP module, which holds the process group; freed later
            # by the GC with the GIL held, gloo's destructor deadlocks: drop those locals now.
            traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if world.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def _check_finite_weights(model: nn.Module, step: int, loss: float, last: Path | None) -> None:
    """Refuse to save weights that are not finite (every rank checks: DDP keeps them equal)."""
    if all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        return
    raise DivergenceError(
        f"training diverged: the weights hold nan or inf after step {step} (loss {loss:.4g}); "
        f"stopped without saving them, {_kept(last)}",
        step=step,
        loss=loss,
        checkpoint=last,
    )


def _kept(checkpoint: Path | None) -> str:
    if checkpoint is None:
        return "and no checkpoint had been saved"
    return f"the last good checkpoint {str(checkpoint)!r} stays"


def _train(
    config: TrainConfig,
    task: TaskLike,
    world: World,
    on_step: Callable[[StepInfo], None] | None,
    on_start: Callable[[StartInfo], None] | None,
) -> TrainResult:
    if config.batch_size % world.size != 0:
        raise ValueError(
            f"batch_size {config.batch_size} (the global batch) must be divisible by the world "
            f"size {world.size}"
        )
    shard = config.batch_size // world.size
    check_fits(
        vocab_size=task.vocab_size,
        embed_dim=config.embed_dim,
        num_layers=config.num_layers,
        ff_dim=config.ff_dim,
        num_heads=config.num_heads,
        seq_len=task.total_len,
        batch_size=shard,
        device=world.device,
    )
    plan: RunPlan = plan_run(config, task)
    model = _build_model(config, task, world.device)
    optimizer = _optimizer(model, config)
    history: list[tuple[int, float, float]] = []
    probes: list[InductionProbe] = []  # induction: the losses and head scores, every few steps
    start_step = 0
    if plan.checkpoint is not None:
        assert plan.loaded is not None
        start_step = restore(plan, model, optimizer)
        history = [(int(s), float(a), float(b)) for s, a, b in plan.loaded["state"]["history"]]
        probes = [InductionProbe.from_list(x) for x in plan.loaded["state"].get("induction", [])]
    # Every check has passed: only now may the run touch the disk.
    if world.rank == 0:
        prepare_out(plan)
    out = plan.out
    extra = {"task": task.to_dict(), "training": config.to_dict()}
    last_checkpoint = plan.checkpoint

    trained: nn.Module = model
    if world.size > 1:
        from torch.nn.parallel import DistributedDataParallel

        ids = [world.device.index] if world.device.type == "cuda" else None
        trained = DistributedDataParallel(model, device_ids=ids)

    def save(step: int, loss: float) -> None:
        nonlocal last_checkpoint
        _check_finite_weights(model, step, loss, last_checkpoint)
        if world.rank != 0:
            return
        state: dict[str, object] = {
            "history": history,
            "rng": {"seed": config.seed, "next_step": step},
        }
        if probes:
            state["induction"] = [x.to_list() for x in probes]
        last_checkpoint = save_checkpoint(
            out,
            step,
            config=config_json(model.config, extra),
            model_state=model.state_dict(),
            optimizer_state=optimizer.state_dict(),
            state=state,
        )
        model.save(out, extra=extra)

    rows = range(world.rank * shard, (world.rank + 1) * shard)
    p = task.prompt_len
    tokens_per_step = config.batch_size * (task.total_len - 1)
    stop = StopRequest(escalate=world.size == 1)
    # Induction: held-out layouts, measured on rank 0 (the model is the same on every rank).
    held = task.probe_batch(config.seed, 64) if isinstance(task, InductionTask) else None
    step = start_step
    loss_v = history[-1][1] if history else math.nan
    interrupted = False
    if world.rank == 0 and on_start is not None:
        on_start(
            StartInfo(start_step=start_step, steps=config.steps, world_size=world.size, out=out)
        )
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
                stop.abandonable = True  # until the update, a second Ctrl-C may drop this step
                # Position t predicts token t+1; only the answer (and <eos>) is scored.
                logits = trained(batch[:, :-1])[:, p - 1 :]  # (b, answer_len, V)
                targets = batch[:, p:]  # (b, answer_len)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip > 0:
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
                stop.abandonable = False
                optimizer.step()
                step += 1

                with torch.no_grad():
                    accuracy = (logits.argmax(-1) == targets).float().mean()
                stats = torch.stack(
                    [
                        loss.detach(),
                        accuracy,
                        torch.tensor(float(stop.requested), device=loss.device),
                    ]
                )
                if world.size > 1:
                    import torch.distributed as dist

                    dist.all_reduce(stats)  # sums: one collective per step, stop flag included
                    stats[:2] /= world.size
                loss_v, acc_v, stop_v = stats.tolist()
                if not math.isfinite(loss_v):  # every rank sees the same reduced loss
                    raise DivergenceError(
                        f"training diverged: the loss is {loss_v} at step {step} (lr {lr:.3g}); "
                        f"stopped without saving it, {_kept(last_checkpoint)}",
                        step=step,
                        loss=loss_v,
                        checkpoint=last_checkpoint,
                    )
                history.append((step, loss_v, acc_v))
                probe = None
                if (
                    held is not None
                    and world.rank == 0
                    and (step % config.probe_every == 0 or step == config.steps)
                ):
                    probe = probe_induction(model, held, step)
                    probes.append(probe)
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
                            probe=probe,
                        )
                    )
                if stop_v > 0:
                    interrupted = True
                    break
                if config.save_every and step % config.save_every == 0 and step < config.steps:
                    save(step, loss_v)
        except KeyboardInterrupt:
            interrupted = True  # raised before the update or by on_step: the state is whole
        finally:
            stop.abandonable = False
        train_seconds = time.perf_counter() - t0
        save(step, loss_v)  # still under the handlers: a further Ctrl-C can't cut it short

    result = TrainResult(
        step=step,
        interrupted=interrupted,
        out=out,
        start_step=start_step,
        train_seconds=train_seconds,
        history=history,
        checkpoint=last_checkpoint,
        model=model,
        probes=probes,
    )
    if interrupted or world.rank != 0:
        return result
    model.eval()
    if config.plots:
        plot_loss(history, out / "loss.png", title=f"{task.name}, L={task.seq_len}")
        example = task.held_out(config.seed, 1).to(world.device)
        plot_attention(model, task, example[0], out / "attention.png")
        if probes:
            plot_induction(probes, out / "induction.png", title=f"induction, L={task.seq_len}")
    if config.eval_size and isinstance(task, Task):  # induction: the probes are its measure
        result.accuracy = evaluate(model, task, seed=config.seed, n=config.eval_size)
    return result
