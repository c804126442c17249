"""A named cache of a model's activations: the residual stream and every head, from one forward.

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
``hook_rot_k`` (accepted as names too), where its ``hook_q`` and ``hook_k`` are before: on a
layer that turns them (found on the run: :class:`~multihead.circuits.runs.rotary_check.
RotaryCheck`) those two names are refused, naming the ones to use.
``attn_out``, ``resid_mid`` and ``mlp_out`` exist where the block is a sum, ``resid_post =
resid_pre + attn_out + mlp_out`` (pre-LN blocks; checked on the run); a post-LN block (BERT) has
no such decomposition and a lookup says so, and a parallel block (GPT-J, GPT-NeoX with
``use_parallel_residual``, Phi: its feed-forward network reads resid_pre, found on the run) has
no ``resid_mid``.

One forward (:class:`SiteRecorder` records it: any run can be recorded), with forward hooks on the
map's blocks, attention, feed-forward modules, norms and embeddings (:func:`multihead.model_map`)
and observers on the attention sites; nothing is stored that was not asked for, and
``positions`` are cut before anything is kept.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import Tensor, nn

from multihead._checks import describe, is_int
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.input_pair import model_inputs, run_model
from multihead.circuits.runs.norm_reads import NormRead, NormReads
from multihead.circuits.runs.rotary_check import RotaryCheck
from multihead.circuits.runs.wiring import WiringRun
from multihead.map_types import Block, ModelMap, output_tensor
from multihead.mapping import model_heads, model_map
from multihead.observe.recorder import capture
from multihead.observe.rows import row_scores
from multihead.observers import AttentionCall, Removable, registered

__all__ = [
    "SITES",
    "RESIDUAL_SITES",
    "HEAD_SITES",
    "LAYER_SITES",
    "MODEL_SITES",
    "NORM_SITES",
    "MLP_SITES",
    "ROW_SITES",
    "ActivationCache",
    "cache",
    "SiteRecorder",
    "head_writes",
    "hook_name",
    "projection_rows",
    "stack_block",
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
_SUM_SITES = ("attn_out", "resid_mid", "mlp_out")

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
}
_OF_MODEL = {
    "hook_embed": "embed",
    "hook_pos_embed": "pos_embed",
    "ln_final.hook_scale": "final_scale",
}


def _from_hook_name(name: str) -> SiteKey | None:
    """``"blocks.3.attn.hook_z"`` -> ``("z", 3)`` (``hook_rot_q`` -> ``q``), ``"hook_embed"``
    (or ``"embed"``) -> ``("embed", 0)``; None otherwise."""
    if name in _OF_MODEL or name in MODEL_SITES:
        return _OF_MODEL.get(name, name), 0
    match = _TL_NAME.fullmatch(name)
    site = _IN_BLOCK.get(match[2]) if match is not None else None
    return (site, int(match[1])) if match is not None and site is not None else None


def _before_rotary(name: object) -> bool:
    """Whether ``name`` is TransformerLens's ``hook_q`` or ``hook_k``: on a rotary model the
    queries or keys before the rotation, which multihead does not keep."""
    match = _TL_NAME.fullmatch(name) if isinstance(name, str) else None
    return match is not None and match[2] in ("attn.hook_q", "attn.hook_k")


def _rotary_refusal(name: str, layer: int) -> str:
    after = name.replace(".hook_q", ".hook_rot_q").replace(".hook_k", ".hook_rot_k")
    site = "q" if name.endswith("hook_q") else "k"
    return (
        f"{name!r}: layer {layer} turns its queries and keys by position (rotary), and "
        f"TransformerLens's {name.rsplit('.', 1)[-1]} is before the turn, which multihead does "
        f"not keep; multihead's {site} is after it: {after!r} or ({site!r}, {layer})"
    )


def stack_block(mapped: ModelMap, layer: int, what: str) -> Block:
    """The block holding attention layer ``layer`` alone, or a ValueError naming ``what`` needs
    it (the residual sites are a stack's: one attention layer per block)."""
    block = mapped.block_of(layer)
    if block is None or len(block.sites) != 1:
        raise ValueError(
            f"{what} needs one attention layer per block of a stack; the map of "
            f"{mapped.family} has no block holding layer {layer} alone"
        )
    return block


def hook_name(site: str, layer: int) -> str:
    """TransformerLens's name of a site: ``hook_name("z", 3) == "blocks.3.attn.hook_z"``,
    ``hook_name("ln2_scale", 0) == "blocks.0.ln2.hook_scale"``, ``hook_name("embed", 0) ==
    "hook_embed"``."""
    if site in MODEL_SITES:
        return next(name for name, s in _OF_MODEL.items() if s == site)
    return f"blocks.{layer}." + next(name for name, s in _IN_BLOCK.items() if s == site)


class ActivationCache(Mapping[SiteKey, Tensor]):
    """What :func:`cache` kept, read as ``cache["z", 3]`` (negative layers count from the end)
    or by TransformerLens's names, ``cache["blocks.3.attn.hook_z"]``.

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
            named = _from_hook_name(key)
            if named is None:
                raise KeyError(
                    f"cache keys are (site, layer) pairs or TransformerLens hook names such as "
                    f"'blocks.0.hook_resid_pre', got {key!r}"
                )
            if _before_rotary(key) and named[1] % max(1, self.num_layers) in self.rotary:
                raise KeyError(_rotary_refusal(key, named[1] % self.num_layers))
            key = named
        if isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str) and is_int(key[1]):
            site, layer = key[0], int(key[1])
            if site not in SITES:
                raise KeyError(f"site must be one of {', '.join(SITES)}, got {site!r}")
            if site in MODEL_SITES and layer != 0:
                raise KeyError(_model_site_layer(site, layer))
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


def _model_site_layer(site: str, layer: int) -> str:
    return (
        f"{site} is one activation of the whole model, keyed at layer 0: ({site!r}, 0), got "
        f"layer {layer}"
    )


def _wanted(names: Names, num_layers: int) -> set[SiteKey]:
    """The (site, layer) keys ``names`` selects (see :func:`cache`)."""
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
        if isinstance(item, str) and (named := _from_hook_name(item)) is not None:
            item = named
        if not (isinstance(item, tuple) and is_site_key(item)):
            raise ValueError(
                f"names items must be one of {', '.join(SITES)}, a (site, layer) pair or a "
                f"TransformerLens hook name, got {item!r}"
            )
        site, layer = item
        if site in MODEL_SITES and layer != 0:
            raise ValueError(f"names: {_model_site_layer(site, layer)}")
        if not -num_layers <= layer < num_layers:
            raise ValueError(
                f"names: layer of {item!r} must be in [{-num_layers}, {num_layers}), got {layer}"
            )
        chosen.add((site, layer % num_layers))
    return chosen


def is_site_key(value: tuple[Any, ...]) -> bool:
    """Whether ``value`` is a ``(site, layer)`` pair: a site name and an int."""
    return len(value) == 2 and value[0] in SITES and is_int(value[1])


def _positions(positions: object, t: int) -> list[int] | None:
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


@torch.no_grad()
def cache(
    model: nn.Module,
    inputs: Any,
    *,
    names: Names = None,
    positions: int | Sequence[int] | slice | Tensor | None = None,
    device: torch.device | str | None = None,
) -> ActivationCache:
    """Run the model once and keep the activations named (see the module docstring's sites).

    Args:
        model: multihead's models, any module of multihead's blocks, or a transformers model
            (through :mod:`multihead.hf`); left as it was.
        inputs: token ids (B, T), a dict of the model's keyword arguments, or for a
            :class:`multihead.TextModel` a text or texts.
        names: what to keep: a site (``"resid_pre"``: every layer), ``(site, layer)`` pairs,
            TransformerLens hook names (``"blocks.0.attn.hook_z"``), a list of these, or a
            predicate ``f(site, layer) -> bool`` (which keeps the sites chosen that the model
            has). Default every site but ``pattern`` and ``attn_scores`` (whose (B, H, T, T)
            are kept only when named).
        positions: the token positions to keep (an int, ints, a slice; negative from the
            end), cut before anything is stored; ``pattern`` keeps these query rows and every
            key. Default all.
        device: where to keep the tensors (``"cpu"`` to move them off an accelerator);
            default where they were computed.

    Returns:
        An :class:`ActivationCache`: ``cache["resid_pre", 0]`` (B, T, E) and so on.

    Raises:
        ValueError: names or positions out of range, a model site (``embed``) at a layer
            other than 0, a site named outright (not by a predicate) that the model does not
            have, its reason named: a sum site (``attn_out``, ``resid_mid``, ``mlp_out``) of a
            post-LN or parallel block, ``pos_embed`` of a model without a position table,
            ``ln1_scale`` of a post-LN block, ``ln2_scale`` of a block whose one norm feeds
            both, ``mlp_pre`` of a mixture of experts, ``attn_scores`` under a score_mod, a
            residual site of a model whose map knows no blocks.
        TypeError: names or positions of another kind.

    Example:
        >>> c = multihead.cache(lm, ids, names=["resid_post", ("z", 1)])
        >>> c["resid_post", -1].shape, c["blocks.1.attn.hook_z"].shape
    """
    checked = model_inputs(model, inputs)
    recorder = SiteRecorder(model, checked, names=names, positions=positions, device=device)
    with recorder.recording():
        run_model(model, checked)
    return recorder.result()


@dataclass
class _Fed:
    """One block's tensors in a run, for telling a parallel block by identity: its stream
    argument, what its feed-forward network was given, each norm's (input, output)."""

    block: Any = None
    mlp: Any = None
    norms: list[tuple[Any, Any]] = field(default_factory=list)


class SiteRecorder:
    """What :func:`cache` keeps, recorded around one run of the model (any run: the
    experiment's recorded runs are :func:`cache`'s too).

    Built with the names checked (nothing is registered yet); :meth:`recording` holds the
    hooks and observers during the forward; :meth:`result` is the cache. One recorder serves
    one run.

    Args:
        model: the model, as for :func:`cache`.
        inputs: the run's inputs, checked
            (:func:`~multihead.circuits.runs.input_pair.model_inputs`): a padded batch's
            attention mask tells a packed run's real tokens.
        names, positions, device: as for :func:`cache`.

    Raises:
        ValueError, TypeError: as :func:`cache`, for names (at once) and positions (at the
            run, once its length is known).
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: Any,
        *,
        names: Names = None,
        positions: int | Sequence[int] | slice | Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.model = model
        found = model_heads(model)
        self.found = found
        mapped = self.mapped = model_map(model)
        num_layers = self.num_layers = len(found)
        mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
        # a model that packs a padded batch (multihead's BERT) runs its blocks on (N, E), the
        # real tokens in row-major order: kept as (B, T, E) with zeros at padding
        real = mask.bool() if isinstance(mask, Tensor) and mask.dim() == 2 else None
        self.real = real
        self.packed = int(real.sum()) if real is not None and not bool(real.all()) else None
        wanted = _wanted(names, num_layers)
        # a site named outright that the model lacks is an error; a predicate keeps what it has
        self.explicit = names is not None and not callable(names)
        self.blocks = [mapped.block_of(layer) for layer in range(num_layers)]
        residual_layers = sorted({layer for s, layer in wanted if s in RESIDUAL_SITES})
        for layer in residual_layers:
            block = self.blocks[layer]
            if block is None or len(block.sites) != 1:
                if self.explicit:
                    raise ValueError(
                        f"the residual sites need one attention layer per block of a stack; the "
                        f"map of {mapped.family} has no block holding layer {layer} alone"
                    )
                wanted = {(s, la) for s, la in wanted if s not in RESIDUAL_SITES}
                break
        self.wanted = wanted
        self.positions = positions
        self.device = device
        self.kept: dict[SiteKey, Tensor] = {}
        self.seen: dict[SiteKey, Tensor] = {}  # what the sum check needs beyond what is kept
        self.where: list[list[int] | None] = []  # the positions, once the run has told T
        self.needs_sum = {layer for s, layer in wanted if s in _SUM_SITES}
        padded = real if self.packed is not None else None
        self.wiring = WiringRun(mapped, real=padded) if self._wants_result() else None
        self.pattern_layers = sorted({layer for s, layer in wanted if s == "pattern"})
        self.patterns: list[Any] = []
        # per layer whose resid_mid is named: the block's stream argument, what its feed-forward
        # network was given, and each norm's (input, output) — the tensors themselves, to tell
        # a parallel block (its feed-forward reads resid_pre) by identity
        self.mid_layers = {layer for s, layer in wanted if s == "resid_mid"}
        # TransformerLens's names before rotary, asked for by name: refused on rotary layers
        items = [names] if isinstance(names, str) else names
        self.before_rotary: list[tuple[str, int]] = [
            (item, key[1] % num_layers)
            for item in (items if isinstance(items, Sequence) else ())
            if isinstance(item, str)
            and _before_rotary(item)
            and (key := _from_hook_name(item)) is not None
        ]
        self.rotary_check = RotaryCheck(mapped, {layer for s, layer in wanted if s in ("q", "k")})
        self.fed: dict[int, _Fed] = {layer: _Fed() for layer in self.mid_layers}
        # a named site this run cannot give, and why (raised when named, else left absent)
        self.missing: dict[SiteKey, str] = {}
        self.norm_reads: dict[int, NormReads] = {}
        self.mlp_parts: list[tuple[SiteKey, nn.Module]] = []
        for site, layer in sorted(k for k in wanted if k[0] in (*NORM_SITES, *MLP_SITES)):
            block = self.blocks[layer]
            if block is None or len(block.sites) != 1:
                self.missing[site, layer] = (
                    f"the map of {mapped.family} has no block holding layer {layer} alone"
                )
            elif site in NORM_SITES:
                reads = self.norm_reads.setdefault(layer, NormReads(mapped, block, set()))
                reads.roles.add(site.removesuffix("_scale"))
            elif (part := block.mlp_in if site == "mlp_pre" else block.mlp_down) is not None:
                self.mlp_parts.append(((site, layer), part))
            else:
                self.missing[site, layer] = (
                    f"the map of {mapped.family} does not know block {layer}'s feed-forward "
                    f"layers (none, or a mixture of experts)"
                )
        self.token_shape: torch.Size | None = None  # the token embedding's output, for pos_embed
        self.final: tuple[Tensor, Tensor] | None = None  # the final norm's (input, output)

    def keep(self, key: SiteKey, value: Tensor, axis: int = 1) -> None:
        value = value.detach()
        if self.packed is not None and self.real is not None and value.dim() == 2:
            # a packed run's (N, E): back to (B, T, E) before positions count its tokens
            value = _unpacked(value, self.real)
        if not self.where:
            self.where.append(_positions(self.positions, value.shape[axis]))
        chosen = self.where[0]
        if chosen is not None:
            value = value.index_select(axis, torch.tensor(chosen, device=value.device))
        self.kept[key] = value if self.device is None else value.to(self.device)

    def _on_block(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            x = self.mapped.stream_of(args, kwargs)
            y = output_tensor(out)
            if layer in self.fed:
                self.fed[layer].block = x
            for site, value in (("resid_pre", x), ("resid_post", y)):
                if (site, layer) in self.wanted:
                    self.keep((site, layer), value)
                if layer in self.needs_sum:
                    self.seen[site, layer] = value.detach()

        return hook

    def _on_part(self, site: str, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self.seen[site, layer] = output_tensor(out).detach()

        return hook

    def _on_output(self, key: SiteKey) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self.keep(key, output_tensor(out))

        return hook

    def _on_input(self, key: SiteKey) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
            self.keep(key, args[0])

        return hook

    def _on_embeddings(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.token_shape = output_tensor(out).shape
        if ("embed", 0) in self.wanted:
            self.keep(("embed", 0), output_tensor(out))

    def _on_positions(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        self.seen["pos_embed", 0] = output_tensor(out).detach()  # broadcast at the result

    def _on_final_norm(self, m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        if args:
            self.final = (args[0].detach(), output_tensor(out).detach())

    def _keep_scores(self, layer: int, call: AttentionCall) -> None:
        """``attn_scores`` of ``layer``: the kept query rows' scores (B, H, P, S)."""
        if self.packed is not None:
            self.missing["attn_scores", layer] = (
                "the model packs this padded batch's tokens into one sequence: give its "
                "sequences unpadded, or one at a time"
            )
            return
        t = call.q.shape[2]
        if not self.where:
            self.where.append(_positions(self.positions, t))
        chosen = self.where[0]
        rows = torch.tensor(range(t) if chosen is None else chosen, device=call.q.device)
        try:
            scores = row_scores(call, rows)
        except ValueError as e:
            self.missing["attn_scores", layer] = str(e)
            return
        self.kept["attn_scores", layer] = scores if self.device is None else scores.to(self.device)

    def _on_heads(self, layer: int) -> Callable[[AttentionCall, Tensor], None]:
        def observer(call: AttentionCall, out: Tensor) -> None:
            if ("attn_scores", layer) in self.wanted:
                self._keep_scores(layer, call)
            for site, value in (
                ("z", out),
                ("q", call.q.transpose(1, 2)),
                ("k", call.k.transpose(1, 2)),
                ("v", call.v.transpose(1, 2)),
            ):
                if (site, layer) in self.wanted:
                    self.keep((site, layer), value)
            if ("result", layer) in self.wanted:
                self.seen["z", layer] = out.detach()

        return observer

    def _on_mlp_input(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            fed = self.fed[layer]
            if fed.mlp is None:
                fed.mlp = self.mapped.stream_of(args, kwargs)

        return hook

    def _on_norm(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if args:
                self.fed[layer].norms.append((args[0], out))

        return hook

    def _parallel(self, layer: int) -> bool:
        """Whether block ``layer``'s feed-forward network read the block's own input (itself, or
        through a norm of it), not the stream after the attention: a parallel block."""
        fed = self.fed.get(layer)
        if fed is None:
            return False
        x, u = fed.block, fed.mlp
        if x is None or u is None:
            return False
        return u is x or any(given is x and made is u for given, made in fed.norms)

    def _wants_result(self) -> bool:
        return any(s == "result" for s, _ in self.wanted)

    def _hooks(self) -> Iterator[Removable]:
        wanted = self.wanted
        for layer in range(self.num_layers):
            block = self.blocks[layer]
            if block is not None and any((s, layer) in wanted for s in RESIDUAL_SITES):
                yield block.module.register_forward_hook(self._on_block(layer), with_kwargs=True)
                if layer in self.needs_sum:
                    if block.attention is not None:
                        yield block.attention.register_forward_hook(
                            self._on_part("attn_out", layer)
                        )
                    if block.mlp is not None:
                        yield block.mlp.register_forward_hook(self._on_part("mlp_out", layer))
                if layer in self.mid_layers and block.mlp is not None:
                    yield block.mlp.register_forward_pre_hook(
                        self._on_mlp_input(layer), with_kwargs=True
                    )
                    for norm, _ in block.norms:
                        yield norm.register_forward_hook(self._on_norm(layer))
            if any((s, layer) in wanted for s in (*HEAD_SITES, "attn_scores")):
                yield self.found[layer].attention.register_observer(self._on_heads(layer))
        for reads in self.norm_reads.values():
            yield from reads.hooks()
        for key, part in self.mlp_parts:
            if key[0] == "mlp_pre":
                yield part.register_forward_hook(self._on_output(key))
            else:
                yield part.register_forward_pre_hook(self._on_input(key))
        yield from self._model_hooks()
        if self.wiring is not None:  # the heads' writes go through each output projection
            yield from self.wiring.hooks()
        yield from self.rotary_check.hooks()

    def _model_hooks(self) -> Iterator[Removable]:
        """The hooks of the model's sites: its embeddings and final norm."""
        mapped, wanted = self.mapped, self.wanted
        tables = mapped.embeddings
        if ("embed", 0) in wanted or ("pos_embed", 0) in wanted:
            if tables:
                yield tables[0].register_forward_hook(self._on_embeddings)
            else:
                for site in ("embed", "pos_embed"):
                    self.missing[site, 0] = f"the map of {mapped.family} knows no embeddings"
        if ("pos_embed", 0) in wanted and tables:
            if len(tables) > 1:
                yield tables[1].register_forward_hook(self._on_positions)
            else:
                self.missing["pos_embed", 0] = (
                    f"{mapped.family} has no position table (its positions are in its attention: "
                    f"rotary or relative)"
                )
        if ("final_scale", 0) in wanted:
            if mapped.final_norm is not None and mapped.norm_eps is not None:
                yield mapped.final_norm.register_forward_hook(self._on_final_norm)
            else:
                self.missing["final_scale", 0] = (
                    f"the map of {mapped.family} knows no final norm (a post-LN model, or one "
                    f"whose norm has no epsilon it can read)"
                )

    def _norm_scales(self) -> None:
        """Keep the scales of the norms named: the final norm's and each block's ln1 / ln2."""
        calls: list[tuple[SiteKey, NormRead | None, str]] = []
        for layer, reads in self.norm_reads.items():
            for role in sorted(reads.roles):
                why = reads.why.get(role, f"block {layer}'s {role} was not called")
                calls.append(((f"{role}_scale", layer), reads.reads.get(role), why))
        if self.final is not None:
            assert self.mapped.final_norm is not None and self.mapped.norm_eps is not None
            norm, eps = self.mapped.final_norm, self.mapped.norm_eps
            calls.append((("final_scale", 0), NormRead(norm, eps, *self.final), ""))
        for key, read, why in calls:
            if read is None:
                self.missing[key] = why
                continue
            rounding = torch.finfo(read.y.dtype).eps if read.y.is_floating_point() else 0.0
            try:
                frozen = FrozenNorm.of(read.norm, read.eps, read.x, read.y, key[0], rounding)
            except ValueError as e:
                self.missing[key] = str(e)
                continue
            self.keep(key, frozen.sigma)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within the block, a run of the model records what was named."""
        with registered(self._hooks()):
            if self.pattern_layers:
                rows = _rows(self.positions)
                with capture(self.model, layers=self.pattern_layers, rows=rows) as recorder:
                    yield
                self.patterns = list(recorder.records)
            else:
                yield

    def result(self) -> ActivationCache:
        """The cache of the run recorded.

        Raises:
            ValueError: a named site the model does not have (the reason named).
        """
        kept, seen, mapped = self.kept, self.seen, self.mapped
        if not self.where and self.patterns:  # patterns alone: their keys tell T
            self.where.append(_positions(self.positions, self.patterns[0].weights.shape[-1]))
        for record in self.patterns:
            weights = record.weights
            kept["pattern", record.layer] = (
                weights if self.device is None else weights.to(self.device)
            )
        absent: dict[str, str] = {}
        self._norm_scales()
        positions = self.seen.pop(("pos_embed", 0), None)
        if positions is not None and self.token_shape is not None:
            # a table looked up by position alone, (T, E) or (1, T, E): one row per token
            self.keep(("pos_embed", 0), positions.expand(self.token_shape))
        for (site, _), why in self.missing.items():
            absent.setdefault(site, why)
        for layer in sorted(self.needs_sum):
            block = self.blocks[layer]
            _sums(mapped, layer, block is not None and block.mlp is not None, seen, absent)
            if self._parallel(layer) and seen.pop(("resid_mid", layer), None) is not None:
                absent.setdefault(
                    "resid_mid",
                    f"{mapped.family}'s block {layer} runs its attention and feed-forward network "
                    f"side by side (a parallel block): the feed-forward network reads resid_pre, "
                    f"and resid_pre + attn_out is read by nothing",
                )
            for site in _SUM_SITES:
                if (site, layer) in self.wanted and (site, layer) in seen:
                    self.keep((site, layer), seen[site, layer])
        for layer in range(self.num_layers):
            if ("result", layer) in self.wanted and ("z", layer) in seen:
                assert self.wiring is not None
                projection = self.wiring.wiring.layers[layer].projection
                if projection is None:
                    absent["result"] = (
                        f"no module inside {self.found[layer].name} is fed its heads' outputs (the "
                        f"output projection is outside the attention module the map knows)"
                    )
                else:
                    self.keep(("result", layer), head_writes(projection, seen["z", layer]))
        self.fed.clear()  # the run's tensors were held for the identity check alone
        # which layers turn q and k is found only where asked (TransformerLens's names before
        # the turn): one more call of each attention module, never on a plain run
        rotary: RotaryCheck | frozenset[int] = self.rotary_check
        if self.before_rotary:
            rotary = self.rotary_check.rotary()
            for name, layer in self.before_rotary:
                if layer in rotary:
                    raise ValueError(_rotary_refusal(name, layer))
        if self.explicit:
            for site, layer in sorted(self.wanted):
                if (site, layer) not in kept and (site, layer) in self.missing:
                    raise ValueError(f"{_label(site, layer)}: {self.missing[site, layer]}")
                if (site, layer) not in kept and site in absent:
                    raise ValueError(f"{_label(site, layer)}: {absent[site]}")
        return ActivationCache(
            kept,
            positions=self.where[0] if self.where else None,
            num_layers=self.num_layers,
            absent=absent,
            rotary=rotary,
        )


def _label(site: str, layer: int) -> str:
    """How a message names a site: ``"z of layer 3"``, ``"embed"`` (a site of the model)."""
    return site if site in MODEL_SITES else f"{site} of layer {layer}"


def _rows(positions: object) -> Any:
    """``positions`` as :func:`~multihead.capture`'s ``rows`` (its checks apply there too)."""
    if isinstance(positions, Tensor):
        return positions.flatten().tolist()
    return positions


def _sums(
    mapped: ModelMap, layer: int, has_mlp: bool, seen: dict[SiteKey, Tensor], absent: dict[str, str]
) -> None:
    """Fill ``seen``'s attn_out, resid_mid and mlp_out of ``layer`` where the block is the sum
    resid_post = resid_pre + attn_out (+ mlp_out), checked within the dtype's rounding; else
    say in ``absent`` why not."""
    x, y = seen.get(("resid_pre", layer)), seen.get(("resid_post", layer))
    attn = seen.get(("attn_out", layer))
    if x is None or y is None or attn is None or attn.shape != x.shape:
        absent.setdefault(
            "attn_out", f"the map of {mapped.family} does not know its attention's write"
        )
        for site in _SUM_SITES:
            seen.pop((site, layer), None)
        absent.setdefault("resid_mid", absent["attn_out"])
        absent.setdefault("mlp_out", absent["attn_out"])
        return
    mlp = seen.get(("mlp_out", layer)) if has_mlp else torch.zeros_like(x)
    if mlp is None or mlp.shape != x.shape:
        mlp = None
    total = x + attn + (mlp if mlp is not None else 0)
    scale = float(y.abs().max().clamp(min=1.0))
    tolerance = 64 * torch.finfo(y.dtype).eps * scale if y.is_floating_point() else 0.0
    if mlp is None or not torch.allclose(total, y, rtol=0.0, atol=tolerance):
        why = (
            f"{mapped.family}'s block {layer} is not the sum resid_post = resid_pre + attn_out + "
            f"mlp_out (a post-LN or otherwise normalised block)"
        )
        for site in _SUM_SITES:
            seen.pop((site, layer), None)
            absent.setdefault(site, why)
        return
    seen["resid_mid", layer] = x + attn
    if has_mlp:
        seen["mlp_out", layer] = mlp
    else:
        absent.setdefault("mlp_out", f"{mapped.family}'s blocks are attention-only")


def _unpacked(value: Tensor, real: Tensor) -> Tensor:
    """(N, ...) real tokens in row-major order -> (B, T, ...), zeros at padding."""
    out = value.new_zeros(*real.shape, *value.shape[1:])
    out[real.to(value.device)] = value
    return out


def head_writes(projection: nn.Module, z: Tensor) -> Tensor:
    """(B, T, H, E): each head's output z (B, T, H, Dv) through ``projection`` (the module an
    attention gives its heads' outputs flattened, (B, T, H·Dv) -> (B, T, E)), less the bias.

    The projection is read as the model calls it (any linear layout, GPT-2's Conv1D included),
    whichever way costs fewer rows through it: once per head on that head alone (H · B · T
    rows), or once on the H·Dv unit vectors, whose outputs less its output on zero are the rows
    A (H·Dv, E) of x ↦ x A + bias, head h writing z_h times its Dv rows (when Dv < B · T)."""
    b, t, h, dv = z.shape
    if dv >= b * t:
        bias = projection(torch.zeros_like(z.flatten(2)[:, :1]))  # (B, 1, E)
        heads = []
        for head in range(h):
            alone = torch.zeros_like(z)
            alone[:, :, head] = z[:, :, head]
            heads.append(projection(alone.flatten(2)) - bias)
        return torch.stack(heads, dim=2)
    rows = projection_rows(projection, z.flatten(2))  # (H·Dv, E)
    return torch.einsum("bthd,hde->bthe", z, rows.view(h, dv, -1))


def projection_rows(projection: nn.Module, like: Tensor) -> Tensor:
    """A (W, out): a per-token linear module read as x ↦ x A + bias, as the model calls it
    (nn.Linear's weight transposed, GPT-2's Conv1D's as it is): its outputs on the W unit
    vectors less its output on zero. ``like`` (..., W) is an input it was given (width, dtype,
    device)."""
    width = like.shape[-1]
    eye = torch.eye(width, dtype=like.dtype, device=like.device)[None]  # (1, W, W)
    return (projection(eye) - projection(torch.zeros_like(eye[:, :1])))[0]
