"""The fonts the figures draw with, and the characters none of them has.

matplotlib draws each character with the first family of its ``font.family`` list that has it
(font fallback). The figures draw with DejaVu Sans (matplotlib's own) and, after it, those of
:data:`FALLBACK_FAMILIES` installed here: a CJK font when there is one, so "東京" is drawn, not
two boxes. A character that no font of the list has is drawn as a box; :func:`missing_glyphs`
finds such characters before drawing, so that :func:`multihead.viz.plots.save_figure` warns once
per figure (:class:`MissingGlyphsWarning`) instead of matplotlib warning once per glyph and draw.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, ParamSpec, TypeVar

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FALLBACK_FAMILIES",
    "MissingGlyphsWarning",
    "font_families",
    "fonts",
    "drawn_with_fonts",
    "missing_glyphs",
    "quiet_glyph_warnings",
]

# Families tried after DejaVu Sans, in order, when installed: the common CJK fonts of Linux
# distributions, macOS and Windows, then broad Unicode fonts.
FALLBACK_FAMILIES: tuple[str, ...] = (
    "Noto Sans CJK JP",
    "Noto Sans CJK SC",
    "Noto Sans CJK TC",
    "Noto Sans CJK KR",
    "Source Han Sans",
    "Source Han Sans JP",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Droid Sans Fallback",
    "IPAGothic",
    "IPAexGothic",
    "TakaoGothic",
    "Hiragino Sans",
    "PingFang SC",
    "Microsoft YaHei",
    "Yu Gothic",
    "MS Gothic",
    "Malgun Gothic",
    "SimHei",
    "Noto Sans",
    "Arial Unicode MS",
)
_FIRST = "DejaVu Sans"
P = ParamSpec("P")
R = TypeVar("R")
_SHOWN = 10  # characters a warning names


class MissingGlyphsWarning(UserWarning):
    """Characters that no installed font of :func:`font_families` has: drawn as boxes.

    Attributes:
        chars: the characters, each once, in order of first appearance.
    """

    def __init__(self, chars: Iterable[str]) -> None:
        self.chars = "".join(dict.fromkeys(chars))
        shown = ", ".join(self.chars[:_SHOWN]) + (" …" if len(self.chars) > _SHOWN else "")
        super().__init__(
            f"no installed font has {shown} ({len(self.chars)} character"
            f"{'s' if len(self.chars) != 1 else ''}): the pictures draw them as boxes; install "
            f"a font that has them (for Chinese, Japanese or Korean: Noto Sans CJK, Debian's "
            f"fonts-noto-cjk)"
        )


def _installed() -> set[str]:
    from matplotlib import font_manager

    return {f.name for f in font_manager.fontManager.ttflist}


def font_families() -> list[str]:
    """DejaVu Sans, then the installed families of :data:`FALLBACK_FAMILIES`, in order."""
    installed = _installed()
    return [_FIRST, *(f for f in FALLBACK_FAMILIES if f in installed)]


def fonts() -> contextlib.AbstractContextManager[object]:
    """A context in which new figure texts draw with :func:`font_families` (matplotlib's
    ``rc_context``: nothing global changes); without matplotlib, nothing (the figure's own
    import says what to install)."""
    try:
        import matplotlib
    except ImportError:
        return contextlib.nullcontext()
    return matplotlib.rc_context({"font.family": font_families()})


def drawn_with_fonts(build: Callable[P, R]) -> Callable[P, R]:
    """A figure builder whose texts draw with :func:`font_families`: a text keeps the fonts
    it was made with, so the builder runs inside :func:`fonts`."""

    @functools.wraps(build)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with fonts():
            return build(*args, **kwargs)

    return wrapper


def _covered(families: list[str]) -> set[int]:
    from matplotlib import font_manager

    codes: set[int] = set()
    for family in families:
        path = font_manager.findfont(
            font_manager.FontProperties(family=family), fallback_to_default=False
        )
        codes.update(font_manager.get_font(path).get_charmap())
    return codes


def missing_glyphs(fig: Figure) -> str:
    """The characters of ``fig``'s texts that no font of their family list has, each once."""
    from matplotlib.text import Text

    covered: dict[tuple[str, ...], set[int]] = {}
    missing: dict[str, None] = {}
    installed: set[str] | None = None
    for text in fig.findobj(Text):
        content = text.get_text()
        if not content or content.isascii():
            continue
        installed = _installed() if installed is None else installed
        families = tuple(f for f in text.get_fontfamily() if f in installed)
        if families not in covered:
            covered[families] = _covered(list(families) or [_FIRST])
        for ch in content:
            if ch.isprintable() and not ch.isspace() and ord(ch) not in covered[families]:
                missing[ch] = None
    return "".join(missing)


@contextlib.contextmanager
def quiet_glyph_warnings() -> Iterator[None]:
    """matplotlib's own warning per missing glyph and draw silenced (:func:`missing_glyphs` has
    said it once); every other warning passes."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .*missing from", category=UserWarning)
        yield
