"""``multihead train`` and ``multihead generate``: train a small causal LM on a synthetic task,
then continue prompts with it.

    multihead train --task sort                      # ≥ 99% exact match in well under a minute
    multihead train --task induction                 # induction heads appear (docs/induction.md)
    multihead train --task induction --num-layers 1  # the control: one layer can't
    multihead train --task reverse --steps 2000 --out runs/rev
    multihead train --out runs/rev --resume          # after Ctrl-C: continue where it stopped
    torchrun --nproc-per-node 2 -m multihead train --task sort --out runs/ddp
    multihead generate --checkpoint runs/sort "5 2 9 1 3 3 0 7 ="
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from typing import Any

from multihead.cli.common import CLIError, progress
from multihead.training import (
    DivergenceError,
    TrainConfig,
    complete_prompts,
    load_run,
    resume_config,
    train,
)

__all__ = ["register", "run_train", "run_generate"]

_TASKS = ("copy", "reverse", "sort", "add", "induction")

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
    "attn_only",
    "embedding_std",
    "warmup_steps",
    "weight_decay",
    "save_every",
    "eval_size",
    "probe_every",
    "threads",
    "device",
)


# Library argument name -> the flag that sets it, to name flags in the library's messages.
_FLAG_OF = {
    name: "--" + name.replace("_", "-")
    for name in (*_TRAIN_FLAGS, "out", "max_new_tokens", "top_k", "temperature")
}
# A quoted value as repr writes it (a quote inside escaped), opening after a non-word
# character: the apostrophe of "the model's" or "the runs'" opens no quote.
_QUOTED = re.compile(r"""((?<!\w)'(?:\\.|[^'\\])*'|(?<!\w)"(?:\\.|[^"\\])*")""")
_NAME = re.compile(r"\b[a-z]+(?:_[a-z]+)+\b")


def _in_flags(message: str) -> str:
    """The library names arguments ("num_heads (3) must ..."); the user typed flags.

    The leading name and every snake_case name become flags ("--num-heads (3) must ..."),
    except inside quotes (paths, values).
    """
    first, _, rest = message.partition(" ")
    if first in _FLAG_OF:
        message = f"{_FLAG_OF[first]} {rest}"
    parts = _QUOTED.split(message)
    for i in range(0, len(parts), 2):  # the even parts are outside quotes
        parts[i] = _NAME.sub(lambda m: _FLAG_OF.get(m.group(0), m.group(0)), parts[i])
    return "".join(parts)


def register(subparsers: Any) -> None:
    """Add the ``train`` and ``generate`` subcommands."""
    p = subparsers.add_parser(
        "train",
        help="train a small causal transformer on a synthetic task",
        description=(
            "Train a TransformerLM on copy, reverse, sort or add, framed as continuation "
            "('3 1 2 =' -> '1 2 3'), or on induction (random tokens with a copied segment; "
            "loss on every token). Writes DIR/config.json, model.safetensors, loss.png, "
            "attention.png (induction: induction.png too) and checkpoints/; prints held-out "
            "exact-match accuracy (induction: the losses on first and repeated tokens and the "
            "best induction head). Ctrl-C saves and stops; --resume continues. Under torchrun "
            "it trains data-parallel."
        ),
    )
    p.add_argument(
        "--task",
        choices=_TASKS,
        help="the task (default sort; taken from the checkpoint with --resume)",
    )
    p.add_argument("--steps", type=int, help="total optimizer steps (default 250; induction 1200)")
    p.add_argument(
        "--seq-len", type=int, help="input digits per example (default 8; induction: tokens, 32)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        help="global batch, split across ranks (default 128; induction 32)",
    )
    p.add_argument("--lr", type=float, help="peak AdamW learning rate (default 3e-3)")
    p.add_argument("--seed", type=int, help="seeds the weights and the data (default 0)")
    p.add_argument("--out", help="run directory (default runs/TASK)")
    again = p.add_mutually_exclusive_group()
    again.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in --out"
    )
    again.add_argument(
        "--overwrite", action="store_true", help="start afresh in an --out that holds a run"
    )
    model = p.add_argument_group("model")
    model.add_argument("--embed-dim", type=int, help="width E (default 128)")
    model.add_argument("--num-heads", type=int, help="heads H (default 4)")
    model.add_argument("--num-layers", type=int, help="layers (default 2)")
    model.add_argument("--ff-dim", type=int, help="feed-forward width (default 512)")
    model.add_argument(
        "--num-kv-heads", type=int, help="key/value heads (grouped-query; default H)"
    )
    model.add_argument("--dropout", type=float, help="dropout (default 0)")
    model.add_argument(
        "--attn-only",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="blocks without feed-forward networks (default: on for induction, off otherwise)",
    )
    model.add_argument(
        "--embedding-std",
        type=float,
        help="std of the initial token/position embeddings (default 0.02; induction 1.0)",
    )
    extra = p.add_argument_group("schedule and output")
    extra.add_argument(
        "--warmup-steps",
        type=int,
        help="linear warmup steps (default 5%% of steps; induction 30)",
    )
    extra.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.01)")
    extra.add_argument(
        "--save-every", type=int, help="checkpoint every N steps (default 100; 0: end)"
    )
    extra.add_argument("--eval-size", type=int, help="held-out sequences to score (default 1000)")
    extra.add_argument(
        "--probe-every",
        type=int,
        help="induction: measure losses and head scores every N steps (default 20)",
    )
    extra.add_argument("--threads", type=int, help="torch threads per process (default 1)")
    extra.add_argument("--device", help="'auto' (default: the local GPU if any), 'cpu', 'cuda:0'")
    extra.add_argument("--no-plots", action="store_true", help="skip loss.png and attention.png")
    extra.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_train)

    g = subparsers.add_parser(
        "generate",
        help="continue prompts with a model trained by 'multihead train'",
        description=(
            "Greedy (or sampled) continuation of space-separated prompts, one answer per line. "
            "A model answers prompts of the shape it was trained on: --seq-len digits and '=' "
            "(e.g. '5 2 9 1 =' for --seq-len 4), or 'a + b =' for add."
        ),
    )
    g.add_argument(
        "--checkpoint", required=True, help="a run directory (or one of its checkpoints/step-N)"
    )
    g.add_argument(
        "prompts", nargs="+", metavar="PROMPT", help='e.g. "5 2 9 1 =" (the trained length)'
    )
    g.add_argument("--max-new-tokens", type=int, help="default: the task's answer length")
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples"
    )
    g.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    g.add_argument("--seed", type=int, default=0, help="seed for sampling (default 0)")
    g.set_defaults(func=run_generate)


