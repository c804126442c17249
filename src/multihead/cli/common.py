"""Helpers shared by the CLI commands."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["CLIError", "printable", "one_line", "status"]


class CLIError(Exception):
    """An error the user can fix; the CLI prints it as one line and exits with code 2."""


def printable(text: str) -> str:
    """``text`` with what cannot be written as UTF-8 escaped: Python keeps bytes of a path or an
    argument that are not UTF-8 as lone surrogates, which a UTF-8 stream refuses to print."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def one_line(text: str) -> str:
    """``text`` on one printable line (some libraries' messages span several)."""
    return printable(" ".join(text.split()))


def status(message: str) -> Any:
    """A context manager: a spinner with ``message`` on stderr while a slow step runs (a nicety:
    nothing without rich, and the command works the same)."""
    try:
        from rich.console import Console
    except ImportError:
        return contextlib.nullcontext()
    return Console(stderr=True).status(message, spinner="dots")
