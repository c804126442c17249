"""One run of a model recorded at the sites named (:mod:`~multihead.circuits.runs.site_names`):
:func:`cache`, ``multihead.cache``, and the :class:`SiteRecorder` every recorded run uses.

One forward (:class:`SiteRecorder` records it: any run can be recorded), with forward hooks on the
map's blocks, attention, feed-forward modules, norms and embeddings (:func:`multihead.model_map`)
and observers on the attention sites; nothing is stored that was not asked for, and
``positions`` are cut before anything is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.runs.activation_cache import ActivationCache
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.head_writes import head_writes
from multihead.circuits.runs.input_pair import model_inputs, run_model
from multihead.circuits.runs.norm_reads import NormRead, NormReads
from multihead.circuits.runs.rotary_check import RotaryCheck
from multihead.circuits.runs.site_names import (
    HEAD_SITES,
    MLP_SITES,
    NORM_SITES,
    RESIDUAL_SITES,
    SUM_SITES,
    Names,
    SiteKey,
    before_rotary,
    chosen_positions,
    chosen_sites,
    rotary_refusal,
    site_label,
    site_of_hook_name,
)
from multihead.circuits.runs.wiring import WiringRun
from multihead.map_types import ModelMap, output_tensor
from multihead.mapping import model_heads, model_map
from multihead.observe.recorder import capture
from multihead.observe.rows import row_scores
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["cache", "SiteRecorder"]


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
        wanted = chosen_sites(names, num_layers)
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
        self.needs_sum = {layer for s, layer in wanted if s in SUM_SITES}
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
            and before_rotary(item)
            and (key := site_of_hook_name(item)) is not None
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
            elif site in MLP_SITES and found[layer].shard is not None:
                self.missing[site, layer] = _split(layer, site)
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
            self.where.append(chosen_positions(self.positions, value.shape[axis]))
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
        """``attn_scores`` of ``layer``: the kept query rows' scores (B, H, P, S), already cut
        to the rows (a packing model's calls too are in batch order)."""
        if self.found[layer].shard is not None:
            self.missing["attn_scores", layer] = _split(layer, "attn_scores")
            return
        t = call.q.shape[2]
        if not self.where:
            self.where.append(chosen_positions(self.positions, t))
        chosen = self.where[0]
        rows = torch.tensor(range(t) if chosen is None else chosen, device=call.q.device)
        try:
            scores = row_scores(call, rows)
        except ValueError as e:
            self.missing["attn_scores", layer] = str(e)
            return
        scores = scores.detach()
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
            if mapped.position_table is not None:
                yield mapped.position_table.register_forward_hook(self._on_positions)
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
                FrozenNorm.of(read.norm, read.eps, read.x, read.y, key[0], rounding)  # its form
            except ValueError as e:
                self.missing[key] = str(e)
                continue
            self.keep(key, FrozenNorm.run_scale(read.norm, read.eps, read.x))

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
            self.where.append(chosen_positions(self.positions, self.patterns[0].weights.shape[-1]))
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
            self.keep(("pos_embed", 0), positions.expand(self.token_shape).contiguous())
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
            for site in SUM_SITES:
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
                    raise ValueError(rotary_refusal(name, layer))
        if self.explicit:
            for site, layer in sorted(self.wanted):
                if (site, layer) not in kept and (site, layer) in self.missing:
                    raise ValueError(f"{site_label(site, layer)}: {self.missing[site, layer]}")
                if (site, layer) not in kept and site in absent:
                    raise ValueError(f"{site_label(site, layer)}: {absent[site]}")
        return ActivationCache(
            kept,
            positions=self.where[0] if self.where else None,
            num_layers=self.num_layers,
            absent=absent,
            rotary=rotary,
        )


def _split(layer: int, site: str) -> str:
    """Why a site of a tensor-parallel layer is not kept: each rank holds a part of it."""
    return (
        f"layer {layer}'s heads are split over ranks (tensor parallelism): its {site} would be "
        f"this rank's part alone"
    )


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
        for site in SUM_SITES:
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
        for site in SUM_SITES:
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
