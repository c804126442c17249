"""The logit lens: what the residual stream would predict if the model stopped after each layer.

nostalgebraist's logit lens (2020) reads layer l's residual stream through the model's own final
norm and unembedding, as if the remaining layers added nothing::

    lens_l = unembedding(final_norm(resid_post_l))        (B, P, V)

times the factor a family multiplies its logits by (Granite's 1 / ``logits_scaling``), so the
last layer's is the model's logits, and the layers before show when the prediction forms.
Each head's write is read the same way, through the final norm frozen at this run (the split of
:mod:`~multihead.circuits.runs.frozen_norm`, as direct logit attribution reads it)::

    head_l,h = (γ ⊙ (result_l,h - mean) / σ) W_U^T      (B, P, V): its direct effect on every logit

``lens=`` reads each layer through a fitted lens instead, an affine map of the stream (M_l, b_l)
before the final norm: a :class:`~multihead.circuits.decompose.jacobian_lens.JacobianLens`
(``M_l = J_l``, no b) or a :class:`~multihead.circuits.decompose.tuned_lens.TunedLens`
(``M_l = I + A_l``, ``b_l``); the last layer is read by the identity, so it stays the model's
logits::

    lens_l = unembedding(final_norm(M_l resid_post_l + b_l))          (B, P, V)

and each head's write through the lens's linear part, then the frozen norm's::

    head_l,h = (γ ⊙ (M_l result_l,h - mean) / σ) W_U^T

(J_l carries a head's write, as any change of layer l's stream, to its first-order effect on
the last block's output; a tuned lens's bias b_l belongs to no head and is left out, as the
norm's β is). A Jacobian lens that is the identity gives the plain lens exactly.

Shapes: B batch, T tokens, P kept positions, E width, V vocabulary, L layers, H heads, k top_k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_indices, check_optional_positive_int
from multihead.circuits.decompose.jacobian_lens import JacobianLens
from multihead.circuits.decompose.tuned_lens import TunedLens
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.site_recorder import cache
from multihead.mapping import model_map
from multihead.observers import registered

__all__ = ["LogitLens", "logit_lens"]


@dataclass(frozen=True)
class LogitLens:
    """Each layer's residual stream read as logits, and each head's write read the same way.

    Attributes:
        layers: the L' layers read, in order.
        positions: the P token positions read.
        logits: (L', B, P, V) each layer's stream through the final norm and unembedding (the
            last layer's equals the model's logits), or None with ``top_k``.
        top_logits: (L', B, P, k) the k largest of them, largest first (k = V without top_k).
        top_ids: (L', B, P, k) their token ids.
        results: (L', B, P, H, E) each head's write into the stream (its output through its
            slice of the output projection, no bias).
        norm: the final norm frozen at this run's last stream (None: the model has none).
        unembedding: the (V, E) unembedding weight, times the model's logit scale (Granite's
            1 / ``logits_scaling``; :attr:`~multihead.map_types.ModelMap.logit_scale`).
        lens: the lens read through (``lens=``), whose linear part M_l at each layer
            :meth:`head_logits` applies to a head's write (the identity at the last layer,
            ``num_layers - 1``); None without a lens.
        num_layers: the model's layers (which layer the lens reads by the identity).
    """

    layers: list[int]
    positions: list[int]
    logits: Tensor | None
    top_logits: Tensor
    top_ids: Tensor
    results: Tensor
    norm: FrozenNorm | None
    unembedding: Tensor
    lens: JacobianLens | TunedLens | None = None
    num_layers: int = 0

    def head_logits(self, layer: int) -> Tensor:
        """(B, P, H, V): each head of ``layer`` (one of :attr:`layers`) read as logits, its
        direct effect on every logit (the final norm frozen, no biases); with a lens, its write
        through the lens's linear part first (module docstring)."""
        if layer not in self.layers:
            raise ValueError(f"layer must be one of the layers read, {self.layers}, got {layer}")
        index = self.layers.index(layer)
        written = self.results[index]  # (B, P, H, E)
        linear = self.lens.affine(layer, self.num_layers)[0] if self.lens is not None else None
        if linear is not None:  # (E, E): the lens's own matrix, none kept per call
            dtype = torch.promote_types(written.dtype, linear.dtype)
            written = written.to(dtype) @ linear.to(written.device, dtype).T  # (B, P, H, E)
        normed = self.norm.linear(written) if self.norm is not None else written
        return normed @ self.unembedding.to(normed.dtype).T


@torch.no_grad()
def logit_lens(
    model: nn.Module,
    inputs: Any,
    *,
    layers: int | Sequence[int] | None = None,
    positions: int | Sequence[int] | slice | None = None,
    top_k: int | None = 10,
    lens: JacobianLens | TunedLens | None = None,
) -> LogitLens:
    """Read each layer's residual stream, and each head's write, as logits (module docstring).

    Args:
        model: a causal LM whose map knows its unembedding (multihead's
            :class:`~multihead.models.TransformerLM`, transformers' ``...ForCausalLM``, a
            :class:`multihead.TextModel` with ``head="lm"``).
        inputs: token ids (B, T), a dict of the model's keyword arguments, or for a text model
            a text or texts.
        layers: the layers whose output stream is read (negative from the end); default all.
        positions: the token positions read (an int, ints, a slice); default all. The logits
            kept are L'·B·P·V numbers: choose positions on a long text.
        top_k: keep only the k largest logits of every layer and position (``top_logits``,
            ``top_ids``) and drop the rest; None keeps every logit (``logits``).
        lens: read each layer through a fitted lens (module docstring): a
            :class:`~multihead.circuits.decompose.jacobian_lens.JacobianLens` or a
            :class:`~multihead.circuits.decompose.tuned_lens.TunedLens`, checked against the
            model first (its width and layers; its provenance: one warning where it differs);
            None (default) is the logit lens.

    Returns:
        A :class:`LogitLens`.

    Raises:
        ValueError: a model without an unembedding, a final norm that is neither a LayerNorm
            nor an RMSNorm as read here, layers or positions out of range, top_k not positive,
            a lens that does not fit the model or has no map for a layer read.
        TypeError: layers, positions or lens of another kind.

    Warns:
        UserWarning: a lens whose recorded provenance differs from the model's.
    """
    check_optional_positive_int("top_k", top_k)
    if lens is not None and not isinstance(lens, (JacobianLens, TunedLens)):
        raise TypeError(
            f"lens must be a JacobianLens, a TunedLens or None, got {type(lens).__name__}"
        )
    mapped = model_map(model)
    if mapped.unembedding is None:
        raise ValueError(
            f"logit_lens needs a model with an unembedding (a causal LM: TransformerLM, a "
            f"transformers ...ForCausalLM, a TextModel with head='lm'), got "
            f"{type(model).__name__}"
        )
    chosen = sorted(
        set(
            check_indices("layers", layers, mapped.num_layers, "layers") or range(mapped.num_layers)
        )
    )
    if lens is not None:
        lens.check(model, stacklevel=4)  # the caller, through torch.no_grad's wrapper
        for layer in chosen:  # before the forward: a layer the lens has no map for
            lens.affine(layer, mapped.num_layers)
    norm, unembedding = mapped.final_norm, mapped.unembedding
    final: list[tuple[Tensor, Tensor]] = []
    hooks = []
    if norm is not None:
        hooks.append(norm.register_forward_hook(lambda m, a, out: final.append((a[0], out))))
    names = [("resid_post", layer) for layer in chosen] + [("result", layer) for layer in chosen]
    with registered(hooks):
        kept = cache(model, inputs, names=names, positions=positions)
    where = kept.positions if kept.positions is not None else None
    frozen = None
    if norm is not None:
        x, y = final[-1]
        if where is not None:
            index = torch.tensor(where, device=x.device)
            x, y = x.index_select(1, index), y.index_select(1, index)
        dtype = torch.promote_types(x.dtype, torch.float32)
        rounding = torch.finfo(y.dtype).eps if y.is_floating_point() else 0.0
        frozen = FrozenNorm.of(
            norm, mapped.norm_eps, x.to(dtype), y.to(dtype), "logit_lens", rounding
        )
    streams = kept.stack("resid_post")  # (L', B, P, E)
    if lens is not None:
        streams = _through(streams, [lens.affine(layer, mapped.num_layers) for layer in chosen])
    logits = unembedding(norm(streams) if norm is not None else streams)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 kept
    if mapped.logit_scale != 1.0:  # the model's own logits (Granite's, Cohere's scaled ones)
        logits = logits * mapped.logit_scale
    if top_k is None:
        top_logits, top_ids = logits.sort(-1, descending=True)
    else:
        top_logits, top_ids = logits.topk(min(top_k, logits.shape[-1]), -1)
    t = streams.shape[2]
    return LogitLens(
        layers=chosen,
        positions=where if where is not None else list(range(t)),
        logits=logits if top_k is None else None,
        top_logits=top_logits,
        top_ids=top_ids,
        results=kept.stack("result"),
        norm=frozen,
        unembedding=unembedding.weight.detach() * mapped.logit_scale,
        lens=lens,
        num_layers=mapped.num_layers,
    )


def _through(streams: Tensor, maps: Sequence[tuple[Tensor | None, Tensor | None]]) -> Tensor:
    """(L', B, P, E) each layer's stream through its lens's affine map ``M h + b`` (computed in
    float32 at least, back in the stream's dtype, which the final norm and unembedding take;
    M None: the identity)."""
    dtype = torch.promote_types(streams.dtype, torch.float32)
    out = []
    for stream, (linear, bias) in zip(streams, maps, strict=True):
        h = stream.to(dtype)
        if linear is not None:
            h = h @ linear.to(h.device, dtype).T
        if bias is not None:
            h = h + bias.to(h.device, dtype)
        out.append(h.to(streams.dtype))
    return torch.stack(out)
