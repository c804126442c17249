"""Forwards of patched variants stacked along the batch: how many fit one forward, one such
forward with the blocks before the patched layer reused, and each variant's metric.

:func:`~multihead.patch_heads` and :func:`~multihead.path_patching`
run their variants this way: n copies of an input stacked along the batch, each edited by
observers or q/k/v editors that know their copy, the blocks before the patched layer handing
back their outputs from the unpatched run
(:class:`~multihead.circuits.runs.prefix_reuse.PrefixCache`), and the metric called once per copy
on that copy's slice of the output.

Shapes: B batch, T tokens, H heads, Dv one head's output width, n stacked variants.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from multihead.circuits.runs.input_pair import InputPair, split_output
from multihead.circuits.runs.metric import Metric, metric_value
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.map_types import Site
from multihead.observers import ObserverHandle

__all__ = ["EndOfRun", "run_stacked", "stacked_metrics", "variant_chunks", "variants_per_forward"]

logger = logging.getLogger(__name__)

# What one stacked variant holds at its peak beyond the output, per token and unit of width:
# the residual stream, the attention's q, k, v and per-head output, a feed-forward network's
# hidden layer (4 to 8 widths) and the copies between them.
_WIDTHS_PER_TOKEN = 24
# The most tokens (stacked rows × T) one forward should hold, by device type.
_TOKENS_PER_FORWARD = {"cpu": 2048, "other": 65536}


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    fields = getattr(value, "__dataclass_fields__", None)
    if fields is not None:
        return sum(_tensor_bytes(getattr(value, name, None)) for name in fields)
    return 0


def variants_per_forward(
    output: Any,
    per_head: Sequence[Tensor],
    limit: int,
    found: list[Site],
) -> int:
    """How many stacked variants one forward should hold.

    Within ``limit`` bytes: each variant holds its own output (twice: the model's and its
    slices' results) and the activations of one run, estimated from the per-head outputs
    (B, T, H, Dv) of ``found``'s sites: ``_WIDTHS_PER_TOKEN`` widths a token, plus a T × T score
    map per head (the attention kernels' working set). Under tensor parallelism a call holds
    H/W heads but the residual stream stays whole on every rank: the widths count W times.
    And at most ``_TOKENS_PER_FORWARD`` tokens in all: stacking pays where a forward is too
    small to keep the device busy (a GPU's launches); past that it only moves more memory (on a
    CPU, forwards of more than a few thousand tokens ran slower per token than one variant at a
    time).
    """
    first = per_head[0]
    ranks = max((site.shard.world_size for site in found if site.shard), default=1)
    activations = max(
        _WIDTHS_PER_TOKEN * ranks * out.numel() * max(out.element_size(), 4)
        + 2 * out.shape[0] * out.shape[2] * out.shape[1] ** 2 * 4
        for out in per_head
    )
    by_memory = limit // (2 * _tensor_bytes(output) + activations)
    budget = _TOKENS_PER_FORWARD.get(first.device.type, _TOKENS_PER_FORWARD["other"])
    by_tokens = budget // max(1, first.shape[0] * first.shape[1])
    return max(1, min(by_memory, by_tokens))


class EndOfRun(Exception):  # noqa: N818  (an end, not an error)
    """Raised by an observer or editor during :func:`run_stacked` when nothing later in the
    forward is needed (the run only records): the forward stops there."""


def run_stacked(
    pair: InputPair,
    inputs: Any,
    copies: int,
    layer: int,
    prefix: PrefixCache | None,
    attach: Callable[[], list[ObserverHandle]],
    caller: str,
) -> Any:
    """The model's output on ``copies`` copies of ``inputs`` stacked along the batch, with the
    observers and editors ``attach()`` registers (removed after), the blocks before ``layer``'s
    handing back ``prefix``'s recorded outputs; None when one raised :class:`EndOfRun`.

    ``prefix`` records the run of ``inputs``. A run whose reused blocks' arguments differed from
    the recorded ones (a model whose inputs to a block depend on the batch) is run again,
    comparing before reusing from then on (``caller`` names the user in the log).
    """

    def forward() -> Any:
        handles = attach()
        try:
            skipping = (
                prefix.skipping(layer, copies) if prefix is not None else contextlib.nullcontext()
            )
            with skipping:
                return pair.run(inputs, copies)
        except EndOfRun:
            return None
        finally:
            for handle in handles:
                handle.remove()

    output = forward()
    if prefix is not None and not prefix.agreed():
        logger.debug(
            "%s: a reused layer's arguments differed from the recorded run's on layer %d: "
            "compared before reuse from now on",
            caller,
            layer,
        )
        prefix.compare_first = True
        output = forward()
    return output


def stacked_metrics(
    pair: InputPair, metric: Metric, output: Any, single: Any, copies: int, what: str
) -> Tensor:
    """The metric of each of ``copies`` stacked variants (n,), each on its own slice of
    ``output`` (shaped like ``single``, one unstacked run's output; ``what`` names the run in
    errors)."""
    pieces = split_output(output, single, copies)
    return torch.stack([metric_value(metric, piece, pair.batch, what) for piece in pieces])


def variant_chunks(
    variants: list[tuple[int, int | None]], size: int, by_position: bool
) -> list[tuple[int, int]]:
    """The (first, end) of each forward's variants: ``size`` at most, and with
    ``by_position`` all of one position (a run from that position on holds them)."""
    bounds = [0]
    for i in range(1, len(variants)):
        if i - bounds[-1] == size or (by_position and variants[i][1] != variants[i - 1][1]):
            bounds.append(i)
    return list(zip(bounds, [*bounds[1:], len(variants)], strict=True))
