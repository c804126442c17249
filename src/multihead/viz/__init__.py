"""Pictures of attention: heatmap grids and single heads (matplotlib), and one self-contained
interactive HTML page.

matplotlib and rich come with the ``viz`` extra (``pip install 'multihead[viz]'``); they are
imported only when a picture is drawn, so importing this package costs nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "grid_figure": "multihead.viz.plots",
    "head_figure": "multihead.viz.plots",
    "save_figure": "multihead.viz.plots",
    "render_page": "multihead.viz.page",
    "write_page": "multihead.viz.page",
    "encode_weights": "multihead.viz.page",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'multihead.viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
