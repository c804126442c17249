"""How much each head matters to a metric: ablation differences or gradient sensitivities.

:func:`head_importance` scores every head of a model for a scalar ``metric()``:

- ``method="ablation"``: metric with the head's output zeroed, minus metric clean. A head in
  layer l cannot change anything computed before it, so the blocks before layer l's are not run
  again: their outputs are recorded once, on a clean run, and handed back (see
  :class:`_PrefixCache`), which makes the 72 ablations of MiniLM cost about 0.6 of 72 forwards.
- ``method="gradient"``: |∂metric/∂ξ_{l,h}| at ξ = 1, where ξ_{l,h} multiplies head (l, h)'s
  output (Michel, Levy and Neubig, "Are Sixteen Heads Really Better than One?", 2019): one
  forward and one backward for every head at once.

Both act through MultiHeadAttention's observers (:mod:`multihead.observe.steering`).

Shapes: L attention modules (layers), H heads (the most any layer has).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_choice
from multihead.attention import AttentionCall, MultiHeadAttention
from multihead.layers import TransformerDecoderLayer, TransformerEncoderLayer
from multihead.observe.steering import intervene, model_heads
from multihead.observers import ObservableAttention
from multihead.packing import PackedBatch

__all__ = ["head_importance", "METHODS"]

logger = logging.getLogger(__name__)

METHODS = ("ablation", "gradient")

Metric = Callable[[], Tensor]

# The layers whose forward is known to be a pure function of its arguments and parameters (no
# state kept, inputs never modified in place): the "blocks" whose outputs may be reused.
_PURE_FORWARDS = (TransformerEncoderLayer.forward, TransformerDecoderLayer.forward)


def _scalar(metric: Metric, what: str) -> Tensor:
    value = metric()
    if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
        raise ValueError(
            f"metric() must return a scalar floating point tensor, got {_describe(value)} ({what})"
        )
    return value.reshape(())


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def head_importance(
    model: nn.Module,
    metric: Metric,
    *,
    method: str = "ablation",
    reuse_prefix: bool = True,
) -> Tensor:
    r"""Score every head of ``model`` for ``metric``: an (L, H) tensor.

    - ``"ablation"``: ``I[l, h] = metric(head (l, h) zeroed) - metric()``, one run per head
      (each under ``torch.no_grad()``). Negative: the metric drops without the head.
    - ``"gradient"``: ``I[l, h] = |∂ metric / ∂ξ_{l,h}|`` at ξ = 1, with ξ_{l,h} multiplying
      head (l, h)'s output (Michel et al., 2019): the first-order estimate of what removing the
      head changes, for every head from one forward and one backward.

    With ``reuse_prefix`` (default), ablation runs skip what they cannot change: zeroing a head
    of layer l leaves every block (a multihead ``TransformerEncoderLayer`` or
    ``TransformerDecoderLayer``) before layer l's as it was, so those blocks hand back their
    outputs from one recorded clean run instead of running. A block is skipped only when its
    arguments equal, bit for bit, those of the recorded call, it carries no cache, observer or
    hook, and it has no active dropout; a check run must reproduce the clean metric exactly.
    Otherwise every ablation runs the full forward, and the reason is logged on
    ``multihead.observe.importance``. Results are the same either way.

    Args:
        model: any module holding :class:`~multihead.MultiHeadAttention` modules. It is left as
            it was (no parameter or mode is changed).
        metric: called with no arguments, runs the model (on fixed inputs) and returns a scalar
            tensor, e.g. ``lambda: model(ids).logits[0, -1, target]``. For ``"gradient"`` it
            must not disable gradients itself.
        method: ``"ablation"`` or ``"gradient"``.
        reuse_prefix: let ablation runs skip the unchanged blocks (see above).

    Returns:
        (L, H) in the metric's dtype and device, L the number of attention modules in module
        order (as :func:`multihead.capture` numbers them), H the most heads a module has (NaN
        where a layer has fewer).

    Raises:
        ValueError: no attention module in the model, an unknown ``method``, a metric that does
            not return a scalar floating point tensor or (``"gradient"``) does not depend on
            the heads through autograd.
    """
    check_choice("method", method, METHODS)
    found = model_heads(model)
    if not callable(metric):
        raise TypeError(f"metric must be a callable with no arguments, got {_describe(metric)}")
    if method == "gradient":
        return _gradient_importance(found, metric)
    return _ablation_importance(model, found, metric, reuse_prefix=bool(reuse_prefix))


def _gradient_importance(found: list[tuple[str, ObservableAttention]], metric: Metric) -> Tensor:
    """|∂metric/∂ξ| with ξ (H,) per layer multiplied into the per-head output by an observer."""
    xis = [
        torch.ones(
            mha.num_heads,
            dtype=next(mha.parameters()).dtype,
            device=next(mha.parameters()).device,
            requires_grad=True,
        )
        for _, mha in found
    ]

    def make_observer(xi: Tensor) -> Callable[[AttentionCall, Tensor], Tensor]:
        def observer(call: AttentionCall, out: Tensor) -> Tensor:
            return out * xi.to(out.dtype)[:, None]  # (B, T, H, Dv) · (H, 1)

        return observer

    handles = [
        mha.register_observer(make_observer(xi)) for (_, mha), xi in zip(found, xis, strict=True)
    ]
    try:
        with torch.enable_grad():
            value = _scalar(metric, 'method="gradient"')
            if not value.requires_grad:
                raise ValueError(
                    'method="gradient" needs metric() to depend on the heads through autograd: '
                    "its result does not require grad (is the model run under torch.no_grad()?)"
                )
            grads = torch.autograd.grad(value, xis, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    scores = _table(found, value)
    for layer, grad in enumerate(grads):
        if grad is not None:
            scores[layer, : grad.shape[0]] = grad.abs().to(scores.dtype)
        else:  # the layer never ran: the metric does not depend on it
            scores[layer, : found[layer][1].num_heads] = 0.0
    return scores


def _table(found: list[tuple[str, ObservableAttention]], like: Tensor) -> Tensor:
    """An (L, H) table of NaN: the heads a layer lacks stay NaN."""
    most = max(mha.num_heads for _, mha in found)
    return torch.full((len(found), most), float("nan"), dtype=like.dtype, device=like.device)


def _ablation_importance(
    model: nn.Module,
    found: list[tuple[str, ObservableAttention]],
    metric: Metric,
    *,
    reuse_prefix: bool,
) -> Tensor:
    with torch.no_grad():
        prefix = _PrefixCache.build(model, found, metric) if reuse_prefix else None
        if prefix is None:
            clean = _scalar(metric, "clean run")
        else:
            clean = prefix.clean
        scores = _table(found, clean)
        for layer, (_, mha) in enumerate(found):
            for head in range(mha.num_heads):
                skipping = contextlib.nullcontext() if prefix is None else prefix.skipping(layer)
                with skipping, intervene(model, {(layer, head): 0.0}):
                    ablated = _scalar(metric, f"head ({layer}, {head}) ablated")
                scores[layer, head] = ablated.to(scores.dtype) - clean
    return scores


class _Call:
    """One recorded call of a block: its arguments and its output."""

    __slots__ = ("block", "args", "kwargs", "output")

    def __init__(self, block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.block = block
        self.args = args
        self.kwargs = kwargs
        self.output: Any = None


def _same(a: Any, b: Any) -> bool:
    """Whether two block arguments are equal, bit for bit; unknown kinds never are."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return (
            a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    if isinstance(a, PackedBatch) and isinstance(b, PackedBatch):
        return _same(a.key_mask, b.key_mask)
    if type(a) is type(b) and isinstance(a, (bool, int, float, str)):
        return bool(a == b)
    return False  # a cache or anything else: the call may have state or side effects


