"""The observer channel of an attention module: what observers see, and the one container that
holds them.

An observer is ``fn(call, out)``: ``call`` an :class:`AttentionCall`, ``out`` the per-head output
(B, T, H, Dv) before the output projection, the one place where a head exists as itself. It
returns None, or a replacement for ``out`` (to ablate, scale or patch heads). Capture, head
statistics and interventions are observers.

A q/k/v editor is ``fn(call)``, run *before* attention: it returns None, or replacements
``(q, k, v)`` for the heads the kernel then attends with (path patching changes one head's
queries, keys or values this way). Keys and values may come back with H heads instead of Hk,
one per query head, so that on a grouped-query module the keys one query head sees can change
without its siblings'.

:class:`Observers` holds both kinds for one attention site (a :class:`~multihead.MultiHeadAttention`
or a transformers module's :class:`multihead.hf.AttentionSite`): ``register`` /
``register_editor`` return a handle, ``bool(observers)`` says whether anything is registered (a
forward with nothing registered does no extra work), ``edit(call)`` runs the editors and ``run(call,
out)`` the observers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, cast

from torch import Tensor, nn

from multihead.head_shard import HeadShard
from multihead.score_mods import ScoreMods

__all__ = [
    "registered",
    "Removable",
    "AttentionCall",
    "AttentionObserver",
    "ObservableAttention",
    "ObserverHandle",
    "Observers",
    "QKVEditor",
]


class AttentionCall:
    """One call of an attention module, as its observers and editors see it.

    Attributes:
        module: the attention module (a :class:`multihead.hf.AttentionSite` for a transformers
            model).
        q: (B, H, T, D) queries, per head.
        k: (B, Hk, S, D) keys (the cache's too, when there is one); (B, H, S, D) after an editor
            returned keys per query head.
        v: (B, Hk, S, Dv) values; (B, H, S, Dv) likewise.
        mask: None, or the bool/float mask the kernel saw, broadcastable to (B, H, T, S): the
            ``mask`` and ``key_mask`` arguments combined. ``is_causal`` comes on top.
        is_causal: bottom-right causal masking (see :func:`multihead.kernels.causal_mask`).
        scale: the factor on the scores.
        query_mask: (B, T) bool, True at real (not padding) queries, when the call knows it
            (self-attention with a key mask, or a packed batch); else None.
        mods: the call's score modifications (:class:`~multihead.score_mods.ScoreMods`:
            softcap, sinks, score_mod, block_mask, and the sink weights convention its weights
            are reported in); empty (false) when it has none.

    Args:
        heads: ``(q, k, v)``, or a function that makes them when first read (a packed batch puts
            them in batch order only when an observer reads them).
    """

    def __init__(
        self,
        module: ObservableAttention,
        heads: tuple[Tensor, Tensor, Tensor] | Callable[[], tuple[Tensor, Tensor, Tensor]],
        mask: Tensor | None,
        is_causal: bool,
        scale: float,
        query_mask: Tensor | None,
        *,
        mods: ScoreMods | None = None,
    ) -> None:
        self.module = module
        self._heads = heads
        self._mask = mask
        self._is_causal = is_causal
        self._scale = scale
        self._query_mask = query_mask
        self._mods = ScoreMods() if mods is None else mods
        self._make: Callable[[], AttentionCall] | None = None

    @classmethod
    def deferred(
        cls, module: ObservableAttention, make: Callable[[], AttentionCall]
    ) -> AttentionCall:
        """A call of ``module`` whose parts (q, k, v, mask, causality, scale, query mask, score
        modifications) are those of the call ``make()`` returns, made when one is first read.

        A transformers family whose attention is not routed works them out from the module's
        inputs: an observer that reads only the per-head output costs nothing.
        """
        call = cls(module, cast(Any, None), None, False, 1.0, None)
        call._make = make
        return call

    @functools.cached_property
    def _made(self) -> AttentionCall:
        return self if self._make is None else self._make()

    @functools.cached_property
    def _qkv(self) -> tuple[Tensor, Tensor, Tensor]:
        made = self._made
        if made is not self:
            return made._qkv
        return self._heads if isinstance(self._heads, tuple) else self._heads()

    @property
    def q(self) -> Tensor:
        return self._qkv[0]

    @property
    def k(self) -> Tensor:
        return self._qkv[1]

    @property
    def v(self) -> Tensor:
        return self._qkv[2]

    @property
    def mask(self) -> Tensor | None:
        return self._made._mask

    @property
    def is_causal(self) -> bool:
        return self._made._is_causal

    @property
    def scale(self) -> float:
        return self._made._scale

    @property
    def query_mask(self) -> Tensor | None:
        return self._made._query_mask

    @property
    def mods(self) -> ScoreMods:
        return self._made._mods


# observer(call, out) with out the per-head output (B, T, H, Dv) before the output projection;
# it returns None (out unchanged) or a replacement of the same shape and dtype.
AttentionObserver = Callable[[AttentionCall, Tensor], Tensor | None]

# editor(call) before attention; it returns None (q, k, v unchanged) or replacements (q, k, v):
# q (B, H, T, D), k (B, Hk or H, S, D), v (B, Hk or H, S, Dv), in the call's dtype and device.
QKVEditor = Callable[[AttentionCall], tuple[Tensor, Tensor, Tensor] | None]


class ObserverHandle:
    """Unregisters one observer or editor: ``handle.remove()``, or leave a ``with`` block.

    Like torch's ``RemovableHandle``; removing twice does nothing.
    """

    def __init__(
        self, entries: dict[int, Any], key: int, release: Callable[[], None] | None
    ) -> None:
        self._entries = entries
        self._key = key
        self._release = release

    def remove(self) -> None:
        if self._entries.pop(self._key, None) is not None and self._release is not None:
            self._release()

    def __enter__(self) -> ObserverHandle:
        return self

    def __exit__(self, *args: object) -> None:
        self.remove()


class Observers:
    """The observers and q/k/v editors of one attention site, each kind in registration order.

    Args:
        acquire: called before each registration is added (a transformers model switches to the
            ``"multihead"`` attention there; it may refuse by raising, and nothing is added).
        release: called after each registration is removed.

    ``len()`` counts both kinds; ``bool()`` is False when nothing is registered, the forward's one
    check before it does anything for the channel.
    """

    def __init__(
        self,
        *,
        acquire: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        self._observers: dict[int, AttentionObserver] = {}
        self._editors: dict[int, QKVEditor] = {}
        # a plain int, not itertools.count: a module holding this must deep-copy on any Python
        self._next_id = 0
        self._acquire = acquire
        self._release = release

    def __len__(self) -> int:
        return len(self._observers) + len(self._editors)

    def __bool__(self) -> bool:
        return bool(self._observers) or bool(self._editors)

    @property
    def observing(self) -> bool:
        """Whether an observer is registered (one that sees the per-head output)."""
        return bool(self._observers)

    @property
    def editing(self) -> bool:
        """Whether a q/k/v editor is registered."""
        return bool(self._editors)

    def register(self, fn: AttentionObserver) -> ObserverHandle:
        """Add the observer ``fn(call, out)``; the handle's ``remove()`` takes it out again."""
        return self._add(self._observers, fn)

    def register_editor(self, fn: QKVEditor) -> ObserverHandle:
        """Add the q/k/v editor ``fn(call)``; the handle's ``remove()`` takes it out again."""
        return self._add(self._editors, fn)

    def _add(self, entries: dict[int, Any], fn: object) -> ObserverHandle:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if self._acquire is not None:
            self._acquire()
        key = self._next_id
        self._next_id += 1
        entries[key] = fn
        return ObserverHandle(entries, key, self._release)

    def edit(self, call: AttentionCall) -> AttentionCall:
        """Run the editors in order, each seeing the previous one's replacements.

        Returns ``call`` itself when no editor replaced anything, else a call with the new
        q, k, v (mask, causality, scale, query mask and score modifications unchanged). Keys
        and values come back with one head count: when an editor returns one of them per query
        head (H) and the other per key/value head (Hk), the other is repeated to H. On a call
        without a mask an editor may return keys and values of more positions than it was given
        (S' > S: the earlier positions of a sequence whose later queries alone are computed,
        put before the given ones; causality stays aligned bottom-right, each query at its own
        position).

        Raises:
            ValueError: an editor returned something other than None or (q, k, v) of the
                call's shapes, dtype and device.
        """
        for fn in tuple(self._editors.values()):
            new = fn(call)
            if new is not None:
                call = AttentionCall(
                    call.module,
                    _checked_edit(call, new),
                    call.mask,
                    call.is_causal,
                    call.scale,
                    call.query_mask,
                    mods=call.mods,
                )
        return call

    def run(self, call: AttentionCall, out: Tensor) -> Tensor:
        """Run the observers in order on ``out`` (B, T, H, Dv), each seeing the previous one's
        replacement; returns the final per-head output.

        Raises:
            ValueError: an observer returned something other than None or a tensor of
                ``out``'s shape and dtype.
        """
        for fn in tuple(self._observers.values()):
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


