"""Attribution patching: the first-order estimate of activation patching, for every head at once.

:func:`~multihead.patch_heads` runs one patched variant per head (and
position). Attribution patching (Nanda, "Attribution Patching", 2023; Syed et al., 2023)
replaces each by its linear estimate around the run being patched: with :math:`z` a head's
per-head output before the output projection,

    metric(target with z := z_source) - metric(target) ≈ ∂metric/∂z |_target · (z_source - z_target)

so two forwards (source, target) and one backward (from the target's metric) give every head
and position. The gradient is taken by an observer on every layer that adds a zero tensor
ξ (B, T, H, Dv) requiring grad to the per-head output: ∂metric/∂ξ is ∂metric/∂z through every
path, later layers included, and the model's parameters get no gradient.

Shapes: B batch, T tokens, L layers, H heads (the most any layer has), Dv one head's width.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_positive_int, describe
from multihead.circuits.patching.patch_result import PatchResult
from multihead.circuits.runs.embedding_path import (
    interpolated_embeddings,
    path_points,
    recorded_embeddings,
)
from multihead.circuits.runs.experiment import Experiment, warn_if_random
from multihead.circuits.runs.input_pair import DIRECTIONS
from multihead.circuits.runs.metric import Metric
from multihead.circuits.runs.site_names import HEAD_SITES, RESIDUAL_SITES
from multihead.circuits.runs.site_recorder import SiteRecorder
from multihead.head_shard import every_head
from multihead.heads import head_table
from multihead.mapping import model_map
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["attribution_patching"]

logger = logging.getLogger(__name__)

# the sites a gradient is taken at: the residual stream's and the heads'
ATTRIBUTED_SITES = (*RESIDUAL_SITES, *HEAD_SITES, "pattern")


def attribution_patching(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    *,
    per_position: bool = False,
    direction: str = "denoise",
    metric_input: str = "logits",
    site: str = "z",
    ig_steps: int = 1,
) -> PatchResult:
    r"""The first-order estimate of :func:`~multihead.patch_heads`, from two forwards and one
    backward.

    With ``source, target = clean, corrupt`` (``"denoise"``, the default) or ``corrupt, clean``
    (``"noise"``), and :math:`z_{l,h,t}` head (l, h)'s output at position t (summed over the
    batch with the metric's own weights)::

        A[l, h, t] = Σ_{b, d} ∂metric/∂z_{l,h}[b, t, d] |_{target run}
                              · (z_{l,h}(source) - z_{l,h}(target))[b, t, d]
        A[l, h]    = Σ_t A[l, h, t]

    The gradient is taken **at the target run** (the run that is patched: corrupt when
    denoising, as in Nanda's attribution patching), and the difference points **from target
    to source**, so ``A`` estimates ``patch_heads(model, clean, corrupt, metric,
    direction=direction)`` with its sign: positive where patching the head raises the metric.
    It is exact for a metric linear in the head's output; where the head acts through a
    saturated softmax later (a previous-token head feeding an induction head's keys, when
    noising) the estimate can miss an effect entirely (docs/circuits.md shows one).

    Args:
        site: what is patched, as :func:`multihead.patch` names it (default ``"z"``, each
            head's output; ``"result"`` gives the same numbers): (L,) or (L, T) for a residual
            site, (L, H) or (L, H, T) per head (Hk for k and v); one of
            :data:`ATTRIBUTED_SITES` (the residual stream's and the heads' sites).
        model, clean, corrupt, metric, metric_input: as for :func:`~multihead.patch_heads`; the
            metric must
            be differentiable (it runs with gradients enabled).
        per_position: one estimate per head and position: (L, H, T).
        direction: ``"denoise"`` or ``"noise"``: which run is patched (see above).
        ig_steps: m, integrated gradients (EAP-IG's for nodes): the gradient averaged over the
            points ``source + (k / m) (target - source)`` of the embeddings (what block 0 is
            given), k = 1 … m, the last the target run itself (1: the plain estimate). Heads'
            sites (``z``, ``result``) only.

    Returns:
        A :class:`~multihead.PatchResult` with :func:`multihead.patch`'s
        axes for the site: values (L, H), or (L, H, T) with ``per_position`` (for z), in the
        metric's dtype (float32 at least) and device, NaN where a layer has fewer heads than
        the most; the clean and corrupt metrics (of the two forwards) beside them. On a
        tensor-parallel model (every rank calling this together) each rank scores the heads it
        holds and every rank gets every head's.

    Raises:
        ValueError, TypeError: as :func:`~multihead.patch_heads`, and a metric that does not
            depend on the heads through autograd.

    Example:
        >>> estimate = attribution_patching(lm, clean_ids, corrupt_ids, logit_diff)
        >>> estimate.values  # (L, H), as patch_heads'
        >>> estimate.top(5), estimate.plot()
    """
    check_choice("direction", direction, DIRECTIONS)
    check_choice("site", site, ATTRIBUTED_SITES)
    check_positive_int("ig_steps", ig_steps)
    if ig_steps > 1 and site not in ("z", "result"):
        raise ValueError(f"ig_steps > 1 scores heads (site 'z' or 'result'), got site={site!r}")
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be a bool, got {describe(per_position)}")
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    warn_if_random(experiment.model, "attribution_patching")
    dims = PatchResult.site_dims(site, per_position)
    if site not in ("z", "result"):  # result is linear in z: the same estimate
        values, source_value, target_value = _SiteAttribution(experiment, site).estimate(
            direction, per_position
        )
    else:
        values, source_value, target_value = _estimate_heads(
            experiment, direction, per_position, ig_steps
        )
    clean, corrupt = (
        (source_value, target_value) if direction == "denoise" else (target_value, source_value)
    )
    return PatchResult(values, dims, site, direction, clean, corrupt)


def _estimate_heads(
    experiment: Experiment, direction: str, per_position: bool, ig_steps: int = 1
) -> tuple[Tensor, float, float]:
    """Every head's estimate (L, H) or (L, H, T), and the metric on the source and target
    runs."""
    found = experiment.found
    source, target = experiment.ends(direction)
    layers = list(range(len(found)))
    head_sites = [("z", layer) for layer in layers]
    caller = "attribution_patching"
    with torch.no_grad():
        recorded = experiment.run(source, sites=head_sites, caller=caller, log=logger)
    sources = {
        layer: recorded.sites["z", layer] for layer in layers if ("z", layer) in recorded.sites
    }
    source_value = recorded.value
    if ig_steps == 1:  # the target's own run, its heads' gradients taken once
        unpatched = experiment.run(
            target, sites=head_sites, gradients=True, caller=caller, log=logger
        )
        assert unpatched.gradients is not None
        ran = [layer for layer in layers if layer in unpatched.gradients]
        grads = [unpatched.gradients[layer] for layer in ran]
        targets = {layer: unpatched.sites["z", layer] for layer in ran}
        value = unpatched.value
    else:
        grads, targets, value, ran = _integrated(experiment, source, target, ig_steps)
    dtype = torch.promote_types(value.dtype, torch.float32)
    lengths = {sources[layer].shape[1] for layer in ran}
    if per_position and len(lengths) > 1:
        raise ValueError(
            f"per_position=True needs one query length T in every layer, got {sorted(lengths)}"
        )
    result = head_table(found, value.detach().to(dtype), lengths.pop() if per_position else None)
    for layer, grad in zip(ran, grads, strict=True):
        if grad is None:  # the metric does not depend on this layer: 0 (every rank gathers)
            per_token = targets[layer].new_zeros(targets[layer].shape[1:3], dtype=dtype)
        else:
            delta = sources[layer].to(dtype) - targets[layer].to(dtype)  # (B, T, H, Dv)
            per_token = (grad.to(dtype) * delta).sum(dim=(0, 3))  # (T, H)
        # under tensor parallelism each rank scored the heads it holds: every rank gets all
        per_token = every_head(per_token, 1, found[layer].shard)
        heads = per_token.shape[1]
        result[layer, :heads] = per_token.T if per_position else per_token.sum(0)
    return result, float(source_value), float(value.detach())


def _integrated(
    experiment: Experiment, source: str, target: str, ig_steps: int
) -> tuple[list[Tensor | None], dict[int, Tensor], Tensor, list[int]]:
    """The heads' gradients averaged over the ``ig_steps`` points of the path between the two
    runs' embeddings (embedding_path.py), the target's heads' outputs, its metric and the
    layers that ran."""
    found = experiment.found
    layers = list(range(len(found)))
    xis: dict[int, Tensor] = {}
    targets: dict[int, Tensor] = {}
    leaves = (
        site.attention.register_observer(_leaf(layer, xis, targets))
        for layer, site in enumerate(found)
    )
    mapped = model_map(experiment.model)
    with torch.no_grad(), recorded_embeddings(mapped, "attribution_patching") as embedded:
        experiment.value(experiment.inputs(source), "source run")
        experiment.value(experiment.inputs(target), "target run")
    summed: list[Tensor | None] = []
    with registered(leaves), experiment.activation_gradients():
        for alpha in path_points(ig_steps):
            path = interpolated_embeddings(
                mapped, embedded[0], embedded[1], alpha, "attribution_patching"
            )
            with path, torch.enable_grad():
                value = experiment.value(experiment.inputs(target), "target run")
                if not value.requires_grad:
                    raise ValueError(
                        "attribution_patching needs metric(output) to depend on the heads "
                        "through autograd: its result does not require grad (does it detach "
                        "the output or run under torch.no_grad()?)"
                    )
                ran = [layer for layer in layers if layer in xis]
                step = torch.autograd.grad(value, [xis[layer] for layer in ran], allow_unused=True)
            summed = list(step) if not summed else [
                a if b is None else (b if a is None else a + b)
                for a, b in zip(summed, step, strict=True)
            ]  # fmt: skip
    grads = [None if g is None else g / ig_steps for g in summed]
    return grads, targets, value.detach(), ran


def _leaf(layer: int, xis: dict[int, Tensor], targets: dict[int, Tensor]) -> Any:
    """The observer adding layer's ξ (zeros requiring grad) to its per-head output, recording
    the output; a layer called again adds the same ξ (its gradient sums over the calls)."""

    def observer(call: AttentionCall, out: Tensor) -> Tensor:
        xi = xis.get(layer)
        if xi is None or xi.shape != out.shape:
            xi = xis[layer] = torch.zeros_like(out, requires_grad=True)
        targets[layer] = out.detach()
        return out + xi

    return observer


class _SiteAttribution:
    """The estimate for a site other than a head's output (see :func:`multihead.patch` for the
    sites): a zero ξ requiring grad is added where the site's activation is made, and
    ``A = Σ ∂metric/∂ξ · (source - target)`` over the batch and the activation's width.

    - residual sites: added to block l's input (``resid_pre``), output (``resid_post``), its
      attention's write (``attn_out``; and ``resid_mid``, which that write alone changes) or its
      feed-forward's (``mlp_out``);
    - ``q``, ``k``, ``v``: added to what the kernel is given (a q/k/v editor);
    - ``pattern``: ξ (B, H, T, S) enters as ``out + ξ v``, the head's output with the weights
      ``A + ξ`` (the kernel's own output is ``A v``), so ∂metric/∂ξ is ∂metric/∂A.
    """

    def __init__(self, experiment: Experiment, site: str) -> None:
        self.experiment = experiment
        self.site = site
        self.mapped = model_map(experiment.model)
        if any(s.shard is not None for s in self.mapped.sites):
            raise ValueError(
                f"attribution_patching of {site} on a tensor-parallel model is not supported: "
                f"use site='z' there"
            )

    def estimate(self, direction: str, per_position: bool) -> tuple[Tensor, float, float]:
        """The estimate (module docstring's shapes), and the metric on the source and target
        runs."""
        experiment, site = self.experiment, self.site
        source, target = experiment.ends(direction)
        layers = range(len(experiment.found))
        names = [(site, layer) for layer in layers]
        with torch.no_grad():
            recorded = experiment.run(
                source, sites=names, caller="attribution_patching", log=logger
            )
        sources, source_value = recorded.sites, recorded.value
        inputs = experiment.inputs(target)
        # the target's activations recorded on its gradient run (the ξ added are zeros)
        recorder = SiteRecorder(experiment.model, inputs, names=names)
        xis: dict[int, Tensor] = {}
        with registered(self._leaves(xis)), recorder.recording(), torch.enable_grad():
            value = experiment.value(inputs, "target run")
            if not value.requires_grad:
                raise ValueError(
                    "attribution_patching needs metric(output) to depend on the activations "
                    "through autograd: its result does not require grad"
                )
            ran = [layer for layer in layers if layer in xis]
            grads = torch.autograd.grad(value, [xis[layer] for layer in ran], allow_unused=True)
        with torch.no_grad():
            targets = recorder.result()
        dtype = torch.promote_types(value.dtype, torch.float32)
        per_token: dict[int, Tensor] = {}  # layer -> (T,) or (T, units)
        for layer, grad in zip(ran, grads, strict=True):
            delta = sources[site, layer].to(dtype) - targets[site, layer].to(dtype)
            if grad is None:
                grad = torch.zeros_like(delta)
            elif site in ("q", "k", "v"):
                grad = grad.transpose(1, 2)  # the kernel's (B, heads, T, D) -> (B, T, heads, D)
            product = grad.to(dtype) * delta
            if site in RESIDUAL_SITES:  # (B, T, E)
                per_token[layer] = product.sum(dim=(0, 2))
            elif site == "pattern":  # (B, H, T, S)
                per_token[layer] = product.sum(dim=(0, 3)).T  # (T, H)
            else:  # (B, T, heads, D)
                per_token[layer] = product.sum(dim=(0, 3))
        t = next(iter(per_token.values())).shape[0]
        units = max((p.shape[1] for p in per_token.values() if p.dim() == 2), default=0)
        shape: tuple[int, ...] = (len(experiment.found),) + ((units,) if units else ())
        shape += (t,) if per_position else ()
        result = torch.full(shape, float("nan"), dtype=dtype, device=value.device)
        for layer, cells in per_token.items():
            if cells.dim() == 1:
                result[layer] = cells if per_position else cells.sum()
            else:
                result[layer, : cells.shape[1]] = cells.T if per_position else cells.sum(0)
        return result, float(source_value), float(value.detach())

    def _leaves(self, xis: dict[int, Tensor]) -> Any:
        """The hooks (and editors, observers) adding each layer's ξ where the site is made."""

        def add(layer: int, current: Tensor) -> Tensor:
            xi = xis.get(layer)
            if xi is None or xi.shape != current.shape:
                xi = xis[layer] = torch.zeros_like(current, requires_grad=True)
            return current + xi

        def first(out: Any, layer: int) -> Any:
            if isinstance(out, tuple):
                return (add(layer, out[0]), *out[1:])
            return add(layer, out)

        handles: list[Removable] = []
        for layer in range(len(self.experiment.found)):
            attention = self.experiment.found[layer].attention
            if self.site in ("q", "k", "v"):
                index = ("q", "k", "v").index(self.site)

                def editor(call: AttentionCall, layer: int = layer, index: int = index) -> Any:
                    qkv = [call.q, call.k, call.v]
                    qkv[index] = add(layer, qkv[index])
                    return tuple(qkv)

                handles.append(attention.register_qkv_editor(editor))
                continue
            if self.site == "pattern":

                def observer(call: AttentionCall, out: Tensor, layer: int = layer) -> Tensor:
                    v = call.v
                    if v.shape[1] != out.shape[2]:  # grouped-query: query head h reads h // group
                        v = v.repeat_interleave(out.shape[2] // v.shape[1], 1)
                    shape = (out.shape[0], out.shape[2], out.shape[1], v.shape[2])  # (B, H, T, S)
                    xi = xis.get(layer)
                    if xi is None or xi.shape != shape:
                        xi = xis[layer] = v.new_zeros(shape, requires_grad=True)
                    return out + torch.einsum("bhts,bhsd->bthd", xi, v).to(out.dtype)

                handles.append(attention.register_observer(observer))
                continue
            block = self.mapped.stack_block(layer, f"attribution_patching of {self.site}")
            if self.site == "resid_pre":

                def pre(m: nn.Module, a: Any, kw: Any, layer: int = layer) -> Any:
                    return self.mapped.with_stream(a, kw, add(layer, self.mapped.stream_of(a, kw)))

                handles.append(block.module.register_forward_pre_hook(pre, with_kwargs=True))
                continue
            part = {"resid_post": block.module, "mlp_out": block.mlp}.get(
                self.site, block.attention
            )
            if part is None:
                raise ValueError(
                    f"attribution_patching of {self.site}: the map of {self.mapped.family} does "
                    f"not know block {layer}'s part that writes it"
                )
            handles.append(
                part.register_forward_hook(lambda m, a, out, layer=layer: first(out, layer))
            )
        return handles
