"""Reuse the outputs of the blocks that editing a head cannot change (ablation, patching).

Editing a head of layer l leaves every block before layer l's as it was. :class:`PrefixCache`
records every block's calls (arguments and output) on one clean run; on an edited run of
layer l, each block before it hands back its recorded output instead of running, when its
arguments equal the recorded ones bit for bit. A "block" is a block of the model's map
(:func:`multihead.model_map`) that the map calls reusable: a multihead layer that declares its
parts and keeps its class's forward, or a transformers layer that transformers itself
recomputes from its arguments; its forward is replaced on the instance for the duration of a
run (:class:`_patched`), so ``nn.Module.__call__`` and its hooks still run.

A run may also stack ``copies`` edited variants of the recorded input along the batch
(activation patching runs many variants per forward): a block whose batched arguments are the
recorded ones repeated ``copies`` times (``x.repeat(copies, ...)``, variant-major) hands back
its recorded output repeated the same way.

Nothing inside a forward waits for the device: a call whose arguments have the recorded kinds,
shapes, dtypes and devices hands back the recorded output at once, and the values of its
tensors are compared on the device; :meth:`PrefixCache.agreed` reads the comparisons back
once, after the run. A run whose arguments differed (a metric whose inputs depend on the
ablation, as a generated text does) is run again, and from then on values are compared before
a call is reused (``compare_first``), as they must be for such a metric.

:func:`multihead.circuits.importance.head_importance` uses it; the reasons for running
full forwards instead are logged on its logger, ``multihead.circuits.importance``;
:func:`multihead.patch_heads` uses it for stacked variants and logs on
``multihead.circuits.patching.patch_heads``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from multihead.map_types import Site, output_tensor, with_output_tensor
from multihead.mapping import model_map
from multihead.observers import ObservableAttention
from multihead.packing import PackedBatch

__all__ = ["PrefixCache"]

# head_importance's logger (its documentation names it as where these reasons go), unless the
# caller names its own
logger = logging.getLogger("multihead.circuits.importance")

# run(what): one run of the metric, its scalar (what names the run in errors)
Run = Callable[[str], Tensor]


class _Call:
    """One recorded call of a block: its arguments and its output."""

    __slots__ = ("block", "args", "kwargs", "output")

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.block = block
        self.args = args
        self.kwargs = kwargs
        self.output: Any = None


class _Match:
    """Compares a call's arguments with a recorded call's, for ``copies`` stacked variants.

    Tensors of one dtype and device may be equal when their shapes are equal, or when the
    call's is the recorded one's repeated ``copies`` times along the first (batch) dimension
    (then :attr:`tiled` is set: the output must be repeated too). Whether they are is appended
    to ``equal`` as a () bool on their device, computed there (no wait for the device here);
    without ``equal``, they are compared now. Unknown kinds never match.
    """

    def __init__(self, copies: int, equal: list[Tensor] | None) -> None:
        self.copies = copies
        self.equal = equal
        self.tiled = False
        self.stateful = False  # an argument of a kind that never matches (a cache)

    def same(self, a: Any, b: Any) -> bool:
        if a is None or b is None:
            return a is None and b is None
        if isinstance(a, Tensor) and isinstance(b, Tensor):
            if a.dtype != b.dtype or a.device != b.device:
                return False
            if a.shape != b.shape:
                n = self.copies
                if n == 1 or b.dim() == 0 or a.shape != (n * b.shape[0], *b.shape[1:]):
                    return False
                a = a.unflatten(0, (n, b.shape[0]))  # (copies, B, ...): compared with b's (B, ...)
                self.tiled = True
            if self.equal is None:
                return bool(torch.eq(a, b).all())
            self.equal.append(torch.eq(a, b).all())  # torch.equal's answer, left on the device
            return True
        if isinstance(a, PackedBatch) and isinstance(b, PackedBatch):
            return self.same(a.key_mask, b.key_mask)
        if isinstance(a, (tuple, list)) and type(a) is type(b):
            # e.g. a transformers layer's rotary (cos, sin)
            return len(a) == len(b) and all(self.same(x, y) for x, y in zip(a, b, strict=True))
        if type(a) is type(b) and isinstance(a, (bool, int, float, str)):
            return bool(a == b)
        self.stateful = True  # a cache or anything else: the call may have state or effects
        return False


def _has_observers(site: ObservableAttention) -> bool:
    """Whether a site (a MultiHeadAttention or a transformers AttentionSite) has observers."""
    return bool(site.observers)


def _random(block: nn.Module, sites: list[Site]) -> bool:
    """Whether the block has active dropout (training mode and p > 0): its runs differ."""
    return any(
        m.training and isinstance(m, nn.Dropout) and m.p > 0 for m in block.modules()
    ) or any(s.module.training and s.dropout > 0 for s in sites)


def _copy(value: Any, copies: int = 1) -> Any:
    """A copy of a recorded value (it must not change if the caller modifies the one it got in
    place), its tensors repeated ``copies`` times along the batch (the first) dimension."""
    if isinstance(value, Tensor):
        # detached: a recorded run made with gradients keeps no graph in its record
        value = value.detach()
        return value.clone() if copies == 1 else value.repeat(copies, *(1,) * (value.dim() - 1))
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(v, copies) for v in value)
    return value


def _from(output: Any, start: int, stop: int | None, copies: int) -> Any:
    """A recorded block output's positions ``start`` … ``stop`` - 1: its residual stream
    (:func:`~multihead.map_types.output_tensor`, (B, T, E)) cut along T and repeated ``copies``
    times along the batch; the other items as recorded."""
    stream = output_tensor(output)
    if not isinstance(stream, Tensor):
        raise TypeError(
            f"a reused block returned {type(output).__name__}, not its residual stream "
            f"(B, T, E) or a tuple starting with it"
        )
    return with_output_tensor(output, stream[:, start:stop].repeat(copies, 1, 1))


class PrefixCache:
    """Record every block's calls on one clean run; hand their outputs back on later runs.

    For editing layer l, the blocks "before" it are those whose first call in the clean run
    came before the first call of the earliest block holding layer l's module. On an edited
    run such a block's forward is replaced: its k-th call returns (a copy of) its k-th recorded
    output when the arguments may equal the recorded ones (:class:`_Match`), and runs for real
    otherwise; :meth:`agreed` tells after the run whether they did.
    """

    def __init__(
        self,
        blocks: list[nn.Module],
        holders: list[list[int]],
        sites: list[list[ObservableAttention]],
        caller: str,
    ) -> None:
        self.blocks = blocks
        self.holders = holders  # per layer, the blocks holding its module (shared modules: >1)
        self.sites = sites  # per block, the attention sites inside it
        self.caller = caller  # who reuses, for the log
        self.calls: dict[int, list[_Call]] = {}
        self.order: dict[int, int] = {}  # block index -> rank of its first call
        self.clean = torch.zeros(())
        self.skipped = 0
        self.stateful = False  # a call was run for real for an argument that never matches
        # per reused call of the running run, whether its tensors equalled the recorded ones
        self.equal: list[Tensor] = []
        self.compare_first = False  # compare values before reusing a call (and wait for them)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        found: list[Site],
        run: Run,
        *,
        caller: str = "head_importance",
        log: logging.Logger = logger,
    ) -> PrefixCache | None:
        """Record the clean run and check that reuse reproduces it, or None (reason logged).

        ``run(what)`` runs the metric once and returns its scalar (``what`` names the run in
        errors): the clean run, then a check run reusing every block it can. ``caller`` names
        the user in the reasons logged on ``log``.
        """
        mapped = model_map(model)
        # a block whose forward is replaced on the instance (another tool's patch) may keep state
        kept = [b for b in mapped.blocks if b.reusable and "forward" not in vars(b.module)]
        blocks = [b.module for b in kept]
        if len(blocks) < 2:
            log.info(
                "%s: full forwards for every run (the model has %s of multihead's or "
                "transformers' layers holding attention: no prefix to reuse)",
                caller,
                "one" if blocks else "none",
            )
            return None
        inside = [[mapped.sites[layer] for layer in b.sites] for b in kept]
        if any(_random(b, held) for b, held in zip(blocks, inside, strict=True)):
            log.warning(
                "%s: full forwards for every run (the model is in training mode with dropout: "
                "no two runs agree); call model.eval() for faster runs",
                caller,
            )
            return None
        holders = [
            [i for i, b in enumerate(kept) if layer in b.sites] for layer in range(len(found))
        ]
        sites = [
            [site.attention for site, held in zip(found, holders, strict=True) if i in held]
            for i in range(len(blocks))
        ]
        cache = cls(blocks, holders, sites, caller)
        cache.clean = cache._record(run)
        if not cache.order:
            log.info("%s: full forwards (metric() ran none of the model's layers)", caller)
            return None
        last = max(cache.order, key=cache.order.__getitem__)
        try:
            with cache._skip_before(cache.order[last]):
                check = run("check run")
        except Exception as e:  # e.g. metric() reads a forward hook of a skipped layer
            reason = f"the check run raised {type(e).__name__}: {e}"
        else:
            if cache.skipped == 0 and cache.stateful:
                # an expected reason, not a mistake: say it quietly
                log.info(
                    "%s: full forwards for every run (no layer's arguments matched the recorded "
                    "run: its layers are called with a cache or another stateful argument; a "
                    "transformers model runs without one with use_cache=False)",
                    caller,
                )
                return None
            if cache.skipped == 0:
                reason = "no layer's arguments matched the recorded run"
            elif not cache.agreed():
                reason = "a reused layer's arguments differed from the recorded run's"
            elif not torch.equal(check, cache.clean):
                reason = f"the check run gave {check.item()!r}, the clean {cache.clean.item()!r}"
            else:
                return cache
        log.warning(
            "%s: full forwards for every run: reusing recorded layer outputs did not reproduce "
            "the clean metric (%s); is metric() deterministic, on the same inputs every call?",
            caller,
            reason,
        )
        return None

    def _record(self, run: Run) -> Tensor:
        def make_forward(index: int) -> Callable[..., Any]:
            block = self.blocks[index]
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

    def skipping(self, layer: int, copies: int = 1) -> Any:
        """Within the block: one edited run of ``layer`` reuses the blocks before its own;
        with ``copies`` > 1 the run stacks that many variants of the recorded input (its
        batched arguments repeated along the batch, variant-major)."""
        return self._skip_before(self._first_call(layer), copies)

    def _first_call(self, layer: int) -> int:
        """The rank of the first call of a block holding ``layer``; a layer outside every
        block (or never run) bounds nothing: a block whose arguments it changed would not
        match anyway."""
        never = len(self.order)
        return min((self.order.get(i, never) for i in self.holders[layer]), default=never)

    def reuses(self, layer: int) -> bool:
        """Whether the block holding ``layer``'s attention is one this cache reuses (and was
        called on the recorded run)."""
        return bool(self.holders[layer]) and all(i in self.order for i in self.holders[layer])

    def skipping_suffix(
        self,
        layer: int,
        start: int,
        stop: int | None = None,
        copies: int = 1,
        written: Tensor | None = None,
    ) -> Any:
        """Within the block: a run of the recorded input's positions ``start`` … ``stop`` - 1
        alone (its ``copies`` variants stacked), in which the blocks before ``layer``'s hand
        back those positions of their recorded outputs (the residual stream, (B, T, E), cut
        along T). With ``written`` ((copies·B, 1, E)), ``layer``'s block too, with ``written``
        at position ``start`` (what a patch of that block changed there alone).

        Their arguments are not compared: such a run gives them other shapes than the
        recorded ones (fewer positions). Whoever runs it checks once that it reproduces the
        recorded run (:class:`~multihead.circuits.runs.suffix_runs.SuffixRuns` does).
        """
        never = len(self.order)
        first = self._first_call(layer)
        counts: dict[int, int] = {}

        def make_forward(index: int) -> Callable[..., Any] | None:
            rank = self.order.get(index, never)
            own = written is not None and rank == first
            if rank >= first and not own:
                return None
            recorded = self.calls[index]

            def forward(*args: Any, **kwargs: Any) -> Any:
                k = counts.get(index, 0)
                counts[index] = k + 1
                self.skipped += 1
                output = _from(recorded[min(k, len(recorded) - 1)].output, start, stop, copies)
                if own:
                    assert written is not None
                    stream = output_tensor(output)
                    stream[:, :1] = written.to(stream.dtype)
                return output

            return forward

        return _patched(self.blocks, make_forward)

    def _skip_before(self, first: int, copies: int = 1) -> Any:
        """Blocks whose first call ranked below ``first`` hand back their recorded outputs."""
        counts: dict[int, int] = {}

        def make_forward(index: int) -> Callable[..., Any] | None:
            if self.order.get(index, first) >= first:
                return None
            block = self.blocks[index]
            real = type(block).forward
            recorded = self.calls[index]

            def forward(*args: Any, **kwargs: Any) -> Any:
                k = counts.get(index, 0)
                counts[index] = k + 1
                if k < len(recorded) and not any(map(_has_observers, self.sites[index])):
                    call = recorded[k]
                    match = _Match(copies, None if self.compare_first else [])
                    if (
                        len(args) == len(call.args)
                        and kwargs.keys() == call.kwargs.keys()
                        and all(match.same(a, b) for a, b in zip(args, call.args, strict=True))
                        and all(match.same(v, call.kwargs[n]) for n, v in kwargs.items())
                    ):
                        self.equal.extend(match.equal or ())
                        self.skipped += 1
                        # a copy: whoever receives it may modify it in place
                        return _copy(call.output, copies if match.tiled else 1)
                    self.stateful = self.stateful or match.stateful
                return real(block, *args, **kwargs)

            return forward

        return _patched(self.blocks, make_forward)


class _patched:
    """Replace chosen blocks' forward for the duration of a ``with`` block (instance attribute,
    so ``nn.Module.__call__`` and the block's own hooks still run); restored on exit."""

    def __init__(
        self,
        blocks: list[nn.Module],
        make_forward: Callable[[int], Callable[..., Any] | None],
    ) -> None:
        self.blocks = blocks
        self.make_forward = make_forward
        self.patched: list[nn.Module] = []

    def __enter__(self) -> None:
        try:
            for index, block in enumerate(self.blocks):
                forward = self.make_forward(index)
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
