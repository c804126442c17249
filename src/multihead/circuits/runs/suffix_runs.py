"""Per-position patches of a causal model, run from the patched position on.

In a causal model a patch at position t changes nothing before t: every activation of an
earlier position, its keys and values included, is the unpatched run's. A per-position sweep
(:func:`~multihead.patch_heads` and :func:`~multihead.patch` with ``per_position=True``) runs
each patch at t on the positions t … T-1 alone:

- the model is called on them, their positions given through the map's
  ``positions_argument`` (:class:`~multihead.map_types.ModelMap`);
- each attention call gets the keys and values of positions 0 … t-1 from the unpatched run put
  before its own (a q/k/v editor; causality is aligned bottom-right, so each query sees the
  keys at or before its own position);
- the blocks before the patched layer hand back their recorded outputs from t on
  (:meth:`~multihead.circuits.runs.prefix_reuse.PrefixCache.skipping_suffix`);
- the unembedding computes only the positions the metric reads (found once, below).

The metric is then given the unpatched run's logits with the recomputed positions put in: at
every position it reads, what a whole patched run gives. A patch that can reach none of them
(a position after the last one read) changes nothing and runs nothing.

Which positions a metric reads is found once, on the unpatched logits: a set of positions is
unread when setting it to NaN, to other numbers, and turning each of its rows round (an argmax
moves) leaves the metric's value the same bit for bit; the sets are halved until each read
position stands alone. A metric that none of these moves at all positions at once (a top-1
accuracy that is 0 on every row) is taken to read every position. So the metric is called a
few more times, and which positions it reads must not depend on the logits' values (a metric
of the last position, or of an answer's positions, does not).

:meth:`SuffixRuns.build` checks once that such runs, unpatched, give the whole run's logits at
the positions read (to the dtype's rounding: they multiply fewer rows at a time); when they do
not, or the model or inputs do not allow them (not causal, no positions argument, positions
embedded by the run's length, padding, a sliding window, tensor parallelism, a metric of the
whole output), every patch runs the whole sequence, and the reason is logged. So does a model
on a GPU, where a forward costs its kernel launches more than its arithmetic: there the whole
sequences stacked along the batch take a few large forwards where these runs take one or two
per position and layer.

Shapes: B batch, T tokens, S keys, E width, V vocabulary, H heads, Hk key/value heads, D one
head's width, n stacked variants, s = T - t recomputed positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from multihead.circuits.runs.input_pair import InputPair
from multihead.circuits.runs.metric import Metric, logits_of
from multihead.circuits.runs.prefix_reuse import PrefixCache
from multihead.map_types import ModelMap, output_tensor
from multihead.mapping import model_map
from multihead.observers import AttentionCall, ObserverHandle, QKVEditor, registered

__all__ = ["SuffixRuns"]

# How far a run from a later position may stray from the whole run, relative to the largest
# logit, before it is not trusted: rounding differs (fewer rows per product), a wrong position
# or mask differs by the logits' own size.
_AGREEMENT = {torch.float64: 1e-9, torch.float32: 1e-4}
_LOW_PRECISION_AGREEMENT = 5e-2


def _with_logits(output: Any, logits: Tensor) -> Any:
    """``output`` with its logits replaced (a tensor output: ``logits`` itself)."""
    if isinstance(output, Tensor):
        return logits
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        return dataclasses.replace(output, logits=logits)
    assert isinstance(output, Mapping)
    return type(output)({**output, "logits": logits})  # type: ignore[call-arg]


class _Written(Exception):  # noqa: N818  (an end, not an error)
    """Raised after the patched block has written the one position a local patch changes."""


class _NotASuffixRun(Exception):  # noqa: N818  (a reason, raised inside the check run)
    """An attention call of a run from a later position that such a run cannot serve."""


class SuffixRuns:
    """Runs of one input from a later position on, reusing an unpatched run (module docstring).

    Built by :meth:`build`; :meth:`run` is one stacked forward of patched variants that all
    patch at or after one position.
    """

    def __init__(
        self,
        pair: InputPair,
        inputs: Any,
        mapped: ModelMap,
        prefix: PrefixCache | None,
        keys: list[Tensor],
        values: list[Tensor],
        output: Any,
        read: list[int] | None,
    ) -> None:
        self.pair = pair
        self.inputs = inputs
        self.mapped = mapped
        self.prefix = prefix
        self.keys = keys  # per layer, (B, Hk, T, D) as the kernel saw them
        self.values = values  # per layer, (B, Hk, T, Dv)
        self.output = output  # the unpatched run's output
        logits = logits_of(output)
        assert logits is not None
        self.logits = logits  # (B, T, V)
        self.read = read  # the positions the metric reads, ascending; None: every one
        # the logits runs hand out, (k·B, T, V): the unpatched ones but at ``dirty``, where the
        # latest run wrote its own (one buffer, not a copy of the whole logits per run)
        self.buffer: Tensor | None = None
        self.dirty = torch.zeros(0, dtype=torch.long, device=logits.device)

    @classmethod
    def build(
        cls,
        pair: InputPair,
        inputs: Any,
        metric: Metric,
        metric_input: str,
        output: Any,
        prefix: PrefixCache | None,
        keys: list[Tensor | None],
        values: list[Tensor | None],
        *,
        caller: str,
        log: logging.Logger,
    ) -> SuffixRuns | None:
        """Runs from a later position of ``inputs`` (whose unpatched run gave ``output``, with
        ``prefix`` recorded on it, and per layer the keys and values (B, T, Hk, D) its kernel
        saw: None for a layer the run did not call), or None when they cannot serve (the reason
        logged on ``log``, naming ``caller``)."""
        reason = cls._refusal(pair, inputs, metric_input, output)
        missing = [
            i for i, (k, v) in enumerate(zip(keys, values, strict=True)) if k is None or v is None
        ]
        if reason is None and missing:
            reason = f"attention layer {missing[0]} was not called"
        if reason is None:
            mapped = model_map(pair.model)
            logits = logits_of(output)
            assert logits is not None
            # the kernel's (B, Hk, T, D), as the cache's (B, T, Hk, D) were taken from it
            heads_first = [k.transpose(1, 2) for k in keys if k is not None]
            values_first = [v.transpose(1, 2) for v in values if v is not None]
            read = _read_positions(metric, logits)
            runs = cls(pair, inputs, mapped, prefix, heads_first, values_first, output, read)
            reason = runs._check()
            if reason is None:
                return runs
        log.info("%s: every per-position patch runs the whole sequence (%s)", caller, reason)
        return None

    @staticmethod
    def _refusal(pair: InputPair, inputs: Any, metric_input: str, output: Any) -> str | None:
        logits = logits_of(output)
        if logits is not None and logits.device.type != "cpu":
            # a GPU's small forwards cost their launches: the whole sequences stacked into a
            # few large forwards are faster there than a forward or two per position
            return f"on {logits.device.type}, whole sequences stacked take fewer forwards"
        mapped = model_map(pair.model)
        if mapped.causal is not True:
            return "the model is not causal: a patch reaches earlier positions"
        if mapped.positions_argument is None:
            return "the model's map names no positions argument for a run of later tokens"
        if mapped.positions_by_length:
            # transformers' dynamic (NTK) and longrope rotary: a run of later positions alone
            # would be embedded by its own length, not the whole sequence's
            return (
                "the model embeds positions by the run's length (a dynamic or longrope rotary): "
                "a run of later positions alone is embedded otherwise than the whole sequence"
            )
        if any(site.shard is not None for site in mapped.sites):
            return "the model is tensor-parallel"
        if any(s.window is not None and s.window < pair.length for s in mapped.sites):
            return "the model attends through a sliding window shorter than the inputs"
        if metric_input != "logits":
            return "the metric reads the whole output, not the logits"
        if logits is None or logits.dim() != 3 or logits.shape[:2] != (pair.batch, pair.length):
            return "the model's output holds no (B, T, V) logits"
        return pair.suffix_refusal(inputs)

    def _check(self) -> str | None:
        """Why runs from a later position do not reproduce the unpatched run (the first and
        the last layer patched, from the middle position), or None when they do."""
        t = self.logits.shape[1]
        # the middle position, or the last one read if earlier: a run that reads something
        start = min(t // 2, max(self.read if self.read is not None else [t - 1]))
        read = self._kept(start)
        scale = float(self.logits.abs().max())
        bound = _AGREEMENT.get(self.logits.dtype, _LOW_PRECISION_AGREEMENT) * max(scale, 1.0)
        last = len(self.mapped.sites) - 1
        # every block run from the position (the first layer's block at it alone), and every
        # block skipped but the last
        for layer, local in ((0, True), (last, False)):
            try:
                output = self.run(1, start, layer, lambda a, b: [], local=local)
            except _NotASuffixRun as e:
                return str(e)
            except Exception as e:  # a family whose forward such a run breaks
                return f"a run from position {start} raised {type(e).__name__}: {e}"
            got = logits_of(output)
            assert got is not None
            index = torch.tensor(read, device=got.device) + start
            gap = float((got[:, index] - self.logits[:, index]).abs().max())
            if not gap <= bound:
                return (
                    f"a run from position {start} gave logits {gap:.3g} from the whole run's, "
                    f"more than {bound:.3g}"
                )
        return None

    def _kept(self, start: int) -> list[int]:
        """The positions from ``start`` on the metric reads, counted from ``start``."""
        t = self.logits.shape[1]
        read = range(t) if self.read is None else self.read
        return [p - start for p in read if p >= start]

    def run(
        self,
        copies: int,
        start: int,
        layer: int,
        attach: Callable[[int, int | None], list[ObserverHandle]],
        *,
        local: bool = False,
    ) -> Any:
        """The output of ``copies`` variants stacked along the batch, each patched by what
        ``attach(start, stop)`` registers (removed after) at or after position ``start`` of
        ``layer`` or later, run from ``start`` on; the logits the unpatched run's elsewhere.
        The logits are valid until the next run (one buffer serves them all): read them before.

        ``attach(start, stop)`` registers hooks for a run of positions ``start`` … ``stop`` - 1
        (``stop`` None: to the end): hidden states, queries and per-head outputs (n·B, stop -
        start, …), keys and values of every position up to ``stop`` (n·B, Hk, stop, D),
        weights (n·B, H, stop - start, stop).

        ``local``: the patch changes what ``layer``'s block writes at position ``start`` alone
        (a head's output, its query or weights there, a block's write there; not the block's
        input nor keys or values, which later positions read). Then that block runs on
        position ``start`` alone, and the rest from the next block on.
        """
        n = copies
        full = self._staged(n)  # (n·B, T, V)
        kept = self._kept(start)
        if not kept:  # no position the metric reads can change: as unpatched, n times
            return _with_logits(self.output, full)
        index = torch.tensor(kept, device=full.device)
        written = None
        hooks: Callable[[], list[ObserverHandle]] = lambda: attach(start, None)  # noqa: E731
        if local and self.prefix is not None and self.prefix.reuses(layer):
            written = self._written(n, start, layer, attach)  # (n·B, 1, E)
            hooks = list  # the patch is in what the block wrote
        t = self.logits.shape[1]
        skipping = (
            self.prefix.skipping_suffix(layer, start, None, n, written)
            if self.prefix is not None
            else contextlib.nullcontext()
        )
        assert self.mapped.positions_argument is not None
        with (
            registered(self._editors(start, t, n)),
            registered(hooks()),
            self._cut(index),
            skipping,
        ):
            output = self.pair.run_suffix(self.inputs, start, n, self.mapped.positions_argument)
        logits = logits_of(output)
        assert logits is not None
        if logits.shape[1] != len(kept):  # every position from start on was computed
            index = torch.arange(logits.shape[1], device=full.device)
        self.dirty = index + start
        full[:, self.dirty] = logits.to(full.dtype)
        # the metric reads the logits alone: the rest of the output as the unpatched run's,
        # whose tensors (hidden states of all T positions, ...) split like one run's
        return _with_logits(self.output, full)

    def _written(
        self,
        n: int,
        start: int,
        layer: int,
        attach: Callable[[int, int | None], list[ObserverHandle]],
    ) -> Tensor:
        """What ``layer``'s block writes at position ``start`` (n·B, 1, E), patched by what
        ``attach`` registers: a run of that one position, ended after the block."""
        block = self.mapped.block_of(layer)
        assert block is not None and self.prefix is not None
        got: list[Tensor] = []

        def capture(module: nn.Module, args: Any, output: Any) -> None:
            stream = output_tensor(output)
            got.append(stream[:, :1].detach().clone())
            raise _Written

        assert self.mapped.positions_argument is not None
        with (
            registered(self._editors(start, start + 1, n)),
            registered(attach(start, start + 1)),
            registered([block.module.register_forward_hook(capture)]),
            self.prefix.skipping_suffix(layer, start, start + 1, n),
            contextlib.suppress(_Written),
        ):
            self.pair.run_suffix(
                self.inputs, start, n, self.mapped.positions_argument, stop=start + 1
            )
        if not got:
            raise _NotASuffixRun(f"the block of attention layer {layer} was not called")
        return got[0]

    def _editors(self, start: int, stop: int, n: int) -> Any:
        """Every layer's editor for a run of positions ``start`` … ``stop`` - 1 (registered as
        the generator is consumed)."""
        return (
            site.attention.register_qkv_editor(self._earlier(i, start, stop, n))
            for i, site in enumerate(self.mapped.sites)
        )

    def _staged(self, n: int) -> Tensor:
        """The unpatched logits of ``n`` stacked variants, (n·B, T, V): the buffer's first
        rows, the latest run's writes undone. Valid until the next run."""
        b = self.logits.shape[0]
        if self.buffer is None or self.buffer.shape[0] < n * b:
            self.buffer = self.logits.repeat(n, 1, 1)
        else:
            stacked = self.buffer.unflatten(0, (-1, b))  # (k, B, T, V)
            stacked[:, :, self.dirty] = self.logits[:, self.dirty]
        self.dirty = self.dirty[:0]
        return self.buffer[: n * b]

    def _cut(self, index: Tensor) -> Any:
        """Within the block, the unembedding computes only the positions ``index`` (counted
        from ``start``) of its input, when the metric's positions are known."""
        unembedding = self.mapped.unembedding
        if unembedding is None or self.read is None:
            return contextlib.nullcontext()

        def pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]  # (n·B, s, E)
            return (x.index_select(1, index.to(x.device)), *args[1:])

        return registered([unembedding.register_forward_pre_hook(pre)])

    def _earlier(self, layer: int, start: int, stop: int, n: int) -> QKVEditor:
        """Layer ``layer``'s editor in a run of positions ``start`` … ``stop`` - 1: the keys
        and values of positions before ``start`` put before the call's."""
        keys = self.keys[layer][:, :, :start]  # (B, Hk, start, D)
        values = self.values[layer][:, :, :start]
        b, hk = keys.shape[:2]

        def editor(call: AttentionCall) -> tuple[Tensor, Tensor, Tensor] | None:
            if call.mask is not None:
                raise _NotASuffixRun(
                    f"attention layer {layer} was given a mask on a run from a later position"
                )
            if call.k.shape != (n * b, hk, stop - start, keys.shape[3]):
                raise _NotASuffixRun(
                    f"attention layer {layer} was given keys {tuple(call.k.shape)} on a run of "
                    f"{stop - start} positions, expected (n·B, Hk, T, D) = ({n * b}, {hk}, "
                    f"{stop - start}, {keys.shape[3]})"
                )
            if not start:
                return None
            # the variants' shared earlier positions copied once, into the concatenation
            k, v = (
                torch.cat([x.to(y.dtype).expand(n, *x.shape), y.unflatten(0, (n, b))], dim=3)
                for x, y in ((keys, call.k), (values, call.v))
            )  # (n, B, Hk, T, D)
            return call.q, k.flatten(0, 1), v.flatten(0, 1)

        return editor


