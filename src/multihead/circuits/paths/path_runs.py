"""The stacked runs of one path patching call (:func:`~multihead.path_patching`,
whose module docstring defines them), on the target input:

- run 1 for some senders of one layer, one stacked variant each: the sender's output (a head's,
  by an observer; a feed-forward network's, by a forward hook) from the source run, every head
  after it frozen at the target run, the receivers' q, k and v recorded by q/k/v editors (the
  run stopping once the last receiver's inputs are read, unless the logits are a receiver);
- run 2 for some (sender, receiver, input) variants of the receivers that start at one layer:
  a q/k/v editor on every layer a receiver's heads are in replaces their input at their
  positions with run 1's.

Both go through :func:`~multihead.circuits.runs.stacked_runs.run_stacked` (the blocks before the
patched layer hand back their target-run outputs). Under tensor parallelism each rank patches
and records the heads it holds.

Shapes: B batch, T query length, S key length, H query heads, Hk key/value heads, D head dim,
E residual width, n stacked variants, N senders, R receiving heads of one layer, e edits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.graph import Sender
from multihead.circuits.paths.path_endpoints import Member, ReceiverSet
from multihead.circuits.runs.input_pair import InputPair
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.circuits.runs.stacked_runs import EndOfRun, run_stacked
from multihead.head_shard import held_heads
from multihead.map_types import ModelMap, Site, output_tensor, with_output_tensor
from multihead.observers import (
    AttentionCall,
    AttentionObserver,
    QKVEditor,
    Removable,
    registered,
)

__all__ = ["PathRuns", "recorded_feed_forward"]


@contextlib.contextmanager
def recorded_feed_forward(mapped: ModelMap, layers: list[int]) -> Iterator[dict[int, Tensor]]:
    """Within the block, ``recorded[layer]`` is the output (B, T, E) of the feed-forward
    network of the block holding attention layer ``layer`` (its latest call), detached."""
    recorded: dict[int, Tensor] = {}

    def make(layer: int) -> Any:
        def hook(m: nn.Module, args: Any, out: Any) -> None:
            recorded[layer] = output_tensor(out).detach()

        return hook

    def hooks() -> Iterator[Removable]:
        for layer in layers:
            yield _mlp(mapped, layer).register_forward_hook(make(layer))

    with registered(hooks()):
        yield recorded


def _all_or_none(registrations: Iterator[Removable]) -> list[Removable]:
    """Make every registration (run_stacked removes them after its run), or, one failing, none:
    those made are removed and the error raised."""
    made: list[Removable] = []
    try:
        made.extend(registrations)
    except BaseException:
        for handle in made:
            handle.remove()
        raise
    return made


def _mlp(mapped: ModelMap, layer: int) -> nn.Module:
    """The feed-forward network of the block holding attention layer ``layer`` (checked to
    exist when the senders were read)."""
    module = mapped.stack_block(layer, "a feed-forward network sender").mlp
    assert module is not None
    return module


def _stacked(call_tensor: Tensor, n: int, batch: int, layer: int) -> Tensor:
    """(n·B, ...) -> (n, B, ...), or a ValueError for a layer called on another batch."""
    if call_tensor.shape[0] != n * batch:
        raise ValueError(
            f"path_patching: layer {layer} was called on a batch of {call_tensor.shape[0]} in a "
            f"run of {n} stacked variants of {batch}; patch only layers the model calls once "
            f"on the whole input"
        )
    return call_tensor.unflatten(0, (n, batch))


class PathRuns:
    """The stacked runs of one path patching call, on the target input: run 1 for some
    senders of one layer, run 2 for some variants of the receivers that start at one layer.

    Args:
        found: the model's attention sites; mapped: its map (the feed-forward networks).
        pair, target: the two inputs, and the one the runs are of.
        prefix: the target run's block outputs, or None (full forwards).
        sources: head sender layer -> its per-head output (B, T, H, Dv) on the source input.
        mlps: feed-forward sender layer -> its output (B, T, E) on the source input.
        frozen_out: layer -> its per-head output on the target input, every layer to freeze.
        receiver_heads: receiver layer -> its receiving heads, in order.
        kinds: the receivers' inputs to record, of "q", "k", "v".
        end: run 1 freezes the layers before ``end`` (after the sender's); it stops at the last
            receiver's layer unless ``end`` is the model's depth (the logits are a receiver).
        kv: ``"query_head"`` or ``"shared"`` (:func:`~multihead.path_patching`).
    """

    def __init__(
        self,
        found: list[Site],
        mapped: ModelMap,
        pair: InputPair,
        target: Any,
        prefix: PrefixCache | None,
        sources: dict[int, Tensor],
        mlps: dict[int, Tensor],
        frozen_out: dict[int, Tensor],
        receiver_heads: dict[int, list[int]],
        kinds: list[str],
        end: int,
        kv: str,
    ) -> None:
        self.found = found
        self.mapped = mapped
        self.pair = pair
        self.target = target
        self.prefix = prefix
        self.sources = sources
        self.mlps = mlps
        self.frozen_out = frozen_out
        self.receiver_heads = receiver_heads
        self.kinds = kinds
        self.end = end
        self.kv = kv
        # the run stops once the last receiver's inputs are read, unless the logits are read
        self.stop = max(receiver_heads) if receiver_heads and end < len(found) else None

    def senders(self, layer: int, chunk: list[Sender]) -> tuple[dict[int, dict[str, Tensor]], Any]:
        """Run 1 for the senders ``chunk`` of ``layer``, one stacked variant each: (receiver
        layer -> kind -> the receivers' inputs (n, B, R, T or S, D), keys and values those of
        each receiver's key/value head; the run's output, None when it stopped early)."""
        got: dict[int, dict[str, Tensor]] = {}

        # (run_stacked's handles: observers' and, for a feed-forward sender, a torch hook's)
        def attach() -> list[Any]:
            got.clear()  # a run repeated (the prefix reuse's check failed) records anew
            return self._sender_hooks(layer, chunk, got)

        output = run_stacked(
            self.pair, self.target, len(chunk), layer, self.prefix, attach, "path_patching"
        )
        missing = [receiver for receiver in self.receiver_heads if receiver not in got]
        if missing:
            raise ValueError(
                f"the model did not call attention layer {missing[0]} "
                f"({self.found[missing[0]].name}) on the inputs: there is nothing to patch there"
            )
        return got, output

    def _sender_hooks(
        self, layer: int, chunk: list[Sender], got: dict[int, dict[str, Tensor]]
    ) -> list[Removable]:
        """Register run 1: each variant's sender from the source run, every head of the
        layers after ``layer`` and before ``end`` frozen at the target run, the receivers'
        inputs into ``got``."""
        n, batch = len(chunk), self.pair.batch

        def freeze(frozen: int) -> AttentionObserver:
            def observer(call: AttentionCall, out: Tensor) -> Tensor:
                _stacked(out, n, batch, frozen)
                return self.frozen_out[frozen].to(out.dtype).repeat(n, 1, 1, 1)  # (n·B, T, H, Dv)

            return observer

        def record(receiver: int) -> QKVEditor:
            site = self.found[receiver].attention
            # the receivers this rank's calls hold, (R,) on the site's device, made here: no
            # copy from the host inside the forward
            local = [head for _, head in self._held(receiver).values()]
            index = torch.tensor(local, dtype=torch.long, device=next(site.parameters()).device)

            def editor(call: AttentionCall) -> None:
                group = call.q.shape[1] // call.k.shape[1]  # query heads per key/value head
                for kind in self.kinds:
                    x = _stacked(getattr(call, kind), n, batch, receiver)  # (n, B, H/Hk, ., D)
                    chosen = index if kind == "q" else index // group  # the key/value heads
                    got.setdefault(receiver, {})[kind] = x.index_select(2, chosen.to(x.device))
                    # (n, B, R, T or S, D)
                if receiver == self.stop:
                    raise EndOfRun  # nothing after the last receiver's inputs is needed

            return editor

        def hooks() -> Iterator[Removable]:
            heads = [(i, s.head) for i, s in enumerate(chunk) if s.kind == "head"]
            if heads:
                yield self.found[layer].attention.register_observer(
                    self._head_sender(layer, n, heads)
                )
            mlp = [i for i, s in enumerate(chunk) if s.kind == "mlp"]
            if mlp:
                yield _mlp(self.mapped, layer).register_forward_hook(
                    self._mlp_sender(layer, n, mlp)
                )
            for frozen in range(layer + 1, self.end):
                yield self.found[frozen].attention.register_observer(freeze(frozen))
            for receiver in self.receiver_heads:
                yield self.found[receiver].attention.register_qkv_editor(record(receiver))

        return _all_or_none(hooks())

    def _head_sender(self, layer: int, n: int, heads: list[tuple[int, int]]) -> AttentionObserver:
        """The observer giving variant i its sender head's output from the source run."""
        src = self.sources[layer]  # (B, T, H, Dv)
        batch = self.pair.batch
        site = self.found[layer].attention
        patched = torch.zeros(n, 1, 1, site.num_heads, 1, dtype=torch.bool)
        for i, head in heads:
            patched[i, 0, 0, head] = True
        held = held_heads(site.num_heads, site.head_shard)  # another rank's sender: its rank's
        patched = patched[:, :, :, held.start : held.stop].to(src.device)  # (n, 1, 1, H, 1)

        def sender(call: AttentionCall, out: Tensor) -> Tensor:
            stacked = _stacked(out, n, batch, layer)  # (n, B, T, H, Dv)
            return torch.where(patched, src.to(out.dtype), stacked).flatten(0, 1)

        return sender

    def _mlp_sender(self, layer: int, n: int, places: list[int]) -> Any:
        """The forward hook giving the variants ``places`` the feed-forward output of the
        source run (a packed model's (N, E) rows as well as (B, T, E))."""
        src = self.mlps[layer]
        patched = torch.zeros(n, dtype=torch.bool)
        patched[places] = True
        patched = patched.reshape(n, *[1] * src.dim()).to(src.device)  # (n, 1, ...)

        def hook(m: nn.Module, args: Any, out: Any) -> Any:
            first = output_tensor(out)
            if first.shape != (n * src.shape[0], *src.shape[1:]):
                raise ValueError(
                    f"path_patching: the feed-forward network of block {layer} gave "
                    f"{tuple(first.shape)} in a run of {n} stacked variants of "
                    f"{tuple(src.shape)}; send only feed-forward networks the model calls once "
                    f"on the whole input"
                )
            new = torch.where(patched, src.to(first.dtype), first.unflatten(0, (n, -1)))
            return with_output_tensor(out, new.flatten(0, 1))

        return hook

    def _held(self, layer: int) -> dict[int, tuple[int, int]]:
        """The receiving heads of ``layer`` this rank's calls hold (all of them without tensor
        parallelism): global head -> (its slot among the held ones, as recorded; its index
        among the call's heads)."""
        site = self.found[layer].attention
        held = held_heads(site.num_heads, site.head_shard)
        mine = [head for head in self.receiver_heads[layer] if head in held]
        return {head: (slot, head - held.start) for slot, head in enumerate(mine)}

    def receivers(
        self,
        layer: int,
        variants: list[tuple[int, ReceiverSet, str]],
        recorded: dict[int, dict[str, Tensor]],
    ) -> Any:
        """Run 2 for ``variants`` (sender row, receiver, kind) of the receivers that start at
        ``layer``, one stacked variant each: the run's output. ``recorded`` holds, per layer,
        the receiving heads this rank holds (all of them without tensor parallelism); another
        rank's head is edited by its rank."""
        n = len(variants)
        edits: dict[int, list[tuple[int, int, str, Member]]] = {}  # layer -> its edits
        for place, (row, receiver, kind) in enumerate(variants):
            for member in receiver.members:
                edits.setdefault(member.layer, []).append((place, row, kind, member))
        editors = {
            at: self._receiver_editor(at, n, changes, recorded[at]) for at, changes in edits.items()
        }

        def attach() -> list[Any]:
            return _all_or_none(
                self.found[at].attention.register_qkv_editor(editor)
                for at, editor in editors.items()
            )

        return run_stacked(self.pair, self.target, n, layer, self.prefix, attach, "path_patching")

    def _receiver_editor(
        self,
        layer: int,
        n: int,
        edits: list[tuple[int, int, str, Member]],
        recorded: dict[str, Tensor],
    ) -> QKVEditor:
        """The q/k/v editor of run 2 at ``layer`` for ``n`` stacked variants: each edit (its
        place in the stack, sender row, kind, receiving head) replaces the head's input of that
        kind at its positions with ``recorded``'s (kind -> (N, B, R, T or S, D)), where this
        rank holds the head."""
        held = self._held(layer)
        site = self.mapped.sites[layer]
        group = site.num_heads // site.num_kv_heads
        length = next(iter(recorded.values())).shape[3]
        device = next(iter(recorded.values())).device
        # kind -> (place, head among the call's) -> (row, slot, positions or None: every one);
        # a head edited twice in one variant (siblings on one key/value head, kv="shared")
        # takes its positions together
        merged: dict[str, dict[tuple[int, int], tuple[int, int, set[int] | None]]] = {}
        for place, row, kind, member in edits:
            if member.head not in held:
                continue
            slot, local = held[member.head]
            unit = local // group if kind != "q" and self.kv == "shared" else local
            at = None if member.positions is None else set(member.positions)
            before = merged.setdefault(kind, {}).get((place, unit))
            if before is not None:
                at = None if at is None or before[2] is None else at | before[2]
            merged[kind][(place, unit)] = (row, slot, at)
        # kind -> (places, units, rows, slots (e,), positions (e, T or S)): built on the host
        # and copied to the device once, before any forward
        chosen: dict[str, tuple[Tensor, ...]] = {}
        for kind, cells in merged.items():
            mask = torch.zeros(len(cells), length, dtype=torch.bool)
            for i, (_, _, at) in enumerate(cells.values()):
                mask[i, slice(None) if at is None else sorted(at)] = True
            index = torch.tensor(
                [(place, unit, row, slot) for (place, unit), (row, slot, _) in cells.items()]
            )
            chosen[kind] = (*index.to(device).unbind(1), mask.to(device))
        kinds = sorted({kind for _, _, kind, _ in edits})
        batch, per_query_head = self.pair.batch, self.kv == "query_head"

        def editor(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor]:
            new = {"q": call.q, "k": call.k, "v": call.v}
            h = call.q.shape[1]
            for kind in kinds:  # every rank checks the shapes, whether it edits or not
                _stacked(new[kind], n, batch, layer)
            for kind, (place, unit, row, slot, mask) in chosen.items():
                x = _stacked(new[kind], n, batch, layer)  # (n, B, H or Hk, T or S, D)
                if per_query_head and x.shape[2] != h:
                    # keys and values per query head: the receiver's siblings keep their own
                    x = x.repeat_interleave(h // x.shape[2], dim=2)
                else:
                    x = x.clone()
                mine = recorded[kind][row, :, slot].to(x.dtype)  # (e, B, T or S, D)
                x[place, :, unit] = torch.where(mask[:, None, :, None], mine, x[place, :, unit])
                new[kind] = x.flatten(0, 1)
            return new["q"], new["k"], new["v"]

        return editor
