"""Attribution patching: the first-order estimate of activation patching, for every head at once.

:func:`~multihead.circuits.patching.patch_heads` runs one patched variant per head (and
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

from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, describe
from multihead.circuits.experiment import Experiment, warn_if_random
from multihead.circuits.input_pair import Metric
from multihead.circuits.patching import DIRECTIONS, record_layers
from multihead.circuits.steering import head_table
from multihead.head_shard import every_head
from multihead.observers import AttentionCall, registered

__all__ = ["attribution_patching"]


def attribution_patching(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    *,
    per_position: bool = False,
    direction: str = "denoise",
    metric_input: str = "logits",
) -> Tensor:
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
        model, clean, corrupt, metric, metric_input: as for :func:`~multihead.patch_heads`; the
            metric must
            be differentiable (it runs with gradients enabled).
        per_position: one estimate per head and position: (L, H, T).
        direction: ``"denoise"`` or ``"noise"``: which run is patched (see above).

    Returns:
        (L, H), or (L, H, T) with ``per_position``, in the metric's dtype (float32 at least)
        and device; NaN where a layer has fewer heads than the most. On a tensor-parallel model
        (every rank calling this together) each rank scores the heads it holds and every rank
        gets every head's.

    Raises:
        ValueError, TypeError: as :func:`~multihead.patch_heads`, and a metric that does not
            depend on the heads through autograd.
    """
    check_choice("direction", direction, DIRECTIONS)
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be a bool, got {describe(per_position)}")
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    warn_if_random(model, "attribution_patching")
    found, pair = experiment.found, experiment.pair
    source, target = pair.pick(direction)
    layers = list(range(len(found)))

    with torch.no_grad(), record_layers(found, layers) as sources:
        pair.run(source)
    xis: dict[int, Tensor] = {}
    targets: dict[int, Tensor] = {}
    leaves = (
        site.register_observer(_leaf(layer, xis, targets)) for layer, (_, site) in enumerate(found)
    )
    with registered(leaves):
        with torch.enable_grad():
            value = experiment.value(target, "target run")
            if not value.requires_grad:
                raise ValueError(
                    "attribution_patching needs metric(output) to depend on the heads through "
                    "autograd: its result does not require grad (does it detach the output or "
                    "run under torch.no_grad()?)"
                )
            ran = [layer for layer in layers if layer in xis]
            grads = torch.autograd.grad(value, [xis[layer] for layer in ran], allow_unused=True)
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
        per_token = every_head(per_token, 1, found[layer][1].head_shard)
        heads = per_token.shape[1]
        result[layer, :heads] = per_token.T if per_position else per_token.sum(0)
    return result


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
