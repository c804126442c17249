"""The figure every picture is drawn on, and the texts it draws.

Figures are :class:`matplotlib.figure.Figure` objects made directly (no pyplot, no display, no
global state), so they are safe in scripts, servers and tests. matplotlib comes with the ``viz``
extra; it is imported when a figure is made, and its absence names the extra to install.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["matplotlib_module", "new_figure", "plain_text", "wrap_text", "APART_COLOUR"]

# The colour of the labels of tokens set apart from the words (special tokens, a decoder's
# first token: the attention sink).
APART_COLOUR = "#8c8c8c"
# An average character of DejaVu Sans is about this many ems wide (a bound for wrapping).
_CHAR_EM = 0.6


def matplotlib_module() -> Any:
    """The ``matplotlib`` module.

    Raises:
        ImportError: matplotlib is not installed (the message names the extra).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(
            "multihead.viz needs matplotlib to draw figures: pip install 'multihead[viz]'"
        ) from e
    return matplotlib


def new_figure(width: float, height: float, **kwargs: Any) -> Figure:
    """A new figure of ``width`` × ``height`` inches (``kwargs``: as for ``Figure``, e.g.
    ``layout="constrained"``)."""
    matplotlib_module()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), **kwargs)


def plain_text(text: str) -> str:
    """``text`` as matplotlib should draw it, as written: a token may well hold "$", which would
    start mathtext."""
    return text.replace("$", r"\$")


def wrap_text(text: str, width: float, fontsize: float) -> str:
    """``text`` broken at spaces into lines that fit ``width`` inches at ``fontsize`` points
    (its own line breaks kept; a word longer than a line broken too), so that a title wider
    than its figure is not cut at the figure's edges."""
    chars = max(12, int(width * 72 / (_CHAR_EM * fontsize)))
    lines = [
        line
        for part in text.split("\n")
        for line in textwrap.wrap(part, chars, break_on_hyphens=False) or [""]
    ]
    return "\n".join(lines)
