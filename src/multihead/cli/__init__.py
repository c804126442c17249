"""The ``multihead`` command: argparse subcommands, each in its own module of this package.

A command module defines ``register(subparsers)`` (adds its parser, with cheap imports only, and
sets ``func`` to a ``run(args) -> int``). Errors a user can fix are raised as :class:`CLIError`
(or ValueError / FileNotFoundError from the library) and printed as one line, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from multihead import __version__
from multihead.cli.common import CLIError

__all__ = ["main", "CLIError", "COMMANDS"]

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
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args))
    except (CLIError, ValueError, FileNotFoundError, PermissionError) as e:
        print(f"multihead {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
