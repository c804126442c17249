"""The features a sparse autoencoder finds in one run of a model: :func:`sae_features`.

The SAE names the activation it reads by TransformerLens's hook name (``sae.site``:
``("z", 5)`` for ``"blocks.5.attn.hook_z"``); the model is run once through the engine's cache
(:func:`~multihead.circuits.runs.site_recorder.cache`) with that one site kept at the positions
asked for, and the SAE encodes it.

Shapes: B batch, T tokens, P kept positions, H heads, Dv a head's output width, E the residual
width, F the SAE's features.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_index, describe, is_int
from multihead.circuits.runs.site_names import (
    MODEL_SITES,
    SiteKey,
    site_label,
)
from multihead.circuits.runs.site_recorder import cache
from multihead.mapping import model_heads
from multihead.sae.sae import SAE

__all__ = ["sae_features", "sae_site", "sae_input", "site_features", "cache_name"]


def sae_site(model: nn.Module, sae: SAE, layer: int | None, caller: str) -> SiteKey:
    """The ``(site, layer)`` of ``model`` that ``sae`` reads: its hook's, at ``layer`` when
    given (negative from the end).

    Raises:
        TypeError: ``sae`` is not an SAE, ``layer`` not an int.
        ValueError: the SAE's hook has no multihead site (or the files name none), ``layer``
            out of range, a layer other than 0 for a site of the whole model.
    """
    if not isinstance(sae, SAE):
        raise TypeError(
            f"{caller}: sae must be a multihead.sae.SAE (multihead.sae.load(path)), got "
            f"{describe(sae)}"
        )
    try:
        site, own = sae.require_site()
    except ValueError as e:
        raise ValueError(f"{caller}: sae: {e}") from None
    num_layers = len(model_heads(model))
    if layer is None:
        if site not in MODEL_SITES and not own < num_layers:
            raise ValueError(
                f"{caller}: the SAE reads {sae.hook_name!r}, layer {own}, and the model has "
                f"{num_layers} attention layers (0..{num_layers - 1})"
                + ("" if caller == "feature_sources" else ": pass layer= to read another")
            )
        return site, own
    if not is_int(layer):
        raise TypeError(f"{caller}: layer must be an int or None, got {describe(layer)}")
    if site in MODEL_SITES:
        if layer != 0:
            raise ValueError(
                f"{caller}: layer: the SAE reads {site}, one activation of the whole model "
                f"(layer 0), got layer {layer}"
            )
        return site, 0
    return site, check_index(f"{caller}: layer", layer, num_layers, "attention layers")


def cache_name(sae: SAE, key: SiteKey) -> str | SiteKey:
    """What the cache is asked for to read ``key`` (:func:`sae_site`) for ``sae``: the SAE's
    own hook name at the key's layer, so that a name the cache refuses is refused as named
    (TransformerLens's ``hook_q`` of a rotary layer: before the turn, which multihead does not
    keep); the key itself for a site of the whole model."""
    match = re.fullmatch(r"blocks\.\d+\.(.+)", sae.hook_name or "")
    return f"blocks.{key[1]}.{match[1]}" if match else key


def sae_input(sae: SAE, key: SiteKey, activation: Tensor, caller: str) -> Tensor:
    """``activation`` of the site ``key`` (B, P, ...) as the SAE reads it: (B, P, E) (a z
    site's heads flattened to H·Dv, or its one head where the SAE reads one,
    ``hook_head_index``).

    Raises:
        ValueError: its width differs from ``sae.d_in`` (both named), or the head the SAE
            reads is not one of the site's.
    """
    site, layer = key
    x = activation
    if site in ("q", "k", "v", "z") and x.dim() == 4:  # (B, P, H, D): per head
        head = sae.hook_head_index
        if head is not None:
            x = x[:, :, check_index(f"{caller}: sae.hook_head_index", head, x.shape[2], "heads")]
        else:
            x = x.flatten(2)  # (B, P, H·D), TransformerLens's hook_z order: head-major
    if x.shape[-1] != sae.d_in:
        shape = tuple(activation.shape[2:])
        raise ValueError(
            f"{caller}: the SAE reads {sae.d_in} values per position (d_in), and "
            f"{site_label(site, layer)} of the model has {x.shape[-1]} (its shape per "
            f"position: {shape}): the SAE is of another model, or of another site"
        )
    return x


@torch.no_grad()
def sae_features(
    model: nn.Module,
    inputs: Any,
    sae: SAE,
    *,
    layer: int | None = None,
    positions: int | Sequence[int] | slice | Tensor | None = None,
) -> Tensor:
    """The SAE's features of the activation it reads, from one forward of the model.

    ``sae.encode(x)`` of ``x`` the site ``sae.site`` names (a transcoder: its input site): a
    ``z`` SAE reads the heads' outputs before the output projection, (B, T, H, Dv) flattened
    head-major to H·Dv (TransformerLens's ``hook_z``, as the SAE's ``reshape_activations``
    says), or the one head of ``hook_head_index``; ``attn_out`` and the residual sites are
    (B, T, E). Only the positions asked for are kept, cut before anything is stored. Over a
    corpus (in batches, with progress, shared over torchrun's ranks), the same features are
    written to shards by ``multihead.cache_corpus(text_model, texts, out_dir, saes=sae)``.

    Args:
        model: multihead's models or a transformers model (through :mod:`multihead.hf`).
        inputs: token ids (B, T), a dict of the model's keyword arguments, or for a
            :class:`multihead.TextModel` a text or texts.
        sae: a :class:`multihead.sae.SAE` (:func:`multihead.sae.load`).
        layer: read this layer's site instead of the one the SAE's hook names (negative from
            the end); default the hook's.
        positions: the token positions to encode (an int, ints, a slice; negative from the
            end); default all.

    Returns:
        (B, P, F) the features, in the SAE's dtype (P = T without ``positions``).

    Raises:
        ValueError: an SAE whose hook multihead has no site for (or whose files name no
            hook), a width of the site other than ``sae.d_in``, ``layer`` or ``positions``
            out of range, a site the model does not have (the cache's reason).
        TypeError: ``sae`` that is not an SAE, ``layer`` not an int.

    Example:
        >>> sae = multihead.sae.load("saes/blocks.5.attn.hook_z")
        >>> sae_features(model, ids, sae, positions=[-1]).shape  # (B, 1, F)
    """
    key = sae_site(model, sae, layer, "sae_features")
    recorded = cache(model, inputs, names=[cache_name(sae, key)], positions=positions)
    return site_features(sae, key, recorded[key], "sae_features")


def site_features(sae: SAE, key: SiteKey, activation: Tensor, caller: str) -> Tensor:
    """``sae.encode`` of ``activation`` of the site ``key`` (B, P, ...): (B, P, F) on the SAE's
    device, in its dtype.

    Raises:
        ValueError: as :func:`sae_input`.
    """
    x = sae_input(sae, key, activation, caller).to(sae.device)
    # a hook_z SAE flattens its input's last two dims itself: (B, P, 1, E) flattens to E
    return sae.encode(x[:, :, None] if sae.reshape_activations == "hook_z" else x)