def _observed(block: nn.Module) -> bool:
    """Whether an attention module inside the block has observers (e.g. a capture in metric())."""
    return any(isinstance(m, MultiHeadAttention) and m._observers for m in block.modules())


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


class _PrefixCache:
    """Record every block's calls on one clean run; hand their outputs back on later runs.

    For ablating layer l, the blocks "before" it are those whose first call in the clean run
    came before the first call of the earliest block holding layer l's module. On an ablation
    run such a block's forward is replaced: its k-th call returns (a copy of) its k-th recorded
    output when the arguments equal the recorded ones, and runs for real otherwise.
    """

    def __init__(self, blocks: list[nn.Module], holders: list[list[int]]) -> None:
        self.blocks = blocks
        self.holders = holders  # per layer, the blocks holding its module (shared modules: >1)
        self.calls: dict[int, list[_Call]] = {}
        self.order: dict[int, int] = {}  # block index -> rank of its first call
        self.clean = torch.zeros(())
        self.skipped = 0

    @classmethod
    def build(
        cls, model: nn.Module, found: list[tuple[str, ObservableAttention]], metric: Metric
    ) -> _PrefixCache | None:
        """Record the clean run and check that reuse reproduces it, or None (reason logged)."""
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
        cache.clean = cache._record(metric)
        if not cache.order:
            logger.info("head_importance: full forwards (metric() ran none of the model's layers)")
            return None
        last = max(cache.order, key=cache.order.__getitem__)
        try:
            with cache._skip_before(cache.order[last]):
                check = _scalar(metric, "check run")
        except Exception as e:  # e.g. metric() reads a forward hook of a skipped layer
            reason = f"the check run raised {type(e).__name__}: {e}"
        else:
            if cache.skipped == 0:
                reason = "no layer's arguments matched the recorded run"
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

    def _record(self, metric: Metric) -> Tensor:
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
            return _scalar(metric, "clean run")

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
                    if (
                        len(args) == len(call.args)
                        and kwargs.keys() == call.kwargs.keys()
                        and all(_same(a, b) for a, b in zip(args, call.args, strict=True))
                        and all(_same(v, call.kwargs[n]) for n, v in kwargs.items())
                    ):
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