def _checked_edit(call: AttentionCall, new: object) -> tuple[Tensor, Tensor, Tensor]:
    """An editor's ``(q, k, v)``, checked against ``call``; k and v on one head count."""
    if not (
        isinstance(new, (tuple, list)) and len(new) == 3 and all(isinstance(t, Tensor) for t in new)
    ):
        got = (
            f"a {type(new).__name__} of {len(new)}"
            if isinstance(new, (tuple, list))
            else type(new).__name__
        )
        raise ValueError(
            f"a q/k/v editor must return None or a tuple (q, k, v) of tensors, got {got}"
        )
    q, k, v = new
    b, h, t, d = call.q.shape
    hk, s, dv = call.k.shape[1], call.k.shape[2], call.v.shape[3]
    if call.mask is None and k.dim() == 4 and k.shape[2] > s:  # earlier positions put before
        s = k.shape[2]
    heads = f"{hk} or {h}" if hk != h else f"{h}"
    for name, x, shape, letters in (
        ("q", q, f"({b}, {h}, {t}, {d})", "(B, H, T, D)"),
        ("k", k, f"({b}, {heads}, {s}, {d})", "(B, Hk or H, S, D)"),
        ("v", v, f"({b}, {heads}, {s}, {dv})", "(B, Hk or H, S, Dv)"),
    ):
        want_heads = (h,) if name == "q" else (hk, h)
        size = (t, d) if name == "q" else (s, d if name == "k" else dv)
        if x.dim() != 4 or x.shape[0] != b or x.shape[1] not in want_heads or x.shape[2:] != size:
            raise ValueError(
                f"a q/k/v editor returned {name} of shape {tuple(x.shape)}, expected "
                f"{letters} = {shape}"
            )
        if x.dtype != call.q.dtype or x.device != call.q.device:
            raise ValueError(
                f"a q/k/v editor returned {name} as {x.dtype} on {x.device}, expected the call's "
                f"{call.q.dtype} on {call.q.device}"
            )
    if k.shape[1] != v.shape[1]:  # one per query head, the other per key/value head
        group = h // min(k.shape[1], v.shape[1])
        k = k if k.shape[1] == h else k.repeat_interleave(group, dim=1)  # (B, H, S, D)
        v = v if v.shape[1] == h else v.repeat_interleave(group, dim=1)  # (B, H, S, Dv)
    return q, k, v


