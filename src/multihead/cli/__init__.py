"""The ``multihead`` command: argparse subcommands, each in its own module of this package.

A command module defines ``register(subparsers)`` (adds its parser, with cheap imports only, and
sets ``func`` to a ``run(args) -> int``). Errors a user can fix are raised as :class:`CLIError`,
or by the library as ValueError (UnicodeError included), TypeError, FileNotFoundError or
PermissionError; each is printed as one line on stderr, exit code 2. A flag argparse refuses
is one line and exit code 2 as well.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from multihead import __version__
from multihead.cli.common import CLIError, one_line

__all__ = ["main", "CLIError", "COMMANDS"]

# What a user's mistake raises: the library's argument checks and missing or forbidden files.
# UnicodeError is a ValueError; it is named for the reader.
_USER_ERRORS = (CLIError, ValueError, UnicodeError, TypeError, FileNotFoundError, PermissionError)

# Module names under multihead.cli, in the order `multihead --help` lists them.
COMMANDS: tuple[str, ...] = ("explain", "train")


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
    """Run the CLI; returns the exit code (0 success, 2 a usage or input error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits after --help, --version or a refused flag
        return e.code if isinstance(e.code, int) else 2
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except _USER_ERRORS as e:
        print(f"multihead {args.command}: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
