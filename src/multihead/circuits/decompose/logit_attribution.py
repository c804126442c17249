"""Direct logit attribution: what each head writes straight into a logit, through the final norm.

In a pre-LN causal LM the residual stream that reaches the final norm is a sum of what every
component wrote into it::

    x = embeddings + Σ_l ( Σ_h z_{l,h} W^O_{l,h} + b^O_l  +  m_l )      (B, T, E)

with :math:`z_{l,h}` head h's output before layer l's output projection, :math:`W^O_{l,h}` the
projection's columns for that head, :math:`b^O_l` its bias, and :math:`m_l` whatever else block
l adds (its feed-forward network). The logit of token a is
``logit_a = norm(x) · W_U[a] + b_U[a]``. With the norm's scale σ (B, T) *frozen at this run*
the norm is affine, ``norm(x) = γ ⊙ (x - mean(x)) / σ + β`` (LayerNorm; RMSNorm: no mean, no
β), so the logit splits exactly into one term per component::

    logit_a = Σ_c  (γ ⊙ (c - mean(c)) / σ) · W_U[a]   +  β · W_U[a]  +  b_U[a]

:func:`logit_attribution` computes each term at every position (a logit difference a − b
works the same, with ``W_U[a] - W_U[b]``). A head's term comes from one vector-Jacobian
product of its layer's output projection (whichever module the per-head output is fed to),
so nothing here depends on how a model family names its projections.

A block that normalises its attention's output before adding it to the stream (Gemma-2's
sandwich norms, OLMo-2's post-norms: ``x + N(Σ_h z_h W^O_h + b^O)``) is read the same way: N
is frozen at this run too (its scale from this run's attention output), so it is linear and
head h writes ``N_lin(z_h W^O_h)``; the heads' writes, ``N_lin(b^O)`` and N's bias add up to
exactly what the block added (N is the layer's post-norm in its
:class:`~multihead.circuits.runs.wiring.Wiring`).
Gemma's norms scale by ``1 + γ``; :class:`~multihead.circuits.runs.frozen_norm.FrozenNorm` reads
either form. A family that caps its final logits (Gemma-2's ``final_logit_softcapping``:
``c · tanh(logit / c)``) is explained before the cap: the unembedding's output, which is what
adds up; the cap is monotonic, applied to that sum.

It serves multihead's :class:`~multihead.models.TransformerLM` (pre-LN) and transformers
causal LMs whose final norm and unembedding can be found (GPT-2, Llama, Gemma-2 and their kin)
and whose blocks add their attention's output to the stream as it is or through a norm. The
direct term is only
the path that skips every later layer: a head whose effect goes through later heads (a
previous-token head feeding an induction head) has a small direct term and may still matter
(activation patching measures that; docs/circuits.md).

Shapes: B batch, T tokens, E width, V vocabulary, L layers, H heads, Dv one head's width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import check_choice, check_index, check_positive_int, describe, is_int
from multihead.circuits.runs.experiment import warn_if_random
from multihead.circuits.runs.frozen_norm import FrozenNorm
from multihead.circuits.runs.input_pair import model_inputs, run_model
from multihead.circuits.runs.layer_recording import record_layers
from multihead.circuits.runs.wiring import WiringRun
from multihead.head_shard import every_head
from multihead.map_types import Block, ModelMap
from multihead.mapping import model_heads, model_map
from multihead.observers import Removable, registered

if dist.is_available():  # a torch built without distributed has no DTensor
    from torch.distributed.tensor import DTensor, Replicate

__all__ = ["LogitAttribution", "logit_attribution"]


@dataclass(frozen=True)
class LogitAttribution:
    """Each component's direct contribution to a logit (or logit difference), per position.

    Every value is a mean over the batch (of the rows that are not padding at each position),
    or keeps the batch with ``reduce="none"``: then each field below has B before T ((L, H, B,
    T), (L, B, T), (B, T)). The fields add up to the model's logit: ``total() == logit`` up to
    rounding.

    Attributes:
        heads: (L, H, T) each head's direct contribution (NaN where a layer has fewer heads).
        attention_bias: (L, T) each attention layer's output-projection bias (0 without one),
            with a post-attention norm's bias where the block has one.
        mlp: (L, T) what each block adds besides its attention (its feed-forward network; 0 in
            an attention-only block).
        embeddings: (T,) the residual stream before the first block (token and position
            embeddings).
        norm_bias: (T,) the final norm's bias β (0 for RMSNorm).
        unembedding_bias: (T,) the unembedding's bias (0 without one).
        logit: (T,) the model's own logit (difference).
    """

    heads: Tensor
    attention_bias: Tensor
    mlp: Tensor
    embeddings: Tensor
    norm_bias: Tensor
    unembedding_bias: Tensor
    logit: Tensor

    def total(self) -> Tensor:
        """(T,) (or (B, T)) the sum of every contribution: the logit, up to rounding."""
        return (
            self.heads.nansum(dim=(0, 1))
            + self.attention_bias.sum(0)
            + self.mlp.sum(0)
            + self.embeddings
            + self.norm_bias
            + self.unembedding_bias
        )

    def top(self, k: int = 5, position: int = -1) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest |contribution| at ``position``: (layer, head, value)
        (with the batch kept, of the batch's mean there).

        Raises:
            ValueError: ``k`` not positive, ``position`` out of range.
            TypeError: either not an int.
        """
        check_positive_int("k", k)
        position = check_index("position", position, self.heads.shape[-1], "positions")
        values = self.heads[..., position]
        values = values.nanmean(-1) if values.dim() == 3 else values  # (L, H)
        flat = values.flatten().nan_to_num(0.0)
        order = flat.abs().argsort(descending=True)[:k].tolist()
        n = values.shape[1]
        return [(i // n, i % n, float(flat[i])) for i in order]


def _final_parts(mapped: ModelMap, model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """(final norm, unembedding) from the model's map, or a ValueError saying which is missing."""
    if mapped.unembedding is None:
        raise ValueError(
            f"logit_attribution needs a causal LM with an unembedding (multihead's "
            f"TransformerLM, or a transformers ...ForCausalLM model), got {type(model).__name__}"
        )
    if mapped.final_norm is None:
        named = type(model).__name__
        named += f" ({mapped.family})" if mapped.family != named else ""
        raise ValueError(
            f"logit_attribution needs a final norm before the unembedding, and {named} has "
            f"none: post-LN (norm_first=False), or a final norm its map does not know"
        )
    return mapped.final_norm, mapped.unembedding


def _blocks(mapped: ModelMap) -> list[Block]:
    """Per attention layer, its block (one attention site each)."""
    blocks = [mapped.block_of(site.layer) for site in mapped.sites]
    for site, block in zip(mapped.sites, blocks, strict=True):
        if block is None or len(block.sites) != 1:
            raise ValueError(
                f"logit_attribution needs one attention module per block of a stack; "
                f"{site.name} is not alone in one"
            )
    return [b for b in blocks if b is not None]


def _tokens(name: str, value: object, b: int, t: int, vocab: int, device: torch.device) -> Tensor:
    """A token id (int) or ids broadcastable to (B, T) -> (B, T) int64."""
    if is_int(value):
        ids = torch.tensor(value, device=device)
    elif isinstance(value, Tensor) and not value.is_floating_point() and value.dtype != torch.bool:
        ids = value.to(device=device, dtype=torch.int64)
    else:
        raise TypeError(
            f"{name} must be a token id (int) or a tensor of ids broadcastable to (B, T), got "
            f"{describe(value)}"
        )
    if ids.dim() == 1 and b > 1:  # (B,) per example or (T,) per position: say which
        raise ValueError(
            f"{name} must be an int or ids broadcastable to (B, T) = ({b}, {t}) with 2 dims: "
            f"give one id per example as (B, 1) and one per position as (1, T), got shape "
            f"{tuple(ids.shape)}"
        )
    try:
        ids = ids.expand(b, t)
    except RuntimeError:
        raise ValueError(
            f"{name} must be broadcastable to (B, T) = ({b}, {t}), got shape {tuple(ids.shape)}"
        ) from None
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} must be token ids in [0, {vocab}), got {describe(value)}")
    return ids


@torch.inference_mode(False)  # called under torch.inference_mode too: it needs autograd inside
@torch.no_grad()
def logit_attribution(
    model: nn.Module,
    inputs: Any,
    answer: int | Tensor,
    wrong: int | Tensor | None = None,
    *,
    reduce: str = "mean",
    position: int | None = None,
) -> LogitAttribution:
    r"""Each head's direct contribution to the logit of ``answer`` (minus ``wrong``'s).

    See the module docstring for the decomposition: with the final norm's scale frozen at this
    run, the logit is exactly the sum of the embeddings', every head's, every output-projection
    bias's, every block's remaining (feed-forward) part's, the norm bias's and the unembedding
    bias's terms (``LogitAttribution.total()``; tests hold the sum to the model's logit).

    Args:
        model: multihead's :class:`~multihead.models.TransformerLM` (pre-LN), or a transformers
            causal LM (``...ForCausalLM``: GPT-2, Llama, ...) through :mod:`multihead.hf`.
        inputs: token ids (B, T), or a dict of the model's keyword arguments; for a
            :class:`multihead.TextModel`, also a text or a list of texts.
        answer: the token whose logit is explained: an id, or ids broadcastable to (B, T) (e.g.
            each position's next token).
        wrong: optionally a second token (or ids): explain ``logit(answer) - logit(wrong)``.
        reduce: ``"mean"`` (default): every field a mean over the batch, per position, of the
            sequences that are not padding there (an ``attention_mask`` of 0 leaves a row out;
            a position where every row is padding is NaN); ``"none"``: every field keeps the
            batch, (..., B, T) (heads (L, H, B, T)).
        position: explain one position only (negative from the end): every field's T axis is
            that one position, and ``answer`` and ``wrong`` may then be one id per example
            (B,).

    Returns:
        A :class:`LogitAttribution`, per position, reduced as ``reduce`` says. On a
        tensor-parallel model (every rank calling this together) each rank computes the terms
        of the heads it holds, and every rank gets every head's.

    Raises:
        ValueError: a model without a final norm or unembedding that can be found, a final norm
            that is neither a LayerNorm nor an RMSNorm as read here, blocks that are not a
            stack of one attention module each, an attention output that goes through
            anything but one norm of its block before the stream, token ids out of range.
        TypeError: answer/wrong that are not token ids; inputs of another kind.
    """
    check_choice("reduce", reduce, ("mean", "none"))
    found = model_heads(model)
    warn_if_random(model, "logit_attribution")
    checked = model_inputs(model, inputs)
    mask = checked.get("attention_mask") if isinstance(checked, dict) else None
    mapped = model_map(model)
    norm, unembedding = _final_parts(mapped, model)
    blocks = _blocks(mapped)
    wiring_run = WiringRun(mapped, post_norms=True)
    hidden: dict[str, list[Any]] = {"in": [None] * len(blocks), "out": [None] * len(blocks)}
    norm_io: list[Tensor] = []

    def on_block(i: int) -> Callable[..., None]:
        def hook(m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
            hidden["in"][i] = mapped.stream_of(args, kwargs)
            hidden["out"][i] = out[0] if isinstance(out, (tuple, list)) else out

        return hook

    logits: list[Tensor] = []

    def hooks() -> Iterator[Removable]:
        for i, block in enumerate(blocks):
            yield block.module.register_forward_hook(on_block(i), with_kwargs=True)
        yield from wiring_run.hooks()
        yield norm.register_forward_hook(lambda m, a, out: norm_io.extend((a[0], out)))
        yield unembedding.register_forward_hook(lambda m, a, out: logits.append(out))

    with registered(hooks()), record_layers(found, range(len(found))) as per_head:
        run_model(model, checked)
    wiring = wiring_run.wiring

    x = norm_io[0]
    b, t = x.shape[0], x.shape[1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    last = hidden["out"][-1]
    if last is None or not torch.equal(last, x):
        raise ValueError(
            f"logit_attribution needs the last block's output to go straight into the final "
            f"norm ({type(norm).__name__}); {type(model).__name__} changes it in between"
        )
    for i in range(1, len(blocks)):
        given, previous = hidden["in"][i], hidden["out"][i - 1]
        if given is None or previous is None or not torch.equal(given, previous):
            # a hybrid's other mixers (linear attention, Mamba) write between the attention
            # blocks: their writes would be nobody's term
            raise ValueError(
                f"logit_attribution needs each attention block to take the previous one's "
                f"output; in {type(model).__name__} something writes to the stream between "
                f"{blocks[i - 1].name} and {blocks[i].name} (a layer without attention?)"
            )
    weight, vocab_bias = unembedding.weight, unembedding.bias
    vocab = weight.shape[0]

    scale = mapped.logit_scale  # the model's logits are the unembedding's output times it

    def looked_up(ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """The unembedding's rows (B, T, E) and bias (B, T) (None without one) for ids (B, T),
        times the model's logit scale."""
        rows = _rows(weight, ids).to(dtype) * scale
        if vocab_bias is None:
            return rows, None
        return rows, _rows(vocab_bias[:, None], ids)[..., 0].to(dtype) * scale

    at = None if position is None else check_index("position", position, t, "positions")
    if at is not None:  # one id per example, (B,), is that position's: (B, 1)
        answer = _per_example(answer, b)
        wrong = _per_example(wrong, b) if wrong is not None else None
    real = (
        mask.to(device=x.device, dtype=torch.bool)
        if isinstance(mask, Tensor) and mask.shape == (b, t)
        else torch.ones(b, t, dtype=torch.bool, device=x.device)
    )

    def batch(value: Tensor) -> Tensor:
        """(B, T, ...) -> (T, ...): the mean over the rows that are not padding; or as it is."""
        if reduce == "none":
            return value
        weights = real.reshape(b, t, *[1] * (value.dim() - 2)).to(value.dtype)
        return (value * weights).sum(0) / weights.sum(0)

    answer_ids = _tokens("answer", answer, b, t, vocab, x.device)
    direction, unembedding_bias = looked_up(answer_ids)  # (B, T, E), (B, T)
    logit = logits[-1].to(dtype).gather(-1, answer_ids[..., None])[..., 0] * scale  # (B, T)
    if wrong is not None:
        wrong_ids = _tokens("wrong", wrong, b, t, vocab, x.device)
        wrong_rows, wrong_bias = looked_up(wrong_ids)
        direction = direction - wrong_rows
        logit = logit - logits[-1].to(dtype).gather(-1, wrong_ids[..., None])[..., 0] * scale
        if unembedding_bias is not None and wrong_bias is not None:
            unembedding_bias = unembedding_bias - wrong_bias

    # the norm ran in the model's dtype: the rebuilt norm is compared within its rounding
    rounding = torch.finfo(norm_io[1].dtype).eps if norm_io[1].is_floating_point() else 0.0
    frozen = FrozenNorm.of(
        norm, mapped.norm_eps, x.to(dtype), norm_io[1].to(dtype), "logit_attribution", rounding
    )
    read, norm_beta = frozen.read(direction), frozen.beta

    def term(c: Tensor) -> Tensor:  # (B, T, E) -> (B, T): c's share of the logit
        return (c.to(dtype) * read).sum(-1)

    shape = (t,) if reduce == "mean" else (b, t)
    most = max(site.num_heads for site in found)
    heads = torch.full((len(found), most, *shape), float("nan"), dtype=dtype, device=x.device)
    attention_bias = torch.zeros(len(found), *shape, dtype=dtype, device=x.device)
    mlp = torch.zeros_like(attention_bias)
    for layer, name in enumerate(site.name for site in found):
        out = per_head[layer]  # (B, T, H, Dv)
        flat = out.flatten(2)
        projection = wiring.layers[layer].projection
        if projection is None:
            raise ValueError(
                f"logit_attribution cannot find the output projection of layer {layer} ({name}): "
                f"no module inside it is fed the per-head output"
            )
        # a post-attention norm, frozen at this run, is linear: the heads' writes go through it
        post = wiring_run.post_norm(layer, "logit_attribution", rounding, dtype)
        read_here = read if post is None else post.read(read)
        with torch.enable_grad():
            z = flat.detach().requires_grad_()
            written = projection(z)  # (B, T, E): Σ_h z_h W^O_h + b^O
            (back,) = torch.autograd.grad((written.to(dtype) * read_here).sum(), z)
        # (B, T): b^O's share (and the post-attention norm's bias's)
        bias = (projection(torch.zeros_like(flat)).to(dtype) * read_here).sum(-1)
        if post is not None and post.beta is not None:
            bias = bias + (post.beta * read).sum(-1)
        per_head_term = (flat.to(dtype) * back.to(dtype)).unflatten(-1, out.shape[2:]).sum(-1)
        # under tensor parallelism each rank has the terms of the heads it holds: gather all
        per_head_term = every_head(per_head_term, 2, found[layer].shard)  # (B, T, H)
        heads[layer, : per_head_term.shape[2]] = batch(per_head_term).movedim(-1, 0)
        attention_bias[layer] = batch(bias)
        block_in, block_out = hidden["in"][layer], hidden["out"][layer]
        added = wiring_run.written(layer)  # what the block added for its attention
        added = written.detach() if added is None else added
        mlp[layer] = batch(term(block_out.to(dtype) - block_in.to(dtype) - added.to(dtype)))
    zero = torch.zeros(shape, dtype=dtype, device=x.device)
    found_terms = LogitAttribution(
        heads=heads,
        attention_bias=attention_bias,
        mlp=mlp,
        embeddings=batch(term(hidden["in"][0])),
        norm_bias=batch((norm_beta * direction).sum(-1)) if norm_beta is not None else zero,
        unembedding_bias=batch(unembedding_bias) if unembedding_bias is not None else zero,
        logit=batch(logit),
    )
    if at is None:
        return found_terms
    return LogitAttribution(
        **{
            f.name: getattr(found_terms, f.name)[..., at : at + 1]
            for f in dataclasses.fields(LogitAttribution)
        }
    )


def _per_example(value: int | Tensor, b: int) -> int | Tensor:
    """A (B,) tensor of ids as (B, 1), one per example; anything else as it is."""
    if isinstance(value, Tensor) and value.dim() == 1 and value.shape[0] == b:
        return value[:, None]
    return value


def _rows(table: Tensor, ids: Tensor) -> Tensor:
    """``table[ids]``: rows of a (V, E) parameter for ids (B, T) -> (B, T, E).

    A table split over ranks (a ``DTensor``: tensor parallelism splits the unembedding over the
    vocabulary) is never gathered whole: each rank looks up the ids its rows hold and the
    lookups are summed (DTensor's vocabulary-parallel embedding), a collective every rank
    reaches; every rank gets the rows.
    """
    if dist.is_available() and isinstance(table, DTensor):
        mesh = table.device_mesh
        spread = DTensor.from_local(ids.contiguous(), mesh, [Replicate()] * mesh.ndim)
        looked = F.embedding(spread, table)
        assert isinstance(looked, DTensor)  # a DTensor op's result
        return looked.full_tensor()
    return table[ids]
