r"""Path patching: does a sender's change reach the metric through a later head's q, k or v, or
through no head at all?

Activation patching (:func:`~multihead.patch_heads`) says that a head matters;
path patching (Wang et al. 2022, "Interpretability in the Wild", the IOI circuit) says through
which later heads, and through which of their inputs. With ``(source, target) = (corrupt,
clean)`` for ``direction="noise"`` (the default, Wang et al.'s) and ``(clean, corrupt)`` for
``"denoise"``; a sender s (head (l, h)'s output :math:`z_{l,h}`, or block l's feed-forward
output :math:`m_l`); a receiver r, a set of heads R (one head, or several patched together),
each with the positions :math:`P_h` of its input to patch (every position by default); and
:math:`x \in \{q, k, v\}` one input of the receivers' heads:

1. run 1: the target input with s := s(source) and every head after s frozen at its target
   output, :math:`z_{l',h'} := z_{l',h'}(\text{target})`; feed-forward networks, norms and
   embeddings recomputed, so the change reaches the receivers directly and through the
   feed-forward networks, never through another head. Record :math:`x_h` for every h ∈ R
   (its queries, or the keys or values it attends with);
2. run 2: the target input with :math:`x_h[P_h] := x_h(\text{run 1})[P_h]` for every h ∈ R at
   once, everything else recomputed::

       P[s, r, x] = metric(run 2) - metric(target)

For the receiver ``"logits"`` (the final residual stream, input ``"resid"``) run 1 alone::

       P[s, logits, resid] = metric(run 1) - metric(target)

the sender's change reaching the logits through no head: directly, and through the
feed-forward networks after it (Wang et al.'s path to the logits, which IOI measures for the
name movers).

Keys and values on grouped-query models (``kv``): with ``"query_head"`` (the default) replacing
head h's keys or values changes what h alone sees (a q/k/v editor returns keys and values per
query head, :meth:`~multihead.MultiHeadAttention.register_qkv_editor`; h's siblings on its
key/value head keep theirs); with ``"shared"`` the key/value head ``h // group`` itself is
replaced, so every query head reading it sees the change (TransformerLens's ``hook_k`` and
``hook_v`` are per key/value head). Without grouped heads the two agree.

Both runs are stacked along the batch as in patch_heads
(:class:`~multihead.circuits.paths.path_runs.PathRuns`): run 1 stacks the senders of one layer,
run 2 the (sender, receiver, x) variants of the receivers that start at one layer; the blocks
before the patched layer hand back their outputs from the target run.
:mod:`~multihead.circuits.paths.path_endpoints` reads the senders and
receivers and writes their names.

Shapes: B batch, T query length, S key length, H query heads, Hk key/value heads, D head dim,
E residual width, n stacked variants, N senders, R receiving heads of one layer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_optional_positive_int, describe
from multihead.circuits.graph import KV_MODES, Sender
from multihead.circuits.patching.patch_result import PatchResult
from multihead.circuits.paths.path_endpoints import ReceiverSet, parse_receivers, parse_senders
from multihead.circuits.paths.path_runs import PathRuns, recorded_feed_forward
from multihead.circuits.runs.experiment import Experiment
from multihead.circuits.runs.input_pair import DIRECTIONS
from multihead.circuits.runs.layer_recording import check_recorded
from multihead.circuits.runs.metric import Metric
from multihead.circuits.runs.stacked_runs import stacked_metrics
from multihead.mapping import model_map

__all__ = ["path_patching", "VIA", "RESID"]

logger = logging.getLogger(__name__)

VIA = ("q", "k", "v")
# the logits' one input: the final residual stream
RESID = "resid"


def path_patching(
    model: nn.Module | Experiment,
    clean: Any = None,
    corrupt: Any = None,
    metric: Metric | None = None,
    senders: Sequence[Any] | None = None,
    receivers: Sequence[Any] | None = None,
    *,
    via: Sequence[str] | None = None,
    direction: str = "noise",
    kv: str = "query_head",
    batch_size: int | None = None,
    metric_input: str = "logits",
) -> PatchResult:
    r"""Path patching: the metric's change when a sender's output changes between the runs only
    through the receivers' queries, keys or values (or through no head, to the logits).

    With :math:`s` a sender's output (head (l, h)'s per-head output (B, T, Dv), or block l's
    feed-forward output (B, T, E)) and :math:`x_h` receiving head h's queries (B, T, D), or the
    keys or values (B, S, D) it attends with::

        run 1:  target, s := s(source), every head after s := its target output
                (feed-forward networks and norms recomputed); record x_h, h in the receiver
        run 2:  target, x_h[P_h] := x_h(run 1)[P_h] for every h in the receiver
                (everything else recomputed)
        P[s, r, x]          = metric(run 2) - metric(target)
        P[s, logits, resid] = metric(run 1) - metric(target)

    as Wang et al. (2022) define it (the module docstring says more), with ``(source, target)
    = (corrupt, clean)`` when noising and ``(clean, corrupt)`` when denoising.

    The runs are stacked along the batch, ``batch_size`` variants a forward, and the blocks
    before the patched layer are not run again: with N senders, R receivers and V inputs, N
    variants of run 1 and N·R·V of run 2, besides one whole source forward (a second one for
    feed-forward senders' outputs), one target forward recording the heads to freeze and the
    blocks for prefix reuse, and the check run of the prefix reuse (its blocks handed back). An
    :class:`~multihead.Experiment` given as ``model`` shares these runs with the other functions
    run on it. Between the two runs it holds, per receiver input, N·R·B·(T or S)·D values.

    Args:
        model, clean, corrupt, metric, metric_input: as for :func:`~multihead.patch_heads`.
            Heads are ``(layer, head)`` or ``"L0H1"`` as :func:`~multihead.capture` numbers
            them (negative indices count from the end; on grouped-query models ``head`` is a
            query head), layers in the order the model calls them.
        senders: what changes: heads, ``(layer, head)`` / ``"L0H1"``, and feed-forward
            networks, ``("mlp", layer)`` / ``"mlp3"`` (the block holding attention layer
            ``layer``); each in an earlier layer than every receiving head.
        receivers: where the change is read, each one of: a head, ``(layer, head)`` /
            ``"L1H3"``; a head at chosen positions of its input, ``(layer, head, positions)``
            (an int or ints along the query axis for q, the key axis for k and v; negative from
            the end: ``(9, 9, -1)`` patches the last query); a **list** of such heads patched
            together in one run (``[(7, 3), (7, 9), (8, 6)]``, in any layers); or
            ``"logits"``.
        via: the receivers' inputs: any of ``"q"``, ``"k"``, ``"v"`` (heads) and ``"resid"``
            (the logits'). Default ``("q", "k", "v")``, with ``"resid"`` after them when the
            logits are a receiver. A cell whose receiver has no such input (a head's
            ``"resid"``, the logits' ``"q"``) is NaN.
        direction: ``"noise"`` (default: run the clean input, the sender from the corrupt run)
            or ``"denoise"`` (run the corrupt input, the sender from the clean run, the other
            heads frozen at their corrupt outputs).
        kv: on grouped-query models, what a receiver's keys and values are: ``"query_head"``
            (default: the receiving query head's own, its siblings untouched) or ``"shared"``
            (its key/value head's, seen by every query head of the group).
        batch_size: variants per forward; default as for :func:`~multihead.patch_heads`.

    Returns:
        A :class:`~multihead.PatchResult`: values (len(senders),
        len(receivers), len(via)) in the metric's dtype and device, dims ``("sender",
        "receiver", "via")``, each index named (``names``: ``"L0H1"`` or ``"MLP3"``;
        ``"L1H3"``, ``"L1H3@[6]"``, ``"{L1H3, L1H4}"`` or ``"logits"``; ``"k"``; a cell's label
        ``"L0H1 -> L1H3.k"``), the clean and corrupt metrics beside them. On a tensor-parallel
        model (every rank calling this together) a sender's output and a receiver's inputs are
        replaced on the rank that holds the head, and every rank gets the one-process result.

    Raises:
        ValueError: a sender in the same layer as a receiving head or after it, an unknown
            ``via``, ``direction`` or ``kv``, none given, ``via`` without ``"resid"`` for the
            logits (or without q, k or v for heads), positions out of range, an empty set, a
            set inside a set, a feed-forward network sender of a block that has none (or on a
            tensor-parallel model), ``clean`` and ``corrupt`` with different shapes or keys, a
            metric that does not return a scalar (or (B,)) floating point tensor, heads out of
            range, a bad ``batch_size``.
        TypeError: inputs of another kind, a metric that is not callable, senders or receivers
            of none of the forms above, ``via`` given as one string.

    Example:
        >>> paths = path_patching(lm, clean_ids, corrupt_ids, logit_diff,
        ...                       senders=[(0, 1), "mlp0"], receivers=[(1, 1), "logits"])
        >>> paths.values.shape  # (2, 2, 4): via q, k, v, resid
        >>> paths.top(3), paths.plot()
        >>> # IOI: every S-inhibition head's queries at END, patched together
        >>> path_patching(gpt2, abc, abb, logit_diff, senders=[(l, h) for l in range(7) for h
        ...               in range(12)], receivers=[[(7, 3, -1), (7, 9, -1), (8, 6, -1),
        ...               (8, 10, -1)]], via=("q",))
    """
    check_optional_positive_int("batch_size", batch_size)
    check_choice("direction", direction, DIRECTIONS)
    check_choice("kv", kv, KV_MODES)
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    found, pair = experiment.found, experiment.pair
    mapped = model_map(experiment.model)
    sent = parse_senders(senders, found, mapped)
    received = parse_receivers(receivers, found)
    kinds = _via(via, received)
    _check_order(sent, received)
    if any(s.kind == "mlp" for s in sent) and any(site.shard for site in found):
        raise ValueError(
            "path_patching: feed-forward network senders ('MLP3') on a tensor-parallel model are "
            "not supported (the feed-forward output is split over the ranks): send heads there"
        )
    unique_senders = list(dict.fromkeys(sent))
    unique_kinds = list(dict.fromkeys(kinds))
    head_kinds = [kind for kind in unique_kinds if kind != RESID]
    logits = any(r.logits for r in received)
    receiver_layers = sorted({m.layer for r in received for m in r.members})
    # heads frozen in run 1: after the first sender, up to the last receiver's layer (its inputs
    # are read before its heads run), or to the end when the logits read the stream
    end = len(found) if logits else receiver_layers[-1]
    frozen = list(range(min(s.layer for s in sent) + 1, end))
    head_layers = sorted({s.layer for s in unique_senders if s.kind == "head"})
    mlp_layers = sorted({s.layer for s in unique_senders if s.kind == "mlp"})
    source_name, target_name = experiment.ends(direction)
    caller = "path_patching"

    with torch.no_grad():
        # the source run, whole (its metric is the result's): the senders' outputs, and the
        # first receiving layer's to know the positions T; a feed-forward sender's output is
        # recorded on a run of its own
        seen = sorted({*head_layers, *receiver_layers[:1]})
        recorded_source = experiment.run(
            source_name, sites=[("z", layer) for layer in seen], caller=caller, log=logger
        )
        source_value = recorded_source.value
        outs = {
            layer: recorded_source.sites[("z", layer)]
            for layer in seen
            if ("z", layer) in recorded_source.sites
        }
        check_recorded(found, seen, outs)
        mlps: dict[int, Tensor] = {}
        if mlp_layers:
            with recorded_feed_forward(mapped, mlp_layers) as mlps:
                experiment.value(recorded_source.inputs, f"{source_name} run")
        if receiver_layers:
            length = outs[receiver_layers[0]].shape[1]
            received = [r.resolved(length) for r in received]
        unique_receivers = list(dict.fromkeys(received))
        # the target run, recorded for prefix reuse: the frozen heads' outputs and the metric
        unpatched = experiment.run(
            target_name, sites=[("z", layer) for layer in frozen], prefix=True, caller=caller,
            log=logger,
        )  # fmt: skip
        target_out = {
            layer: unpatched.sites[("z", layer)]
            for layer in frozen
            if ("z", layer) in unpatched.sites
        }
        check_recorded(found, frozen, target_out)
        base = experiment.checked_value(unpatched, f"{target_name} run")
        single, prefix, target = unpatched.output, unpatched.prefix, unpatched.inputs
        held = [*outs.values(), *target_out.values()] or [m.unsqueeze(2) for m in mlps.values()]
        size = experiment.stack_size(batch_size, single, held, logger)

        receiver_heads: dict[int, list[int]] = {}  # layer -> its receiving heads, in order
        for r in unique_receivers:
            for m in r.members:
                heads = receiver_heads.setdefault(m.layer, [])
                if m.head not in heads:
                    heads.append(m.head)
        runs = PathRuns(
            found, mapped, pair, target, prefix, dict(outs), mlps, target_out, receiver_heads,
            head_kinds, end, kv,
        )  # fmt: skip
        table = torch.full(
            (len(unique_senders), len(unique_receivers), len(unique_kinds)), float("nan"),
            dtype=base.dtype, device=base.device,
        )  # fmt: skip
        logit_cells = [
            (j, unique_kinds.index(RESID)) for j, r in enumerate(unique_receivers) if r.logits
        ]
        # run 1, the senders of a layer stacked: the receivers' inputs, senders in ``row`` order
        row: dict[Sender, int] = {}
        parts: list[dict[int, dict[str, Tensor]]] = []
        for layer in sorted({s.layer for s in unique_senders}):
            group = [s for s in unique_senders if s.layer == layer]
            for start in range(0, len(group), size):
                chunk = group[start : start + size]
                row.update({s: len(row) + i for i, s in enumerate(chunk)})
                got, output = runs.senders(layer, chunk)
                parts.append(got)
                if logit_cells:
                    values = stacked_metrics(
                        pair, experiment.metric, output, single, len(chunk),
                        f"senders of layer {layer}, to the logits",
                    )  # fmt: skip
                    for s, value in zip(chunk, values.to(table.dtype) - base, strict=True):
                        for j, x in logit_cells:
                            table[unique_senders.index(s), j, x] = value
        recorded = {
            layer: {kind: torch.cat([p[layer][kind] for p in parts]) for kind in head_kinds}
            for layer in receiver_heads
        }  # receiver layer -> kind -> (N, B, R, T or S, D), senders in row order

        # run 2, the (sender, receiver, kind) variants of the receivers starting at one layer
        starts: dict[int, list[int]] = {}
        for j, r in enumerate(unique_receivers):
            if not r.logits:
                starts.setdefault(r.first_layer, []).append(j)
        for layer, items in sorted(starts.items()):
            variants = [
                (row[s], unique_receivers[j], kind)
                for j in items
                for kind in head_kinds
                for s in unique_senders
            ]
            where = [
                (i, j, unique_kinds.index(kind))
                for j in items
                for kind in head_kinds
                for i in range(len(unique_senders))
            ]
            for start in range(0, len(variants), size):
                chunk_variants = variants[start : start + size]
                output = runs.receivers(layer, chunk_variants, recorded)
                values = stacked_metrics(
                    pair, experiment.metric, output, single, len(chunk_variants),
                    f"receivers from layer {layer}",
                )  # fmt: skip
                index = torch.tensor(where[start : start + size], device=table.device)
                table[index.unbind(1)] = values.to(table.dtype) - base
    sender_index = torch.tensor([unique_senders.index(s) for s in sent], device=table.device)
    receiver_index = [unique_receivers.index(r) for r in received]
    kind_index = torch.tensor([unique_kinds.index(k) for k in kinds], device=table.device)
    names = (
        tuple(s.label for s in sent),
        tuple(r.label for r in received),
        tuple(kinds),
    )
    clean_value, corrupt_value = (
        (base, source_value) if direction == "noise" else (source_value, base)
    )
    values = table[sender_index][:, receiver_index][:, :, kind_index]
    dims = ("sender", "receiver", "via")
    return PatchResult(
        values, dims, "path", direction, float(clean_value), float(corrupt_value), names
    )


def _via(via: object, received: list[ReceiverSet]) -> list[str]:
    """``via``, a non-empty sequence of ``"q"``, ``"k"``, ``"v"``, ``"resid"`` fitting the
    receivers (None: every input they have)."""
    heads = any(not r.logits for r in received)
    logits = any(r.logits for r in received)
    if via is None:
        return [*(VIA if heads else ()), *((RESID,) if logits else ())]
    if isinstance(via, str) or not isinstance(via, Sequence):
        raise TypeError(
            f"via must be a sequence of 'q', 'k', 'v', 'resid' (e.g. ('k',)), got {describe(via)}"
        )
    if not via:
        raise ValueError("via must name at least one of 'q', 'k', 'v', 'resid', got none")
    kinds = [check_choice("via item", kind, (*VIA, RESID)) for kind in via]
    if logits and RESID not in kinds:
        raise ValueError(
            f"via must hold 'resid' (the logits' input, the final residual stream) when "
            f"'logits' is a receiver, got {describe(tuple(kinds))}"
        )
    if heads and not any(kind in VIA for kind in kinds):
        raise ValueError(
            f"via must hold 'q', 'k' or 'v' (a head's inputs) when a head is a receiver, got "
            f"{describe(tuple(kinds))}"
        )
    return kinds


def _check_order(sent: list[Sender], received: list[ReceiverSet]) -> None:
    """Every sender in an earlier layer than every receiving head (ValueError)."""
    members = [m for r in received for m in r.members]
    if not members:
        return
    first = min(members, key=lambda m: m.layer)
    for s in sent:
        if s.layer >= first.layer:
            raise ValueError(
                f"senders item {s.shown} must be in an earlier layer than every receiver, got "
                f"layer {s.layer} and receivers item {(first.layer, first.head)} in layer "
                f"{first.layer}: path patching follows what a sender writes into a later "
                f"head's inputs"
            )
