"""Where a lens came from, and whether the model it is read on is that one.

A fitted lens (:class:`~multihead.circuits.decompose.jacobian_lens.JacobianLens`,
:class:`~multihead.circuits.decompose.tuned_lens.TunedLens`) is a set of matrices for one
model: read on another model of the same shapes it gives numbers, only wrong ones. So each lens
records the model it was fitted for (its name, where the model's files came from, and the
transformers version that ran it) and compares them with the model it is read on. A difference
is one warning, never an error: a lens fitted on a model loaded from the Hub is rightly read on
the same model loaded from a local copy, and a transformers release rarely changes a forward.
Names are compared by their last path component, so ``"HuggingFaceTB/SmolLM2-135M"`` and a
local directory ``.../SmolLM2-135M`` are one model. Shapes that differ (the width, the layers)
are errors, each lens's own.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from multihead.holds_transformers import holds_transformers
from multihead.mapping import model_map

__all__ = ["LensProvenance"]


def _last_component(name: str) -> str:
    return name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


def _model_name(model: nn.Module, name: str | None) -> str | None:
    """The model's name as a lens records it: a Hub name as given; for files read from a
    local directory (what every multihead loader reads), the Hub name its Hugging Face cache
    folder spells (``models--org--name``), else the name the model was loaded by (a
    :class:`multihead.TextModel`'s ``name``: ``"smollm2"``), else None (not recorded, not
    compared): a directory of this machine names no model."""
    if name is None or not os.path.isabs(name):
        return name
    for part in Path(name).parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return "/".join(part.split("--")[1:])
    given = getattr(model, "name", None)
    return given if isinstance(given, str) and given else None


@dataclass(frozen=True)
class LensProvenance:
    """The model a lens is fitted for or read on, as a lens records it.

    Attributes:
        model_name: the model's own name (:attr:`multihead.ModelMap.name` when it is a Hub
            name; for a local directory the Hub name of its cache folder, else the name it was
            loaded by: :func:`_model_name`), or None when not known.
        transformers_version: the installed transformers version for a transformers model,
            None for any other model.
    """

    model_name: str | None
    transformers_version: str | None

    @classmethod
    def of(cls, model: nn.Module) -> LensProvenance:
        """What is known of ``model``: its map's name and, for a transformers model, the
        transformers version installed."""
        version = None
        if holds_transformers(model):
            version = importlib.metadata.version("transformers")
        return cls(_model_name(model, model_map(model).name), version)

    @classmethod
    def recorded(cls, metadata: Mapping[str, Any]) -> LensProvenance:
        """What a lens's metadata records: its ``model_name`` and ``transformers_version``
        (where they are strs)."""
        name, version = metadata.get("model_name"), metadata.get("transformers_version")
        return cls(
            name if isinstance(name, str) else None,
            version if isinstance(version, str) else None,
        )

    def differences(self, recorded: LensProvenance) -> list[str]:
        """How ``recorded`` (a lens's) differs from this model's, one phrase each; a field
        either side does not know is not compared."""
        found = []
        a, b = recorded.model_name, self.model_name
        if a and b and _last_component(a) != _last_component(b):
            found.append(f"it was fitted for model {a!r}, this model is {b!r}")
        a, b = recorded.transformers_version, self.transformers_version
        if a and b and a != b:
            found.append(f"it was fitted under transformers {a}, this is transformers {b}")
        return found

    @staticmethod
    def warn(what: str, differences: Sequence[str], stacklevel: int = 3) -> None:
        """One warning naming every difference (none: nothing)."""
        if differences:
            warnings.warn(
                f"{what} may not belong to this model: {'; '.join(differences)}",
                stacklevel=stacklevel,
            )
