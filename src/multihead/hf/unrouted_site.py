"""The calls of an attention module transformers computes itself (not routed through its
attention interface): two hooks make them, while anything observes the module's site.

A pre-hook on the module keeps its forward's arguments; a pre-hook on its output projection
(:class:`~multihead.hf.unrouted_families.UnroutedFamily`'s ``output``) splits the heads'
concatenated outputs (B, T, H·Dv) into the per-head output (B, T, H, Dv), runs the site's q/k/v
editors and observers on it, and hands the projection their replacement. The call's q, k, v,
mask and scale are worked out by the family's recipe only when an observer reads them, and then
the heads' outputs recomputed from them must equal the module's own, or the family is refused
by name: a recipe can never be silently wrong. The check runs on each site's calls until one
with padding has passed (a call without padding does not test the recipe's mask), then no more.
With q/k/v editors the heads' outputs are recomputed from the edited call
(:func:`multihead.functional.attention`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from multihead import functional, kernels
from multihead.hf.forward import real_queries
from multihead.hf.unrouted_families import Recomputed, UnroutedFamily
from multihead.observers import AttentionCall, ObservableAttention

__all__ = ["UnroutedCalls"]

# How far the heads' outputs recomputed from a recipe may be from the module's own, relative to
# their largest magnitude (at least 1): the kernels round differently, a wrong recipe is far off.
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 4e-2}


class UnroutedCalls:
    """Makes the calls of one unrouted attention module for its site's observers and editors.

    Args:
        module: the transformers attention module.
        projection: its output projection (given the heads' concatenated outputs).
        holder: the module whose forward runs both (the module itself, or the layer holding it
            and the sibling its projection is in): the call's arguments are dropped when its
            forward ends, also by an exception.
        family: the module's :class:`~multihead.hf.unrouted_families.UnroutedFamily`.
        label: the family and class, as errors name them (``"gpt_neo (GPTNeoSelfAttention)"``).

    ``acquire`` and ``release`` are the site's registration callbacks: the hooks are registered
    with the first registration and removed with the last (a forward with nothing registered
    runs the module's own code alone). ``site`` is the site whose observers run (set once by
    :func:`multihead.hf.sites.attention_sites`).
    """

    def __init__(
        self,
        module: nn.Module,
        projection: nn.Module,
        holder: nn.Module,
        family: UnroutedFamily,
        label: str,
    ) -> None:
        self.module = module
        self.holder = holder
        self.label = label
        self.projection = projection
        self.family = family
        self.site: ObservableAttention | None = None
        self._count = 0
        self._hooks: list[Any] = []
        self._arguments: dict[str, Any] | None = None
        # checked on every call until one with padding has passed (a padding-free call does
        # not test the recipe's masking), then no more
        self._settled = False
        self._signature = inspect.signature(type(module).forward)

    def acquire(self) -> None:
        if self._count == 0:
            self._hooks = [
                self.module.register_forward_pre_hook(self._on_module, with_kwargs=True),
                self.projection.register_forward_pre_hook(self._on_heads),
                self.holder.register_forward_hook(self._on_end, always_call=True),
            ]
        self._count += 1

    def release(self) -> None:
        self._count -= 1
        if self._count == 0:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._arguments = None

    def _on_module(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        bound = self._signature.bind(module, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        for name, parameter in self._signature.parameters.items():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(name, {}))
        self._arguments = arguments

    def _on_end(self, holder: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        # a forward that raised before the projection ran must not leave its arguments for
        # the next call of the projection (by an observer, or another module)
        self._arguments = None

    def _on_heads(self, projection: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        site, arguments, self._arguments = self.site, self._arguments, None
        if arguments is None:
            # not the module's call: the projection run by an observer (each head's write
            # through it), or by something else
            return None
        if site is None or not site.observers or not args or not isinstance(args[0], Tensor):
            return None
        given = args[0]
        heads, width = site.num_heads, site.head_dim
        if given.shape[-1] != heads * width:
            raise ValueError(
                f"{self.label}: its output projection was given {given.shape[-1]} "
                f"features, but the module was read as {heads} heads of width {width}; its heads "
                f"cannot be observed"
            )
        own = given.unflatten(-1, (heads, width))  # (B, T, H, Dv)
        call = AttentionCall.deferred(site, lambda: self._call(site, arguments, own))
        out = own
        edited = site.observers.edit(call) if site.observers.editing else call
        if edited is not call:  # an editor replaced q, k or v: the heads' outputs follow them
            call = edited
            out = functional.attention(
                call.q, call.k, call.v, mask=call.mask, is_causal=call.is_causal, scale=call.scale
            ).transpose(1, 2)
            out = out.to(own.dtype)
        out = site.observers.run(call, out)
        if out is own:
            return None
        return (out.flatten(2), *args[1:])

    def _call(
        self, site: ObservableAttention, arguments: dict[str, Any], own: Tensor
    ) -> AttentionCall:
        """The call the recipe works out from the module's ``arguments``, checked against the
        module's own per-head output ``own`` (B, T, H, Dv) until the site is settled."""
        name = self.label
        recipe = self.family.recipe
        if recipe is None:
            raise ValueError(
                f"{name}: multihead knows where its heads' outputs are (they can be read, "
                f"patched and steered), but not how its attention scores are made, so its "
                f"attention weights, queries and keys cannot be recomputed"
            )
        if "Flash" in type(self.module).__name__:
            # its mask is the padding alone (or none) and causality the kernel's own
            raise ValueError(
                f"{name}: the flash-attention variant's attention weights are not recomputed "
                f"(its heads can be read, patched and steered); load the model with "
                f"attn_implementation='eager' to capture them"
            )
        try:
            made = recipe(self.module, arguments)
        except torch.OutOfMemoryError:
            raise
        except (KeyError, AttributeError, TypeError, RuntimeError) as error:
            # a transformers release whose forward takes other arguments, keeps other parts or
            # shapes them otherwise
            raise ValueError(
                f"{name}: its score recipe does not fit the installed transformers "
                f"({type(error).__name__}: {error}): multihead cannot recompute its attention "
                f"weights"
            ) from error
        keys = made.mask.shape[-1] if made.mask is not None else made.k.shape[-2]
        if keys != made.k.shape[-2] or made.k.shape[-2] != made.q.shape[-2]:
            raise ValueError(
                f"{name}: the call attends to {keys} keys, {made.q.shape[-2]} of them computed "
                f"in this call (a KV cache holding earlier tokens): its weights are recomputed "
                f"without a cache only"
            )
        real = real_queries(made.mask)
        if not self._settled or self.module.training:
            self._check(made, own, real)
        return AttentionCall(
            site, (made.q, made.k, made.v), made.mask, made.is_causal, made.scale, real
        )

    def _check(self, made: Recomputed, own: Tensor, real: Tensor | None) -> None:
        """Refuse the family unless the heads' outputs recomputed from ``made`` equal ``own``
        on the real queries ``real`` ((B or 1, T) bool, or None: all)."""
        with torch.no_grad():
            again = functional.attention(
                made.q, made.k, made.v, mask=made.mask, is_causal=made.is_causal, scale=made.scale
            ).transpose(1, 2)  # (B, T, H, Dv)
        own = own.detach()
        if again.shape != own.shape:
            raise ValueError(
                f"{self.label}: its score recipe makes heads' outputs of shape "
                f"{tuple(again.shape)}, the module's are {tuple(own.shape)}: multihead cannot "
                f"recompute its attention weights"
            )
        a, b = again.float(), own.float()
        if real is not None:
            keep = real.expand(own.shape[0], own.shape[1])
            a, b = a[keep], b[keep]
        difference = float((a - b).abs().max()) if a.numel() else 0.0
        tolerance = _TOLERANCE.get(own.dtype, 1e-2) * max(
            1.0, float(b.abs().max()) if b.numel() else 1.0
        )
        if not difference <= tolerance:
            training = (
                " (the module is in training mode: its dropout makes each call differ; call "
                "model.eval())"
                if self.module.training
                else ""
            )
            raise ValueError(
                f"{self.label}: its score recipe does not reproduce the module's "
                f"own output (largest difference {difference:.3g}, tolerance {tolerance:.1g})"
                f"{training}: multihead cannot recompute its attention weights"
            )
        if real is not None:
            self._settled = not bool(real.all())
        elif made.mask is not None and made.mask.shape[-2] == 1:  # a key padding mask (XLM)
            self._settled = not bool(kernels.allowed(made.mask).all())
