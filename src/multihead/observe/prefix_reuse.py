"""Reuse the outputs of the blocks that ablating a head cannot change (ablation importance).

Zeroing a head of layer l leaves every block before layer l's as it was. :class:`PrefixCache`
records every block's calls (arguments and output) on one clean run; on an ablation run of
layer l, each block before it hands back its recorded output instead of running, when its
arguments equal the recorded ones bit for bit. A "block" is a multihead
``TransformerEncoderLayer`` or ``TransformerDecoderLayer`` holding attention modules
(:func:`_blocks`); its forward is replaced on the instance for the duration of a run
(:class:`_patched`), so ``nn.Module.__call__`` and its hooks still run.

Nothing inside a forward waits for the device: a call whose arguments have the recorded kinds,
shapes, dtypes and devices hands back the recorded output at once, and the values of its
tensors are compared on the device; :meth:`PrefixCache.agreed` reads the comparisons back
once, after the run. A run whose arguments differed (a metric whose inputs depend on the
ablation, as a generated text does) is run again, and from then on values are compared before
a call is reused (``compare_first``), as they must be for such a metric.

:func:`multihead.observe.importance.head_importance` is the one user; the reasons for running
full forwards instead are logged on its logger, ``multihead.observe.importance``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.layers import TransformerDecoderLayer, TransformerEncoderLayer
from multihead.observers import ObservableAttention
from multihead.packing import PackedBatch

__all__ = ["PrefixCache"]

# head_importance's logger: its documentation names it as where these reasons go
logger = logging.getLogger("multihead.observe.importance")

# run(what): one run of the metric, its scalar (what names the run in errors)
Run = Callable[[str], Tensor]

# The layers whose forward is known to be a pure function of its arguments and parameters (no
# state kept, inputs never modified in place): the "blocks" whose outputs may be reused.
_PURE_FORWARDS = (TransformerEncoderLayer.forward, TransformerDecoderLayer.forward)


class _Call:
    """One recorded call of a block: its arguments and its output."""

    __slots__ = ("block", "args", "kwargs", "output")

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.block = block
        self.args = args
        self.kwargs = kwargs
        self.output: Any = None


def _same(a: Any, b: Any, equal: list[Tensor] | None) -> bool:
    """Whether two block arguments may be equal, bit for bit; unknown kinds never are.

    Tensors of one shape, dtype and device may be: whether they are is appended to ``equal``
    as a () bool on their device, computed there (no wait for the device here); without
    ``equal``, they are compared now.
    """
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
            return False
        if equal is None:
            return bool(torch.equal(a, b))
        equal.append(torch.eq(a, b).all())  # torch.equal's answer, left on the device
        return True
    if isinstance(a, PackedBatch) and isinstance(b, PackedBatch):
        return _same(a.key_mask, b.key_mask, equal)
    if type(a) is type(b) and isinstance(a, (bool, int, float, str)):
        return bool(a == b)
    return False  # a cache or anything else: the call may have state or side effects


def _observed(block: nn.Module) -> bool:
    """Whether an attention module inside the block has observers (e.g. a capture in metric())."""
    return any(isinstance(m, MultiHeadAttention) and m.observers for m in block.modules())


def _random(block: nn.Module) -> bool:
    """Whether the block has active dropout (training mode and p > 0): its runs differ."""
    return any(
        m.training
        and (
            (isinstance(m, nn.Dropout) and m.p > 0)
            or (isinstance(m, MultiHeadAttention) and m.dropout > 0)
        )
        for m in block.modules()
    )


def _copy(value: Any) -> Any:
    """A tensor's copy (recorded values must not change if the caller modifies them in place)."""
    return value.clone() if isinstance(value, Tensor) else value


