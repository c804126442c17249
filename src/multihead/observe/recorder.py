"""Record attention weights: only the layers, heads and query rows asked for.

No fused kernel returns attention weights, and materialising every head's (T, S) matrix costs
O(T²) memory per head. :func:`capture` records weights from any model built from
:class:`~multihead.MultiHeadAttention` without touching its code, and only what is asked for: a
choice of layers, heads and query rows, so that one token's attention in a 4,096-token input
costs O(rows · S) per head. The model's own forward still runs the fused path; the weights are
recomputed beside it by an observer, from the per-head q and k, by the core's formula.

Shapes: B batch, H' the selected heads, R the selected query rows, S keys.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from multihead.heads import HeadName
from multihead.observe.rows import Rows, observe_rows, row_values
from multihead.observers import AttentionCall

__all__ = ["capture", "Recorder", "CapturedAttention"]


@dataclass(frozen=True)
class CapturedAttention:
    """The weights one attention call produced, for the chosen heads and rows.

    Attributes:
        layer: index of the attention module among the model's (module order, 0-based).
        name: its qualified module name, e.g. ``"encoder.layers.3.self_attn"``.
        heads: the query heads kept (H').
        rows: the query rows kept (R).
        weights: (B, H', R, S) softmax weights, detached; with sinks and
            ``sink_weights="column"``, S + 1 columns (the last the sink's share). Captured with
            ``received=True``: (B, H', S), the attention each key received from the rows (the
            weights summed over them).
    """

    layer: int
    name: str
    heads: tuple[int, ...]
    rows: tuple[int, ...]
    weights: Tensor


@dataclass
class Recorder:
    """What :func:`capture` recorded: one :class:`CapturedAttention` per call of a chosen layer.

    A single forward pass gives one record per chosen layer, in layer order; each further pass
    (e.g. each step of a generation loop) appends another round.
    """

    records: list[CapturedAttention] = field(default_factory=list)

    @property
    def weights(self) -> list[Tensor]:
        """The recorded weights, one (B, H', R, S) tensor per record."""
        return [r.weights for r in self.records]

    @property
    def layers(self) -> list[int]:
        """The layer index of each record."""
        return [r.layer for r in self.records]

    @property
    def heads(self) -> list[tuple[int, ...]]:
        """The query heads kept in each record."""
        return [r.heads for r in self.records]

    @property
    def rows(self) -> list[tuple[int, ...]]:
        """The query rows kept in each record."""
        return [r.rows for r in self.records]

    def stack(self) -> Tensor:
        """All records as one tensor (N, B, H', R, S); they must share their shapes."""
        if not self.records:
            raise ValueError("nothing was recorded: run the model inside the capture block")
        shapes = {tuple(r.weights.shape) for r in self.records}
        if len(shapes) != 1:
            raise ValueError(f"records have different shapes {sorted(shapes)}; cannot stack them")
        return torch.stack(self.weights)

    def clear(self) -> None:
        """Forget the records (the capture stays installed)."""
        self.records.clear()


@contextlib.contextmanager
def capture(
    model: nn.Module,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | Sequence[HeadName] | None = None,
    rows: Rows = None,
    device: torch.device | str | None = None,
    chunk_size: int | None = None,
    sink_weights: str | None = None,
    received: bool = False,
) -> Iterator[Recorder]:
    """Record attention weights of a model built from :class:`~multihead.MultiHeadAttention`.

    Inside the block, each chosen attention module reports the softmax weights (before any
    dropout) of the chosen heads and query rows, recomputed from the projected heads and the
    exact mask the core used. The model's forward and its outputs are unchanged (the fused
    kernel still runs). Memory is O(B · H' · R · S) per layer: one row of a 4,096-token input
    is (B, H, 1, 4096), not T².

    Args:
        model: any module; every MultiHeadAttention inside it, in module order, is a "layer".
        layers: which of those to record (ints, negative from the end), default all.
        heads: which query heads, default all: head indices (the same in every chosen layer),
            or heads named with their layers, ``"L0H1"`` or ``(0, 1)`` (then each of their
            layers records its own heads, and ``layers`` must be None). Grouped-query heads
            are handled (head h reads key/value head h // (H // Hk)).
        rows: which query rows: an int, ints, a slice, or None for all (negative from the end).
        device: where to keep the weights (e.g. ``"cpu"``); default the model's device.
        chunk_size: compute the weights this many rows at a time, bounding the temporaries;
            default all the chosen rows at once.
        sink_weights: for a layer with attention sinks, which weights to record:
            ``"dropped"`` (the keys' shares of the softmax over keys and sink; rows sum to
            less than 1), ``"column"`` (those and the sink's share as a last column, S + 1) or
            ``"plain"`` (the softmax over the keys alone); default each layer's own (its
            family's, for a transformers model; see docs/formulations.md).
        received: record, instead of each row's weights, the attention each key receives
            from the chosen rows: the weights summed over the rows, (B, H', S), folded in a
            chunk of rows at a time, so that memory stays O(B · H' · chunk_size · S) however
            many rows are chosen (``rows=None``: every query's).

    Yields:
        A :class:`Recorder`; ``rec.weights`` lists one (B, H', R, S) tensor per recorded call
        ((B, H', S) with ``received``).
        Under tensor parallelism (a transformers model loaded with a ``tp_plan``; every rank
        runs the block) each rank computes the chosen heads it holds and every rank's recorder
        gets all of them, (B, H', R, S) with global head numbers (``torch.distributed``
        all_gather).

    Raises:
        ValueError: no MultiHeadAttention in the model, layer/head/row indices out of range.
        TypeError: indices that aren't ints.

    Example:
        >>> mha = MultiHeadAttention(16, num_heads=4)
        >>> with capture(mha, heads=[0, 2], rows=[-1]) as rec:
        ...     _ = mha(torch.randn(2, 5, 16))
        >>> rec.weights[0].shape
        torch.Size([2, 2, 1, 5])
    """
    recorder = Recorder()
    slots: list[tuple[int, str, list[int] | None]] = []
    pending: dict[int, list[Tensor]] = {}
    # T -> the chosen rows as ints: recorded from Python, never read back from the device
    row_values_of: dict[int, tuple[int, ...]] = {}

    if not isinstance(received, bool):
        raise TypeError(f"received must be a bool, got {type(received).__name__}")
    done: dict[int, int] = {}  # slot -> the rows of its current call folded in so far

    def consume(slot: int, row_ids: Tensor, w: Tensor, t: int, call: AttentionCall) -> None:
        parts = pending.setdefault(slot, [])
        if received:  # (B, H', R, S) -> (B, H', S), summed as the chunks come
            summed = w.sum(2, dtype=torch.promote_types(w.dtype, torch.float32))
            summed = summed if device is None else summed.to(device)
            parts[:] = [summed if not parts else parts[0] + summed]
        else:
            parts.append(w if device is None else w.to(device))
        done[slot] = done.get(slot, 0) + w.shape[2]
        if t not in row_values_of:
            row_values_of[t] = tuple(row_values(rows, t))
        chosen = row_values_of[t]
        if done[slot] == len(chosen):
            del pending[slot], done[slot]
            layer, name, head_list = slots[slot]
            all_heads = range(w.shape[1]) if head_list is None else head_list
            recorder.records.append(
                CapturedAttention(
                    layer=layer,
                    name=name,
                    heads=tuple(all_heads),
                    rows=chosen,
                    weights=(
                        parts[0].to(w.dtype)
                        if received
                        else parts[0]
                        if len(parts) == 1
                        else torch.cat(parts, dim=2)
                    ),
                )
            )

    with observe_rows(
        model,
        layers=layers,
        heads=heads,
        rows=rows,
        chunk_size=chunk_size,
        consume=consume,
        sink_weights=sink_weights,
    ) as installed:
        slots.extend(installed)
        yield recorder
