"""Steer heads, not only watch them: ablate, scale, mean-ablate or patch a head's output.

A head exists as itself in one place only: its output (B, T, Dv) before the output projection
mixes the heads, ``out = [head_1; ...; head_H] W^O``. Editing head h there is exactly editing the
columns ``h·Dv:(h+1)·Dv`` of ``W^O``: zeroing the head equals zeroing those columns, scaling it
equals scaling them. After ``out_proj`` the heads are summed and no edit of one is possible.
Everything here is an observer on that per-head output
(:meth:`multihead.MultiHeadAttention.register_observer`); no layer has another path.

- :func:`intervene` edits chosen ``(layer, head)`` outputs inside a ``with`` block.
- :func:`record_heads` records them, e.g. on one input to patch into a run on another
  (activation patching).
- :func:`multihead.circuits.importance.head_importance` scores every head (ablation or gradient).

``layer`` numbers the model's attention modules in module order, as :func:`multihead.capture`
does (:func:`multihead.mapping.attention_modules`); ``head`` is a query head. With grouped
query heads (H > Hk) an edit of query head h leaves the other query heads that share its
key/value head untouched: the per-head output is per query head.

Shapes: B batch, T queries, H query heads, Dv the width of one head's output.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch
from torch import Tensor, nn

from multihead._checks import describe
from multihead.head_shard import held_heads
from multihead.heads import HeadKey, HeadName, parse_head, resolve_head
from multihead.map_types import Site
from multihead.mapping import model_heads
from multihead.observers import (
    AttentionCall,
    AttentionObserver,
    ObservableAttention,
    registered,
)

__all__ = [
    "intervene",
    "record_heads",
    "HeadRecording",
    "Edit",
]

# 0.0: zero ablation; another number: a scale; "mean": the mean over real tokens; a Tensor
# (B, T, Dv): a patch.
Edit = Union[float, int, str, Tensor]  # noqa: UP007 - a runtime alias, also on Python 3.10

_EDIT_KINDS = (
    '0.0 (zero ablation), a finite number (a scale), "mean" (mean ablation) or a patch tensor '
    "(B, T, Dv)"
)


def _module_dtype(mha: ObservableAttention) -> torch.dtype:
    return next(mha.parameters()).dtype  # = out_proj's: the per-head output feeds it


def _module_device(mha: ObservableAttention) -> torch.device:
    return next(mha.parameters()).device


def _check_edit(key: HeadKey, edit: object, mha: ObservableAttention) -> float | str | Tensor:
    """One edit, checked against the head it edits (its dtype, its device); a number comes back
    as a float, a patch on the module's device."""
    where = f"edits[{key}]"
    if isinstance(edit, bool):
        raise TypeError(f"{where} must be {_EDIT_KINDS}, got the bool {edit!r}")
    if isinstance(edit, (int, float)):
        try:
            scale = float(edit)
        except OverflowError:  # an int beyond any float (10**400)
            raise ValueError(
                f"{where} must be {_EDIT_KINDS}, got an int too large for a float: {describe(edit)}"
            ) from None
        if not math.isfinite(scale):
            raise ValueError(f"{where} must be {_EDIT_KINDS}, got {edit!r}")
        dtype = _module_dtype(mha)
        held = torch.tensor(scale, dtype=torch.float64).to(dtype).item()
        if not math.isfinite(held) or (held == 0.0) != (scale == 0.0):
            # the factor itself would be inf or 0 in the head's dtype (1e5 in float16)
            raise ValueError(
                f"{where}: the scale {scale!r} does not fit the model's dtype {dtype} (it "
                f"would be {held!r} there); scale by a number {dtype} can hold"
            )
        return scale
    if isinstance(edit, str):
        if edit != "mean":
            raise ValueError(
                f'{where} must be {_EDIT_KINDS}; the only string edit is "mean", got {edit!r}'
            )
        return edit
    if isinstance(edit, Tensor):
        dv, dtype, device = mha.head_dim, _module_dtype(mha), _module_device(mha)
        if edit.dim() != 3 or edit.shape[-1] != dv:
            raise ValueError(
                f"{where}: a patch must be the head's output (B, T, Dv) with Dv={dv}, got shape "
                f"{tuple(edit.shape)}"
            )
        if edit.dtype != dtype:
            raise TypeError(
                f"{where}: a patch must have the model's dtype {dtype}, got {edit.dtype}"
            )
        if edit.is_meta and device.type != "meta":
            raise ValueError(
                f"{where}: a patch must hold values, got a tensor on the meta device (the model "
                f"is on {device})"
            )
        return edit.to(device)
    raise TypeError(f"{where} must be {_EDIT_KINDS}, got {type(edit).__name__} {describe(edit)}")