class ObservableAttention(Protocol):
    """An attention site with the observer channel: :class:`~multihead.MultiHeadAttention`, or
    a transformers attention module's :class:`multihead.hf.AttentionSite`.

    ``num_heads`` is H (query heads), ``head_dim`` Dv (one head's output width), ``observers``
    the site's :class:`Observers` (read it to count or test for registrations; register through
    the two methods). ``head_shard`` is None when every call holds all H heads; under tensor
    parallelism it is the :class:`~multihead.head_shard.HeadShard` naming the global heads this
    rank's calls hold (its observers and editors see those, in that order: ``call.q`` and ``out``
    carry H/W heads, and ``num_heads`` stays the global H).
    """

    @property
    def num_heads(self) -> int: ...

    @property
    def head_shard(self) -> HeadShard | None: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def observers(self) -> Observers: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def register_observer(self, fn: AttentionObserver) -> ObserverHandle: ...

    def register_qkv_editor(self, fn: QKVEditor) -> ObserverHandle: ...


class Removable(Protocol):
    """A registration's handle: :class:`ObserverHandle`, or torch's hook handle."""

    def remove(self) -> None: ...


@contextlib.contextmanager
def registered(handles: Iterable[Removable]) -> Iterator[list[Removable]]:
    """Make registrations on many sites and remove them all on exit: the one loop every
    observe and circuit function uses.

    ``handles`` is consumed inside the block, so a generator that registers as it goes
    (``site.register_observer(fn) for ...``) leaves nothing behind when one of its
    registrations fails (a transformers model that will not switch) or the body raises.

    Yields:
        The handles, in registration order.
    """
    made: list[Removable] = []
    try:
        for handle in handles:
            made.append(handle)
        yield made
    finally:
        for handle in reversed(made):
            handle.remove()
