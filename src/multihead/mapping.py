"""``model_map(model)``: the one way to know a model (see :mod:`multihead.map_types`)."""

from __future__ import annotations

from torch import nn

from multihead.holds_transformers import holds_transformers
from multihead.map_types import MapsItself, ModelMap, Site
from multihead.observers import ObservableAttention

__all__ = ["attention_modules", "model_heads", "model_map"]

# The map lives on the model it describes (an attribute outside the state dict): built once,
# gone with the model, and it never keeps a model alive.
_ATTRIBUTE = "_multihead_model_map"


class _Kept:
    """The holder of a model's map: a copy of the model (``copy.deepcopy``, pickling) gets an
    empty holder, so the copy's map is built from the copy's own modules."""

    __slots__ = ("map",)

    def __init__(self, found: ModelMap | None) -> None:
        self.map = found

    def __deepcopy__(self, memo: dict[int, object]) -> _Kept:
        return _Kept(None)

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return _Kept, (None,)


def model_map(model: nn.Module, *, rebuild: bool = False) -> ModelMap:
    """The :class:`~multihead.map_types.ModelMap` of ``model``: its attention sites, blocks,
    embeddings, final norm and unembedding, causality, position limit and call options.

    Built once per model and kept with it: a model that declares its map
    (``build_model_map()``: multihead's :class:`~multihead.models.TransformerLM`,
    :class:`~multihead.models.BertModel`, :class:`~multihead.TextModel`) gives its own; a
    transformers model gets the one :mod:`multihead.hf` builds; any other module gets its
    :class:`~multihead.MultiHeadAttention` modules and declared blocks
    (:meth:`ModelMap.of_modules`).

    Args:
        model: any ``nn.Module``.
        rebuild: build it again (after replacing modules inside the model).

    Raises:
        TypeError: ``model`` not an ``nn.Module``.
        ValueError: a transformers family whose attention multihead cannot observe (named).

    Example:
        >>> import multihead
        >>> from multihead.models import TransformerLM
        >>> lm = TransformerLM(vocab_size=11, embed_dim=16, num_heads=2, num_layers=2)
        >>> found = multihead.model_map(lm)
        >>> found.num_layers, found.sites[1].num_heads, found.causal
        (2, 2, True)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    kept = None if rebuild else model.__dict__.get(_ATTRIBUTE)
    if isinstance(kept, _Kept) and kept.map is not None:
        return kept.map
    if isinstance(model, MapsItself):
        built = model.build_model_map()
    elif holds_transformers(model):
        from multihead import hf  # only here: transformers is an optional extra

        built = hf.transformers_map(model)
    else:
        built = ModelMap.of_modules(model)
    object.__setattr__(model, _ATTRIBUTE, _Kept(built))  # not a submodule, not in the state dict
    return built


def attention_modules(model: nn.Module) -> list[tuple[str, ObservableAttention]]:
    """Every observable attention site in ``model``, in module order (= layer order): the
    sites of its :func:`multihead.model_map`.

    A site is a :class:`~multihead.MultiHeadAttention`, or, in a Hugging Face transformers
    model, an attention module routed through transformers' ``AttentionInterface`` (the model
    runs on ``attn_implementation="multihead"`` while observers are registered). Both offer
    the same observer channel.

    Returns:
        ``(qualified_name, site)`` pairs; the model itself comes first if it is one.
    """
    return [(s.name, s.attention) for s in model_map(model).sites]


def model_heads(model: nn.Module) -> list[Site]:
    """The model's attention sites (= layers, :class:`~multihead.map_types.Site`), or a
    ValueError when there are none."""
    found = list(model_map(model).sites)
    if not found:
        raise ValueError(
            f"model ({type(model).__name__}) contains no multihead.MultiHeadAttention module: "
            f"heads can be edited only in attention built from multihead's modules (or a "
            f"transformers model, through multihead.hf)"
        )
    return found