# -- train ------------------------------------------------------------------------------------


def _config(args: argparse.Namespace) -> Any:

    given = {f: getattr(args, f) for f in _TRAIN_FLAGS if getattr(args, f) is not None}
    if args.resume:
        if args.out is None:
            raise CLIError("--resume needs --out DIR, the run to continue")
        # Flags not given keep the checkpoint's values.
        return resume_config(args.out, **given, overwrite=args.overwrite, plots=not args.no_plots)
    # One thread per process by default: the default model is small enough that more threads
    # gain little, and on a busy machine OpenMP threads spin and slow every step down.
    given.setdefault("threads", 1)
    task = given.pop("task", "sort")
    out = os.path.join("runs", str(task)) if args.out is None else args.out
    # The task's own defaults (the induction recipe) under the flags given.
    return TrainConfig.for_task(
        task, **given, out=out, overwrite=args.overwrite, plots=not args.no_plots
    )


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _worth_logging(info: Any, config: Any) -> bool:
    # Every fifth measurement and the last: a dozen lines for the default induction run.
    every = 5 * config.probe_every
    return info.probe is not None and (info.step % every == 0 or info.step == config.steps)


def _probe_line(probe: Any) -> str:
    layer, head, score = probe.best()
    return (
        f"step {probe.step:>5}: loss on first occurrences {probe.first_loss:.3f}, on repeated "
        f"tokens {probe.repeated_loss:.3f}; best induction head L{layer} H{head} {score:.2f}"
    )


def run_train(args: argparse.Namespace) -> int:

    try:
        config = _config(args)
    except (TypeError, ValueError) as e:
        raise CLIError(_in_flags(str(e))) from None
    rank0 = _is_rank0()
    update: Any = None  # the progress bar's, once the run has started

    with contextlib.ExitStack() as bar:

        def on_start(info: Any) -> None:
            # Called once every check has passed: a run that fails them prints nothing here.
            nonlocal update
            where = f" on {info.world_size} ranks" if info.world_size > 1 else ""
            print(
                f"training {config.task} (L={config.seq_len}) for {config.steps} steps, global "
                f"batch {config.batch_size}{where} -> {config.out}",
                flush=True,
            )
            if not args.quiet:
                description = f"{config.task} L={config.seq_len}"
                update = bar.enter_context(
                    progress(description, config.steps, "steps", start=info.start_step)
                )

        def on_step(info: Any) -> None:
            if _worth_logging(info, config):
                print(_probe_line(info.probe), flush=True)  # above the bar
            if update is not None:
                update(
                    info.step,
                    f"loss {info.loss:.4f}  acc {100 * info.accuracy:5.1f}%  "
                    f"{info.tokens_per_s / 1000:.0f}k tok/s",
                )

        try:
            result = train(config, on_step=on_step, on_start=on_start)
        except DivergenceError as e:
            raise CLIError(f"{e}; a lower --lr may help") from None
        except (TypeError, ValueError) as e:
            raise CLIError(_in_flags(str(e))) from None
    if not rank0:
        return 0
    if result.interrupted:
        resume = f"multihead train --out {config.out} --resume"
        print(
            f"interrupted at step {result.step}/{config.steps}: checkpoint saved in "
            f"{result.checkpoint}; continue with: {resume}"
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
    if result.probes:
        print(f"held-out layouts, {_probe_line(result.probes[-1])}")
    files = ["config.json", "model.safetensors"]
    if config.plots:
        files += ["loss.png", "attention.png"] + (["induction.png"] if result.probes else [])
    print(f"wrote {', '.join(os.path.join(config.out, f) for f in files)}")
    return 0


# -- generate ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:

    model, task = load_run(args.checkpoint)
    try:
        answers = complete_prompts(
            model,
            task,
            args.prompts,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
        )
    except (TypeError, ValueError) as e:
        raise CLIError(_in_flags(str(e))) from None
    for answer in answers:
        print(answer)
    return 0
