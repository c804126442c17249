"""Path patching: does a head's change reach the metric through a later head's q, k or v?

Activation patching (:func:`~multihead.circuits.patching.patch_heads`) says that a head matters;
path patching (Wang et al. 2022, "Interpretability in the Wild", the IOI circuit) says through
which later head, and through which of its inputs. For a sender head s, a receiver head r in a
later layer and one of r's inputs x ∈ {q, k, v}:

1. run the clean input with s's per-head output taken from the corrupt run and every other
   head's output frozen at its clean value; feed-forward networks, norms and embeddings are
   recomputed, so the change reaches r directly and through the feed-forward networks, never
   through another head. Record r's x (its queries, or the keys or values its query head sees);
2. run the clean input with only r's x replaced by the recorded one (everything else
   recomputed);
3. the effect is metric(run 2) - metric(clean).

Both runs are stacked along the batch as in patch_heads (:func:`~multihead.circuits.stacked_runs.
run_stacked`): run 1 stacks the senders of one layer (one variant each, recording every
receiver's inputs at once, and stopping after the last receiver's layer has been read), run 2
the (sender, receiver, x) variants of one receiver layer; the blocks before the patched layer
hand back their outputs from the clean run (:class:`~multihead.circuits.prefix_reuse.PrefixCache`).
A receiver's x is replaced by a q/k/v editor
(:meth:`~multihead.MultiHeadAttention.register_qkv_editor`): on a grouped-query model the keys
and values come back per query head, so r's siblings on its key/value head keep their own.

Shapes: B batch, T query length, S key length, H query heads, Hk key/value heads, D head dim,
n stacked variants, N senders, R receivers of one layer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice, check_optional_positive_int, describe, is_int
from multihead.circuits.experiment import Experiment
from multihead.circuits.input_pair import InputPair, Metric
from multihead.circuits.patch_result import PatchResult
from multihead.circuits.patching import check_recorded, record_layers
from multihead.circuits.prefix_reuse import PrefixCache
from multihead.circuits.stacked_runs import (
    EndOfRun,
    run_stacked,
    stacked_metrics,
)
from multihead.circuits.steering import HeadKey, resolve_head
from multihead.head_shard import held_heads
from multihead.observers import (
    AttentionCall,
    AttentionObserver,
    ObservableAttention,
    ObserverHandle,
    QKVEditor,
)
from multihead.sites import HeadName, head_label

__all__ = ["path_patching", "VIA"]

logger = logging.getLogger(__name__)

VIA = ("q", "k", "v")


def path_patching(
    model: nn.Module,
    clean: Any,
    corrupt: Any,
    metric: Metric,
    senders: Sequence[HeadName],
    receivers: Sequence[HeadName],
    *,
    via: Sequence[str] = VIA,
    batch_size: int | None = None,
    metric_input: str = "logits",
) -> PatchResult:
    r"""Path patching: the metric's change when a sender head's output changes from clean to
    corrupt only through a receiver head's queries, keys or values.

    With :math:`z_s(x)` sender s's per-head output (B, T, Dv) on input x and :math:`x_r`
    receiver r's queries (B, T, D), or the keys or values (B, S, D) its query head attends
    with::

        run 1:  clean, z_s := z_s(corrupt), every other head's output := its clean value
                (feed-forward networks and norms recomputed); record x_r
        run 2:  clean, x_r := x_r(run 1)                     (everything else recomputed)
        P[s, r, x] = metric(run 2) - metric(clean)

    as Wang et al. (2022) define it. A sender changes its receiver directly and through the
    feed-forward networks between them, never through another head; a receiver's effect goes
    on to the metric through everything after it. On a grouped-query model replacing r's keys
    or values leaves the query heads that share its key/value head as they were.

    The runs are stacked along the batch, ``batch_size`` variants a forward, and the blocks
    before the patched layer are not run again (see the module docstring): with N senders, R
    receivers and V inputs, N variants of run 1 and N·R·V of run 2, besides one corrupt
    forward (to the last sender's layer), one clean forward recording the heads to freeze (to
    the last receiver's layer), and the clean and check runs of the prefix reuse. Between the
    two runs it holds, per receiver input, N·R·B·(T or S)·D values.

    Args:
        model, clean, corrupt, metric, metric_input: as for :func:`~multihead.patch_heads`.
            Heads are ``(layer, head)`` as :func:`~multihead.capture` numbers them (negative indices
            count from the end; on grouped-query models ``head`` is a query head), layers in
            the order the model calls them.
        senders: the heads whose output changes, each in an earlier layer than every receiver.
        receivers: the heads whose inputs carry the change.
        via: which inputs of the receiver: any of ``"q"``, ``"k"``, ``"v"``.
        batch_size: variants per forward; default as for :func:`~multihead.patch_heads`.

    Returns:
        A :class:`~multihead.circuits.patch_result.PatchResult`: values (len(senders),
        len(receivers), len(via)) in the metric's dtype and device, dims ``("sender",
        "receiver", "via")``, each index named (``names``: ``"L0H1"``, ``"L1H3"``, ``"k"``; a
        cell's label ``"L0H1 -> L1H3.k"``), the clean and corrupt metrics beside them. On a
        tensor-parallel model (every rank calling this together) a sender's output and a
        receiver's inputs are replaced on the rank that holds the head, and every rank gets the
        one-process result.

    Raises:
        ValueError: a sender in the same layer as a receiver or after it, an unknown ``via``,
            none of them given, ``clean`` and ``corrupt`` with different shapes or keys, a
            metric that does not return a scalar (or (B,)) floating point tensor, heads out of
            range, a bad ``batch_size``.
        TypeError: inputs of another kind, a metric that is not callable, heads that are not
            ``(layer, head)`` pairs of ints, ``via`` given as one string.

    Example:
        >>> paths = path_patching(lm, clean_ids, corrupt_ids, logit_diff,
        ...                       senders=[(0, 1)], receivers=[(1, 1)])  # (1, 1, 3)
        >>> paths.values[0, 0]  # via q, k, v
        >>> paths.top(3), paths.plot()
    """
    check_optional_positive_int("batch_size", batch_size)
    experiment = Experiment.of(model, clean, corrupt, metric, metric_input)
    found, pair = experiment.found, experiment.pair
    sent = _heads("senders", senders, found)
    received = _heads("receivers", receivers, found)
    kinds = _via(via)
    first = min(received)
    for key in sent:
        if key[0] >= first[0]:
            raise ValueError(
                f"senders item {key} must be in an earlier layer than every receiver, got layer "
                f"{key[0]} and receivers item {first} in layer {first[0]}: path patching follows "
                f"what a sender writes into a later head's inputs"
            )
    unique_senders = list(dict.fromkeys(sent))
    unique_receivers = list(dict.fromkeys(received))
    unique_kinds = list(dict.fromkeys(kinds))
    sender_layers = sorted({layer for layer, _ in unique_senders})
    receiver_heads: dict[int, list[int]] = {}
    for layer, head in unique_receivers:
        receiver_heads.setdefault(layer, []).append(head)
    frozen = list(range(sender_layers[0] + 1, max(receiver_heads)))

    with torch.no_grad():
        with record_layers(found, sender_layers) as recorded_corrupt:
            corrupt_value = experiment.value(pair.corrupt, "corrupt run")
        check_recorded(found, sender_layers, recorded_corrupt)
        corrupt_out = dict(recorded_corrupt)
        clean_out = _recorded(found, pair, pair.clean, frozen) if frozen else {}
        unpatched = experiment.unpatched(
            pair.clean, "clean run", caller="path_patching", log=logger
        )
        base, single, prefix = unpatched.value, unpatched.output, unpatched.prefix
        size = experiment.stack_size(
            batch_size, single, [*corrupt_out.values(), *clean_out.values()], logger
        )

        runs = _Runs(found, pair, prefix, corrupt_out, clean_out, receiver_heads, unique_kinds)
        # run 1, the senders of a layer stacked: the receivers' inputs, senders in ``row`` order
        row: dict[HeadKey, int] = {}
        parts: list[dict[int, dict[str, Tensor]]] = []
        for layer in sender_layers:
            heads = [head for sender_layer, head in unique_senders if sender_layer == layer]
            for start in range(0, len(heads), size):
                chunk = heads[start : start + size]
                row.update({(layer, head): len(row) + i for i, head in enumerate(chunk)})
                parts.append(runs.senders(layer, chunk))
        recorded = {
            receiver: {kind: torch.cat([p[receiver][kind] for p in parts]) for kind in unique_kinds}
            for receiver in receiver_heads
        }  # receiver layer -> kind -> (N, B, R, T or S, D)

        # run 2, the (sender, receiver, kind) variants of a receiver layer stacked
        table = torch.empty(
            len(unique_senders), len(unique_receivers), len(unique_kinds),
            dtype=base.dtype, device=base.device,
        )  # fmt: skip
        for layer, heads in receiver_heads.items():
            variants = [
                (row[sender], head, slot, kind)
                for slot, head in enumerate(heads)
                for sender in unique_senders
                for kind in range(len(unique_kinds))
            ]
            where = [
                (i, unique_receivers.index((layer, head)), kind)
                for head in heads
                for i in range(len(unique_senders))
                for kind in range(len(unique_kinds))
            ]
            for start in range(0, len(variants), size):
                values = runs.receivers(
                    layer,
                    variants[start : start + size],
                    recorded[layer],
                    experiment.metric,
                    single,
                )
                index = torch.tensor(where[start : start + size], device=table.device)
                table[index.unbind(1)] = values.to(table.dtype) - base
    pick = [
        torch.tensor([order.index(key) for key in keys], device=table.device)
        for order, keys in ((unique_senders, sent), (unique_receivers, received))
    ]
    kind_index = torch.tensor([unique_kinds.index(k) for k in kinds], device=table.device)
    names = (
        tuple(head_label(*key) for key in sent),
        tuple(head_label(*key) for key in received),
        tuple(kinds),
    )
    return PatchResult(
        table[pick[0]][:, pick[1]][:, :, kind_index], ("sender", "receiver", "via"), "path",
        "noise", float(base), float(corrupt_value), names,
    )  # fmt: skip


def _heads(name: str, keys: object, found: list[tuple[str, ObservableAttention]]) -> list[HeadKey]:
    """``keys``, a non-empty sequence of ``(layer, head)`` pairs, resolved in order."""
    if isinstance(keys, (str, bytes, Tensor)) or not isinstance(keys, Sequence):
        raise TypeError(f"{name} must be a sequence of (layer, head) pairs, got {describe(keys)}")
    if len(keys) == 2 and all(is_int(k) for k in keys):
        raise TypeError(
            f"{name} must be a sequence of (layer, head) pairs, got {describe(keys)} (one pair: "
            f"write [{describe(tuple(keys))}])"
        )
    if not keys:
        raise ValueError(f"{name} must name at least one (layer, head) pair, got none")
    return [resolve_head(f"{name} item", key, found) for key in keys]


def _via(via: object) -> list[str]:
    """``via``, a non-empty sequence of ``"q"``, ``"k"``, ``"v"``."""
    if isinstance(via, str) or not isinstance(via, Sequence):
        raise TypeError(
            f"via must be a sequence of 'q', 'k', 'v' (e.g. ('k',)), got {describe(via)}"
        )
    if not via:
        raise ValueError("via must name at least one of 'q', 'k', 'v', got none")
    return [check_choice("via item", kind, VIA) for kind in via]


def _recorded(
    found: list[tuple[str, ObservableAttention]],
    pair: InputPair,
    inputs: Any,
    layers: list[int],
) -> dict[int, Tensor]:
    """layer -> its per-head output (B, T, H, Dv) on ``inputs``, the forward ended after the
    last of ``layers``."""
    last = found[layers[-1]][1]

    def end(call: AttentionCall, out: Tensor) -> None:
        raise EndOfRun

    with record_layers(found, layers) as recorded, last.register_observer(end):
        with contextlib.suppress(EndOfRun):
            pair.run(inputs)
    check_recorded(found, layers, recorded)
    return dict(recorded)


def _stacked(call_tensor: Tensor, n: int, batch: int, layer: int) -> Tensor:
    """(n·B, ...) -> (n, B, ...), or a ValueError for a layer called on another batch."""
    if call_tensor.shape[0] != n * batch:
        raise ValueError(
            f"path_patching: layer {layer} was called on a batch of {call_tensor.shape[0]} in a "
            f"run of {n} stacked variants of {batch}; patch only layers the model calls once "
            f"on the whole input"
        )
    return call_tensor.unflatten(0, (n, batch))


class _Runs:
    """The stacked runs of one :func:`path_patching` call, on the clean input: run 1 for some
    senders of one layer, run 2 for some variants of one receiver layer.

    Args:
        found: the model's attention sites.
        pair: the clean and corrupt inputs.
        prefix: the clean run's block outputs, or None (full forwards).
        corrupt_out: sender layer -> its per-head output (B, T, H, Dv) on corrupt.
        clean_out: layer -> its per-head output on clean, for every layer to freeze.
        receiver_heads: receiver layer -> its receivers' heads (R), in order.
        kinds: the receivers' inputs to record, of "q", "k", "v".
    """

    def __init__(
        self,
        found: list[tuple[str, ObservableAttention]],
        pair: InputPair,
        prefix: PrefixCache | None,
        corrupt_out: dict[int, Tensor],
        clean_out: dict[int, Tensor],
        receiver_heads: dict[int, list[int]],
        kinds: list[str],
    ) -> None:
        self.found = found
        self.pair = pair
        self.prefix = prefix
        self.corrupt_out = corrupt_out
        self.clean_out = clean_out
        self.receiver_heads = receiver_heads
        self.kinds = kinds
        self.last = max(receiver_heads)

    def senders(self, layer: int, heads: list[int]) -> dict[int, dict[str, Tensor]]:
        """Run 1 for the senders ``heads`` of ``layer``, one stacked variant each: receiver
        layer -> kind -> the receivers' inputs (n, B, R, T or S, D), keys and values those of
        each receiver's key/value head."""
        got: dict[int, dict[str, Tensor]] = {}

        def attach() -> list[ObserverHandle]:
            got.clear()  # a run repeated (the prefix reuse's check failed) records anew
            return self._sender_hooks(layer, heads, got)

        run_stacked(
            self.pair, self.pair.clean, len(heads), layer, self.prefix, attach, "path_patching"
        )
        missing = [receiver for receiver in self.receiver_heads if receiver not in got]
        if missing:
            raise ValueError(
                f"the model did not call attention layer {missing[0]} "
                f"({self.found[missing[0]][0]}) on the inputs: there is nothing to patch there"
            )
        return got

    def _sender_hooks(
        self, layer: int, heads: list[int], got: dict[int, dict[str, Tensor]]
    ) -> list[ObserverHandle]:
        """Register run 1: the sender's output from corrupt, every head of the later layers
        before the last receiver's frozen at clean, the receivers' inputs into ``got``; the
        run ends at the last receiver's layer."""
        n = len(heads)
        src = self.corrupt_out[layer]  # (B, T, H, Dv)
        batch = self.pair.batch
        site = self.found[layer][1]
        patched = torch.zeros(n, 1, 1, site.num_heads, 1, dtype=torch.bool)
        patched[torch.arange(n), 0, 0, heads] = True
        held = held_heads(site.num_heads, site.head_shard)  # another rank's sender: its rank's
        patched = patched[:, :, :, held.start : held.stop].to(src.device)  # (n, 1, 1, H, 1)

        def sender(call: AttentionCall, out: Tensor) -> Tensor:
            stacked = _stacked(out, n, batch, layer)  # (n, B, T, H, Dv)
            return torch.where(patched, src.to(out.dtype), stacked).flatten(0, 1)

        def freeze(frozen: int) -> AttentionObserver:
            def observer(call: AttentionCall, out: Tensor) -> Tensor:
                _stacked(out, n, batch, frozen)
                return self.clean_out[frozen].to(out.dtype).repeat(n, 1, 1, 1)  # (n·B, T, H, Dv)

            return observer

        def record(receiver: int) -> QKVEditor:
            site = self.found[receiver][1]
            # the receivers this rank's calls hold, (R,) on the site's device, made here: no
            # copy from the host inside the forward
            heads_r = self._held(receiver)[1]
            index = torch.tensor(heads_r, dtype=torch.long, device=next(site.parameters()).device)

            def editor(call: AttentionCall) -> None:
                group = call.q.shape[1] // call.k.shape[1]  # query heads per key/value head
                for kind in self.kinds:
                    x = _stacked(getattr(call, kind), n, batch, receiver)  # (n, B, H/Hk, ., D)
                    chosen = index if kind == "q" else index // group  # the key/value heads
                    got.setdefault(receiver, {})[kind] = x.index_select(2, chosen.to(x.device))
                    # (n, B, R, T or S, D)
                if receiver == self.last:
                    raise EndOfRun  # nothing after the last receiver's inputs is needed

            return editor

        handles: list[ObserverHandle] = []
        try:
            handles.append(self.found[layer][1].register_observer(sender))
            for frozen in range(layer + 1, self.last):
                handles.append(self.found[frozen][1].register_observer(freeze(frozen)))
            for receiver in self.receiver_heads:
                handles.append(self.found[receiver][1].register_qkv_editor(record(receiver)))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def _held(self, layer: int) -> tuple[dict[int, int], list[int]]:
        """The receivers of ``layer`` this rank's calls hold (all without tensor parallelism):
        (their slot among the layer's receivers -> their slot among the held ones, their heads
        among the call's heads)."""
        site = self.found[layer][1]
        held = held_heads(site.num_heads, site.head_shard)
        receivers = self.receiver_heads[layer]
        mine = [(slot, head) for slot, head in enumerate(receivers) if head in held]
        slots = {slot: j for j, (slot, _) in enumerate(mine)}
        return slots, [head - held.start for _, head in mine]

    def receivers(
        self,
        layer: int,
        variants: list[tuple[int, int, int, int]],
        recorded: dict[str, Tensor],
        metric: Metric,
        single: Any,
    ) -> Tensor:
        """Run 2 for ``variants`` of receiver layer ``layer`` (sender row, receiver head, its
        slot among the layer's receivers, index into the kinds), one stacked variant each: the
        metric of each (n,). ``recorded`` holds the receivers this rank holds (all of them
        without tensor parallelism); another rank's receiver is edited by its rank."""
        n = len(variants)
        slots, heads = self._held(layer)
        own = [
            (i, row, heads[slots[slot]], slots[slot], kind)
            for i, (row, _, slot, kind) in enumerate(variants)
            if slot in slots
        ]
        editor = _receiver_editor(layer, n, own, self.kinds, recorded, self.pair.batch)
        site = self.found[layer][1]
        output = run_stacked(
            self.pair, self.pair.clean, n, layer, self.prefix,
            lambda: [site.register_qkv_editor(editor)], "path_patching",
        )  # fmt: skip
        return stacked_metrics(self.pair, metric, output, single, n, f"receivers, layer {layer}")


def _receiver_editor(
    layer: int,
    n: int,
    variants: list[tuple[int, int, int, int, int]],
    kinds: list[str],
    recorded: dict[str, Tensor],
    batch: int,
) -> QKVEditor:
    """The q/k/v editor of run 2 for ``n`` stacked variants, of which ``variants`` (its place
    in the stack, sender row, receiver head among the call's, its slot in ``recorded``, index
    into ``kinds``) are edited here: the receiver's input of that kind from ``recorded`` (kind
    -> (N, B, R, T or S, D))."""
    device = next(iter(recorded.values())).device
    # kind -> (places, heads, rows, slots), each (n_kind,): built on the host and copied to the
    # device once, before any forward
    chosen: dict[str, tuple[Tensor, ...]] = {}
    for i, kind in enumerate(kinds):
        mine = [(place, head, row, slot) for place, row, head, slot, k in variants if k == i]
        if mine:
            chosen[kind] = torch.tensor(mine, dtype=torch.long).to(device).unbind(1)

    def editor(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
        new = {"q": call.q, "k": call.k, "v": call.v}
        h = call.q.shape[1]
        for kind in kinds:  # every rank checks the shapes, whether it edits or not
            _stacked(new[kind], n, batch, layer)
        for kind, (place, head, row, slot) in chosen.items():
            x = _stacked(new[kind], n, batch, layer)  # (n, B, H or Hk, T or S, D)
            # keys and values per query head: the receiver's siblings keep their own
            x = x.repeat_interleave(h // x.shape[2], dim=2) if x.shape[2] != h else x.clone()
            x[place, :, head] = recorded[kind][row, :, slot].to(x.dtype)
            new[kind] = x.flatten(0, 1)
        return new["q"], new["k"], new["v"]

    return editor
