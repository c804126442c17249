"""Helpers shared by the CLI commands."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from multihead._files import read_json
from multihead.devices import DTYPES, resolve_device
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.mapping import attention_modules
from multihead.pretrained import load_text_model
from multihead.pretrained.text_loader import check_text_model_files
from multihead.training.ddp import World, setup_world, world_size
from multihead.viz.fonts import MissingGlyphsWarning

__all__ = [
    "CLIError",
    "printable",
    "one_line",
    "status",
    "print_warnings",
    "progress",
    "load_model",
    "load_on_every_rank",
    "on_rank_zero",
    "torchrun_world",
    "add_tensor_parallel_argument",
    "check_tensor_parallel",
    "print_split",
]

T = TypeVar("T")

# On a terminal the bar is redrawn at most this often (seconds); elsewhere (a log, a pipe) a
# line is written at most this often.
_REDRAW_S = 0.25
_LINE_S = 5.0


class CLIError(Exception):
    """An error the user can fix; the CLI prints it as one line and exits with code 2."""


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, as every command that runs a given model takes them."""
    parser.add_argument(
        "--device",
        default="auto",
        help="where the model runs: 'auto' (default: the local GPU if any), 'cpu', 'cuda:0'",
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="the weights' dtype (default: the one the model declares; float32 on the CPU when "
        "it declares a half type)",
    )


def add_tensor_parallel_argument(parser: argparse.ArgumentParser) -> None:
    """``--tensor-parallel``, as every command that runs a --model under torchrun takes it."""
    parser.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="under torchrun, split the --model over the ranks by its family's tensor-parallel "
        "plan (transformers; each rank holds a slice of every layer's heads); rank 0 prints and "
        "writes",
    )


def check_tensor_parallel(args: argparse.Namespace) -> None:
    """``--tensor-parallel`` needs a ``--model``, torchrun's ranks and ``--device auto``
    (transformers places each rank's slice itself): else a CLIError, before anything is
    loaded."""
    if not args.tensor_parallel:
        return
    if args.device != "auto":
        raise CLIError(
            f"--tensor-parallel places each rank's slice of the model on the machine's "
            f"accelerator at LOCAL_RANK (the CPU without one): leave --device at auto, got "
            f"{args.device!r}"
        )
    if not args.model:
        raise CLIError(
            "--tensor-parallel splits a Hugging Face model over the ranks: give its directory "
            "with --model DIR"
        )
    if world_size() < 2:
        raise CLIError(
            "--tensor-parallel splits the model over torchrun's ranks: run it under torchrun "
            "with 2 processes or more (torchrun --nproc-per-node 2 -m multihead ...)"
        )


def print_split(model: nn.Module) -> None:
    """One note on stderr when ``model``'s heads are split over ranks (tensor parallelism):
    how many ranks, and how many of each layer's heads each holds."""
    shard = next((s.head_shard for _, s in attention_modules(model) if s.head_shard), None)
    if shard is not None:
        print(
            f"note: the model is split over {shard.world_size} ranks by tensor parallelism: each "
            f"rank holds {shard.per_rank} of every layer's {shard.num_heads} heads",
            file=sys.stderr,
        )


def load_model(
    given: str | None,
    *,
    device: str = "auto",
    dtype: str | None = None,
    tensor_parallel: bool = False,
    together: bool = False,
    next_token: bool = False,
    head: Literal["lm"] | None = None,
) -> Any:
    """The text model ``--model`` names, from :func:`multihead.pretrained.load_text_model` (the
    default, loaded once per process, without one); a missing extra becomes a CLIError that
    names it (a GGUF file's ``gguf``, ``smollm2``'s package). ``head``: as
    :func:`~multihead.pretrained.load_text_model`'s. ``together``: every rank of the command's
    process group calls this
    (:func:`load_on_every_rank`: a failure on one is raised on all; with ``tensor_parallel``
    the files are checked and agreed on before the collective build). ``next_token``: keep a
    causal language model's head (``head="lm"``: its next-token distribution, for
    ``explain``'s head importance) when the model is one; any other model loads without."""

    def load() -> Any:
        try:
            if next_token and given is not None and not _own_bert(given):
                found = _causal_lm(given, device, dtype, tensor_parallel)
                if found is not None:
                    return found
            return load_text_model(
                given, device=device, dtype=dtype, tensor_parallel=tensor_parallel, head=head
            )
        except ImportError as e:
            raise CLIError(str(e)) from None  # it names the extra to install

    def check() -> None:
        try:
            check_text_model_files(given or "")
        except ImportError as e:
            raise CLIError(str(e)) from None

    if not together:
        return load()
    return load_on_every_rank(load, check if tensor_parallel and given else None)


