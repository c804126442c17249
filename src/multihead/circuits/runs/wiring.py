"""How each attention layer is wired into its block: found in one run, kept with the model's map.

Every exact decomposition and every edge of the graph needs to know, per attention layer, which
module of the block normalises the stream for the attention (a pre-LN norm), which modules
inside the attention project that input into queries, keys and values, which one is given the
heads' outputs (the output projection), which module takes the attention's output before the
stream (a post-attention norm: Gemma-2's "sandwich" norms, OLMo-2's post-norms) and which
normalises the stream for the feed-forward network. A :class:`Wiring` holds all of it.

No family is named: the modules are found by where the tensors go in one run, for any model the
map knows (:class:`WiringRun`'s hooks):

    norm        the module of the block (outside the attention and the feed-forward network)
                whose output tensor *is* what the attention is given as its stream
    inputs      the modules inside the attention site given that tensor itself
    projection  the module inside the attention site given its heads' outputs (B, T, H·Dv),
                value for value
    post_norms  the modules of the block (outside the attention) given the attention's output
                tensor itself, dropout and the identity looked through
    mlp_norm    the module whose output tensor is what the feed-forward network is given

The first run that asks finds it, and it is kept with the model's map (a rebuilt map finds it
again); every run after hooks only the modules it names. The map's blocks tell where to look: a
layer whose block does not hold it alone has only its ``inputs`` and ``projection``.

Shapes: B batch, T tokens, E width, H query heads, Dv head width.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.map_types import Block, ModelMap, output_tensor
from multihead.observers import AttentionCall, Removable

__all__ = ["LayerWiring", "Wiring", "WiringRun"]


@dataclass(frozen=True, eq=False)
class LayerWiring:
    """One attention layer's wiring (see the module docstring).

    Attributes:
        attention: the block's attention part (the module whose output the block adds), or the
            site's module where the map knows no block holding the layer alone.
        width: the width of what the attention is given (E).
        norm: the module whose output the attention is given (a pre-LN norm), or None: the
            attention reads the stream itself, or the block is not known.
        norm_eps: that norm's epsilon where the map knows it.
        inputs: the modules inside the attention site given its input itself (its q/k/v
            projections, one fused module or three), in call order.
        projection: the module inside the attention site given its heads' outputs, or None.
        post_norms: the modules of the block given the attention's output before the stream
            (one post-attention norm, or none: the output is added as it is).
        mlp_norm: the module whose output the block's feed-forward network is given, or None.
    """

    attention: nn.Module
    width: int | None = None
    norm: nn.Module | None = None
    norm_eps: float | None = None
    inputs: tuple[nn.Module, ...] = ()
    projection: nn.Module | None = None
    post_norms: tuple[nn.Module, ...] = ()
    mlp_norm: nn.Module | None = None


@dataclass(frozen=True, eq=False)
class Wiring:
    """Per attention layer, its :class:`LayerWiring` (layer l is ``layers[l]``)."""

    layers: tuple[LayerWiring, ...]

    @staticmethod
    def known(mapped: ModelMap) -> Wiring | None:
        """The wiring found for ``mapped`` by an earlier run, or None."""
        return _KEPT.get(mapped)


# Kept per map, as the map is per model (outside the state dict); a wiring holds the model's
# submodules, never the model or the map, so the entry goes with the map.
_KEPT: weakref.WeakKeyDictionary[ModelMap, Wiring] = weakref.WeakKeyDictionary()


class _Layer:
    """What one run saw of one layer (the finding's and the post-norms' records)."""

    def __init__(self) -> None:
        self.ran = False
        self.given: Tensor | None = None  # what the attention was given as its stream
        self.norm: nn.Module | None = None
        self.inputs: list[nn.Module] = []
        self.heads: Tensor | None = None  # its heads' outputs, flattened (B, T, H·Dv)
        self.packed: Tensor | None = None  # the same at the real tokens (N, H·Dv): packed
        self.projection: nn.Module | None = None
        self.output: Tensor | None = None  # the attention's output
        self.after: list[tuple[nn.Module, Tensor, Tensor]] = []  # (module, given, output)
        self.mlp_norm: nn.Module | None = None


class WiringRun:
    """The hooks for one run that read the model's wiring: they find it when no earlier run has
    (and keep it with the map when every attention layer ran), and with ``post_norms`` record
    what each post-attention norm was given and gave in this run (:meth:`post_norm`,
    :meth:`written`).

    Register :meth:`hooks` for the run; afterwards :attr:`wiring` is the model's wiring.

    Args:
        mapped: the model's map.
        real: for a padded batch, the (B, T) mask of the real tokens (a model that packs it
            runs its blocks on (N, E), the real tokens alone); else None.
        post_norms: whether to record the post-attention norms' inputs and outputs.
    """

    def __init__(
        self, mapped: ModelMap, *, real: Tensor | None = None, post_norms: bool = False
    ) -> None:
        self._mapped = mapped
        self._real = real
        self._post_norms = post_norms
        self._known = Wiring.known(mapped)
        self._seen = [_Layer() for _ in mapped.sites]
        # per layer, what its block's modules made: id(output) -> (module, output)
        self._made: list[dict[int, tuple[nn.Module, Tensor]]] = [{} for _ in mapped.sites]
        self._found: Wiring | None = None

    @property
    def wiring(self) -> Wiring:
        """The model's wiring: known before the run, or found in it (what a layer's attention
        did not run through is not found)."""
        if self._known is not None:
            return self._known
        if self._found is None:
            self._found = self._result()
            if all(seen.ran for seen in self._seen):
                _KEPT[self._mapped] = self._found
        return self._found

    # -- hooks ----------------------------------------------------------------------------------

    def hooks(self) -> Iterator[Removable]:
        """The hooks to register for the run."""
        if self._known is not None:
            if self._post_norms:
                for layer, wired in enumerate(self._known.layers):
                    if wired.post_norms:
                        yield wired.attention.register_forward_hook(self._on_attention(layer))
                        for m in wired.post_norms:
                            yield m.register_forward_hook(self._on_after(layer))
            return
        for layer, site in enumerate(self._mapped.sites):
            block, part = self._parts(layer)
            yield site.attention.register_observer(self._on_heads(layer))
            yield part.register_forward_pre_hook(self._on_input(layer), with_kwargs=True)
            # the projections are the site's own modules: a part around it (BERT's attention
            # with its output block) may hold modules that take more than the heads' outputs
            for m in site.module.modules():
                if m is not site.module:
                    yield m.register_forward_pre_hook(self._inside(layer))
            if block is None:
                continue
            yield part.register_forward_hook(self._on_attention(layer))
            inside = {id(m) for m in part.modules()}
            in_mlp = {id(m) for m in block.mlp.modules()} if block.mlp is not None else set()
            for m in block.module.modules():
                if id(m) not in inside and m is not block.module:
                    # a norm is a module of the block outside both its parts; anything outside
                    # the attention may be given its output
                    yield m.register_forward_hook(self._on_part(layer, id(m) not in in_mlp))
            if block.mlp is not None:
                yield block.mlp.register_forward_pre_hook(self._on_mlp(layer), with_kwargs=True)

    def _parts(self, layer: int) -> tuple[Block | None, nn.Module]:
        """The block holding ``layer`` alone (None if none does) and the attention part to read:
        the block's attention where the map knows it, else the site's module."""
        block = self._mapped.block_of(layer)
        if block is None or len(block.sites) != 1:
            return None, self._mapped.sites[layer].module
        return block, block.attention if block.attention is not None else self._mapped.sites[
            layer
        ].module

    def _maker(self, layer: int, given: Any) -> nn.Module | None:
        """The module of ``layer``'s block whose output tensor is ``given``, or None (another
        block's output, as a post-LN block is given, is not its norm)."""
        if not isinstance(given, Tensor):
            return None
        made = self._made[layer].get(id(given))
        return made[0] if made is not None and made[1] is given else None

    def _on_input(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen = self._seen[layer]
            given = self._mapped.stream_of(args, kwargs)
            if seen.given is None and isinstance(given, Tensor):
                seen.given, seen.norm = given, self._maker(layer, given)

        return hook

    def _on_heads(self, layer: int) -> Callable[[AttentionCall, Tensor], None]:
        def observer(call: AttentionCall, out: Tensor) -> None:
            seen = self._seen[layer]
            if not seen.ran:
                flat = out.flatten(2)
                real = self._real
                seen.heads = flat
                # a model that packs the batch gives its projection the real tokens alone
                seen.packed = None if real is None else flat[real.to(flat.device)]
                seen.ran = True

        return observer

    def _inside(self, layer: int) -> Callable[..., None]:  # each module inside the attention
        def hook(m: nn.Module, args: tuple[Any, ...]) -> None:
            seen = self._seen[layer]
            given = args[0] if args else None
            if not isinstance(given, Tensor):
                return
            if given is seen.given and all(m is not other for other in seen.inputs):
                seen.inputs.append(m)
            for heads in (seen.heads, seen.packed):
                if (
                    seen.projection is None
                    and heads is not None
                    and given.shape == heads.shape
                    and bool((given == heads).all())
                ):
                    seen.projection = m

        return hook

    def _on_attention(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            self._seen[layer].output = output_tensor(out)

        return hook

    def _on_after(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            seen = self._seen[layer]
            given = seen.output
            if given is not None and args and args[0] is given:
                seen.after.append((m, given, output_tensor(out)))

        return hook

    def _on_part(self, layer: int, remember: bool) -> Callable[..., None]:
        after = self._on_after(layer)

        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            if remember and isinstance(out, Tensor):
                self._made[layer][id(out)] = (m, out)
            if not isinstance(m, (nn.Dropout, nn.Identity)):
                after(m, args, out)

        return hook

    def _on_mlp(self, layer: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen = self._seen[layer]
            if seen.mlp_norm is None:
                seen.mlp_norm = self._maker(layer, self._mapped.stream_of(args, kwargs))

        return hook

    def _result(self) -> Wiring:
        for made in self._made:  # the outputs were kept alive for the finding only
            made.clear()
        layers = []
        for layer, seen in enumerate(self._seen):
            block, part = self._parts(layer)
            layers.append(
                LayerWiring(
                    attention=part,
                    width=seen.given.shape[-1] if seen.given is not None else None,
                    norm=seen.norm,
                    norm_eps=(
                        block.norm_eps(seen.norm)
                        if block is not None and seen.norm is not None
                        else None
                    ),
                    inputs=tuple(seen.inputs),
                    projection=seen.projection,
                    post_norms=tuple(m for m, _, _ in seen.after),
                    mlp_norm=seen.mlp_norm,
                )
            )
        return Wiring(tuple(layers))

    # -- what the run's post-attention norms did --------------------------------------------------

    def post_norm(self, layer: int, caller: str, rounding: float, dtype: Any) -> FrozenNorm | None:
        """Layer ``layer``'s post-attention norm frozen at the run (computed in ``dtype``), or
        None when the block adds the attention's output as it is (``post_norms`` recorded).

        Raises:
            ValueError: the output goes through a module that is not a LayerNorm or RMSNorm of
                the block (its heads' shares would not be linear), or through several.
        """
        found = self._seen[layer].after
        if not found:
            return None
        block = self._mapped.block_of(layer)
        names = ", ".join(type(m).__name__ for m, _, _ in found)
        eps = block.norm_eps(found[0][0]) if block is not None and len(found) == 1 else None
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
        found = self._seen[layer].after
        return found[0][2] if len(found) == 1 else None
