"""What a patching experiment measured: the effects with their axes named and labelled, and the
two runs they are measured between.

Axis order, one for every site: layer first, then head (per-head sites), then position
(``per_position``)::

    residual sites (resid_pre, attn_out, resid_mid, mlp_out, resid_post)   (L,) or (L, T)
    per-head sites (z, result, q, pattern)                                 (L, H) or (L, H, T)
    key/value sites (k, v)                                                 (L, Hk) or (L, Hk, T)
    paths (path patching)                                                  (N, R, X)

(TransformerLens's per-position head tables are (L, T, H): ``values.permute(0, 2, 1)``.)

A result whose axes are not layers, heads and positions (path patching's senders, receivers
and their inputs) names each index along each axis in :attr:`PatchResult.names`.

:meth:`PatchResult.plot` draws the effects as one heatmap (:func:`multihead.viz.plots.
effects_figure`, a diverging scale around 0, NaN cells blank), rows and columns by the axes:

    (L,)          layers × the site                 (L, T)      layers × positions
    (L, H)        layers × heads                    (L, H, T)   the top heads × positions
    (N, R, X)     senders × each receiver's inputs (``"L1H3.k"``)

Shapes: L layers, H heads, Hk key/value heads, T positions, N senders, R receivers, X receiver
inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from multihead._checks import check_positive_int, describe
from multihead.circuits.runs.site_names import LAYER_SITES, MODEL_SITES
from multihead.heads import head_label
from multihead.viz.plots import effects_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["PatchResult"]

_PATH_DIMS = ("sender", "receiver", "via")


@dataclass(frozen=True)
class PatchResult:
    """The metric's change per patch, ``metric(patched) - metric(unpatched)``.

    Attributes:
        values: the effects, axes as :attr:`dims` says (module docstring); NaN where nothing
            was patched (heads a layer does not have, layers or heads not chosen).
        dims: the axes' names: ``("layer", "head")``, ``("layer", "head", "position")``,
            ``("layer",)``, ``("layer", "position")``; ``("sender", "receiver", "via")`` for
            path patching.
        site: the site patched (``"z"``, ``"resid_pre"``, ...; ``"path"`` for path patching).
        direction: ``"denoise"`` (the corrupt run, patched from the clean one) or ``"noise"``.
        clean: the metric on the clean run.
        corrupt: the metric on the corrupt run.
        names: for axes other than layer, head and position, the written name of each index
            along each axis (``(("L0H1", "L0H2"), ("L1H3",), ("q", "k", "v"))``); None for
            layer/head/position axes, which are named by their numbers.
    """

    values: Tensor
    dims: tuple[str, ...]
    site: str
    direction: str
    clean: float
    corrupt: float
    names: tuple[tuple[str, ...], ...] | None = None

    @staticmethod
    def site_dims(site: str, per_position: bool) -> tuple[str, ...]:
        """The axes of a result of patching ``site`` (module docstring): ``("layer",)`` for a
        site with one activation per layer (the residual stream, a norm's scale, the
        feed-forward's hidden activations; a site of the whole model has one "layer"),
        ``("layer", "head")`` per head, and ``"position"`` after them with ``per_position``."""
        dims: tuple[str, ...] = ("layer",) if site in LAYER_SITES else ("layer", "head")
        return dims + (("position",) if per_position else ())

    def __post_init__(self) -> None:
        if len(self.dims) != self.values.dim():
            raise ValueError(
                f"dims names {len(self.dims)} axes {self.dims}, values has {self.values.dim()}"
            )
        if self.names is not None and tuple(map(len, self.names)) != tuple(self.values.shape):
            raise ValueError(
                f"names has {tuple(map(len, self.names))} names per axis, values is shaped "
                f"{tuple(self.values.shape)}"
            )

    def label(self, index: tuple[int, ...]) -> str:
        """The written name of one cell: ``"L3H5"``, ``"L3H5 pos 7"``, ``"L3 resid_pre pos 7"``,
        ``"embed pos 2"``; with :attr:`names`, ``"L0H1 -> L1H3.k"`` (sender, receiver, via) or
        the axes' names joined by spaces."""
        if self.names is not None:
            parts = {
                dim: axis[i] for dim, axis, i in zip(self.dims, self.names, index, strict=True)
            }
            if self.dims == _PATH_DIMS:
                return f"{parts['sender']} -> {parts['receiver']}.{parts['via']}"
            return " ".join(parts.values())
        named = dict(zip(self.dims, index, strict=True))
        at = f" pos {named['position']}" if "position" in named else ""
        if self.site in MODEL_SITES:
            return f"{self.site}{at}"
        layer = f"L{named['layer']}"
        head = f"H{named['head']}" if "head" in named else f" {self.site}"
        return f"{layer}{head}{at}"

    def labels(self) -> list[str]:
        """Every cell's label, in the order of ``values.flatten()``."""
        return [self.label(index) for index in _indices(self.values.shape)]

    def normalized(self) -> Tensor:
        """``(patched - corrupt) / (clean - corrupt)``, the share of the clean behaviour a patch
        gives (denoising: 1 is all of it) or keeps (noising: 0 is all of it lost).

        Raises:
            ValueError: the clean and corrupt metrics are equal (nothing to share out).
        """
        gap = self.clean - self.corrupt
        if gap == 0 or not math.isfinite(gap):
            raise ValueError(
                f"normalized() divides by clean - corrupt, which is {gap!r} here (clean "
                f"{self.clean!r}, corrupt {self.corrupt!r})"
            )
        unpatched = self.corrupt if self.direction == "denoise" else self.clean
        return (self.values + unpatched - self.corrupt) / gap

    def top(self, k: int = 10) -> list[tuple[str, float]]:
        """The ``k`` computed cells with the largest |effect|: ``(label, effect)``, largest
        first (a NaN cell, one nothing was patched at, is none of them)."""
        check_positive_int("k", k)
        flat = self.values.flatten()
        computed = (~flat.isnan()).nonzero().flatten()
        order = computed[flat[computed].abs().argsort(descending=True)[:k]].tolist()
        indices = _indices(self.values.shape)
        return [(self.label(indices[i]), float(flat[i])) for i in order]

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per computed cell (NaN cells left out): each axis's index, the label, the
        effect and the normalised effect (None when clean equals corrupt, or either is not
        finite); for a table
        (``pandas.DataFrame(result.to_rows())``)."""
        gap = self.clean - self.corrupt
        shares = gap != 0 and math.isfinite(gap)
        normal = self.normalized().flatten().tolist() if shares else None
        rows = []
        for i, (index, value) in enumerate(
            zip(_indices(self.values.shape), self.values.flatten().tolist(), strict=True)
        ):
            if math.isnan(value):
                continue
            row: dict[str, Any] = dict(zip(self.dims, index, strict=True))
            row |= {"label": self.label(index), "effect": value}
            row["normalized"] = normal[i] if normal is not None else None
            rows.append(row)
        return rows

    def plot(
        self, *, top: int = 10, tokens: Sequence[str] | None = None, title: str | None = None
    ) -> Figure:
        """The effects as one heatmap (module docstring): a diverging scale centred on 0, NaN
        cells (nothing patched) blank, each cell labelled with its value when there are at
        most 24 columns.

        Args:
            top: for (L, H, T), how many heads to draw: those with the largest
                Σ_t |P[l, h, t]|, largest first (heads never patched left out).
            tokens: names of the T positions (e.g. the clean input's tokens); default their
                numbers.
            title: the figure's title; default the site and direction.

        Returns:
            A matplotlib Figure (save it with :func:`multihead.viz.plots.save_figure`).

        Raises:
            ValueError: ``tokens`` not of the result's length, ``top`` not positive.
            ImportError: matplotlib is missing (the ``viz`` extra).
        """
        check_positive_int("top", top)
        grid, rows, columns, ylabel, xlabel = self._grid(top, tokens)
        if title is None:
            what = "Path patching" if self.dims == _PATH_DIMS else f"Patching {self.site}"
            title = f"{what} ({self.direction})"
        return effects_figure(
            grid, rows, columns, title=title, label=f"metric change ({self.direction})",
            xlabel=xlabel, ylabel=ylabel,
        )  # fmt: skip

    def _grid(
        self, top: int, tokens: Sequence[str] | None
    ) -> tuple[Tensor, list[str], list[str], str, str]:
        """(the (rows, columns) effects to draw, row labels, column labels, the rows' axis
        label, the columns')."""
        values = self.values.detach().float().cpu()
        if self.dims == _PATH_DIMS and self.names is not None:
            senders, receivers, via = self.names
            # a logits receiver has one input, the residual stream; a head has q, k, v
            cells = [
                (j, x)
                for j, receiver in enumerate(receivers)
                for x, kind in enumerate(via)
                if (receiver == "logits") == (kind == "resid")
            ]
            grid = torch.stack([values[:, j, x] for j, x in cells], dim=1)  # (N, columns)
            columns = [
                "logits" if receivers[j] == "logits" else f"{receivers[j]}.{via[x]}"
                for j, x in cells
            ]
            return grid, list(senders), columns, "sender", "receiver.input"
        layers = [str(layer) for layer in range(values.shape[0])]
        axis = "layer"
        if self.site in MODEL_SITES:  # one row, the whole model's
            layers, axis = [self.site], ""
        unit = "key/value head" if self.site in ("k", "v") else "head"
        if self.dims == ("layer",):
            return values[:, None], layers, [self.site], axis, ""
        if self.dims == ("layer", "head"):
            return values, layers, [str(h) for h in range(values.shape[1])], "layer", unit
        positions = self._positions(values.shape[-1], tokens)
        if self.dims == ("layer", "position"):
            return values, layers, positions, axis, "position"
        if self.dims != ("layer", "head", "position"):
            raise ValueError(
                f"plot() draws the axes patch and path_patching give, got dims {self.dims}"
            )
        n = values.shape[1]
        patched = ~values.isnan().all(-1).flatten()  # (L·H,) the heads patched at all
        order = values.abs().nansum(-1).flatten().argsort(descending=True).tolist()
        heads = [(i // n, i % n) for i in order if patched[i]][:top]
        if not heads:
            raise ValueError("plot(): no head of this result was patched (every value is NaN)")
        grid = torch.stack([values[layer, head] for layer, head in heads])  # (top, T)
        return grid, [head_label(*h) for h in heads], positions, unit, "position"

    @staticmethod
    def _positions(t: int, tokens: Sequence[str] | None) -> list[str]:
        """The T positions' column labels: ``tokens``, or their numbers."""
        if tokens is None:
            return [str(i) for i in range(t)]
        if isinstance(tokens, str) or not isinstance(tokens, Sequence):
            raise TypeError(f"tokens must be a sequence of {t} strings, got {describe(tokens)}")
        if len(tokens) != t:
            raise ValueError(
                f"tokens must name the result's {t} positions, got {len(tokens)} tokens"
            )
        return [str(token) for token in tokens]


def _indices(shape: torch.Size) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in ix) for ix in torch.cartesian_prod(
        *[torch.arange(n) for n in shape]
    ).reshape(-1, len(shape)).tolist()]  # fmt: skip
