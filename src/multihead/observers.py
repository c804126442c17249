"""What an observer of :class:`~multihead.MultiHeadAttention` sees, and how observers run.

An observer is ``fn(call, out)``: ``call`` an :class:`AttentionCall`, ``out`` the per-head output
(B, T, H, Dv) before the output projection, the one place where a head exists as itself. It
returns None, or a replacement for ``out`` (to ablate, scale or patch heads). Capture, head
statistics and interventions are observers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from torch import Tensor, nn

__all__ = [
    "AttentionCall",
    "AttentionObserver",
    "ObservableAttention",
    "ObserverHandle",
    "run_observers",
]


class AttentionCall:
    """One call of a :class:`MultiHeadAttention`, as its observers see it.

    Attributes:
        module: the attention module (a :class:`multihead.hf.AttentionSite` for a transformers
            model).
        q: (B, H, T, D) queries, per head.
        k: (B, Hk, S, D) keys (the cache's too, when there is one).
        v: (B, Hk, S, Dv) values.
        mask: None, or the bool/float mask the kernel saw, broadcastable to (B, H, T, S): the
            ``mask`` and ``key_mask`` arguments combined. ``is_causal`` comes on top.
        is_causal: bottom-right causal masking (see :func:`multihead.functional.causal_mask`).
        scale: the factor on the scores.
        query_mask: (B, T) bool, True at real (not padding) queries, when the call knows it
            (self-attention with a key mask, or a packed batch); else None.

    On a packed batch, q, k and v are put in batch order only when an observer reads them.
    """

    def __init__(
        self,
        module: ObservableAttention,
        heads: Callable[[], tuple[Tensor, Tensor, Tensor]],
        mask: Tensor | None,
        is_causal: bool,
        scale: float,
        query_mask: Tensor | None,
    ) -> None:
        self.module = module
        self._heads = heads
        self.mask = mask
        self.is_causal = is_causal
        self.scale = scale
        self.query_mask = query_mask

    @functools.cached_property
    def _qkv(self) -> tuple[Tensor, Tensor, Tensor]:
        return self._heads()

    @property
    def q(self) -> Tensor:
        return self._qkv[0]

    @property
    def k(self) -> Tensor:
        return self._qkv[1]

    @property
    def v(self) -> Tensor:
        return self._qkv[2]


class ObserverHandle(Protocol):
    """What ``register_observer`` returns."""

    def remove(self) -> None: ...


class ObservableAttention(Protocol):
    """An attention site with the observer channel: :class:`~multihead.MultiHeadAttention`, or
    a transformers attention module's :class:`multihead.hf.AttentionSite`.

    ``num_heads`` is H (query heads), ``head_dim`` Dv (one head's output width).
    """

    @property
    def num_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def register_observer(self, fn: AttentionObserver) -> ObserverHandle: ...


# observer(call, out) with out the per-head output (B, T, H, Dv) before the output projection;
# it returns None (out unchanged) or a replacement of the same shape and dtype.
AttentionObserver = Callable[[AttentionCall, Tensor], Tensor | None]


def run_observers(
    observers: Iterable[AttentionObserver], call: AttentionCall, out: Tensor
) -> Tensor:
    """Run ``observers`` in order on ``out`` (B, T, H, Dv), each seeing the previous one's
    replacement; returns the final per-head output."""
    for fn in tuple(observers):
        new = fn(call, out)
        if new is None:
            continue
        if not isinstance(new, Tensor) or new.shape != out.shape or new.dtype != out.dtype:
            got: Any = f"{new.dtype} {tuple(new.shape)}" if isinstance(new, Tensor) else new
            raise ValueError(
                f"an observer must return None or a per-head output like {out.dtype} "
                f"{tuple(out.shape)} (B, T, H, Dv), got {got}"
            )
        out = new
    return out
