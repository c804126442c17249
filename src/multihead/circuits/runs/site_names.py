"""The sites a run's activations are kept at, their names, and how names and positions choose them.

Sites, per layer l (the l-th attention site, the block holding it):

    resid_pre    (B, T, E)      the residual stream entering block l
    attn_out     (B, T, E)      what block l's attention adds to it
    resid_mid    (B, T, E)      resid_pre + attn_out: what block l's feed-forward reads from
    mlp_out      (B, T, E)      what block l's feed-forward adds
    resid_post   (B, T, E)      the stream leaving block l (= resid_pre of block l + 1)
    q            (B, T, H, D)   queries, per head, as the kernel sees them (after rotary)
    k, v         (B, T, Hk, D)  keys and values, per key/value head (Hk < H: grouped-query)
    z            (B, T, H, Dv)  each head's output before the output projection
    result       (B, T, H, E)   z times the head's slice of the output projection (no bias)
    pattern      (B, H, P, S)   softmax weights of the kept query rows (only when named)
    attn_scores  (B, H, P, S)   their scores before the softmax: scaled (softcapped) q·k, the
                                mask added, -inf at every key the row may not see (only when
                                named)
    ln1_scale    (B, T, 1)      the scale of the norm the attention reads: σ (LayerNorm) or rms
    ln2_scale    (B, T, 1)      ... of the norm the feed-forward network reads
    mlp_pre      (B, T, F)      the feed-forward's hidden pre-activations (a gated one's gate)
    mlp_post     (B, T, F)      its hidden activations, what its output projection reads

and of the whole model (keyed at layer 0: ``cache["embed"]`` or ``cache["embed", 0]``):

    embed        (B, T, E)      the token embedding's output
    pos_embed    (B, T, E)      the position table's, where the model has one (not rotary)
    final_scale  (B, T, 1)      the scale of the final norm

The names, and the keys ``"blocks.{l}.hook_resid_pre"``, ``"blocks.{l}.attn.hook_z"``,
``"blocks.{l}.ln1.hook_scale"``, ``"blocks.{l}.mlp.hook_pre"``, ``"hook_embed"``,
``"ln_final.hook_scale"`` and so on, are TransformerLens's (``run_with_cache``; ln1 and ln2 are
the norms the attention and the feed-forward network read, found on the run:
:mod:`~multihead.circuits.runs.norm_reads`), with one difference on rotary models: multihead's q
and k are what the kernel reads, after rotary positions, TransformerLens's ``hook_rot_q`` and
``hook_rot_k`` (accepted as names too, as is ``hook_mlp_in``, its copy of ``resid_mid``),
where its ``hook_q`` and ``hook_k`` are before: on a
layer that turns them (found on the run: :class:`~multihead.circuits.runs.rotary_check.
RotaryCheck`) those two names are refused, naming the ones to use.
``attn_out``, ``resid_mid`` and ``mlp_out`` exist where the block is a sum, ``resid_post =
resid_pre + attn_out + mlp_out`` (pre-LN blocks; checked on the run); a post-LN block (BERT) has
no such decomposition and a lookup says so, and a parallel block (GPT-J, GPT-NeoX with
``use_parallel_residual``, Phi: its feed-forward network reads resid_pre, found on the run) has
no ``resid_mid``.

:func:`chosen_sites` reads what a caller names (a site, ``(site, layer)`` pairs, hook names or a
predicate), :func:`chosen_positions` the positions it keeps; :class:`~multihead.circuits.runs.
activation_cache.ActivationCache` is what is kept, :class:`~multihead.circuits.runs.
site_recorder.SiteRecorder` records it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Union

from torch import Tensor

from multihead._checks import describe, is_int

__all__ = [
    "SITES",
    "RESIDUAL_SITES",
    "HEAD_SITES",
    "LAYER_SITES",
    "MODEL_SITES",
    "NORM_SITES",
    "MLP_SITES",
    "ROW_SITES",
    "SUM_SITES",
    "SiteKey",
    "Names",
    "hook_name",
    "site_of_hook_name",
    "before_rotary",
    "rotary_refusal",
    "model_site_layer",
    "site_label",
    "chosen_sites",
    "is_site_key",
    "chosen_positions",
]

RESIDUAL_SITES = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
HEAD_SITES = ("q", "k", "v", "z", "result")
NORM_SITES = ("ln1_scale", "ln2_scale")
MLP_SITES = ("mlp_pre", "mlp_post")
# one activation of the whole model each, keyed at layer 0
MODEL_SITES = ("embed", "pos_embed", "final_scale")
# the (B, H, P, S) sites, kept only when named
ROW_SITES = ("pattern", "attn_scores")
SITES = (*RESIDUAL_SITES, *HEAD_SITES, *ROW_SITES, *NORM_SITES, *MLP_SITES, *MODEL_SITES)
# the sites with one activation per layer (no heads): patched per layer
LAYER_SITES = (*RESIDUAL_SITES, *NORM_SITES, *MLP_SITES, *MODEL_SITES)
# the sites of the block's sum, defined only where resid_post = resid_pre + attn_out + mlp_out
SUM_SITES = ("attn_out", "resid_mid", "mlp_out")

# A site of one layer: ("z", 3). Names select: a site ("z": every layer), a key ("z", 3), a
# TransformerLens hook name, or a predicate on (site, layer).
SiteKey = tuple[str, int]
Names = Union[str, SiteKey, Sequence[Union[str, SiteKey]], Callable[[str, int], bool], None]  # noqa: UP007

_TL_NAME = re.compile(r"blocks\.(\d+)\.(.+)")
# TransformerLens's name of each site within block l, ``blocks.{l}.<this>``, and of the model's
_IN_BLOCK = {
    **{f"hook_{site}": site for site in RESIDUAL_SITES},
    **{f"attn.hook_{site}": site for site in (*HEAD_SITES, *ROW_SITES)},
    "ln1.hook_scale": "ln1_scale",
    "ln2.hook_scale": "ln2_scale",
    "mlp.hook_pre": "mlp_pre",
    "mlp.hook_post": "mlp_post",
    # its names for q and k after rotary positions, which multihead's q and k are
    "attn.hook_rot_q": "q",
    "attn.hook_rot_k": "k",
    # its copy of resid_mid that the feed-forward network's norm reads (use_hook_mlp_in: the
    # hook SAELens's transcoders read)
    "hook_mlp_in": "resid_mid",
}
_OF_MODEL = {
    "hook_embed": "embed",
    "hook_pos_embed": "pos_embed",
    "ln_final.hook_scale": "final_scale",
}


def site_of_hook_name(name: str) -> SiteKey | None:
    """``"blocks.3.attn.hook_z"`` -> ``("z", 3)`` (``hook_rot_q`` -> ``q``), ``"hook_embed"``
    (or ``"embed"``) -> ``("embed", 0)``; None otherwise."""
    if name in _OF_MODEL or name in MODEL_SITES:
        return _OF_MODEL.get(name, name), 0
    match = _TL_NAME.fullmatch(name)
    site = _IN_BLOCK.get(match[2]) if match is not None else None
    return (site, int(match[1])) if match is not None and site is not None else None


def before_rotary(name: object) -> bool:
    """Whether ``name`` is TransformerLens's ``hook_q`` or ``hook_k``: on a rotary model the
    queries or keys before the rotation, which multihead does not keep."""
    match = _TL_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match[2] in ("attn.hook_q", "attn.hook_k")


def rotary_refusal(name: str, layer: int) -> str:
    after = name.replace(".hook_q", ".hook_rot_q").replace(".hook_k", ".hook_rot_k")
    site = "q" if name.endswith("hook_q") else "k"
    return (
        f"{name!r}: layer {layer} turns its queries and keys by position (rotary), and "
        f"TransformerLens's {name.rsplit('.', 1)[-1]} is before the turn, which multihead does "
        f"not keep; multihead's {site} is after it: {after!r} or ({site!r}, {layer})"
    )


def hook_name(site: str, layer: int) -> str:
    """TransformerLens's name of a site: ``hook_name("z", 3) == "blocks.3.attn.hook_z"``,
    ``hook_name("ln2_scale", 0) == "blocks.0.ln2.hook_scale"``, ``hook_name("embed", 0) ==
    "hook_embed"``."""
    if site in MODEL_SITES:
        return next(name for name, s in _OF_MODEL.items() if s == site)
    return f"blocks.{layer}." + next(name for name, s in _IN_BLOCK.items() if s == site)


def model_site_layer(site: str, layer: int) -> str:
    """Why a site of the whole model has no ``layer`` but 0."""
    return (
        f"{site} is one activation of the whole model, keyed at layer 0: ({site!r}, 0), got "
        f"layer {layer}"
    )


def chosen_sites(names: Names, num_layers: int) -> set[SiteKey]:
    """The (site, layer) keys ``names`` selects (see :func:`~multihead.cache`)."""
    every = [
        (s, layer)
        for layer in range(num_layers)
        for s in SITES
        if s not in MODEL_SITES or layer == 0
    ]
    if names is None:
        return {(s, layer) for s, layer in every if s not in ROW_SITES}
    if callable(names):
        return {(s, layer) for s, layer in every if names(s, layer)}
    items: Sequence[object] = (
        [names] if isinstance(names, str) or (isinstance(names, tuple) and is_site_key(names))
        else names
    )  # fmt: skip
    if not isinstance(items, Sequence) or isinstance(items, bytes):
        raise TypeError(
            f"names must be a site, (site, layer) pairs, TransformerLens hook names or a "
            f"predicate (site, layer) -> bool, got {describe(names)}"
        )
    chosen: set[SiteKey] = set()
    for item in items:
        if isinstance(item, str) and item in SITES:
            count = 1 if item in MODEL_SITES else num_layers
            chosen.update((item, layer) for layer in range(count))
            continue
        if isinstance(item, str) and (named := site_of_hook_name(item)) is not None:
            item = named
        if not (isinstance(item, tuple) and is_site_key(item)):
            raise ValueError(
                f"names items must be one of {', '.join(SITES)}, a (site, layer) pair or a "
                f"TransformerLens hook name, got {item!r}"
            )
        site, layer = item
        if site in MODEL_SITES and layer != 0:
            raise ValueError(f"names: {model_site_layer(site, layer)}")
        if not -num_layers <= layer < num_layers:
            raise ValueError(
                f"names: layer of {item!r} must be in [{-num_layers}, {num_layers}), got {layer}"
            )
        chosen.add((site, layer % num_layers))
    return chosen


def is_site_key(value: tuple[Any, ...]) -> bool:
    """Whether ``value`` is a ``(site, layer)`` pair: a site name and an int."""
    return len(value) == 2 and value[0] in SITES and is_int(value[1])


def chosen_positions(positions: object, t: int) -> list[int] | None:
    if positions is None:
        return None
    if is_int(positions):
        positions = [positions]
    if isinstance(positions, slice):
        chosen = list(range(t))[positions]
        if not chosen:
            raise ValueError(f"positions {positions} names none of the {t} positions")
        return chosen
    if isinstance(positions, Tensor) and not positions.is_floating_point():
        positions = positions.flatten().tolist()
    if not isinstance(positions, Sequence) or not all(is_int(p) for p in positions):
        raise TypeError(
            f"positions must be None, an int, ints or a slice, got {describe(positions)}"
        )
    if not len(positions):
        raise ValueError(
            f"positions must name at least one position, got none of the {t} positions"
        )
    out = []
    for p in positions:
        if not -t <= int(p) < t:
            raise ValueError(f"positions must be in [{-t}, {t}) for {t} tokens, got {p}")
        out.append(int(p) % t)
    return out


def site_label(site: str, layer: int) -> str:
    """How a message names a site: ``"z of layer 3"``, ``"embed"`` (a site of the model)."""
    return site if site in MODEL_SITES else f"{site} of layer {layer}"
