"""Gemma Scope's files as SAELens reads them: :func:`gemma_scope_config` (an SAE's config from
its tensors' shapes and its path) and :func:`gemma_scope_names` (the file's tensor names ->
SAELens's).

Gemma Scope 1 (``params.npz``: ``W_enc (E, F)``, ``W_dec (F, E)``, ``b_enc``, ``b_dec``,
``threshold``) and Gemma Scope 2 (``params.safetensors``: the same in lower case, ``w_enc``,
``w_dec``, ..., and a transcoder's ``affine_skip_connection (E, O)``) hold JumpReLU SAEs and
transcoders without a config: as in sae_lens/loading/pretrained_sae_loaders.py
(``get_gemma_2_config_from_hf``, ``gemma_2_sae_huggingface_loader``, ``get_gemma_3_config_from_hf``,
``gemma_3_sae_huggingface_loader``) the sizes come from the shapes, ``apply_b_dec_to_input`` is
false, and the hook from the folder names: ``layer_<L>``, and for Gemma Scope 2 the folder
``resid_post`` / ``attn_out`` / ``mlp_out`` / ``transcoder`` (or ``clt``), for Gemma Scope 1 the
repository's folder (``gemma-scope-...-res``, ``-mlp``, ``-att``; ``embedding``). Where the path
does not say, the hook is unknown (None). Gemma Scope 1's embedding SAEs are rescaled by √E as
SAELens does.
"""

from __future__ import annotations

import re
from pathlib import Path

from multihead._files import TensorInfo
from multihead.sae.sae_config import SAEConfig

__all__ = ["gemma_scope_names", "gemma_scope_config", "EMBEDDING_RESCALED"]

# the metadata key saying an SAE's W_enc / W_dec were rescaled by √d_in (Gemma Scope 1's
# embedding SAEs, sae_lens gemma_2_sae_huggingface_loader)
EMBEDDING_RESCALED = "embedding_rescaled"
_LAYER = re.compile(r"layer_(\d+)(?:_|$)")
_SCOPE_1_REPO = re.compile(r"-(res|mlp|att)(?:-|$)")


def gemma_scope_names(file_names: list[str]) -> dict[str, str]:
    """SAELens's name of each of a file's tensors: ``w_enc`` -> ``W_enc``, ``affine_skip_
    connection`` -> ``W_skip`` (transposed when read), the rest as they are."""
    renamed = {}
    for name in file_names:
        if name == "affine_skip_connection":
            renamed[name] = "W_skip"
        else:
            renamed[name] = "W_" + name[2:] if name.startswith("w_") else name
    return renamed


def _hooks(path: Path, scope: int) -> tuple[str | None, str | None, str]:
    """The hook read and written (a transcoder's) and the reshape, from the folder names below
    the repository's (``gemma-scope...``; without one, the file's folder and its parent): the
    layer from a folder named ``layer_<L>...``, the kind from a folder named for it."""
    parts = [p.lower() for p in path.resolve().parent.parts]
    repo = max((i for i, p in enumerate(parts) if "gemma-scope" in p), default=None)
    below = parts[repo + 1 :] if repo is not None else parts[-2:]
    layers = [int(m[1]) for p in below for m in [_LAYER.match(p)] if m]
    if scope == 1 and repo is not None and "embedding" in below:
        return "hook_embed", None, "none"
    if not layers:
        return None, None, "none"
    layer = layers[-1]
    if scope == 2:
        for part in reversed(below):
            if part.startswith(("transcoder", "clt")):
                return f"blocks.{layer}.hook_mlp_in", f"blocks.{layer}.hook_mlp_out", "none"
            kinds = {"resid_post": "hook_resid_post", "attn_out": "attn.hook_z",
                     "mlp_out": "hook_mlp_out"}  # fmt: skip
            if part in kinds:
                return f"blocks.{layer}.{kinds[part]}", None, "none"
        return None, None, "none"
    match = _SCOPE_1_REPO.search(parts[repo]) if repo is not None else None
    if match:
        kinds = {"res": "hook_resid_post", "mlp": "hook_mlp_out", "att": "attn.hook_z"}
        # SAELens converts Gemma Scope 1's configs as pre-6.0 ones: hook_z reshapes
        reshape = "hook_z" if match[1] == "att" else "none"
        return f"blocks.{layer}.{kinds[match[1]]}", None, reshape
    return None, None, "none"


def gemma_scope_config(path: Path, shapes: dict[str, TensorInfo], scope: int) -> SAEConfig:
    """The config of Gemma Scope ``scope``'s (1 or 2) file at ``path`` holding tensors of
    ``shapes`` (SAELens's names). Its sizes: ``d_in, d_sae = W_enc.shape``, ``d_out =
    W_dec.shape[-1]``; a transcoder where the folders say so, ``W_dec`` writes another width
    or the file has a skip connection.

    Raises:
        ValueError: ``W_enc`` or ``W_dec`` missing or not 2-D (one line naming the file).
    """
    for name in ("W_enc", "W_dec"):
        info = shapes.get(name)
        if info is None or len(info.shape) != 2:
            found = "missing" if info is None else f"of shape {info.shape}"
            raise ValueError(
                f"{str(path)!r}: Gemma Scope's {name} must be a 2-D tensor (a cross-layer "
                f"transcoder's 3-D decoder is not supported), got {found}"
            )
    d_in, d_sae = shapes["W_enc"].shape
    d_out = shapes["W_dec"].shape[-1]
    hook_in, hook_out, reshape = _hooks(path, scope)
    transcoder = hook_out is not None or d_out != d_in or "W_skip" in shapes
    architecture = "jumprelu"
    if transcoder:
        architecture = "jumprelu_skip_transcoder" if "W_skip" in shapes else "jumprelu_transcoder"
    metadata: dict[str, object] = {"format": f"gemma_scope_{scope}"}
    if scope == 1 and hook_in == "hook_embed":
        metadata[EMBEDDING_RESCALED] = True
    return SAEConfig(
        architecture=architecture,
        d_in=d_in,
        d_sae=d_sae,
        d_out=d_out,
        apply_b_dec_to_input=False,
        reshape_activations=reshape,
        hook_name=hook_in,
        hook_name_out=hook_out,
        metadata=metadata,
    ).check(repr(str(path)))
