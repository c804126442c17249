"""Helpers shared by the CLI commands."""

from __future__ import annotations


class CLIError(Exception):
    """An error the user can fix; the CLI prints it as one line and exits with code 2."""
