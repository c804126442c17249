"""``multihead train`` and ``multihead generate``: train a small causal LM on a synthetic task,
then continue prompts with it.

    multihead train --task sort                      # ≥ 99% exact match in well under a minute
    multihead train --task reverse --steps 2000 --out runs/rev
    multihead train --out runs/rev --resume          # after Ctrl-C: continue where it stopped
    torchrun --nproc-per-node 2 -m multihead train --task sort --out runs/ddp
    multihead generate --checkpoint runs/sort "5 2 9 1 3 3 0 7 ="
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from multihead.cli.common import CLIError

__all__ = ["register", "run_train", "run_generate"]

_TASKS = ("copy", "reverse", "sort", "add")

# flag name -> TrainConfig field, for the flags that default to "the config's (or the
# checkpoint's) value" so that --resume can tell what the user set explicitly.
_TRAIN_FLAGS = (
    "task",
    "seq_len",
    "steps",
    "batch_size",
    "lr",
    "seed",
    "embed_dim",
    "num_heads",
    "num_layers",
    "ff_dim",
    "num_kv_heads",
    "dropout",
    "warmup_steps",
    "weight_decay",
    "save_every",
    "eval_size",
    "threads",
    "device",
)


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def register(subparsers: Any) -> None:
    """Add the ``train`` and ``generate`` subcommands."""
    p = subparsers.add_parser(
        "train",
        help="train a small causal transformer on a synthetic task",
        description=(
            "Train a TransformerLM on copy, reverse, sort or add, framed as continuation "
            "('3 1 2 =' -> '1 2 3'). Writes DIR/config.json, model.safetensors, loss.png, "
            "attention.png and checkpoints/; prints held-out exact-match accuracy. Ctrl-C saves "
            "and stops; --resume continues. Under torchrun it trains data-parallel."
        ),
    )
    p.add_argument(
        "--task",
        choices=_TASKS,
        help="the task (default sort; taken from the checkpoint with --resume)",
    )
    p.add_argument("--steps", type=_positive, help="total optimizer steps (default 250)")
    p.add_argument("--seq-len", type=_positive, help="input digits per example (default 8)")
    p.add_argument(
        "--batch-size", type=_positive, help="global batch, split across ranks (default 128)"
    )
    p.add_argument("--lr", type=_positive_float, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, help="seeds the weights and the data (default 0)")
    p.add_argument("--out", help="run directory (default runs/TASK)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="start afresh in an --out that holds a run"
    )
    model = p.add_argument_group("model")
    model.add_argument("--embed-dim", type=_positive, help="width E (default 128)")
    model.add_argument("--num-heads", type=_positive, help="heads H (default 4)")
    model.add_argument("--num-layers", type=_positive, help="layers (default 2)")
    model.add_argument("--ff-dim", type=_positive, help="feed-forward width (default 512)")
    model.add_argument(
        "--num-kv-heads", type=_positive, help="key/value heads (grouped-query; default H)"
    )
    model.add_argument("--dropout", type=float, help="dropout (default 0)")
    extra = p.add_argument_group("schedule and output")
    extra.add_argument(
        "--warmup-steps", type=_non_negative, help="linear warmup steps (default 5%% of steps)"
    )
    extra.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.01)")
    extra.add_argument(
        "--save-every", type=_non_negative, help="checkpoint every N steps (default 100; 0: end)"
    )
    extra.add_argument(
        "--eval-size", type=_non_negative, help="held-out sequences to score (default 1000)"
    )
    extra.add_argument("--threads", type=_positive, help="torch threads per process (default 1)")
    extra.add_argument("--device", help="'auto' (default: the local GPU if any), 'cpu', 'cuda:0'")
    extra.add_argument("--no-plots", action="store_true", help="skip loss.png and attention.png")
    extra.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)

    g = subparsers.add_parser(
        "generate",
        help="continue prompts with a model trained by 'multihead train'",
        description="Greedy (or sampled) continuation of space-separated prompts, one per line.",
    )
    g.add_argument(
        "--checkpoint", required=True, help="a run directory (or one of its checkpoints/step-N)"
    )
    g.add_argument("prompts", nargs="+", metavar="PROMPT", help='e.g. "5 2 9 1 ="')
    g.add_argument("--max-new-tokens", type=_positive, help="default: the task's answer length")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    g.add_argument("--top-k", type=_positive, help="sample from the k most likely tokens")
    g.add_argument("--seed", type=int, default=0, help="seed for sampling (default 0)")
    g.set_defaults(func=run_generate)


# -- train ------------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Any:
    from multihead.training import TrainConfig, latest_checkpoint, load_checkpoint

    given = {f: getattr(args, f) for f in _TRAIN_FLAGS if getattr(args, f) is not None}
    if args.resume:
        if args.out is None:
            raise CLIError("--resume needs --out DIR, the run to continue")
        path = latest_checkpoint(args.out)
        if path is None:
            raise CLIError(f"--resume: no complete checkpoint in {args.out!r}/checkpoints")
        saved = load_checkpoint(path)["config"].get("training")
        if not isinstance(saved, dict):
            raise CLIError(f"{str(path)!r} was not written by 'multihead train'")
        base = TrainConfig.from_dict(saved).to_dict()
        base.update(given)
        base.update(out=args.out, resume=True, overwrite=False, plots=not args.no_plots)
        return TrainConfig(**base)
    # One thread per process by default: the default model is small enough that more threads
    # gain little, and on a busy machine OpenMP threads spin and slow every step down.
    given.setdefault("threads", 1)
    task = given.get("task", "sort")
    out = args.out or os.path.join("runs", task)
    return TrainConfig(**given, out=out, overwrite=args.overwrite, plots=not args.no_plots)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def run_train(args: argparse.Namespace) -> int:
    from multihead.training import train

    config = _config(args)
    rank0 = _is_rank0()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    progress = None
    on_step = None
    if rank0 and not args.quiet:
        try:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
        except ImportError:
            print(
                "(install rich for a progress bar: pip install 'multihead[viz]')", file=sys.stderr
            )
        else:
            progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            bar = progress.add_task(
                f"{config.task} L={config.seq_len}", total=config.steps, stats=""
            )

            def on_step(info: Any) -> None:
                progress.update(
                    bar,
                    completed=info.step,
                    stats=(
                        f"loss {info.loss:.4f}  acc {100 * info.accuracy:5.1f}%  "
                        f"{info.tokens_per_s / 1000:.0f}k tok/s"
                    ),
                )

    if rank0:
        where = f" on {world} ranks" if world > 1 else ""
        print(
            f"training {config.task} (L={config.seq_len}) for {config.steps} steps, global batch "
            f"{config.batch_size}{where} -> {config.out}"
        )
    if progress is not None:
        with progress:
            result = train(config, on_step=on_step)
    else:
        result = train(config, on_step=on_step)
    if not rank0:
        return 0
    if result.interrupted:
        print(
            f"interrupted at step {result.step}/{config.steps}: checkpoint saved in "
            f"{result.checkpoint}; continue with: multihead train --out {config.out} --resume"
        )
        return 130
    last = result.history[-1] if result.history else None
    loss = f", final loss {last[1]:.4f}" if last else ""
    resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
    print(
        f"trained {result.step - result.start_step} steps in {result.train_seconds:.1f} s"
        f"{resumed}{loss}"
    )
    if result.accuracy is not None:
        print(f"held-out exact match: {100 * result.accuracy:.1f}% of {config.eval_size} sequences")
    files = ["config.json", "model.safetensors"]
    if config.plots:
        files += ["loss.png", "attention.png"]
    print(f"wrote {', '.join(os.path.join(config.out, f) for f in files)}")
    return 0


# -- generate ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from multihead.models import TransformerLM
    from multihead.training.tasks import EOS, PAD, Task

    config = TransformerLM.read_config(args.checkpoint)
    info = config.get("task")
    if not isinstance(info, dict) or "name" not in info or "seq_len" not in info:
        raise CLIError(
            f"{args.checkpoint!r} has no task in its config.json: generate needs a model "
            f"trained by 'multihead train'"
        )
    task = Task(info["name"], info["seq_len"])
    model = TransformerLM.load(args.checkpoint)
    prompts = [task.encode(text) for text in args.prompts]
    width = max(len(p) for p in prompts)
    room = model.max_len - width
    if room <= 0:
        raise CLIError(
            f"a prompt of {width} tokens is too long: the model's max_len is {model.max_len} "
            f"(its prompts have {task.prompt_len} tokens)"
        )
    new = min(args.max_new_tokens or task.answer_len, room)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    key_mask = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):  # left padding: every row ends at the same position
        ids[i, width - len(p) :] = torch.tensor(p)
        key_mask[i, width - len(p) :] = True
    out = model.generate(
        ids,
        new,
        temperature=args.temperature,
        top_k=args.top_k,
        key_mask=None if bool(key_mask.all()) else key_mask,
        eos_id=EOS,
        generator=torch.Generator().manual_seed(args.seed),
    )
    for row in out[:, width:]:
        print(Task.decode(row))
    return 0
