"""Activation patching of any site: the residual stream, a block's writes, and every head's
queries, keys, values, pattern and output.

For a clean input and a corrupt one, patching site s of layer l (at position t, or at every
position) replaces its activation, in the run of one input, with the activation the other
input gave it (the sites and their shapes are :mod:`~multihead.circuits.runs.site_names`'s)::

    P[l]       = metric(target run with s_l := s_l(source)) - metric(target run)     residual
    P[l, t]    = the same with only position t replaced                              per_position
    P[l, h]    = the same for head h's part of s_l (z, result, q, pattern; k and v per
                 key/value head)
    P[l, h, t] = head h at position t (the query row t of a pattern)

where (source, target) is (clean, corrupt) for ``"denoise"`` and (corrupt, clean) for
``"noise"``. Heads' outputs (``z``) are :func:`~multihead.patch_heads`'s, and ``result`` (a
head's output through its slice of the output projection) patches to the same numbers: the slice
is linear. The other sites run here, with the same stacking of variants along the batch and the
same reuse of the blocks before the patched one (:mod:`~multihead.circuits.runs.stacked_runs`):

- ``resid_pre``, ``resid_post``: a forward pre-hook / hook on block l replaces its input /
  output; ``attn_out`` and ``mlp_out`` a hook on its attention / feed-forward module;
  ``resid_mid`` (= resid_pre + attn_out) sets the attention's write to the source's resid_mid
  minus this run's resid_pre, so that the sum is the source's;
- ``q``, ``k``, ``v``: a q/k/v editor on the attention site replaces the head's queries (keys,
  values) before the kernel (after rotary positions: what the kernel sees);
- ``pattern``: an observer recomputes the head's output from the source's softmax weights and
  this run's values (with attention sinks, the weights in the family's own convention and the
  rest of the call this run's: Granite-SWA's output is scaled by this run's keys' share);
  ``attn_scores`` the same from the softmax of the source's scores (refused with sinks);
- ``embed``, ``pos_embed``: a hook on the token embedding / the map's position table replaces
  its output (one row, L = 1, of the whole model);
- ``mlp_pre``, ``mlp_post``: a hook on the map's ``Block.mlp_in`` output / ``Block.mlp_down``
  input;
- ``ln1_scale``, ``ln2_scale``, ``final_scale``: where the norm's output is read (the
  attention, the feed-forward network: :mod:`~multihead.circuits.runs.norm_reads`; every
  reader of that output), the output is given at the source's scale, ``β + (y - β) σ / σ'``
  (:meth:`~multihead.circuits.runs.frozen_norm.FrozenNorm.at_scale`), the patched cells alone.

Shapes: B batch, T tokens, S keys, E width, L layers, H heads, Hk key/value heads, D one head's
width, n stacked variants.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_indices, check_optional_positive_int, describe
from multihead.circuits.patching.patch_heads import patch_heads
from multihead.circuits.patching.patch_result import PatchResult
from multihead.circuits.runs.experiment import Experiment
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.input_pair import DIRECTIONS
from multihead.circuits.runs.layer_recording import check_recorded
from multihead.circuits.runs.norm_reads import NormRead, NormReads
from multihead.circuits.runs.site_names import (
    LAYER_SITES,
    MODEL_SITES,
    NORM_SITES,
    ROW_SITES,
    SITES,
)
from multihead.circuits.runs.stacked_runs import run_stacked, stacked_metrics, variant_chunks
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.heads import HeadCount, HeadName, chosen_heads
from multihead.map_types import output_tensor, with_output_tensor
from multihead.mapping import model_map
from multihead.observe.rows import row_weights
from multihead.observers import AttentionCall

__all__ = ["patch"]

logger = logging.getLogger(__name__)

_KV_SITES = ("k", "v")
# the sites whose patch at a position reaches the later positions through that block's keys and
# values (or every block's): not the block's write at that position alone
_REACHING = ("resid_pre", *_KV_SITES, "ln1_scale", "embed", "pos_embed", "final_scale")


def patch(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Callable[[Any], Tensor] | None = None,
    *,
    site: str = "z",
    per_position: bool = False,
    direction: str = "denoise",
    heads: Sequence[HeadName] | None = None,
    layers: int | Sequence[int] | None = None,
    batch_size: int | None = None,
    group: Any = None,
    metric_input: str = "logits",
) -> PatchResult:
    r"""Activation patching of one kind of site, every layer (and head) of it; see the module
    docstring for what each site's patch replaces.

    Args:
        model, clean, corrupt, metric, direction, batch_size, group, metric_input: as for
            :func:`~multihead.patch_heads` (the metric is given the logits by default).
        site: ``"resid_pre"``, ``"attn_out"``, ``"resid_mid"``, ``"mlp_out"``,
            ``"resid_post"``, ``"ln1_scale"``, ``"ln2_scale"``, ``"mlp_pre"``, ``"mlp_post"``
            (per layer), ``"embed"``, ``"pos_embed"``, ``"final_scale"`` (of the whole model:
            one row), ``"z"`` (default), ``"result"``, ``"q"``, ``"pattern"``,
            ``"attn_scores"`` (per head) or ``"k"``, ``"v"`` (per key/value head).
        per_position: patch one position at a time (a pattern's query row).
        heads: for a per-head site, the ``(layer, head)`` pairs to patch (``"L0H1"``; key/value
            heads for k and v); default every head of ``layers``.
        layers: the layers to patch (negative from the end); default all.

    Returns:
        A :class:`~multihead.PatchResult`: values (L,) or (L, T) for a
        residual site, (L, H) or (L, H, T) per head (Hk for k and v), NaN where nothing was
        patched; the clean and corrupt metrics beside them.

    Raises:
        ValueError: an unknown site or direction, heads and layers both given, heads of a
            per-layer site, layers of a site of the whole model, a site the model does not have
            (``mlp_out`` of an attention-only block, ``resid_mid`` of a post-LN block,
            ``ln2_scale`` of a block whose one norm feeds both), a padded batch the model runs
            packed (a per-layer site), and everything
            :func:`~multihead.patch_heads` refuses.
        TypeError: as :func:`~multihead.patch_heads`.

    Example:
        >>> res = multihead.patch(lm, clean, corrupt, logit_diff, site="resid_pre",
        ...                       per_position=True)         # (L, T)
        >>> res.normalized(), res.top(5)
    """
    check_choice("site", site, SITES)
    check_choice("direction", direction, DIRECTIONS)
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be a bool, got {describe(per_position)}")
    check_optional_positive_int("batch_size", batch_size)
    if heads is not None and layers is not None:
        raise ValueError("give heads or layers, not both (heads name their layers)")
    if heads is not None and site in LAYER_SITES:
        raise ValueError(f"heads: {site} is one activation per layer, with no heads; give layers")
    if layers is not None and site in MODEL_SITES:
        raise ValueError(
            f"layers: {site} is one activation of the whole model, with no layers; give none"
        )
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    found = experiment.found
    chosen = sorted(set(check_indices("layers", layers, len(found), "layers") or range(len(found))))
    if site in MODEL_SITES:
        chosen = [0]
    dims = PatchResult.site_dims(site, per_position)
    if site in ("z", "result"):
        every = [(layer, h) for layer in chosen for h in range(found[layer].num_heads)]
        values = patch_heads(
            experiment, direction=direction, per_position=per_position,
            heads=heads if heads is not None else every, batch_size=batch_size, group=group,
        ).values  # fmt: skip
    else:
        values = _SitePatch(experiment, site, direction, per_position, group).run(
            chosen, heads, batch_size
        )
    # both inputs ran for the patches: their metrics are the recorded runs'
    clean_value = experiment.run("clean", caller="patch", log=logger).value
    corrupt_value = experiment.run("corrupt", caller="patch", log=logger).value
    return PatchResult(values, dims, site, direction, float(clean_value), float(corrupt_value))


class _SitePatch:
    """One sweep of patches of a site other than a head's output (module docstring)."""

    def __init__(
        self, experiment: Experiment, site: str, direction: str, per_position: bool, group: Any
    ) -> None:
        self.experiment = experiment
        self.site = site
        self.per_position = per_position
        self.mapped = model_map(experiment.model)
        self.split = DataParallelGroup.of(group, experiment.model)
        self.source, self.target = experiment.ends(direction)

    def _units(self, layer: int) -> int:
        """Heads (key/value heads for k and v) of ``layer``; 1 for a residual site."""
        site = self.mapped.sites[layer]
        if self.site in LAYER_SITES:
            return 1
        return site.num_kv_heads if self.site in _KV_SITES else site.num_heads

    def run(
        self, layers: list[int], heads: Sequence[HeadName] | None, batch_size: int | None
    ) -> Tensor:
        experiment, pair = self.experiment, self.experiment.pair
        found = experiment.found
        if any(self.mapped.sites[layer].shard is not None for layer in layers):
            raise ValueError(
                f"patching {self.site} on a tensor-parallel model is not supported: patch z "
                f"(patch_heads) there"
            )
        if heads is not None:
            by_layer = chosen_heads(heads, found) if self.site not in _KV_SITES else {}
            if self.site in _KV_SITES:
                by_layer = self._kv_heads(heads)
        else:
            by_layer = {layer: list(range(self._units(layer))) for layer in layers}
        with torch.no_grad():
            names = [(self.site, layer) for layer in by_layer]
            kept = experiment.run(self.source, sites=names, caller="patch", log=logger)
            sources = {
                layer: kept.sites[self.site, layer]
                for layer in by_layer
                if (self.site, layer) in kept.sites
            }
            check_recorded(found, list(by_layer), sources)
            suffix = (
                experiment.suffix_runs(self.target, caller="patch", log=logger)
                if self.per_position
                else None
            )
            unpatched = experiment.run(self.target, prefix=True, caller="patch", log=logger)
            base = experiment.checked_value(unpatched, "unpatched run")
            single, prefix, target = unpatched.output, unpatched.prefix, unpatched.inputs
            stand_ins = [self._as_heads(src) for src in sources.values()]
            size = experiment.stack_size(batch_size, single, stand_ins, logger)
            t = next(iter(sources.values())).shape[2 if self.site in ROW_SITES else 1]
            most = max(self._units(layer) for layer in range(len(found)))
            shape: tuple[int, ...] = (1 if self.site in MODEL_SITES else len(found),)
            shape += () if self.site in LAYER_SITES else (most,)
            shape += (t,) if self.per_position else ()
            result = torch.full(shape, float("nan"), dtype=base.dtype, device=base.device)
            spans: list[int | None] = list(range(t)) if self.per_position else [None]
            # position-major: a run from a later position holds the variants of one position
            variants = {
                layer: [(h, at) for at in spans for h in units] for layer, units in by_layer.items()
            }
            forwards = [
                (layer, *chunk)
                for layer, v in variants.items()
                for chunk in variant_chunks(v, size, suffix is not None)
            ]
            changes = torch.zeros_like(result)
            error: Exception | None = None
            try:
                for layer, start, stop in self.split.share(forwards):
                    chunk = variants[layer][start:stop]
                    first = chunk[0][1] if suffix is not None else None
                    attach = functools.partial(self._attach, layer, chunk, sources[layer])
                    # the first block the patch changes: the embeddings' is 0, the final
                    # norm's the last
                    block = len(found) - 1 if self.site == "final_scale" else layer
                    if suffix is not None and first is not None:
                        local = self.site not in _REACHING
                        output = suffix.run(len(chunk), first, block, attach, local=local)
                    else:
                        whole = functools.partial(attach, 0, None)
                        output = run_stacked(
                            pair, target, len(chunk), block, prefix, whole, "patch"
                        )
                    values = stacked_metrics(
                        pair, experiment.metric, output, single, len(chunk),
                        f"{self.site} of layer {layer} patched",
                    )  # fmt: skip
                    for (h, pos), value in zip(chunk, values.to(result.dtype) - base, strict=True):
                        changes[self._cell(layer, h, pos)] = value
            except Exception as e:  # every rank must hear of it before the sum
                error = e
            self.split.gather(None, error)
            changes = self.split.sum(changes)
            for layer, chunk in variants.items():
                for h, pos in chunk:
                    result[self._cell(layer, h, pos)] = changes[self._cell(layer, h, pos)]
        return result

    def _cell(self, layer: int, unit: int, at: int | None) -> tuple[int, ...]:
        """Where a variant's effect goes in the result."""
        index = (layer,) if self.site in LAYER_SITES else (layer, unit)
        return index if at is None else (*index, at)

    def _kv_heads(self, heads: Sequence[HeadName]) -> dict[int, list[int]]:
        """k and v name key/value heads: ``(layer, kv_head)`` pairs checked against Hk."""
        counts = [HeadCount(site.name, site.num_kv_heads) for site in self.experiment.found]
        return chosen_heads(heads, counts)

    def _as_heads(self, src: Tensor) -> Tensor:
        """A (B, T, H, D)-shaped view of a source, for the stack size's memory estimate."""
        if self.site in ROW_SITES:
            return src.transpose(1, 2)  # (B, T, H, S)
        return src if src.dim() == 4 else src.unsqueeze(2)

    def _attach(
        self,
        layer: int,
        chunk: list[tuple[int, int | None]],
        src: Tensor,
        start: int,
        stop: int | None,
    ) -> list[Any]:
        """Register the hooks that patch ``chunk``'s variants (stacked, variant-major) of
        ``layer``'s site from ``src``; returns their handles. In a run of positions ``start``
        … ``stop`` - 1 alone (:mod:`~multihead.circuits.runs.suffix_runs`) the hooks see those
        positions, but keys and values, which hold every one up to ``stop``."""
        n = len(chunk)
        if self.site in _KV_SITES:
            src = src[:, :stop]
        else:
            # a pattern's rows, and its keys up to the run's last (causal: none later is seen)
            src = src[:, :, start:stop, :stop] if self.site in ROW_SITES else src[:, start:stop]
            chunk = [(h, None if at is None else at - start) for h, at in chunk]
        if self.site in LAYER_SITES:
            return self._attach_stream(layer, chunk, src)
        attention = self.experiment.found[layer].attention
        units = self._units(layer)
        t = src.shape[2] if self.site in ROW_SITES else src.shape[1]
        mask = torch.zeros(n, t, units, dtype=torch.bool)
        for i, (h, at) in enumerate(chunk):
            mask[i, slice(None) if at is None else at, h] = True
        mask = mask.to(src.device)

        def tiled(value: Tensor) -> Tensor:  # (B, ...) -> (n·B, ...), variant-major
            return value.repeat(n, *[1] * (value.dim() - 1))

        if self.site in ROW_SITES:
            if self.site == "attn_scores":  # the source's scores through this call's softmax
                src = torch.softmax(src, -1).nan_to_num_(0.0)  # float32 at least, as recorded
            weights = tiled(src)  # (n·B, H, T, S)
            where = mask.repeat_interleave(src.shape[0], 0)[..., None]  # (n·B, T, H, 1)

            def observer(call: AttentionCall, out: Tensor) -> Tensor:
                if self.site == "attn_scores" and call.mods.sinks is not None:
                    raise ValueError(
                        f"patching attn_scores of layer {layer}: its softmax has attention sinks, "
                        f"whose logits are not scores; patch its pattern"
                    )
                v = call.v
                if v.shape[1] != out.shape[2]:  # grouped-query: query head h reads h // group
                    v = v.repeat_interleave(out.shape[2] // v.shape[1], 1)
                # with sinks in the "column" convention the last column is the sink's share;
                # float32 at least, as the kernel mixes the values
                compute = torch.promote_types(v.dtype, torch.float32)
                keys = weights[..., : v.shape[2]].to(compute)
                z = torch.einsum("bhts,bhsd->bthd", keys, v.to(compute))
                if call.mods.sinks is not None and call.mods.sink_weights == "plain":
                    z = z * _keys_share(call).to(z.dtype)  # the rest of the call is its own
                return torch.where(where, z.to(out.dtype), out)

            return [attention.register_observer(observer)]
        # q, k, v: the kernel's (n·B, heads, T, D) tensors
        index = ("q", "k", "v").index(self.site)
        heads_first = tiled(src.transpose(1, 2))  # (n·B, units, T, D)
        where = mask.transpose(1, 2).repeat_interleave(src.shape[0], 0)[..., None]

        def editor(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
            qkv = [call.q, call.k, call.v]
            current = qkv[index]
            if current.shape[1] != units:
                raise ValueError(
                    f"patch {self.site}: layer {layer}'s kernel was given {current.shape[1]} "
                    f"heads of {self.site} where the model has {units}"
                )
            qkv[index] = torch.where(where, heads_first.to(current.dtype), current)
            return qkv[0], qkv[1], qkv[2]

        return [attention.register_qkv_editor(editor)]

    def _attach_stream(
        self, layer: int, chunk: list[tuple[int, int | None]], src: Tensor
    ) -> list[Any]:
        """Hooks on block ``layer`` patching a residual site at each variant's positions."""
        n, b, t = len(chunk), src.shape[0], src.shape[1]
        mask = torch.zeros(n, 1, t, 1, dtype=torch.bool)
        for i, (_, at) in enumerate(chunk):
            mask[i, :, slice(None) if at is None else at] = True
        mask = mask.to(src.device)

        def replaced(current: Tensor, by: Tensor) -> Tensor:  # current (n·B, T, E)
            if current.dim() != by.dim() - 1 or current.shape[0] != n * b:
                raise ValueError(
                    f"patching {self.site}: the model ran this padded batch's tokens packed, "
                    f"{tuple(current.shape)} where ({n * b}, {t}, ...) was expected: give "
                    f"unpadded inputs (or one sequence)"
                )
            stacked = current.unflatten(0, (n, b))
            return torch.where(mask, by.to(current.dtype), stacked).flatten(0, 1)

        def source_out(m: nn.Module, a: Any, out: Any) -> Any:  # the module's output := src's
            return with_output_tensor(out, replaced(output_tensor(out), src[None]))

        def rescaled(read: NormRead) -> Tensor:  # the norm's output at the source's scale
            # the norm's form was checked where the source's scale was recorded; here only
            # the patched cells change, in float32 at least
            run = FrozenNorm.run_scale(read.norm, read.eps, read.x)  # (n·B, T, 1)
            unchanged = torch.zeros_like(run, dtype=torch.bool)
            changed = replaced(unchanged, torch.ones_like(src, dtype=torch.bool)[None])
            new = FrozenNorm.at_scale(read.norm, read.y, run, replaced(run, src[None]))
            return torch.where(changed, new, read.y)

        mapped = self.mapped
        if self.site in ("embed", "pos_embed"):
            table = mapped.embeddings[0] if mapped.embeddings else None
            if self.site == "pos_embed":
                table = mapped.position_table
            if table is None:
                raise ValueError(
                    f"patching {self.site}: the map of {mapped.family} knows no "
                    f"{'token embedding' if self.site == 'embed' else 'position table'}"
                )

            def table_out(m: nn.Module, a: Any, out: Any) -> Any:
                current = output_tensor(out)
                if current.dim() == 2 and current.shape[0] != t:  # (N, E): packed tokens
                    replaced(current, src[None])  # refused there, with the reason
                # a position table's (T, E) or (1, T, E): one row per token of the stacked batch
                current = current.expand(n * b, *current.shape[-2:])
                return with_output_tensor(out, replaced(current, src[None]))

            return [table.register_forward_hook(table_out)]
        if self.site == "final_scale":
            norm, eps = mapped.final_norm, mapped.norm_eps
            if norm is None or eps is None:
                raise ValueError(
                    f"patching final_scale: the map of {mapped.family} knows no final norm"
                )

            def final_out(m: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
                y = output_tensor(out)
                return with_output_tensor(out, rescaled(NormRead(m, eps, args[0], y)))

            return [norm.register_forward_hook(final_out)]
        block = mapped.stack_block(layer, f"patching {self.site}")
        if self.site in NORM_SITES:
            role = self.site.removesuffix("_scale")
            reads = NormReads(mapped, block, {role}, change=lambda _, read: rescaled(read))
            return list(reads.hooks())
        if self.site in ("mlp_pre", "mlp_post"):
            layer_part = block.mlp_in if self.site == "mlp_pre" else block.mlp_down
            if layer_part is None:
                raise ValueError(
                    f"patching {self.site}: the map of {mapped.family} does not know block "
                    f"{layer}'s feed-forward layers"
                )
            if self.site == "mlp_pre":
                return [layer_part.register_forward_hook(source_out)]

            def hidden(m: nn.Module, args: tuple[Any, ...]) -> Any:
                return (replaced(args[0], src[None]), *args[1:])

            return [layer_part.register_forward_pre_hook(hidden)]
        if self.site == "resid_pre":

            def pre(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
                stream = replaced(self.mapped.stream_of(args, kwargs), src[None])
                return self.mapped.with_stream(args, kwargs, stream)

            return [block.module.register_forward_pre_hook(pre, with_kwargs=True)]
        if self.site == "resid_post":
            return [block.module.register_forward_hook(source_out)]
        part = block.mlp if self.site == "mlp_out" else block.attention
        if part is None:
            raise ValueError(
                f"patching {self.site}: the map of {self.mapped.family} does not know block "
                f"{layer}'s {'feed-forward' if self.site == 'mlp_out' else 'attention'} module"
            )
        if self.site in ("attn_out", "mlp_out"):
            return [part.register_forward_hook(source_out)]
        # resid_mid = resid_pre + attn_out: the write that makes the sum the source's
        entering: list[Tensor] = []

        def record(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            entering[:] = [self.mapped.stream_of(args, kwargs)]

        def write(m: nn.Module, a: Any, out: Any) -> Any:
            written = output_tensor(out)
            wanted = src[None] - entering[0].unflatten(0, (n, b)).to(src.dtype)
            return with_output_tensor(out, replaced(written, wanted))

        return [
            block.module.register_forward_pre_hook(record, with_kwargs=True),
            part.register_forward_hook(write),
        ]


def _keys_share(call: AttentionCall) -> Tensor:
    """(B, T, H, 1): the keys' share of each query row's softmax over the keys and the sink, in
    a call with sinks; a family whose weights are the softmax over the keys alone (Granite-SWA's
    "plain") scales its output by it, so a patched pattern is scaled by this call's share."""
    rows = torch.arange(call.q.shape[2], device=call.q.device)
    sink = row_weights(call, None, rows, None, sink_weights="column")[..., -1]  # (B, H, T)
    return (1.0 - sink).transpose(1, 2)[..., None]
