"""How much each head matters to a metric: ablation differences or gradient sensitivities.

:func:`head_importance` scores every head of a model for a scalar ``metric()``:

- ``method="ablation"``: metric with the head's output zeroed, minus metric clean. A head in
  layer l cannot change anything computed before it, so the blocks before layer l's are not run
  again: their outputs are recorded once, on a clean run, and handed back
  (:mod:`multihead.circuits.runs.prefix_reuse`), which makes the 72 ablations of MiniLM cost
  about 0.6 of 72 forwards.
- ``method="gradient"``: |∂metric/∂ξ_{l,h}| at ξ = 1, where ξ_{l,h} multiplies head (l, h)'s
  output (Michel, Levy and Neubig, "Are Sixteen Heads Really Better than One?", 2019): one
  forward and one backward for every head at once.

Both act through MultiHeadAttention's observers (:mod:`multihead.circuits.steering`).

Shapes: L attention modules (layers), H heads (the most any layer has).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from multihead._checks import check_choice
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.steering import intervene
from multihead.head_shard import held_heads
from multihead.heads import head_table
from multihead.map_types import Site
from multihead.mapping import model_heads
from multihead.observers import AttentionCall, ObservableAttention, registered

__all__ = ["head_importance", "METHODS"]

logger = logging.getLogger(__name__)  # also prefix_reuse's: the reasons for full forwards

METHODS = ("ablation", "gradient")

Metric = Callable[[], Tensor]


def _scalar(metric: Metric, what: str) -> Tensor:
    value = metric()
    if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ValueError(
            f"metric() must return a scalar floating point tensor, got {_describe(value)} ({what})"
        )
    return value.reshape(())


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def head_importance(
    model: nn.Module,
    metric: Metric,
    *,
    method: str = "ablation",
    reuse_prefix: bool = True,
) -> Tensor:
    r"""Score every head of ``model`` for ``metric``: an (L, H) tensor.

    - ``"ablation"``: ``I[l, h] = metric(head (l, h) zeroed) - metric()``, one run per head
      (each under ``torch.no_grad()``). Negative: the metric drops without the head.
    - ``"gradient"``: ``I[l, h] = |∂ metric / ∂ξ_{l,h}|`` at ξ = 1, with ξ_{l,h} multiplying
      head (l, h)'s output (Michel et al., 2019): the first-order estimate of what removing the
      head changes, for every head from one forward and one backward.

    With ``reuse_prefix`` (default), ablation runs skip what they cannot change: zeroing a head
    of layer l leaves every block (a multihead ``TransformerEncoderLayer`` or
    ``TransformerDecoderLayer``) before layer l's as it was, so those blocks hand back their
    outputs from one recorded clean run instead of running. A block is skipped only when its
    arguments equal, bit for bit, those of the recorded call, it carries no cache, observer or
    hook, and it has no active dropout; a check run must reproduce the clean metric exactly.
    The argument values are compared on the device and read back once per run, after it (no
    forward waits for the host); a run whose arguments differed (``metric()``'s inputs depend on
    the ablation, e.g. a generated text) is run again, and later runs compare before reusing.
    Otherwise every ablation runs the full forward, and the reason is logged on
    ``multihead.circuits.importance``. Results are the same either way.

    Args:
        model: any module holding :class:`~multihead.MultiHeadAttention` modules. It is left as
            it was (no parameter or mode is changed).
        metric: called with no arguments, runs the model (on fixed inputs) and returns a scalar
            tensor, e.g. ``lambda: model(ids).logits[0, -1, target]``. For ``"gradient"`` it
            must not disable gradients itself.
        method: ``"ablation"`` or ``"gradient"``.
        reuse_prefix: let ablation runs skip the unchanged blocks (see above).

    Under tensor parallelism every rank calls this together (each ablation is a forward all
    ranks run) and gets the whole table; ``metric()`` must give every rank the same value (as
    the gathered logits of a tensor-parallel model do).

    Returns:
        (L, H) in the metric's dtype and device, L the number of attention modules in module
        order (as :func:`multihead.capture` numbers them), H the most heads a module has (NaN
        where a layer has fewer).

    Raises:
        ValueError: no attention module in the model, an unknown ``method``, a metric that does
            not return a scalar floating point tensor or (``"gradient"``) does not depend on
            the heads through autograd.
    """
    check_choice("method", method, METHODS)
    found = model_heads(model)
    if not callable(metric):
        raise TypeError(f"metric must be a callable with no arguments, got {_describe(metric)}")
    if method == "gradient":
        return _gradient_importance(found, metric)
    return _ablation_importance(model, found, metric, reuse_prefix=bool(reuse_prefix))


def _gradient_importance(found: list[Site], metric: Metric) -> Tensor:
    """|∂metric/∂ξ| with ξ (H,) per layer multiplied into the per-head output by an observer."""
    xis = [
        torch.ones(
            mha.num_heads,
            dtype=next(mha.parameters()).dtype,
            device=next(mha.parameters()).device,
            requires_grad=True,
        )
        for mha in (site.attention for site in found)
    ]

    def make_observer(
        xi: Tensor, mha: ObservableAttention
    ) -> Callable[[AttentionCall, Tensor], Tensor]:
        # under tensor parallelism a rank's call holds its own heads: their slice of ξ
        held = held_heads(mha.num_heads, mha.head_shard)

        def observer(call: AttentionCall, out: Tensor) -> Tensor:
            part = xi[held.start : held.stop]  # sliced here, where gradients are recorded
            return out * part.to(out.dtype)[:, None]  # (B, T, H, Dv) · (H, 1)

        return observer

    scaled = (
        mha.register_observer(make_observer(xi, mha))
        for mha, xi in zip((site.attention for site in found), xis, strict=True)
    )
    with registered(scaled), torch.enable_grad():
        value = _scalar(metric, 'method="gradient"')
        if not value.requires_grad:
            raise ValueError(
                'method="gradient" needs metric() to depend on the heads through autograd: '
                "its result does not require grad (is the model run under torch.no_grad()?)"
            )
        grads = torch.autograd.grad(value, xis, allow_unused=True)
    scores = head_table(found, value, None)
    for layer, grad in enumerate(grads):
        shard = found[layer].shard
        if shard is not None and grad is not None:
            # each rank's gradient is zero but at the heads it holds: the sum is every head's
            grad = shard.sum(grad)
        if grad is not None:
            scores[layer, : grad.shape[0]] = grad.abs().to(scores.dtype)
        else:  # the layer never ran: the metric does not depend on it
            scores[layer, : found[layer].num_heads] = 0.0
    return scores


def _ablation_importance(
    model: nn.Module,
    found: list[Site],
    metric: Metric,
    *,
    reuse_prefix: bool,
) -> Tensor:
    with torch.no_grad():
        prefix = PrefixCache.build(model, found, partial(_scalar, metric)) if reuse_prefix else None
        if prefix is None:
            clean = _scalar(metric, "clean run")
        else:
            clean = prefix.clean
        scores = head_table(found, clean, None)
        for layer, mha in enumerate(site.attention for site in found):
            for head in range(mha.num_heads):
                what = f"head ({layer}, {head}) ablated"
                skipping = contextlib.nullcontext() if prefix is None else prefix.skipping(layer)
                with skipping, intervene(model, {(layer, head): 0.0}):
                    ablated = _scalar(metric, what)
                if prefix is not None and not prefix.agreed():
                    # the run reused outputs recorded for other arguments (metric()'s inputs
                    # depend on the ablation): run it again, comparing before reusing
                    logger.debug(
                        "head_importance: a reused layer's arguments differed from the recorded "
                        "run's in the ablation of head (%d, %d): compared before reuse from now on",
                        layer,
                        head,
                    )
                    prefix.compare_first = True
                    with prefix.skipping(layer), intervene(model, {(layer, head): 0.0}):
                        ablated = _scalar(metric, what)
                scores[layer, head] = ablated.to(scores.dtype) - clean
    return scores