def _read_positions(metric: Metric, logits: Tensor) -> list[int] | None:
    """The positions of ``logits`` (B, T, V) that ``metric`` reads, ascending (module
    docstring); None when the metric's value is not reproducible, or no fill of every position
    changes it (then every position)."""
    want = metric(logits)
    if not isinstance(want, Tensor) or not torch.equal(want, metric(logits)):
        return None

    def unread(positions: list[int]) -> bool:
        for fill in ("nan", "other", "reversed"):
            changed = logits.clone()
            if fill == "nan":
                changed[:, positions] = float("nan")
            elif fill == "other":
                changed[:, positions] = 1.0 - changed[:, positions]
            else:  # every row's order turned round: a metric of the argmax sees it
                changed[:, positions] = changed[:, positions].flip(-1)
            try:
                got = metric(changed)
            except Exception:  # e.g. a metric that checks its input is finite: it reads it
                return False
            if not (isinstance(got, Tensor) and got.shape == want.shape and torch.equal(got, want)):
                return False
        return True

    t = logits.shape[1]
    read: list[int] = []
    pending = [list(range(t))]
    while pending:
        group = pending.pop()
        if unread(group):
            continue
        if len(group) == 1:
            read.extend(group)
            continue
        half = len(group) // 2
        pending += [group[:half], group[half:]]
    # a metric whose value no change of the logits moves (a top-1 accuracy that is 0 on every
    # row, as it stays under every fill) reads positions that cannot be told: every one
    return sorted(read) if read else None