def _mean_over_real(x: Tensor, query_mask: Tensor | None) -> Tensor:
    """Mean of one head's output x (B, T, Dv) over the real tokens -> (Dv,).

    Accumulated in float32 at least; all tokens when the call doesn't know its padding.
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    if query_mask is None:
        return x.mean(dim=(0, 1), dtype=acc).to(x.dtype)
    weight = query_mask.to(acc)[..., None]  # (B, T, 1)
    total = (x.to(acc) * weight).sum(dim=(0, 1))  # (Dv,)
    return (total / weight.sum().clamp(min=1.0)).to(x.dtype)


def _edit_observer(
    layer: int, mha: ObservableAttention, edits: Mapping[int, float | str | Tensor]
) -> AttentionObserver:
    """The observer applying one module's edits (head -> edit) to its per-head output.

    Under tensor parallelism (``mha.head_shard``) a rank's output holds its own heads only: it
    applies the edits of those, at their positions there, and leaves the others' to their ranks.
    """
    held = held_heads(mha.num_heads, mha.head_shard)  # the global heads in out, in order
    h = len(held)
    # (global head, its position in out, edit), for the heads this call holds
    own = [(head, head - held.start, e) for head, e in edits.items() if head in held]
    scales = {at: e for _, at, e in own if isinstance(e, float)}
    replaced = [(head, at, e) for head, at, e in own if not isinstance(e, float)]
    # every patch is checked on every rank, so that a wrong one stops all ranks at the same
    # call (one rank raising alone would leave the others waiting in the next collective)
    patches = [(head, e.shape[:2]) for head, e in edits.items() if isinstance(e, Tensor)]
    factors: Tensor | None = None
    if scales:
        # One multiply for every scaled or zeroed head; x · 1.0 leaves the others bit-exact.
        factors = torch.ones(h, dtype=_module_dtype(mha), device=_module_device(mha))
        for at, a in scales.items():
            factors[at] = a

    def observer(call: AttentionCall, out: Tensor) -> Tensor:
        # out: (B, T, H, Dv) before out_proj; never modified in place (autograd may need it)
        b, t = out.shape[0], out.shape[1]
        for head, bt in patches:
            if bt != (b, t):
                raise ValueError(
                    f"edits[({layer}, {head})]: the patch has (B, T) = {tuple(bt)} but this "
                    f"call of layer {layer} has (B, T) = ({b}, {t}); record the patch on an "
                    f"input of the same shape"
                )
        new = out
        if factors is not None:
            new = out * factors.to(out.dtype)[:, None]  # (B, T, H, Dv) · (H, 1)
        if replaced:
            if new is out:
                new = out.clone()
            for _, at, e in replaced:
                if isinstance(e, Tensor):
                    new[:, :, at] = e.to(out.dtype)
                else:  # "mean": one (Dv,) vector for every position
                    new[:, :, at] = _mean_over_real(out[:, :, at], call.query_mask)
        return new

    return observer


def check_edits(
    model: nn.Module, edits: object
) -> tuple[list[Site], dict[int, dict[int, float | str | Tensor]]]:
    """Validate every edit against the model; returns the modules and layer -> head -> edit."""
    found = model_heads(model)
    if not isinstance(edits, Mapping):
        raise TypeError(
            f"edits must be a mapping {{(layer, head): edit}}, got {type(edits).__name__}"
        )
    by_layer: dict[int, dict[int, float | str | Tensor]] = {}
    for key, edit in edits.items():
        layer, head = resolve_head("edits key", key, found)
        if head in by_layer.get(layer, {}):
            raise ValueError(
                f"edits key {key} names head ({layer}, {head}) a second time (negative indices "
                f"count from the end)"
            )
        by_layer.setdefault(layer, {})[head] = _check_edit(
            (layer, head), edit, found[layer].attention
        )
    return found, by_layer


@contextlib.contextmanager
def intervene(
    model: nn.Module,
    edits: Mapping[HeadKey, Edit] | Mapping[str, Edit] | Mapping[HeadName, Edit],
) -> Iterator[None]:
    """Edit chosen heads' outputs inside the block; the model is exactly itself again after.

    Each edit acts on head h's output (B, T, Dv) before ``out_proj`` (see the module docstring):

    - ``0.0``: zero ablation, the head contributes nothing (its ``out_proj`` bias stays, as it
      belongs to no head).
    - another number ``a``: the head's output times ``a``.
    - ``"mean"``: the head's output replaced, at every position, by its mean over the call's
      real tokens (B and T together; ``call.query_mask`` when the call knows the padding, else
      all tokens).
    - a tensor (B, T, Dv) of the model's dtype: the head's output replaced by it (a patch, e.g.
      one recorded by :func:`record_heads` on another input of the same shape).

    Edits apply to every call of the layer inside the block (each step of a generation too) and
    keep gradients: training with some heads ablated trains the others. Observers that were
    registered before see the unedited output, later ones (e.g. :func:`record_heads` entered
    inside this block) the edited one. :func:`multihead.capture` may run in the same forward: the
    weights do not depend on the output edits of their own layer.

    Under tensor parallelism (a transformers model loaded with a ``tp_plan``, every rank in the
    block together) heads keep their global numbers: an edit applies on the rank that holds its
    head, and every rank's output equals the one-process run's.

    Nothing is registered for an empty ``edits`` (no overhead at all); on leaving the block,
    normally or by an exception, every observer it added is removed, and the model's outputs
    equal the unedited ones bit for bit (no parameter is ever touched).

    Args:
        model: any module holding :class:`~multihead.MultiHeadAttention` modules (the model
            itself may be one).
        edits: ``{(layer, head): edit}``; negative indices count from the end.

    Raises:
        ValueError: no attention module in the model, a layer or head out of range, the same
            head twice, a non-finite number or one the head's dtype cannot hold (1e5 in
            float16: inf there), a string other than ``"mean"``, a patch of the wrong shape or
            on the meta device; at run time, a patch whose (B, T) differs from the call's.
        TypeError: a key that is not a ``(layer, head)`` pair of ints, a bool or another kind of
            edit, a patch of the wrong dtype.
        All are raised before anything is registered.

    Example:
        >>> mha = MultiHeadAttention(16, num_heads=4)
        >>> x = torch.randn(2, 5, 16)
        >>> with intervene(mha, {(0, 1): 0.0, (0, 3): 2.0}):
        ...     edited = mha(x)
        >>> torch.equal(mha(x), edited)
        False
    """
    found, by_layer = check_edits(model, edits)
    with registered(
        found[layer].attention.register_observer(
            _edit_observer(layer, found[layer].attention, head_edits)
        )
        for layer, head_edits in by_layer.items()
    ):
        yield


@dataclass
class HeadRecording:
    """The per-head outputs :func:`record_heads` recorded.

    ``rec[(layer, head)]`` is that head's output (B, T, Dv) of the layer's latest call, detached
    (a copy, not a view into the whole per-head output); :meth:`calls` lists every call's, in
    order (e.g. each step of a generation).

    Attributes:
        heads: the recorded ``(layer, head)`` pairs, indices as given but counted from 0.
    """

    heads: list[HeadKey]
    _calls: dict[HeadKey, list[Tensor]] = field(default_factory=dict, repr=False)
    # per layer, its heads: a key's negative indices count from the end, as when recording
    _sizes: list[int] = field(default_factory=list, repr=False)

    def _resolve(self, key: object) -> HeadKey:
        layer, head = parse_head("a recording's key", key)
        if self._sizes and -len(self._sizes) <= layer < 0:
            layer += len(self._sizes)
        if self._sizes and 0 <= layer < len(self._sizes) and -self._sizes[layer] <= head < 0:
            head += self._sizes[layer]
        return layer, head

    def _key(self, key: object) -> HeadKey:
        head = self._resolve(key)
        if head not in self._calls:
            raise KeyError(f"head {key!r} was not recorded; recorded: {self.heads}")
        return head

    def calls(self, key: HeadKey) -> list[Tensor]:
        """Every recorded output (B, T, Dv) of head ``key``, one per call, in call order."""
        return list(self._calls[self._key(key)])

    def __getitem__(self, key: HeadKey) -> Tensor:
        outputs = self._calls[self._key(key)]
        if not outputs:
            raise ValueError(
                f"head {key} has not been called yet: run the model inside the record_heads block"
            )
        return outputs[-1]

    def __contains__(self, key: object) -> bool:
        try:
            return self._resolve(key) in self._calls
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self.heads)

    def __iter__(self) -> Iterator[HeadKey]:
        return iter(self.heads)

    def clear(self) -> None:
        """Forget what was recorded (the recording stays installed)."""
        for outputs in self._calls.values():
            outputs.clear()


@contextlib.contextmanager
def record_heads(model: nn.Module, heads: Sequence[HeadName]) -> Iterator[HeadRecording]:
    """Record the per-head outputs (before ``out_proj``) of chosen ``(layer, head)`` pairs.

    Recording on input B and patching the result into a run on input A with :func:`intervene`
    is activation patching::

        with record_heads(model, [(3, 5)]) as rec:
            model(ids_b)
        with intervene(model, {(3, 5): rec[(3, 5)]}):
            patched = model(ids_a)

    Args:
        model: any module holding :class:`~multihead.MultiHeadAttention` modules.
        heads: the ``(layer, head)`` pairs (negative indices count from the end; recorded
            under the indices from 0).

    Yields:
        A :class:`HeadRecording`: ``rec[(layer, head)]`` is the output (B, T, Dv), detached.
        Under tensor parallelism every rank records every chosen head (each gathered from the
        rank that holds it), so a patch recorded on one input applies on any rank.

    Raises:
        ValueError, TypeError: as :func:`intervene` for bad keys; an empty ``heads``.
    """
    found = model_heads(model)
    if isinstance(heads, (str, bytes)) or not isinstance(heads, Sequence):
        raise TypeError(
            f"heads must be a sequence of heads ('L0H1' or (layer, head) pairs), got "
            f"{describe(heads)}"
        )
    if not heads:
        raise ValueError("heads must name at least one (layer, head) pair, got none")
    keys = list(dict.fromkeys(resolve_head("heads item", key, found) for key in heads))
    recording = HeadRecording(keys, {key: [] for key in keys}, [s.num_heads for s in found])
    by_layer: dict[int, list[int]] = {}
    for layer, head in keys:
        by_layer.setdefault(layer, []).append(head)

    def make_observer(
        layer: int, chosen: list[int], site: ObservableAttention
    ) -> AttentionObserver:
        shard = site.head_shard
        if shard is None:

            def observer(call: AttentionCall, out: Tensor) -> None:
                for head in chosen:
                    recording._calls[(layer, head)].append(out[:, :, head].detach().clone())

            return observer
        # tensor parallelism: each rank takes the chosen heads it holds, and every rank gets all
        gather = shard.gatherer(chosen)
        gather.to(_module_device(site))

        def gathering_observer(call: AttentionCall, out: Tensor) -> None:
            every = gather.take(out.detach(), dim=2)  # (B, T, len(chosen), Dv), on every rank
            for j, head in enumerate(chosen):
                recording._calls[(layer, head)].append(every[:, :, j].clone())

        return gathering_observer

    with registered(
        found[layer].attention.register_observer(
            make_observer(layer, chosen, found[layer].attention)
        )
        for layer, chosen in by_layer.items()
    ):
        yield recording
