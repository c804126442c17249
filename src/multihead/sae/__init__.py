"""Sparse autoencoders and transcoders read from their files: :func:`load` -> :class:`SAE`.

``multihead.sae.load(path)`` reads a SAELens directory (``cfg.json`` + ``sae_weights.safetensors``)
or a Gemma Scope file (``params.npz``, ``params.safetensors``) without SAELens or TransformerLens,
header first and never a pickle; ``sae.encode(x)`` and ``sae.decode(f)`` compute SAELens's
formulas, and ``sae.site`` names the activation it reads by multihead's ``(site, layer)``.
"""

from __future__ import annotations

from multihead.sae.loading import load
from multihead.sae.sae import SAE
from multihead.sae.sae_config import SAEConfig

__all__ = ["load", "SAE", "SAEConfig"]