class PrefixCache:
    """Record every block's calls on one clean run; hand their outputs back on later runs.

    For ablating layer l, the blocks "before" it are those whose first call in the clean run
    came before the first call of the earliest block holding layer l's module. On an ablation
    run such a block's forward is replaced: its k-th call returns (a copy of) its k-th recorded
    output when the arguments may equal the recorded ones (:func:`_same`), and runs for real
    otherwise; :meth:`agreed` tells after the run whether they did.
    """

    def __init__(self, blocks: list[nn.Module], holders: list[list[int]]) -> None:
        self.blocks = blocks
        self.holders = holders  # per layer, the blocks holding its module (shared modules: >1)
        self.calls: dict[int, list[_Call]] = {}
        self.order: dict[int, int] = {}  # block index -> rank of its first call
        self.clean = torch.zeros(())
        self.skipped = 0
        # per reused call of the running run, whether its tensors equalled the recorded ones
        self.equal: list[Tensor] = []
        self.compare_first = False  # compare values before reusing a call (and wait for them)

    @classmethod
    def build(
        cls, model: nn.Module, found: list[tuple[str, ObservableAttention]], run: Run
    ) -> PrefixCache | None:
        """Record the clean run and check that reuse reproduces it, or None (reason logged).

        ``run(what)`` runs the metric once and returns its scalar (``what`` names the run in
        errors): the clean run, then a check run reusing every block it can.
        """
        blocks = _blocks(model, found)
        if len(blocks) < 2:
            logger.info(
                "head_importance: full forwards for every ablation (the model has %s of "
                "multihead's layers holding attention: no prefix to reuse)",
                "one" if blocks else "none",
            )
            return None
        if any(_random(b) for b in blocks):
            logger.warning(
                "head_importance: full forwards for every ablation (the model is in training "
                "mode with dropout: no two runs agree); call model.eval() for faster ablation"
            )
            return None
        holders = [
            [i for i, b in enumerate(blocks) if any(m is mha for m in b.modules())]
            for _, mha in found
        ]
        cache = cls(blocks, holders)
        cache.clean = cache._record(run)
        if not cache.order:
            logger.info("head_importance: full forwards (metric() ran none of the model's layers)")
            return None
        last = max(cache.order, key=cache.order.__getitem__)
        try:
            with cache._skip_before(cache.order[last]):
                check = run("check run")
        except Exception as e:  # e.g. metric() reads a forward hook of a skipped layer
            reason = f"the check run raised {type(e).__name__}: {e}"
        else:
            if cache.skipped == 0:
                reason = "no layer's arguments matched the recorded run"
            elif not cache.agreed():
                reason = "a reused layer's arguments differed from the recorded run's"
            elif not torch.equal(check, cache.clean):
                reason = f"the check run gave {check.item()!r}, the clean {cache.clean.item()!r}"
            else:
                return cache
        logger.warning(
            "head_importance: full forwards for every ablation: reusing recorded layer outputs "
            "did not reproduce the clean metric (%s); is metric() deterministic, on the same "
            "inputs every call?",
            reason,
        )
        return None

    def _record(self, run: Run) -> Tensor:
        def make_forward(index: int, block: nn.Module) -> Callable[..., Any]:
            real = type(block).forward

            def forward(*args: Any, **kwargs: Any) -> Any:
                self.order.setdefault(index, len(self.order))
                call = _Call(
                    block, tuple(map(_copy, args)), {k: _copy(v) for k, v in kwargs.items()}
                )
                output = real(block, *args, **kwargs)
                call.output = _copy(output)
                self.calls.setdefault(index, []).append(call)
                return output

            return forward

        with _patched(self.blocks, make_forward):
            return run("clean run")

    def agreed(self) -> bool:
        """Whether every reused call since the last ``agreed()`` had the recorded arguments
        (the one read from the device, once per run, after it)."""
        equal, self.equal = self.equal, []
        by_device: dict[torch.device, list[Tensor]] = {}
        for flag in equal:
            by_device.setdefault(flag.device, []).append(flag)
        return all(bool(torch.stack(flags).all()) for flags in by_device.values())

    def skipping(self, layer: int) -> Any:
        """Within the block: one ablation run of ``layer`` reuses the blocks before its own."""
        # the first call of a block holding the layer; a layer outside every block (or never
        # run) bounds nothing: a block whose arguments it changed would not match anyway
        never = len(self.order)
        first = min((self.order.get(i, never) for i in self.holders[layer]), default=never)
        return self._skip_before(first)

    def _skip_before(self, first: int) -> Any:
        """Blocks whose first call ranked below ``first`` hand back their recorded outputs."""
        counts: dict[int, int] = {}

        def make_forward(index: int, block: nn.Module) -> Callable[..., Any] | None:
            if self.order.get(index, first) >= first:
                return None
            real = type(block).forward
            recorded = self.calls[index]

            def forward(*args: Any, **kwargs: Any) -> Any:
                k = counts.get(index, 0)
                counts[index] = k + 1
                if k < len(recorded) and not _observed(block):
                    call = recorded[k]
                    equal: list[Tensor] | None = None if self.compare_first else []
                    if (
                        len(args) == len(call.args)
                        and kwargs.keys() == call.kwargs.keys()
                        and all(_same(a, b, equal) for a, b in zip(args, call.args, strict=True))
                        and all(_same(v, call.kwargs[n], equal) for n, v in kwargs.items())
                    ):
                        self.equal.extend(equal or ())
                        self.skipped += 1
                        # a copy: whoever receives it may modify it in place
                        return call.output.clone()
                return real(block, *args, **kwargs)

            return forward

        return _patched(self.blocks, make_forward)


class _patched:
    """Replace chosen blocks' forward for the duration of a ``with`` block (instance attribute,
    so ``nn.Module.__call__`` and the block's own hooks still run); restored on exit."""

    def __init__(
        self,
        blocks: list[nn.Module],
        make_forward: Callable[[int, nn.Module], Callable[..., Any] | None],
    ) -> None:
        self.blocks = blocks
        self.make_forward = make_forward
        self.patched: list[nn.Module] = []

    def __enter__(self) -> None:
        try:
            for index, block in enumerate(self.blocks):
                forward = self.make_forward(index, block)
                if forward is not None:
                    block.forward = forward
                    self.patched.append(block)
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        for block in self.patched:
            del block.forward
        self.patched.clear()


def _blocks(model: nn.Module, found: list[tuple[str, ObservableAttention]]) -> list[nn.Module]:
    """The multihead layers that hold the attention modules (the nearest one above each).

    Only layers whose class keeps the library's own forward count (a subclass that overrides
    it may keep state); none may hold another.
    """
    modules = dict(model.named_modules())
    blocks: list[nn.Module] = []
    for name, _ in found:
        parts = name.split(".") if name else []
        for cut in range(len(parts) - 1, -1, -1):
            candidate = modules.get(".".join(parts[:cut]))
            if (
                candidate is not None
                and isinstance(candidate, (TransformerEncoderLayer, TransformerDecoderLayer))
                and type(candidate).forward in _PURE_FORWARDS
                and "forward" not in vars(candidate)  # not patched on the instance
            ):
                if not any(candidate is b for b in blocks):
                    blocks.append(candidate)
                break
    for b in blocks:
        if any(other is not b and any(m is other for m in b.modules()) for other in blocks):
            return []  # nested layers: a skipped outer layer would hide an inner one
    return blocks
