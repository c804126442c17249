"""The ``multihead`` command: argparse subcommands, each in its own module of this package.

A command module defines ``register(subparsers)`` (adds its parser, with cheap imports only, and
sets ``func`` to a ``run(args) -> int``). Errors a user can fix are raised as :class:`CLIError`,
or by the library as ValueError (UnicodeError included), TypeError or OSError
(FileNotFoundError, PermissionError, ...); each is printed as one line on stderr, exit code 2.
A flag argparse refuses is one line and exit code 2 as well.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from multihead import __version__
from multihead.cli.common import CLIError, one_line

__all__ = ["main", "CLIError", "COMMANDS"]

# What a user's mistake raises: the library's argument checks and missing or forbidden files.
# UnicodeError is a ValueError; it is named for the reader.
_USER_ERRORS = (CLIError, ValueError, TypeError, OSError)  # UnicodeError is a ValueError

# Module names under multihead.cli, in the order `multihead --help` lists them.
COMMANDS: tuple[str, ...] = ("explain", "train", "patch", "circuit")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        # One line and exit code 2, as argparse does, but without the usage block.
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="multihead",
        description="Multi-head attention that is correct, fast and visible.",
    )
    parser.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = parser.add_subparsers(
        dest="command", title="commands", metavar="COMMAND", parser_class=_Parser
    )
    for name in COMMANDS:
        importlib.import_module(f"multihead.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 success, 2 a usage or input error, 130 interrupted).

    ``main()`` without ``argv`` runs the process's own command line (the ``multihead`` script,
    ``python -m multihead``) and owns the process: once the user has stopped a command with
    Ctrl-C, further Ctrl-Cs are ignored on the way out rather than printed as tracebacks.
    ``main(argv)`` leaves process-wide state alone, for callers such as tests.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits after --help, --version or a refused flag
        return e.code if isinstance(e.code, int) else 2
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    if argv is None and _in_main_thread() and signal.getsignal(signal.SIGINT) is _DEFAULT_SIGINT:
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        code = int(func(args))
    except _USER_ERRORS as e:
        print(f"multihead {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if argv is None:
            _ignore_further_interrupts()
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
    if code == 130 and argv is None:
        _ignore_further_interrupts()
    return code


_DEFAULT_SIGINT = signal.default_int_handler


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _interrupt_once(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C stops the command (KeyboardInterrupt) and every later Ctrl-C is ignored, so the
    way out (a checkpoint's save, the last lines, the interpreter's shutdown) is never cut short
    by a second traceback. Commands may install their own handler meanwhile (training does)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _ignore_further_interrupts() -> None:
    """The command has stopped on the user's Ctrl-C: what is left is printing and exiting."""
    if _in_main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
