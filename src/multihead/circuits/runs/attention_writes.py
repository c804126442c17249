"""What each attention layer writes into the residual stream: its output, or its output through
a norm the block applies before adding it (a post-attention norm), found at the run.

Most blocks add their attention's output to the stream as it is (``x + attn(norm(x))``). Some
normalise it first: Gemma-2's "sandwich" norms (``x + post_attention_layernorm(attn(...))``),
OLMo-2's post-norms. Which module does is read off the run, for any family: the one module of
the block (outside the attention) whose input *is* the attention module's output tensor
(dropout, the identity in eval, is looked through). A norm there is frozen at the run
(:class:`~multihead.circuits.runs.frozen_norm.FrozenNorm`: its scale from this run's attention
output), so it is linear and a sum of heads' writes goes through it term by term, exactly: the
frozen norm's outputs of the heads, plus its bias, add up to what the block added. Anything else
there is refused by name: its heads' shares would not be linear.

Shapes: B batch, T tokens, E width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn

from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.map_types import Block, ModelMap, output_tensor
from multihead.observers import Removable

__all__ = ["AttentionWrites"]


class AttentionWrites:
    """Per attention layer, the module (if any) its output goes through before the stream.

    ``hooks()`` yields the forward hooks to register for one run; afterwards ``norm(layer, ...)``
    is that layer's post-attention norm frozen at the run (None where the output is added as it
    is) and ``written(layer)`` what the block added to the stream for its attention (the norm's
    output; None where nothing was found: the output itself is the write).

    Args:
        mapped: the model's map; its blocks hold one attention site each (layer l in
            ``blocks[l]``).
        blocks: per layer, its block.
    """

    def __init__(self, mapped: ModelMap, blocks: list[Block]) -> None:
        self._mapped = mapped
        self._blocks = blocks
        self._outputs: list[Tensor | None] = [None] * len(blocks)
        self._after: list[list[tuple[nn.Module, Tensor, Tensor]]] = [[] for _ in blocks]

    def hooks(self) -> Iterator[Removable]:
        """The forward hooks that find each layer's post-attention module in one run."""
        for layer, block in enumerate(self._blocks):
            attention = self._mapped.sites[layer].module
            yield attention.register_forward_hook(self._on_attention(layer))
            inside = {id(m) for m in attention.modules()}
            for m in block.module.modules():
                if m is not block.module and id(m) not in inside:
                    yield m.register_forward_hook(self._on_part(layer))

    def _on_attention(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self._outputs[layer] = output_tensor(out)

        return hook

    def _on_part(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            given = self._outputs[layer]
            if (
                given is not None
                and args
                and args[0] is given
                and not isinstance(m, (nn.Dropout, nn.Identity))
            ):
                self._after[layer].append((m, given, output_tensor(out)))

        return hook

    def norm(self, layer: int, caller: str, rounding: float, dtype: Any) -> FrozenNorm | None:
        """Layer ``layer``'s post-attention norm frozen at the run (computed in ``dtype``), or
        None when the block adds the attention's output as it is.

        Raises:
            ValueError: the output goes through a module that is not a LayerNorm or RMSNorm of
                the block (its heads' shares would not be linear), or through several.
        """
        found = self._after[layer]
        if not found:
            return None
        block = self._blocks[layer]
        names = ", ".join(type(m).__name__ for m, _, _ in found)
        eps = block.norm_eps(found[0][0]) if len(found) == 1 else None
        if eps is None:
            raise ValueError(
                f"{caller}: the attention output of layer {layer} "
                f"({self._mapped.sites[layer].name}) goes through {names} before the residual "
                f"stream, which is not one norm of its block: its heads' shares of the stream are "
                f"not linear"
            )
        module, given, out = found[0]
        return FrozenNorm.of(module, eps, given.to(dtype), out.to(dtype), caller, rounding)

    def written(self, layer: int) -> Tensor | None:
        """(B, T, E) what the block added for its attention when it went through a norm (that
        norm's output), else None."""
        found = self._after[layer]
        return found[0][2] if len(found) == 1 else None
