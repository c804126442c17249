"""What a run of a model kept: its activations by site and layer, read as TransformerLens does.

The sites and their names are :mod:`~multihead.circuits.runs.site_names`'s; :func:`~multihead.
circuits.runs.site_recorder.cache` (``multihead.cache``) records one run into an
:class:`ActivationCache`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from multihead._checks import describe, is_int
from multihead.circuits.runs.rotary_check import RotaryCheck
from multihead.circuits.runs.site_names import (
    MODEL_SITES,
    SITES,
    SiteKey,
    before_rotary,
    model_site_layer,
    rotary_refusal,
    site_of_hook_name,
)

__all__ = ["ActivationCache"]


class ActivationCache(Mapping[SiteKey, Tensor]):
    """What :func:`~multihead.cache` kept, read as ``cache["z", 3]`` (negative layers count from
    the end) or by TransformerLens's names, ``cache["blocks.3.attn.hook_z"]``.

    Attributes:
        positions: the token positions kept (T above is their count), or None for all.
        num_layers: L, the model's attention layers.
        absent: site -> why the model has no such site (e.g. ``attn_out`` of a post-LN block).
        rotary: the layers whose queries and keys turn by position: there TransformerLens's
            ``hook_q`` / ``hook_k`` (before the turn) are refused, ``hook_rot_q`` / ``hook_rot_k``
            are ``q`` / ``k`` (found when first asked: one more call of each attention module).
    """

    def __init__(
        self,
        values: dict[SiteKey, Tensor],
        *,
        positions: list[int] | None,
        num_layers: int,
        absent: dict[str, str],
        rotary: RotaryCheck | frozenset[int] = frozenset(),
    ) -> None:
        self._values = values
        self.positions = positions
        self.num_layers = num_layers
        self.absent = absent
        self._rotary = rotary

    @property
    def rotary(self) -> frozenset[int]:
        """The layers whose queries and keys turn by position (class docstring)."""
        if isinstance(self._rotary, RotaryCheck):  # asked for the first time: the replays now
            self._rotary = self._rotary.rotary()
        return self._rotary

    def _key(self, key: object) -> SiteKey:
        if isinstance(key, str):
            named = site_of_hook_name(key)
            if named is None:
                raise KeyError(
                    f"cache keys are (site, layer) pairs or TransformerLens hook names such as "
                    f"'blocks.0.hook_resid_pre', got {key!r}"
                )
            if before_rotary(key) and named[1] % max(1, self.num_layers) in self.rotary:
                raise KeyError(rotary_refusal(key, named[1] % self.num_layers))
            key = named
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and is_int(key[1]):
            site, layer = key[0], int(key[1])
            if site not in SITES:
                raise KeyError(f"site must be one of {', '.join(SITES)}, got {site!r}")
            if site in MODEL_SITES and layer != 0:
                raise KeyError(model_site_layer(site, layer))
            if not -self.num_layers <= layer < self.num_layers:
                raise KeyError(
                    f"layer must be in [{-self.num_layers}, {self.num_layers}), got {layer}"
                )
            return site, layer % self.num_layers
        raise KeyError(f"cache keys are (site, layer) pairs, got {describe(key)}")

    def __getitem__(self, key: object) -> Tensor:
        site, layer = self._key(key)
        if (site, layer) not in self._values:
            if site in self.absent:
                raise KeyError(f"{site} of layer {layer}: {self.absent[site]}")
            raise KeyError(f"{site} of layer {layer} was not kept: name it in cache(names=...)")
        return self._values[site, layer]

    def __iter__(self) -> Iterator[SiteKey]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        try:
            return self._key(key) in self._values
        except KeyError:
            return False

    def stack(self, site: str) -> Tensor:
        """Every kept layer of ``site`` stacked on a new first axis: (L', ...)."""
        layers = sorted(layer for s, layer in self._values if s == site)
        if not layers:
            self[site, 0]  # raises the reason
        return torch.stack([self._values[site, layer] for layer in layers])

    @property
    def nbytes(self) -> int:
        """The bytes the kept tensors hold."""
        return sum(v.numel() * v.element_size() for v in self._values.values())

    def __repr__(self) -> str:
        sites = sorted({s for s, _ in self._values}, key=SITES.index)
        return (
            f"ActivationCache({len(self)} tensors: {', '.join(sites)}; "
            f"{self.nbytes / 2**20:.1f} MiB)"
        )
