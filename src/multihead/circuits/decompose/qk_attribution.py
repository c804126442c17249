r"""QK attribution: why a head looks where it looks, one attention score split into pairs.

Head h of layer l scores key j for query i as ``s_ij = scale · q_i · k_j``. Both sides are read
from the same residual stream x (B, T, E) entering block l, a sum of what every earlier
component wrote into it::

    x = embed + Σ_{l' < l} ( Σ_h r_{l',h} + b^O_{l'} + m_{l'} )

(embed: the token and position embeddings; r: each earlier head's write, its output through
its slice of the output projection; b^O: each output projection's bias; m: each feed-forward
network's write). The block's pre-attention norm, with its scale σ (T,) *frozen at this run*
(:class:`~multihead.circuits.runs.frozen_norm.FrozenNorm`), is affine: ``norm(x) = Σ_c
γ ⊙ (c - mean c) / σ + β``. At fixed positions the map from the attention's input to one head's
query and key is affine too (the projections W_Q, W_K with their biases, then rotary positions,
a rotation per position): ``q_i = Σ_c A_i n_c + A_i β + b_i``. So::

    s_ij = scale · Σ_a Σ_b  q_i[a] · k_j[b]

over query-side components a and key-side components b (each earlier component, the norm's
bias, the projection's bias), exactly. :func:`qk_attribution` computes every component's part
of the head's query and keys by running the head's attention module once on the components
(normalised with the frozen scale) stacked along the batch, so nothing here names a model
family's projections or rotary tables; it checks that the parts add up to the query and keys
the model computed, and that the head's output is the softmax of these scores (a model that
caps its scores or adds a position bias to them is refused, naming which).

Shapes: T tokens (S keys, the same tokens), E width, D one head's query/key width, N
components.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from multihead._checks import check_index, check_positive_int
from multihead.circuits.graph import EMBED, Sender
from multihead.circuits.runs.attention_replay import replay_attention
from multihead.circuits.runs.experiment import warn_if_random
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.site_recorder import cache
from multihead.circuits.runs.wiring import WiringRun
from multihead.kernels import causal_mask
from multihead.map_types import ModelMap
from multihead.mapping import model_heads, model_map
from multihead.observe.rows import row_weights, visible_keys
from multihead.observers import AttentionCall, Removable, registered

__all__ = ["QKAttribution", "qk_attribution"]
_CHUNK = 64  # components per run of the attention module


@dataclass(frozen=True)
class QKAttribution:
    """One head's attention score at (query, key) split into (query-side, key-side) pairs.

    Components are labelled as everywhere in multihead: ``"embed"``, a head ``"L0H1"``, a
    feed-forward network ``"MLP0"``, an output projection's bias ``"L0 attn bias"``, the
    layer's pre-attention norm's bias ``"norm bias"`` (LayerNorm only), and the projection's
    own bias ``"q bias"`` / ``"k bias"`` (with rotary positions applied, as the kernel reads it).

    Attributes:
        layer, head, query, key: what is explained (non-negative).
        query_labels: (Nq,) the query-side components.
        key_labels: (Nk,) the key-side components.
        query_parts: (Nq, D) each component's part of the head's query at ``query``, as the
            kernel reads it (after rotary positions); they add up to the query.
        key_parts: (Nk, S, D) each component's part of the head's key at every position.
        scale: the factor on the scores.
        score: the model's own score ``scale · q · k`` at (query, key).
        weights: (S,) the head's attention row at ``query`` (0 at keys it cannot see).
        visible: (S,) bool, the keys the query may attend to.
        q: (D,) the head's query at ``query`` as the kernel read it.
        k: (S, D) its keys at every position as the kernel read them.

    Every key's split is held: :meth:`at` gives the split of another key with no forward.
    """

    layer: int
    head: int
    query: int
    key: int
    query_labels: tuple[str, ...]
    key_labels: tuple[str, ...]
    query_parts: Tensor
    key_parts: Tensor
    scale: float
    score: float
    weights: Tensor
    visible: Tensor
    q: Tensor
    k: Tensor

    def at(self, key: int) -> QKAttribution:
        """The split of the score of ``key`` (negative from the end) for the same query: every
        key's parts are held, so no forward runs.

        Raises:
            ValueError: ``key`` out of range, or a key the query cannot see.
            TypeError: ``key`` not an int.
        """
        key = check_index("key", key, len(self.visible), "positions")
        if not bool(self.visible[key]):
            raise ValueError(
                f"key must be a position query {self.query} may attend to, got {key} (a causal "
                f"model's queries see keys at or before their own position)"
            )
        score = float(self.scale * self.q.double() @ self.k[key].double())
        return replace(self, key=key, score=score)

    def table(self) -> Tensor:
        """(Nq, Nk) float64: every pair's share of the score at (query, key)."""
        q = self.query_parts.double()
        return self.scale * q @ self.key_parts[:, self.key].double().T

    @property
    def pairs(self) -> list[tuple[str, str, float]]:
        """Every ``(query-side label, key-side label, value)``, query side major."""
        values = self.table().tolist()
        return [
            (a, b, v)
            for a, row in zip(self.query_labels, values, strict=True)
            for b, v in zip(self.key_labels, row, strict=True)
        ]

    def top(self, k: int = 10) -> list[tuple[str, str, float]]:
        """The ``k`` pairs with the largest |value|, largest first.

        Raises:
            ValueError, TypeError: ``k`` not a positive int.
        """
        check_positive_int("k", k)
        table = self.table()
        order = table.flatten().abs().argsort(descending=True)[:k].tolist()
        n = table.shape[1]
        return [
            (self.query_labels[i // n], self.key_labels[i % n], float(table.flatten()[i]))
            for i in order
        ]

    def total(self) -> float:
        """The sum of every pair: the score, up to rounding."""
        return float(self.table().sum())

    def key_side(self) -> Tensor:
        """(Nk, S) float64: each key-side component's share of the score at every key, with the
        whole query; NaN at keys the query cannot see. Its sum over components is each key's
        score, whose softmax over the visible keys is :attr:`weights`."""
        q = self.query_parts.double().sum(0)  # (D,)
        side = self.scale * self.key_parts.double() @ q  # (Nk, S)
        return side.masked_fill(~self.visible.to(side.device), float("nan"))

    def scores(self) -> Tensor:
        """(S,) float64: the score of every key (NaN at keys the query cannot see)."""
        return self.key_side().sum(0)

    def key_rise(self, key: int | None = None) -> list[tuple[str, float]]:
        """Each key-side component's share at ``key`` (default :attr:`key`) over its mean at
        the other visible keys, ``(label, rise)``, largest rise first: what makes this key stand
        out for this query.

        Raises:
            ValueError: ``key`` out of range, not visible, or the only visible key.
            TypeError: ``key`` not an int.
        """
        at = self.key if key is None else check_index("key", key, len(self.visible), "positions")
        if not bool(self.visible[at]):
            raise ValueError(f"key {at} is not visible from query {self.query}")
        others = self.visible.clone()
        others[at] = False
        if not bool(others.any()):
            raise ValueError(f"key {at} is the only key query {self.query} sees")
        side = self.key_side()
        rise = side[:, at] - side[:, others.to(side.device)].mean(1)
        order = rise.argsort(descending=True).tolist()
        return [(self.key_labels[i], float(rise[i])) for i in order]

    def __repr__(self) -> str:
        return (
            f"QKAttribution(L{self.layer}H{self.head}, query {self.query}, key {self.key}: "
            f"score {self.score:.4g}, {len(self.query_labels)} x {len(self.key_labels)} pairs)"
        )


def _hidden(mapped: ModelMap, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor | None:
    """A module call's hidden states (the map's :meth:`~multihead.ModelMap.stream_of`)."""
    value = mapped.stream_of(args, kwargs)
    return value if isinstance(value, Tensor) else None


@torch.inference_mode(False)
@torch.no_grad()
def qk_attribution(
    model: nn.Module, inputs: Any, *, layer: int, head: int, query: int, key: int | None = None
) -> QKAttribution:
    """Split head ``head`` of ``layer``'s score of ``key`` for ``query`` into pairs of
    components (see the module docstring), exactly: ``total()`` is the score. One forward
    splits every key's score (:meth:`QKAttribution.at` reads another key's).

    Args:
        model: multihead's :class:`~multihead.models.TransformerLM` (pre-LN), or a transformers
            causal LM (GPT-2, Llama, ...) through :mod:`multihead.hf`.
        inputs: one sequence: token ids (1, T), a dict of the model's keyword arguments, or for
            a :class:`multihead.TextModel` a text.
        layer, head: the head (negative from the end).
        query: the query position (negative from the end).
        key: the key position (negative from the end); one the query may attend to. Default
            the key the head scores highest for the query.

    Returns:
        A :class:`QKAttribution`.

    Raises:
        ValueError: a batch of more than one sequence; layer, head or positions out of range, a
            key the query cannot see; blocks that are not a stack of one attention module each
            adding to the stream (post-LN); a pre-attention norm that is neither LayerNorm nor
            RMSNorm as read here; a query or key that is not affine in the attention's input
            (per-head query/key norms); scores the model changes (softcapping, a position bias);
            a tensor-parallel model.
        TypeError: indices that are not ints; inputs of another kind.
    """
    found = model_heads(model)
    warn_if_random(model, "qk_attribution")
    mapped = model_map(model)
    layer = check_index("layer", layer, len(found), "attention layers")
    site = mapped.sites[layer]
    head = check_index("head", head, site.num_heads, f"heads in layer {layer} ({site.name})")
    if site.shard is not None:
        raise ValueError("qk_attribution does not support tensor-parallel models")
    mapped.stack_block(layer, "qk_attribution")  # a stack's block holds the layer alone
    earlier = [mapped.stack_block(la, "qk_attribution") for la in range(layer)]
    kv = head // (site.num_heads // site.num_kv_heads)
    fed: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    seen: dict[str, Any] = {}
    wiring_run = WiringRun(mapped)

    def on_attention(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fed.append((args, kwargs))

    def on_heads(call: AttentionCall, out: Tensor) -> None:
        if "q" not in seen:
            seen.update(q=call.q.detach(), k=call.k.detach(), v=call.v.detach(), call=call)
            seen["out"] = out.detach()

    def hooks() -> Iterator[Removable]:
        yield site.module.register_forward_pre_hook(on_attention, with_kwargs=True)
        yield site.attention.register_observer(on_heads)
        yield from wiring_run.hooks()

    names: list[tuple[str, int]] = [("resid_pre", 0), ("resid_pre", layer)]
    for la, b in enumerate(earlier):
        names += [("result", la), ("attn_out", la)] + ([("mlp_out", la)] if b.mlp else [])
    with registered(hooks()):
        kept = cache(model, inputs, names=names)
    x = kept["resid_pre", layer]  # (B, T, E)
    b_size, t = x.shape[0], x.shape[1]
    if b_size != 1:
        raise ValueError(f"qk_attribution explains one sequence: inputs must hold 1, got {b_size}")
    query = check_index("query", query, t, "positions")
    if key is not None:
        key = check_index("key", key, t, "positions")
    args, kwargs = fed[0]
    h = _hidden(mapped, args, kwargs)
    assert h is not None  # the attention ran on the hidden states
    call: AttentionCall = seen["call"]
    rows = torch.tensor([query], device=x.device)
    visible = visible_keys(call, rows)[0, 0]  # (S,)
    captured_q = seen["q"][0, head, query]  # (D,)
    if key is None:  # the key the head scores highest
        scores = (captured_q.double() @ seen["k"][0, kv].double().T).masked_fill(
            ~visible, float("-inf")
        )
        key = int(scores.argmax())
    if not bool(visible[key]):
        raise ValueError(
            f"key must be a position query {query} may attend to, got {key} (a causal model's "
            f"queries see keys at or before their own position)"
        )
    weights = _checked_row(call, seen["out"], head, kv, query, site.name)

    labels = [Sender(EMBED).label]
    parts = [kept["resid_pre", 0]]
    for la, b in enumerate(earlier):
        result = kept["result", la]  # (1, T, H', E)
        labels += [Sender("head", la, hh).label for hh in range(result.shape[2])]
        parts += list(result.unbind(2))
        labels.append(f"L{la} attn bias")
        parts.append(kept["attn_out", la] - result.sum(2))
        if b.mlp:
            labels.append(Sender("mlp", la).label)
            parts.append(kept["mlp_out", la])
    stream = torch.stack(parts, 2)  # (1, T, N, E)
    wired = wiring_run.wiring.layers[layer]
    eps = wired.norm_eps if wired.norm_eps is not None else mapped.norm_eps
    frozen = _frozen_norm(wired.norm, eps, x, h)
    normed = (frozen.linear(stream) if frozen is not None else stream)[0].movedim(1, 0)
    constants = ["norm bias"] if frozen is not None and frozen.beta is not None else []
    if constants:
        assert frozen is not None and frozen.beta is not None
        normed = torch.cat([normed, frozen.beta.expand(1, t, -1)])
    stacked = torch.cat([normed, torch.zeros_like(normed[:1])]).to(h.dtype)  # (N', T, E)
    q, k = _head_parts(site.module, site.attention, args, kwargs, h, stacked, head, kv)
    q_parts = torch.cat([q[:-1] - q[-1:], q[-1:]])[:, query]  # (Nq, D)
    k_parts = torch.cat([k[:-1] - k[-1:], k[-1:]])  # (Nk, S, D)
    _check_sum("query", q_parts.sum(0), seen["q"][0, head, query], site.name)
    _check_sum("key", k_parts.sum(0), seen["k"][0, kv], site.name)
    base = labels + constants
    return QKAttribution(
        layer=layer,
        head=head,
        query=query,
        key=key,
        query_labels=(*base, "q bias"),
        key_labels=(*base, "k bias"),
        query_parts=q_parts,
        key_parts=k_parts,
        scale=float(call.scale),
        score=float(call.scale * captured_q.double() @ seen["k"][0, kv, key].double()),
        weights=weights,
        visible=visible,
        q=captured_q,
        k=seen["k"][0, kv],
    )


def _frozen_norm(
    norm: nn.Module | None, eps: float | None, x: Tensor, h: Tensor
) -> FrozenNorm | None:
    """The block's pre-attention norm (its wiring's), frozen at this run where it mapped the
    stream ``x`` to the attention's input ``h``; None when the attention reads ``x`` itself."""
    if norm is None:
        if torch.equal(h, x):
            return None
        raise ValueError(
            "qk_attribution needs the attention's input to be the residual stream through one "
            "norm; no module of the block gives the attention its input"
        )
    rounding = torch.finfo(h.dtype).eps
    return FrozenNorm.of(norm, eps, x, h, "qk_attribution (the pre-attention norm)", rounding)


def _head_parts(
    module: nn.Module,
    attention: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    h: Tensor,
    stacked: Tensor,
    head: int,
    kv: int,
) -> tuple[Tensor, Tensor]:
    """The head's queries (N', T, D) and keys (N', S, D) when the attention module is run on
    ``stacked`` (N', T, E) in place of its input ``h``, with the run's other arguments (its
    positions, its mask), ``_CHUNK`` inputs at a time."""

    def read(call: AttentionCall) -> tuple[Tensor, ...]:
        return call.q[:, head], call.k[:, kv]

    q, k = replay_attention(module, attention, (args, kwargs), h, stacked, _CHUNK, read)
    return q, k


def _tolerance(reference: Tensor) -> float:
    rounding = torch.finfo(reference.dtype).eps
    return max(1e-3, 4 * rounding) * float(reference.abs().max().clamp(min=1.0))


def _check_sum(side: str, total: Tensor, captured: Tensor, name: str) -> None:
    """The parts of one side must add up to what the model computed."""
    off = float((total.double() - captured.double()).abs().max())
    if off > _tolerance(captured):
        raise ValueError(
            f"qk_attribution reads the head's {side} as affine in its attention's input at "
            f"fixed positions; {name}'s is not (off by {off:.3g}: a per-head query/key norm?)"
        )


def _checked_row(
    call: AttentionCall, out: Tensor, head: int, kv: int, query: int, name: str
) -> Tensor:
    """(S,) the head's attention row at ``query``, once the head's output there is seen to be
    softmax(scale · q · kᵀ + mask) · v (else the model changes its scores: refused)."""
    rows = torch.tensor([query], device=call.q.device)
    mask = call.mask
    if mask is not None and mask.is_floating_point():
        m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        m = m[:, head if m.shape[1] > 1 else 0, query if m.shape[2] > 1 else 0]  # (B|1, S|1)
        finite = m[m > torch.finfo(m.dtype).min / 2]
        if finite.numel() and bool((finite != 0).any()):
            raise ValueError(
                f"qk_attribution explains q·k scores; {name} adds a bias to them (ALiBi?)"
            )
    causal = causal_mask(call.q.shape[2], call.k.shape[2], rows=rows) if call.is_causal else None
    heads = torch.tensor([head], device=call.q.device)
    weights = row_weights(call, heads, rows, causal)[0, 0, 0]  # (S,)
    expected = weights.to(call.v.dtype) @ call.v[0, kv]  # (Dv,)
    got = out[0, query, head]
    if float((expected - got).abs().max()) > _tolerance(got):
        raise ValueError(
            f"qk_attribution explains heads whose output is softmax(scale · q · kᵀ + mask) · v; "
            f"{name}'s is not (its scores are capped or otherwise changed)"
        )
    return weights