def _own_bert(given: str) -> bool:
    """Whether ``given`` is a directory that ``load_text_model`` runs on multihead's own BERT
    (``config.json``'s model_type "bert"), which has no language-model head."""
    try:
        config = read_json(Path(given).expanduser() / "config.json")
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("model_type", "bert") == "bert"


# What hf.loading's warning says of weights missing from the files (initialised at random).
_RANDOM_WEIGHTS = "initialised at random"


def _causal_lm(given: str, device: str, dtype: str | None, tensor_parallel: bool) -> Any:
    """The model ``given`` names with its language-model head, or None when it is not a causal
    language model (its loader refuses ``head="lm"``: an encoder, an encoder-decoder) or its
    files hold no head (a decoder's base model: the head would be initialised at random); the
    refused attempt's warnings are dropped, and whatever is wrong with the files the load
    without a head says again."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = load_text_model(
                given, device=device, dtype=dtype, tensor_parallel=tensor_parallel, head="lm"
            )
        except (ValueError, TypeError, OSError):
            return None
    if any(_RANDOM_WEIGHTS in str(w.message) for w in caught):
        return None  # a base model's files: the head would be random (the loader says which)
    for w in caught:  # a causal LM's own warnings, as a load without a head gives them
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return model


@contextlib.contextmanager
def torchrun_world(device: str) -> Iterator[World]:
    """The ranks torchrun started, for the block: with ``WORLD_SIZE`` > 1 this process joins
    their group (gloo on CPUs, nccl on GPUs) and leaves it after, if it joined; else one process.

    ``World.device`` is where this rank's model goes: ``device`` (a ``--device`` value), and for
    a GPU without an index each rank its own (``LOCAL_RANK``).

    Raises:
        TypeError, ValueError: a ``--device`` that is unknown or not on this machine (before any
            group is joined).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = resolve_device(device, local_rank)
    if world_size() > 1 and where.type != "cpu" and where.index is None:
        where = torch.device(where.type, local_rank)  # "cuda": each rank its own GPU
    world = setup_world(where)
    try:
        yield world
    finally:
        if world.owns_group:
            dist.destroy_process_group()


def load_on_every_rank(load: Callable[[], T], check: Callable[[], object] | None = None) -> T:
    """``load()``; under torchrun (a process group initialised), the error any rank's load
    raised is raised on every rank: a rank that failed alone (a directory missing on one
    machine, memory) would leave the others waiting in their first collective. The failing
    rank raises its own error, the others a :class:`CLIError` naming the rank and the message.

    With ``check``, every rank runs it first and the ranks agree on it before any starts
    ``load()``: a load that is itself collective (a tensor-parallel build) must not start on
    some ranks while another has already failed on its files.
    """
    if check is not None:
        _on_every_rank(check)
    return _on_every_rank(load)


def on_rank_zero(rank: int, work: Callable[[], T]) -> T | None:
    """``work()`` on rank 0 alone, for a command whose work is one process's (nothing to share
    over the ranks): rank 0 runs, prints and writes; under torchrun every other rank waits for
    it, and an error there is raised on every rank, one line each (as
    :func:`load_on_every_rank`), so that all stop with exit code 2. Returns ``work()``'s
    result on rank 0, None elsewhere."""
    return _on_every_rank(work if rank == 0 else lambda: None)


def _on_every_rank(fn: Callable[[], T]) -> T:
    """``fn()``, its error (on any rank) raised on every rank: see :func:`load_on_every_rank`."""
    error: Exception | None = None
    result: T | None = None
    try:
        result = fn()
    except Exception as e:  # every rank must hear of it
        error = e
    try:
        DataParallelGroup.of().gather(None, error)
    except Exception as e:
        if e is error:
            raise
        raise CLIError(one_line(str(e))) from None  # "rank 1 of 2 failed (...): ..."
    return result  # type: ignore[return-value]  # not None: fn() returned


