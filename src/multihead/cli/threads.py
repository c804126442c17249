"""The CLI's one thread policy: how many CPU threads torch runs a command's model on.

Every command that runs a model (``explain``, ``explain --corpus``, ``patch``) takes
``--threads N`` (:func:`add_threads_argument`) and runs inside :func:`torch_threads`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["add_threads_argument", "torch_threads", "DEFAULT_THREADS"]

# The threads torch runs a command's model on, unless --threads or OMP_NUM_THREADS says otherwise.
DEFAULT_THREADS = 1


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``, as every command that runs a model takes it (:func:`torch_threads`)."""
    parser.add_argument(
        "--threads",
        type=_thread_count,
        metavar="N",
        help=f"CPU threads torch may use (default: OMP_NUM_THREADS when set, else "
        f"{DEFAULT_THREADS}: on a CPU shared with other work, torch's threads on every core "
        f"wait for each other, up to 10x slower than one; raise it on cores of your own)",
    )


def _thread_count(text: str) -> int:
    """ "4" -> 4 (argparse type: a ValueError becomes a one-line error)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 4096:
        raise argparse.ArgumentTypeError(
            f"expected a number of threads from 1 to 4096, got {text!r}"
        )
    return n


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """The command's thread policy, for the block: torch uses ``threads`` (``--threads``);
    without it, the number ``OMP_NUM_THREADS`` set when it is set (torch read it at start),
    else :data:`DEFAULT_THREADS`. The caller's setting is restored after: ``main()`` may run
    inside a longer-lived process. Yields the number in force.

    One thread is the default because the models a command runs are small enough that a second
    thread buys little, while on a CPU shared with other work torch's threads spin-wait for
    each other: ``multihead patch`` on SmolLM2-135M took 189.8 s on every core of a busy
    2-core machine against 18.5 s on one.
    """
    before = torch.get_num_threads()
    if threads is None:
        threads = before if "OMP_NUM_THREADS" in os.environ else DEFAULT_THREADS
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
