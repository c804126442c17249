"""The model map: where a model's heads, blocks, embeddings, final norm and unembedding are.

Everything that observes, steers or explains a model needs to know the model around its heads:
which attention sites there are and in what order, which blocks hold them and whether a block's
output may be reused, where the embeddings, the final norm and the unembedding are, whether the
model is causal, how many positions it takes and what its calls need. A :class:`ModelMap` holds
all of it, built once per model (:func:`multihead.model_map`) by one of two builders, and only
these know model families:

- multihead's own modules *declare* theirs: a layer class names its parts in a
  :class:`BlockParts` class attribute (``block_parts``), a model class returns its map from
  ``build_model_map()`` (usually :meth:`ModelMap.of_modules` with the facts it knows); any other
  module made of multihead's parts gets :meth:`ModelMap.of_modules` with no facts;
- :mod:`multihead.hf` builds the map of a transformers model (its family tables).

Everyone else reads the map and names no family, class or attribute of another library.

Shapes and names: L attention sites ("layers", numbered in module order), H query heads, Hk
key/value heads, Dv one head's output width, E the residual width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.head_shard import HeadShard
from multihead.heads import head_label
from multihead.observers import ObservableAttention

__all__ = [
    "BlockParts",
    "Block",
    "block_norms",
    "MapsItself",
    "ModelMap",
    "Site",
    "output_tensor",
    "with_output_tensor",
]


def output_tensor(output: Any) -> Tensor:
    """What a block or a block's part returns, as one tensor: the output itself, or the first
    item of the tuple or list it returns (transformers' modules put extras after it)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_output_tensor(output: Any, tensor: Tensor) -> Any:
    """``output`` (as :func:`output_tensor` reads it) with its tensor replaced by ``tensor``."""
    if isinstance(output, (tuple, list)):
        return type(output)((tensor, *output[1:]))
    return tensor


@dataclass(frozen=True)
class BlockParts:
    """What a residual block class declares about itself (its ``block_parts`` class attribute).

    Attributes:
        attention: the attribute holding the self-attention whose output the block adds to the
            residual stream (``"self_attn"``).
        mlp: the attribute holding the feed-forward network whose output it adds (``"ff"``), or
            None for an attention-only block.
        pure: whether the declaring class's ``forward`` is a pure function of its arguments and
            parameters (no state kept, inputs never modified in place): then a recorded output
            may be handed back for equal arguments (prefix reuse). A subclass that overrides
            ``forward`` without declaring again is not pure.
        mlp_in: the dotted path, from the block, of the feed-forward network's module whose
            output the activation reads (``"ff.linear1"``), or None.
        mlp_down: the path of the module that reads the hidden activations and writes the
            feed-forward's output (``"ff.linear2"``), or None.
    """

    attention: str
    mlp: str | None
    pure: bool = True
    mlp_in: str | None = None
    mlp_down: str | None = None


@dataclass(frozen=True, eq=False)
class Site:
    """One attention site: a "layer" of :func:`multihead.capture` and every head function.

    Attributes:
        layer: its number, in module order.
        name: its qualified module name in the model the map was built for.
        attention: the observer channel (a :class:`~multihead.MultiHeadAttention`, or a
            transformers attention module's :class:`multihead.hf.AttentionSite`).
        module: the module that runs the attention (the MultiHeadAttention itself, or the
            transformers attention module).
        num_heads: H, its query heads (all ranks' under tensor parallelism).
        num_kv_heads: Hk, its key/value heads.
        head_dim: Dv, the width of one head's output.
        shard: the global heads this rank's calls hold (tensor parallelism), else None.
        dropout: the attention dropout the site applies inside its call in training mode.
        window: the sliding window its queries attend through (each sees the keys at most
            this many positions back), or None for global attention.
    """

    layer: int
    name: str
    attention: ObservableAttention
    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    shard: HeadShard | None = None
    dropout: float = 0.0
    window: int | None = None

    def labels(self) -> list[str]:
        """``["L{layer}H0", ...]``: the written names of its heads."""
        return [head_label(self.layer, h) for h in range(self.num_heads)]


@dataclass(frozen=True, eq=False)
class Block:
    """One residual block: a layer of the stack that holds attention sites.

    Attributes:
        index: its number among the blocks, in module order.
        name: its qualified module name.
        module: the block.
        sites: the numbers of the attention sites inside it.
        reusable: whether its output is a pure function of its arguments and parameters, so
            that a recorded output may be handed back for equal arguments.
        attention: the module whose output is the block's attention write into the residual
            stream, or None where the map does not know it.
        mlp: the module whose output is its feed-forward write, or None (none, or not known).
        norms: the norms inside it (outside its attention sites), each with its epsilon: what
            a function that freezes a norm at a run reads (a post-attention norm, Gemma-2's
            sandwich norms, is one of them).
        mlp_in: the feed-forward network's module whose output is the hidden pre-activations
            (TransformerLens's ``mlp.hook_pre``: GPT-2's ``c_fc``, a gated network's gate), or
            None where the map does not know it (a mixture of experts).
        mlp_down: its module that reads the hidden activations (``mlp.hook_post``) and writes
            the feed-forward's output (``c_proj``, ``down_proj``), or None.
    """

    index: int
    name: str
    module: nn.Module
    sites: tuple[int, ...]
    reusable: bool
    attention: nn.Module | None = None
    mlp: nn.Module | None = None
    norms: tuple[tuple[nn.Module, float], ...] = ()
    mlp_in: nn.Module | None = None
    mlp_down: nn.Module | None = None

    def norm_eps(self, module: nn.Module) -> float | None:
        """The epsilon of ``module`` if it is one of the block's norms, else None."""
        return next((eps for norm, eps in self.norms if norm is module), None)


@dataclass(frozen=True, eq=False)
class ModelMap:
    """Where everything of a model is, in forward order (see the module docstring).

    Attributes:
        family: a name for messages (``"llama"``, ``"TransformerLM"``).
        name: the model's own name (where its files came from), or None.
        sites: the attention sites, in module order: layer l is ``sites[l]``.
        blocks: the residual blocks holding them, in module order (empty when they can't be
            told apart, e.g. one block nested in another).
        embeddings: the embedding modules, the token embedding first (empty when not known).
        position_table: the one of them looked up by position alone (its output one row per
            position: GPT-2's ``wpe``), or None (rotary or relative positions, or not known).
        final_norm: the norm before the unembedding, or None (post-LN models, encoders).
        norm_eps: the final norm's epsilon, or None when not known.
        unembedding: the linear map from the residual stream to the vocabulary, or None.
        logit_scale: the factor the model multiplies the unembedding's output by to make its
            logits (Granite divides by ``logits_scaling``); 1.0 for most.
        base: the module whose output's ``last_hidden_state`` is the residual stream at the
            end (the model itself, a task head's base model, an encoder-decoder's encoder).
        width: E, the width of the residual stream (None when not known).
        causal: whether every site's queries read only keys at or before their own position;
            None when not known.
        position_limit: the most positions the model embeds, or None (relative positions).
        token_types: whether the model's forward takes ``token_type_ids`` and embeds them.
        call_options: keyword arguments every run here passes (``use_cache=False`` for a model
            that would otherwise keep a cache of every stacked variant).
        positions_argument: the keyword of the model's forward that takes each token's position
            (``"positions"``, ``"position_ids"``), so that a run of a sequence's later tokens
            alone embeds them where they are; None when not known.
        positions_by_length: whether how the model embeds a position depends on how long the
            run is (transformers' dynamic NTK rotary rescales every position's frequencies
            when a run outgrows ``max_position_embeddings``, and sets them back on a short
            one; longrope switches factors by length): then a run of some positions alone
            does not embed them as the whole sequence does. False for most.
        stream_keyword: the keyword under which the model's blocks, and the modules inside them,
            are given the residual stream when it is not their first positional argument
            (transformers' ``"hidden_states"``); None where it always comes first. Read and
            written by :meth:`stream_of` and :meth:`with_stream` alone.
    """

    family: str
    sites: tuple[Site, ...]
    name: str | None = None
    blocks: tuple[Block, ...] = ()
    embeddings: tuple[nn.Module, ...] = ()
    position_table: nn.Module | None = None
    final_norm: nn.Module | None = None
    norm_eps: float | None = None
    unembedding: nn.Linear | None = None
    logit_scale: float = 1.0
    base: nn.Module | None = None
    width: int | None = None
    causal: bool | None = None
    position_limit: int | None = None
    token_types: bool = False
    call_options: Mapping[str, Any] = field(default_factory=dict)
    positions_argument: str | None = None
    positions_by_length: bool = False
    stream_keyword: str | None = None

    @property
    def num_layers(self) -> int:
        """L, the attention sites."""
        return len(self.sites)

    @property
    def max_heads(self) -> int:
        """The most query heads of any site (0 without sites)."""
        return max((s.num_heads for s in self.sites), default=0)

    def block_of(self, layer: int) -> Block | None:
        """The block holding site ``layer``, or None."""
        return next((b for b in self.blocks if layer in b.sites), None)

    def stack_block(self, layer: int, what: str) -> Block:
        """The block holding attention layer ``layer`` alone, or a ValueError naming ``what``
        needs it (the residual sites are a stack's: one attention layer per block)."""
        block = self.block_of(layer)
        if block is None or len(block.sites) != 1:
            raise ValueError(
                f"{what} needs one attention layer per block of a stack; the map of "
                f"{self.family} has no block holding layer {layer} alone"
            )
        return block

    def stream_of(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        """The residual stream a call of a block (or of a module inside one) was given, as its
        forward (pre-)hook sees the call: its first positional argument, else the map's
        :attr:`stream_keyword` argument; None when it has neither."""
        if args:
            return args[0]
        return kwargs.get(self.stream_keyword) if self.stream_keyword is not None else None

    def with_stream(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], stream: Tensor
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A call's arguments with its residual stream (:meth:`stream_of`) replaced by
        ``stream``, as a forward pre-hook with keyword arguments returns them."""
        if args or self.stream_keyword is None:
            return (stream, *args[1:]), kwargs
        return args, {**kwargs, self.stream_keyword: stream}

    def labels(self) -> list[list[str]]:
        """Per layer, the written names of its heads (``[["L0H0", ...], ...]``)."""
        return [s.labels() for s in self.sites]

    def with_options(self, **changes: Any) -> ModelMap:
        """A copy with some fields replaced (a wrapper's map: its own base, its own options)."""
        return replace(self, **changes)

    @classmethod
    def of_modules(
        cls,
        model: nn.Module,
        *,
        family: str | None = None,
        embeddings: Sequence[nn.Module] = (),
        position_table: nn.Module | None = None,
        final_norm: nn.Module | None = None,
        unembedding: nn.Linear | None = None,
        width: int | None = None,
        causal: bool | None = None,
        position_limit: int | None = None,
        token_types: bool = False,
        positions_argument: str | None = None,
    ) -> ModelMap:
        """The map of a model built from multihead's modules: the
        :class:`~multihead.MultiHeadAttention` modules are the sites, in module order; the
        modules whose class declares :class:`BlockParts` are the blocks; the rest is what the
        caller (the model's own ``build_model_map``) knows.
        """
        named = list(model.named_modules())
        found: list[Site] = []
        for name, m in named:
            if isinstance(m, MultiHeadAttention):
                found.append(
                    Site(
                        layer=len(found),
                        name=name,
                        attention=m,
                        module=m,
                        num_heads=m.num_heads,
                        num_kv_heads=m.num_kv_heads,
                        head_dim=m.head_dim,
                        shard=m.head_shard,
                        dropout=m.dropout,
                    )
                )
        declared = [(n, m, _declared_parts(type(m))) for n, m in named]
        holders = [(n, m, p) for n, m, p in declared if p is not None]
        nested = any(
            other is not m and any(inner is other for inner in m.modules())
            for _, m, _ in holders
            for _, other, _ in holders
        )
        blocks: list[Block] = []
        # nested blocks: a skipped outer block would hide an inner one, so none is listed
        for name, m, parts in [] if nested else holders:
            assert parts is not None
            inside = tuple(
                s.layer
                for s in found
                if not name or s.name == name or s.name.startswith(f"{name}.")
            )
            if not inside:
                continue
            blocks.append(
                Block(
                    index=len(blocks),
                    name=name,
                    module=m,
                    sites=inside,
                    reusable=parts.pure and _keeps_forward(type(m)),
                    attention=getattr(m, parts.attention, None),
                    mlp=getattr(m, parts.mlp, None) if parts.mlp else None,
                    norms=block_norms(m, [found[i].module for i in inside], _torch_norm_eps),
                    mlp_in=_part(m, parts.mlp_in),
                    mlp_down=_part(m, parts.mlp_down),
                )
            )
        return cls(
            family=family or type(model).__name__,
            sites=tuple(found),
            blocks=tuple(blocks),
            embeddings=tuple(embeddings),
            position_table=position_table,
            final_norm=final_norm,
            norm_eps=_torch_norm_eps(final_norm),
            unembedding=unembedding,
            base=model,
            width=width,
            causal=causal,
            position_limit=position_limit,
            token_types=token_types,
            positions_argument=positions_argument,
        )


@runtime_checkable
class MapsItself(Protocol):
    """A model that declares its own map (multihead's models, :class:`~multihead.TextModel`)."""

    def build_model_map(self) -> ModelMap: ...


def _declaring_class(cls: type) -> type | None:
    """The class in ``cls``'s MRO that declares ``block_parts``, or None."""
    return next((c for c in cls.__mro__ if "block_parts" in vars(c)), None)


def _declared_parts(cls: type) -> BlockParts | None:
    parts = getattr(cls, "block_parts", None)
    return parts if isinstance(parts, BlockParts) else None


def _part(block: nn.Module, path: str | None) -> nn.Module | None:
    """The submodule of ``block`` at a declared dotted ``path``, or None (none declared, or the
    block has no such part: a layer built without a feed-forward network)."""
    if path is None:
        return None
    try:
        return block.get_submodule(path)
    except AttributeError:
        return None


def _keeps_forward(cls: type) -> bool:
    """Whether ``cls`` runs the ``forward`` of the class that declared its parts (a subclass
    overriding it may keep state)."""
    owner = _declaring_class(cls)
    return owner is not None and getattr(cls, "forward", None) is vars(owner).get("forward", None)


def block_norms(
    block: nn.Module,
    sites: Sequence[nn.Module],
    eps_of: Callable[[nn.Module], float | None],
) -> tuple[tuple[nn.Module, float], ...]:
    """The norms of ``block`` outside its ``sites`` with their epsilon (``eps_of`` tells a norm:
    its epsilon, or None for any other module)."""
    inside = {id(m) for site in sites for m in site.modules()}
    found = []
    for m in block.modules():
        eps = eps_of(m) if id(m) not in inside else None
        if eps is not None:
            found.append((m, eps))
    return tuple(found)


def _torch_norm_eps(norm: nn.Module | None) -> float | None:
    """The epsilon of a torch ``LayerNorm`` or ``RMSNorm`` (None for anything else)."""
    kinds = tuple(k for k in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if k is not None)
    if isinstance(norm, kinds):
        eps = getattr(norm, "eps", None)
        return float(eps) if isinstance(eps, float) else None
    return None