def printable(text: str) -> str:
    """``text`` with what cannot be written as UTF-8 escaped: Python keeps bytes of a path or an
    argument that are not UTF-8 as lone surrogates, which a UTF-8 stream refuses to print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str) -> str:
    """``text`` on one printable line (some libraries' messages span several)."""
    return printable(" ".join(text.split()))


def status(message: str, shown: bool = True) -> Any:
    """A context manager: ``message`` on stderr while a slow step runs, on a terminal, cleared
    when it ends (a nicety: nothing without rich, and the command works the same). It does not
    animate: an animating thread competes for the CPU with torch's threads, which then wait
    for each other (a 4× slower corpus run on a shared machine). Nothing when not ``shown``
    (the ranks other than 0 under torchrun)."""
    if not shown:
        return contextlib.nullcontext()
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:
        return contextlib.nullcontext()
    console = Console(stderr=True)
    if not console.is_terminal:
        return contextlib.nullcontext()
    return Live(Text(message), console=console, auto_refresh=False, transient=True)


def print_warnings(
    caught: Sequence[warnings.WarningMessage], rewrite: Callable[[str], str] = str
) -> None:
    """The library's warnings in the command's voice: one ``warning:`` line each, once each
    however often it was raised (per batch, per picture), the pictures' missing glyphs merged
    into one line; ``rewrite`` adapts a message to what the user gave (file line numbers)."""
    # deprecations inside other packages (pyparsing under an older matplotlib, ...) are for
    # their developers, not for the user of a command
    caught = [w for w in caught if not issubclass(w.category, DeprecationWarning)]
    glyphs = "".join(w.message.chars for w in caught if isinstance(w.message, MissingGlyphsWarning))
    lines = [
        rewrite(str(w.message)) for w in caught if not isinstance(w.message, MissingGlyphsWarning)
    ]
    if glyphs:
        lines.append(str(MissingGlyphsWarning(glyphs)))
    for line in dict.fromkeys(lines):
        print(f"warning: {one_line(line)}", file=sys.stderr)


@contextlib.contextmanager
def progress(
    description: str, total: int, unit: str = "texts", *, start: int = 0
) -> Iterator[Callable[..., None]]:
    """A context giving ``update(done, note="")``: on a terminal a bar on stderr with done/total,
    the note (e.g. a loss), the time elapsed and an estimate of the time left (rich); elsewhere, a
    plain line every few seconds. Nothing runs beside the work: the bar has no refresh thread (it
    would compete for the CPU with torch's threads) and is redrawn from ``update``, a few times a
    second at most. ``start``: work done before (a resumed run), not counted in the estimate.
    What the command prints meanwhile appears above the bar.
    """
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
    except ImportError:
        yield _lines(description, total, unit, start)
        return
    console = Console(stderr=True)
    if not console.is_terminal:
        yield _lines(description, total, unit, start)
        return
    bar = Progress(
        TextColumn(description),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"{unit}{{task.fields[note]}},"),
        TimeElapsedColumn(),
        TextColumn("elapsed, about"),
        TimeRemainingColumn(),
        TextColumn("left"),
        console=console,
        auto_refresh=False,
    )
    task = bar.add_task(description, total=total, completed=start, note="")
    last = 0.0

    def update(done: int, note: str = "") -> None:
        nonlocal last
        bar.update(task, completed=done, note=f", {note}" if note else "")
        now = time.monotonic()
        if now - last >= _REDRAW_S or done >= total:
            last = now
            bar.refresh()

    with bar:
        bar.refresh()
        yield update


def _lines(description: str, total: int, unit: str, first: int) -> Callable[..., None]:
    """``update(done, note="")`` writing "description: done/total unit, note, elapsed, about T
    left" to stderr at most every few seconds (the first after a few seconds: a short run writes
    nothing); ``first``: work done before, not counted in the estimate."""
    start = last = time.monotonic()

    def update(done: int, note: str = "") -> None:
        nonlocal last
        now = time.monotonic()
        if now - last < _LINE_S and not (done >= total and last > start):
            return
        last = now
        elapsed = now - start
        left = elapsed / (done - first) * (total - done) if done > first else float("nan")
        tail = "done" if done >= total else f"about {_clock(left)} left"
        note = f", {note}" if note else ""
        print(
            f"{description}: {done}/{total} {unit}{note}, {_clock(elapsed)} elapsed, {tail}",
            file=sys.stderr,
            flush=True,
        )

    return update


def _clock(seconds: float) -> str:
    if seconds != seconds:  # NaN: nothing done yet
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
