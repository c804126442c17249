"""Activation patching of heads: which heads carry what differs between two inputs?

For a clean input (the model does the behaviour) and a corrupt one (it does not), patching
head (l, h) replaces its per-head output (B, T, Dv) before the output projection, the one place
where a head exists as itself, with the one it had on the other input:

- ``"denoise"``: run corrupt, head (l, h) taken from the clean run. A large effect: the head
  carries (part of) what the behaviour needs from the clean input (it is *sufficient*).
- ``"noise"``: run clean, head (l, h) taken from the corrupt run. A large effect: the behaviour
  breaks without the head's clean output (it is *necessary*).

The result is ``metric(patched) - metric(unpatched)``, one number per head, or per head and
position (``per_position``: only position t of the head is patched). It equals a plain loop
of :func:`~multihead.circuits.steering.record_heads` and
:func:`~multihead.circuits.steering.intervene`, one forward per patch, and costs much less:

- the patched variants run stacked along the batch dimension, ``batch_size`` of them per
  forward (chosen from the memory budget by default), each patched by one observer on the
  patched layer (an ``out`` replaced where a (variant, position, head) mask says so);
- the blocks before the patched layer are not run again: they hand back their outputs from the
  unpatched run, repeated for every variant
  (:class:`~multihead.circuits.runs.prefix_reuse.PrefixCache`).

The stacked forwards are :mod:`~multihead.circuits.runs.stacked_runs`'s, shared with
:mod:`~multihead.circuits.paths.path_patching`.

Shapes: B batch, T tokens, L attention layers, H heads (the most any layer has), Dv one head's
output width, n stacked variants.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_optional_positive_int, describe
from multihead.circuits.patching.patch_result import PatchResult
from multihead.circuits.runs.experiment import Experiment
from multihead.circuits.runs.input_pair import DIRECTIONS, InputPair
from multihead.circuits.runs.layer_recording import check_recorded
from multihead.circuits.runs.metric import Metric
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.runs.stacked_runs import run_stacked, stacked_metrics, variant_chunks
from multihead.circuits.runs.suffix_runs import SuffixRuns
from multihead.distributed.data_parallel import DataParallelGroup
from multihead.head_shard import held_heads
from multihead.heads import HeadName, chosen_heads, head_table
from multihead.observers import AttentionCall, ObservableAttention, ObserverHandle

__all__ = [
    "patch_heads",
]

logger = logging.getLogger(__name__)


def _variant_mask(
    variants: list[tuple[int, int | None]], src: Tensor, site: ObservableAttention
) -> Tensor:
    """(n, T, H) bool on ``src``'s device: True where variant i takes global head h (at position
    t, or at every position for t None) from the source run; ``src`` is the site's per-head
    output (B, T, H, Dv). Under tensor parallelism H is the heads this rank holds (a variant of
    another rank's head patches nothing here: its rank patches it). Made per forward, so that a
    sweep never holds the masks of all its variants at once."""
    patched = torch.zeros(len(variants), src.shape[1], site.num_heads, dtype=torch.bool)
    for i, (h, t) in enumerate(variants):
        patched[i, slice(None) if t is None else t, h] = True
    held = held_heads(site.num_heads, site.head_shard)
    return patched[:, :, held.start : held.stop].to(src.device)


def patch_heads(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    *,
    direction: str = "denoise",
    per_position: bool = False,
    heads: Sequence[HeadName] | None = None,
    batch_size: int | None = None,
    group: Any = None,
    metric_input: str = "logits",
) -> PatchResult:
    r"""Activation patching: the metric's change when one head's output comes from the other run.

    With ``source, target = clean, corrupt`` (``"denoise"``) or ``corrupt, clean``
    (``"noise"``), and :math:`z_{l,h}(x)` head (l, h)'s output (B, T, Dv) before ``out_proj``
    on input x::

        P[l, h]    = metric(target run with z_{l,h} := z_{l,h}(source)) - metric(target run)
        P[l, h, t] = the same with only position t of z_{l,h} replaced   (per_position=True)

    It equals a plain loop of ``record_heads`` (on source) and ``intervene`` (on target), one
    forward per patch; here the variants run stacked along the batch, ``batch_size`` per
    forward, and the blocks before the patched layer hand back their recorded outputs (see the
    module docstring). A layer called several times in one forward (a shared module) is patched
    at every call with its source output's latest call, as ``intervene`` does.

    Args:
        model: any module holding :class:`~multihead.MultiHeadAttention` modules, or a
            transformers model (through :mod:`multihead.hf`: heads of grouped-query models are
            query heads). Left as it was. Or an :class:`~multihead.Experiment`, given alone
            (no clean, corrupt nor metric): its two recorded runs serve, shared with every
            other function run on it.
        clean: the input on which the model does the behaviour: token ids (B, T) passed as the
            model's first argument, or a dict of keyword arguments (``input_ids``,
            ``attention_mask``, ...); for a :class:`multihead.TextModel`, also a text or a list
            of texts, which it tokenizes.
        corrupt: an input of the same kind and shapes on which it does not.
        metric: ``metric(logits) -> Tensor``: given the model's logits (B, T, V) (or its whole
            output: ``metric_input``); a scalar floating point tensor, or one value per example
            (B,), which is averaged. On stacked variants it is called once per variant, with
            that variant's own logits or output (every tensor cut to its rows: exactly an
            unstacked run's), so it needs no knowledge of the stacking.
        direction: ``"denoise"`` (default) or ``"noise"``.
        per_position: patch one position of one head at a time: (L, H, T).
        heads: the ``(layer, head)`` pairs to patch (negative indices count from the end);
            default every head. The others stay NaN.
        batch_size: variants per forward; default as many as the memory budget
            (:data:`~multihead.memory_budget.DEFAULT_MEMORY_LIMIT`) holds by an estimate from
            the unpatched run's output and per-head outputs, and at most 2,048 tokens in all
            on a CPU (65,536 elsewhere): stacking pays where one forward is too small to keep
            the device busy.
        group: the ``torch.distributed`` process group to share the patched forwards over
            (each variant runs on one rank; every rank gets the whole result); default every
            rank when ``torch.distributed`` is initialised, else this process alone. Every rank
            calls this with the same arguments and runs the two unpatched forwards itself. A
            tensor-parallel model (every rank in the call together) is not split again: every
            rank runs every variant, each patching the heads it holds, and gets the result one
            process would.
        metric_input: what the metric is given: ``"logits"`` (default; the output's
            ``logits``, as TransformerLens gives them; a model returning a tensor gives that;
            an output without logits is given whole) or ``"output"`` (whatever the model
            returns: a loss, hidden states, ...). An exception inside the metric carries a
            note naming what it was given.

    Returns:
        A :class:`~multihead.PatchResult` of site ``"z"``: values (L, H), or (L, H, T) with
        ``per_position``, in the metric's dtype and device, NaN where a layer has fewer heads
        than the most and for heads not in ``heads``; the clean and corrupt metrics (of the
        two unpatched runs) beside them.

    Raises:
        ValueError: an unknown ``direction``, a bad ``batch_size``, ``clean`` and ``corrupt``
            with different shapes or keys, a metric that does not return a scalar (or (B,))
            floating point tensor, a model without attention modules, heads out of range.
        TypeError: inputs of another kind, a metric that is not callable, heads that are not
            ``(layer, head)`` pairs of ints.

    Example:
        >>> def logit_diff(logits):  # the right answer's logit minus the wrong one's
        ...     return logits[:, -1, right] - logits[:, -1, wrong]
        >>> effects = patch_heads(lm, clean_ids, corrupt_ids, logit_diff)
        >>> effects.values  # (L, H)
        >>> effects.top(5), effects.plot()
    """
    check_choice("direction", direction, DIRECTIONS)
    if not isinstance(per_position, bool):
        raise TypeError(f"per_position must be a bool, got {describe(per_position)}")
    check_optional_positive_int("batch_size", batch_size)
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    found, pair = experiment.found, experiment.pair
    by_layer = chosen_heads(heads, found)
    source, target = experiment.ends(direction)
    split = DataParallelGroup.of(group, experiment.model)

    with torch.no_grad():
        sources = experiment.run(
            source, sites=[("z", layer) for layer in by_layer], caller="patch_heads", log=logger
        )
        recorded = {
            layer: sources.sites["z", layer] for layer in by_layer if ("z", layer) in sources.sites
        }
        check_recorded(found, list(by_layer), recorded)
        suffix = (
            experiment.suffix_runs(target, caller="patch_heads", log=logger)
            if per_position
            else None
        )
        unpatched = experiment.run(target, prefix=True, caller="patch_heads", log=logger)
        base = experiment.checked_value(unpatched, "unpatched run")
        single, prefix = unpatched.output, unpatched.prefix
        size = experiment.stack_size(batch_size, single, list(recorded.values()), logger)
        lengths = {out.shape[1] for out in recorded.values()}
        if per_position and len(lengths) > 1:
            raise ValueError(
                f"per_position=True needs one query length T in every patched layer, got "
                f"{sorted(lengths)} (pass heads= of layers with one length)"
            )
        positions = lengths.pop()
        result = head_table(found, base, positions if per_position else None)
        masks: dict[int, list[tuple[int, int | None]]] = {}  # layer -> its variants (head, t)
        places: dict[int, tuple[Any, ...]] = {}  # layer -> where its values go in the result
        forwards: list[tuple[int, int, int]] = []  # (layer, first variant, end): one forward each
        for layer, layer_heads in by_layer.items():
            src = recorded[layer]  # (B, T, H, Dv)
            # every variant of the layer, built on the host and copied to the device once
            spans = range(src.shape[1]) if per_position else [None]
            # position-major: a run from a later position holds the variants of one position
            variants = [(h, t) for t in spans for h in layer_heads]
            masks[layer] = variants  # each forward's (n, T, H) mask is made for its n alone
            index = torch.tensor([[h, t or 0] for h, t in variants], device=result.device)
            places[layer] = (layer, *index.unbind(1)) if per_position else (layer, index[:, 0])
            forwards += [
                (layer, *chunk) for chunk in variant_chunks(variants, size, suffix is not None)
            ]
        # data parallel: each rank runs its share of the forwards; the changes meet in one sum
        changes = torch.zeros_like(result)
        error: Exception | None = None
        try:
            for layer, start, stop in split.share(forwards):
                site = found[layer].attention
                mask = _variant_mask(masks[layer][start:stop], recorded[layer], site)
                values = _run_variants(
                    pair, unpatched.inputs, experiment.metric, single, site, layer,
                    recorded[layer], mask, prefix, suffix, masks[layer][start][1],
                )  # fmt: skip
                where = tuple(p if isinstance(p, int) else p[start:stop] for p in places[layer])
                changes[where] = values.to(result.dtype) - base
        except Exception as e:  # every rank must hear of it before the sum
            error = e
        split.gather(None, error)
        changes = split.sum(changes)
        for where in places.values():
            result[where] = changes[where]
    clean_value, corrupt_value = (
        experiment.run(name, caller="patch_heads", log=logger).value
        for name in ("clean", "corrupt")
    )
    dims = PatchResult.site_dims("z", per_position)
    return PatchResult(result, dims, "z", direction, float(clean_value), float(corrupt_value))


def _run_variants(
    pair: InputPair,
    target: Any,
    metric: Metric,
    single: Any,
    site: ObservableAttention,
    layer: int,
    src: Tensor,
    patched: Tensor,
    prefix: PrefixCache | None,
    suffix: SuffixRuns | None,
    position: int | None,
) -> Tensor:
    """One forward of n stacked copies of the target input, variant i with the per-head output
    of ``layer`` replaced by ``src``'s (B, T, H, Dv) where ``patched[i]`` (T, H) is True;
    returns the metric of every variant (n,). With ``suffix``, every variant patches at
    ``position`` and the forward runs from there on."""
    n, b = patched.shape[0], src.shape[0]

    def attach(start: int, stop: int | None) -> list[ObserverHandle]:
        """The observer of a run of positions ``start`` … ``stop`` - 1."""
        part = src[:, start:stop]  # (B, stop - start, H, Dv)
        where = patched[:, None, start:stop, :, None]  # (n, 1, stop - start, H, 1)

        def observer(call: AttentionCall, out: Tensor) -> Tensor:
            if out.shape != (n * b, *part.shape[1:]):
                raise ValueError(
                    f"patch_heads: layer {layer} was called with a per-head output of shape "
                    f"{tuple(out.shape)} in a run of {n} stacked variants of "
                    f"{tuple(part.shape)}; patch only layers the model calls once on the whole "
                    f"input"
                )
            stacked = out.unflatten(0, (n, b))  # (n, B, T, H, Dv)
            return torch.where(where, part.to(out.dtype), stacked).flatten(0, 1)

        return [site.register_observer(observer)]

    if suffix is not None and position is not None:
        # a head's output at one position: its block writes there alone
        output = suffix.run(n, position, layer, attach, local=True)
    else:
        t = src.shape[1]
        output = run_stacked(pair, target, n, layer, prefix, lambda: attach(0, t), "patch_heads")
    return stacked_metrics(pair, metric, output, single, n, f"patched layer {layer}")
