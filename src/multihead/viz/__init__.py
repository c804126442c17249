"""Pictures of attention: heatmap grids and single heads (matplotlib: ``grid_figure``,
``head_figure``, saved by ``save_figure`` in the ``FORMATS`` that ``check_formats`` and
``check_output_dir`` check), the heatmap of patching effects (``effects_figure``, which
:meth:`multihead.PatchResult.plot` draws with), a circuit's graph and faithfulness curves
(``circuit_figure``, ``faithfulness_figure``), the head map (``heads_map_figure``,
``save_heads_map``) and one self-contained interactive HTML page (``render_page``,
``write_page``, its weights packed by ``encode_weights``).

matplotlib and rich come with the ``viz`` extra (``pip install 'multihead[viz]'``); they are
imported only when a picture is drawn, so importing this package costs nothing.
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "FORMATS": "multihead.viz.formats",
    "check_formats": "multihead.viz.formats",
    "check_output_dir": "multihead.viz.formats",
    "grid_figure": "multihead.viz.plots",
    "head_figure": "multihead.viz.plots",
    "effects_figure": "multihead.viz.plots",
    "save_figure": "multihead.viz.plots",
    "circuit_figure": "multihead.viz.circuit_graph",
    "faithfulness_figure": "multihead.viz.circuit_graph",
    "heads_map_figure": "multihead.viz.heads_map",
    "save_heads_map": "multihead.viz.heads_map",
    "render_page": "multihead.viz.page",
    "write_page": "multihead.viz.page",
    "encode_weights": "multihead.viz.page",
}

__all__ = list(_LAZY)


__getattr__ = lazy_getattr(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(__all__)
