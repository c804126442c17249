"""The map of a transformers model: every family table multihead needs, in one place.

:func:`transformers_map` builds the :class:`~multihead.map_types.ModelMap` of a transformers model
(what :func:`multihead.model_map` returns for one): its routed attention sites
(:func:`~multihead.hf.sites.attention_sites`) with their query and key/value heads, the layers
holding them, the embeddings, the final norm and the unembedding, the base module that gives
the hidden states, causality, the position limit, token types and the call options. What a
family names differently is looked up here and nowhere else: the attribute names of final norms,
feed-forward networks, position tables and head counts, and config facts
(``is_encoder_decoder``, ``max_position_embeddings``, ``type_vocab_size``, ...).

Causality is what transformers declares on each attention module (``is_causal``, the flag its
own sdpa path reads); only a family whose modules do not declare it is probed, once, with a
three-token forward whose masks are read by :func:`multihead.kernels.allowed`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from multihead import kernels
from multihead.hf.sites import AttentionSite, attention_sites
from multihead.hf.unrouted_families import unrouted_family
from multihead.map_types import Block, ModelMap, Site, block_norms
from multihead.observers import AttentionCall, registered

__all__ = ["transformers_map", "position_limit", "NORM_NAMES", "MLP_NAMES"]

# The attribute names transformers families give their final norm (on the base model).
NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")
# ... their feed-forward network (on a layer).
MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "fc", "ff")
# ... the module of a feed-forward network whose output the activation reads (a gated
# network's gate before its up projection), and the one that reads the hidden activations.
_MLP_IN_NAMES = ("gate_proj", "c_fc", "fc1", "fc_in", "dense_h_to_4h", "w1", "up_proj")
_MLP_DOWN_NAMES = ("down_proj", "c_proj", "fc2", "fc_out", "dense_4h_to_h", "w2")
# ... a composite model's sub-configs that may hold the text model's rotary.
_TEXT_CONFIGS = ("text_config", "decoder")
# ... a learned position table (on the base model, or its embeddings).
_POSITION_NAMES = ("wpe", "embed_positions", "position_embeddings")
# ... key/value head counts (on the attention module, then on the config).
_KV_MODULE = ("num_key_value_heads", "num_kv_heads", "n_kv_heads")
# ... an attention module's own dropout rate, a norm's epsilon.
_DROPOUT_NAMES = ("attention_dropout", "attn_dropout", "dropout")
_EPS_NAMES = ("eps", "variance_epsilon", "epsilon")
# ... the residual width (on the config).
_WIDTH_CONFIG = ("hidden_size", "d_model", "n_embd", "dim", "embed_dim")
_KV_CONFIG = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")


def _count(value: Any) -> int | None:
    """``value`` if it is an int > 0 (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _first(obj: object, names: tuple[str, ...]) -> int | None:
    return next((v for v in (_count(getattr(obj, n, None)) for n in names) if v), None)


def position_limit(model: nn.Module) -> int | None:
    """The most positions ``model`` embeds, from its config (``max_position_embeddings``,
    ``n_positions`` or ``n_ctx``), less the positions a RoBERTa-style embedding reserves (it
    numbers positions from ``padding_idx + 1``); None when the config names no limit (relative
    positions)."""
    positions = _first(
        getattr(model, "config", None), ("max_position_embeddings", "n_positions", "n_ctx")
    )
    base = getattr(model, "base_model", model)  # RobertaForMaskedLM -> its RobertaModel
    table = getattr(getattr(base, "embeddings", None), "position_embeddings", None)
    reserved = getattr(table, "padding_idx", None)
    if positions is not None and isinstance(reserved, int) and not isinstance(reserved, bool):
        positions -= reserved + 1
    return positions


def _base(model: nn.Module) -> nn.Module:
    """The module whose ``last_hidden_state`` is the residual stream at the end: an
    encoder-decoder model's encoder, a task head's base model, else the model."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and callable(
        getattr(model, "get_encoder", None)
    ):
        encoder = model.get_encoder()  # type: ignore[operator]
        if isinstance(encoder, nn.Module):
            return encoder
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def _kv_heads(site: AttentionSite) -> int:
    heads = site.num_heads
    own = _first(site.module, _KV_MODULE)  # the module's own count wins over its config's
    found = own or _first(getattr(site.module, "config", None), _KV_CONFIG)
    groups = _first(site.module, ("num_key_value_groups",))
    if found is None and groups:
        found = heads // groups
    if own is None and getattr(getattr(site.module, "config", None), "multi_query", False) is True:
        found = 1  # (Falcon's new decoder architecture ignores multi_query: its module says)
    return found if found and heads % found == 0 else heads


def _reusable_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a layer transformers itself defines as recomputable from its
    arguments (a ``GradientCheckpointingLayer`` of its own: what activation checkpointing
    reruns)."""
    cls = type(module)
    return cls.__module__.startswith("transformers.") and any(
        c.__name__ == "GradientCheckpointingLayer" and c.__module__.startswith("transformers.")
        for c in cls.__mro__
    )


def _blocks(model: nn.Module, sites: list[Site]) -> tuple[Block, ...]:
    """Per site its layer: the nearest transformers layer above it that activation
    checkpointing may rerun (reusable), else the nearest module held in an ``nn.ModuleList``."""
    modules = dict(model.named_modules())
    found: list[tuple[str, nn.Module, bool, list[int]]] = []
    for site in sites:
        parts = site.name.split(".") if site.name else []
        chosen: tuple[str, nn.Module, bool] | None = None
        for cut in range(len(parts) - 1, -1, -1):
            name = ".".join(parts[:cut])
            candidate = modules.get(name)
            if candidate is None:
                continue
            if _reusable_layer(candidate):
                chosen = (name, candidate, True)
                break
            parent = modules.get(".".join(parts[: cut - 1])) if cut > 0 else None
            if chosen is None and isinstance(parent, nn.ModuleList):
                chosen = (name, candidate, False)
        if chosen is None:
            return ()
        existing = next((f for f in found if f[1] is chosen[1]), None)
        if existing is None:
            found.append((*chosen, [site.layer]))
        else:
            existing[3].append(site.layer)
    holders = [m for _, m, _, _ in found]
    if any(a is not b and any(m is b for m in a.modules()) for a in holders for b in holders):
        return ()  # nested layers: a skipped outer layer would hide an inner one
    blocks = []
    for index, (name, module, reusable, layers) in enumerate(found):
        first = sites[layers[0]]
        # the block's part that holds its (first) attention, what it adds to the stream: the
        # first module on the way down that is not a container (T5: layer[0])
        rest = first.name[len(name) + 1 :] if name else first.name
        attention: nn.Module | None = module
        for part in rest.split(".") if rest else []:
            attention = attention.get_submodule(part) if attention is not None else None
            if not isinstance(attention, (nn.ModuleList, nn.ModuleDict)):
                break
        mlp = next(
            (m for m in (getattr(module, n, None) for n in MLP_NAMES) if isinstance(m, nn.Module)),
            None,
        )
        blocks.append(
            Block(
                index=index,
                name=name,
                module=module,
                sites=tuple(layers),
                reusable=reusable,
                attention=attention if attention is not module else None,
                mlp=mlp,
                norms=block_norms(module, [sites[i].module for i in layers], _block_norm_eps),
                mlp_in=_named_part(mlp, _MLP_IN_NAMES),
                mlp_down=_named_part(mlp, _MLP_DOWN_NAMES),
            )
        )
    return tuple(blocks)


def _named_part(mlp: nn.Module | None, names: tuple[str, ...]) -> nn.Module | None:
    """The first of ``names`` that is a module of the feed-forward network ``mlp``, or None."""
    parts = (getattr(mlp, n, None) for n in names) if mlp is not None else iter(())
    return next((m for m in parts if isinstance(m, nn.Module)), None)


def _embeddings(model: nn.Module, base: nn.Module) -> tuple[nn.Module, ...]:
    found: list[nn.Module] = []
    get_input = getattr(model, "get_input_embeddings", None)
    try:
        token = get_input() if callable(get_input) else None
    except (NotImplementedError, AttributeError):
        token = None
    if isinstance(token, nn.Module):
        found.append(token)
    for holder in (base, getattr(base, "embeddings", None)):
        for name in _POSITION_NAMES:
            table = getattr(holder, name, None)
            if isinstance(table, nn.Module) and not any(table is f for f in found):
                found.append(table)
    return tuple(found)


def _position_table(base: nn.Module) -> nn.Module | None:
    """The learned position table (an embedding looked up by position), or None."""
    for holder in (base, getattr(base, "embeddings", None)):
        for name in _POSITION_NAMES:
            table = getattr(holder, name, None)
            if isinstance(table, nn.Embedding):
                return table
    return None


def _attention_dropout(module: nn.Module) -> float:
    """A transformers attention module's own dropout rate (applied inside its call)."""
    for name in _DROPOUT_NAMES:
        rate = getattr(module, name, None)
        if isinstance(rate, nn.Dropout):
            return float(rate.p)
        if isinstance(rate, float):
            return rate
    return 0.0


def _norm_eps(norm: nn.Module | None) -> float | None:
    for name in _EPS_NAMES:
        eps = getattr(norm, name, None)
        if isinstance(eps, float):
            return eps
    return None


def _block_norm_eps(module: nn.Module) -> float | None:
    """A norm's epsilon (a module whose class is named a norm: ``LayerNorm``, ``RMSNorm``,
    ``Gemma2RMSNorm``, ...); None for any other module."""
    return _norm_eps(module) if "norm" in type(module).__name__.lower() else None


def _embedding_width(model: nn.Module) -> int | None:
    token = _embeddings(model, model)
    return _count(getattr(token[0], "embedding_dim", None)) if token else None


def _stream_end(model: nn.Module, base: nn.Module) -> nn.Module:
    """Where the stream the unembedding reads ends: an encoder-decoder model's decoder, else
    the base model."""
    config = getattr(model, "config", None)
    get_decoder = getattr(model, "get_decoder", None)
    if getattr(config, "is_encoder_decoder", False) and callable(get_decoder):
        decoder = get_decoder()
        if isinstance(decoder, nn.Module):
            return decoder
    return base


def _final_norm(base: nn.Module) -> nn.Module | None:
    return next(
        (getattr(base, n) for n in NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)),
        None,
    )


def _unembedding(model: nn.Module) -> nn.Linear | None:
    get_output = getattr(model, "get_output_embeddings", None)
    try:
        found = get_output() if callable(get_output) else None
    except (NotImplementedError, AttributeError):
        found = None
    return found if isinstance(found, nn.Linear) else None


def _takes(module: nn.Module, argument: str) -> bool:
    try:
        return argument in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _causal(model: nn.Module, base: nn.Module, sites: list[Site]) -> bool:
    """Whether every self-attention site of ``base`` is causal: as the modules declare it
    (``is_causal``), or, for a family whose modules do not, read off one short forward."""
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and base is not model:
        return False  # what is read is the encoder
    declared = [getattr(s.module, "is_causal", None) for s in sites]
    if declared and all(isinstance(d, bool) for d in declared):
        return all(declared)
    return _probe_causal(base, sites)


def _probe_causal(base: nn.Module, sites: list[Site]) -> bool:
    """One three-token forward: causal when no site's mask lets a query see a later key (a
    site of an unrouted family without a score recipe has no mask to read: not causal then)."""
    seen: list[bool] = []
    unknown = [s for s in sites if (f := unrouted_family(s.module)) and f.recipe is None]
    if unknown:
        return False

    def observe(call: AttentionCall, out: Tensor) -> None:
        t, s = call.q.shape[-2], call.k.shape[-2]
        if call.is_causal:
            seen.append(True)
        elif call.mask is None:
            seen.append(False)
        else:
            allowed = kernels.allowed(call.mask).expand(*call.mask.shape[:-2], t, s)
            seen.append(not bool(allowed.triu(1 + s - t).any()))

    device = next((p.device for p in base.parameters()), torch.device("cpu"))
    ids = torch.zeros(1, 3, dtype=torch.long, device=device)
    with registered(s.attention.register_observer(observe) for s in sites), torch.no_grad():
        base(input_ids=ids)
    return bool(seen) and all(seen)


def transformers_map(model: nn.Module) -> ModelMap:
    """The :class:`~multihead.map_types.ModelMap` of a model holding a transformers
    ``PreTrainedModel`` (see the module docstring).

    Raises:
        ValueError: a family whose attention is not routed through transformers'
            AttentionInterface, or that computes some attention outside it (named).
    """
    root = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)
    config = getattr(root, "config", None)
    sites = [
        Site(
            layer=layer,
            name=name,
            attention=site,
            module=site.module,
            num_heads=site.num_heads,
            num_kv_heads=_kv_heads(site),
            head_dim=site.head_dim,
            shard=site.head_shard,
            dropout=_attention_dropout(site.module),
            window=_window(site.module, config),
        )
        for layer, (name, site) in enumerate(attention_sites(model))
    ]
    base = _base(root)
    causal = _causal(root, base, [s for s in sites if _inside(base, s.module)])
    return ModelMap(
        family=str(getattr(config, "model_type", None) or type(root).__name__),
        sites=tuple(sites),
        name=str(getattr(config, "name_or_path", "") or "") or None,
        blocks=_blocks(model, sites),
        embeddings=_embeddings(root, base),
        position_table=_position_table(base),
        final_norm=_final_norm(_stream_end(root, base)),
        norm_eps=_norm_eps(_final_norm(_stream_end(root, base))),
        unembedding=_unembedding(root),
        logit_scale=_logit_scale(config),
        base=base,
        width=_first(config, _WIDTH_CONFIG) or _embedding_width(root),
        causal=causal,
        position_limit=position_limit(root),
        token_types=int(getattr(config, "type_vocab_size", 0) or 0) > 0
        and _takes(base, "token_type_ids"),
        call_options={"use_cache": False} if _takes(model, "use_cache") else {},
        positions_argument="position_ids" if causal and _takes(model, "position_ids") else None,
        positions_by_length=_positions_by_length(config),
        stream_keyword="hidden_states",  # transformers' layers and norms take it by this name
    )


def _positions_by_length(config: Any) -> bool:
    """Whether the model's rotary embeds positions by the run's length: a rope type that
    transformers' ``dynamic_rope_update`` updates on each run ("dynamic" ones rescale the
    frequencies to the longest run seen and back on a short one; "longrope" switches its
    factors at ``original_max_position_embeddings``). The rope type is in the config's
    ``rope_parameters`` (``rope_scaling`` before transformers 5; the legacy key ``type``), or
    in one such dict per layer type (Gemma-3's), on the config or a composite model's text or
    decoder config."""
    for each in [config, *(getattr(config, name, None) for name in _TEXT_CONFIGS)]:
        parameters = getattr(each, "rope_parameters", None) or getattr(each, "rope_scaling", None)
        if not isinstance(parameters, dict):
            continue
        nested = [p for p in parameters.values() if isinstance(p, dict)]
        for rope in nested or [parameters]:
            kind = str(rope.get("rope_type") or rope.get("type") or "")
            if "dynamic" in kind or kind == "longrope":
                return True
    return False


def _logit_scale(config: Any) -> float:
    """The factor a family's forward multiplies its unembedding's output by: Granite divides
    by ``logits_scaling``; else 1."""
    divided = getattr(config, "logits_scaling", None)
    if isinstance(divided, (int, float)) and not isinstance(divided, bool) and divided:
        return 1.0 / float(divided)
    return 1.0


def _window(module: nn.Module, config: Any) -> int | None:
    """The sliding window of an attention module: GPT-Neo's ``window_size`` on its local layers,
    its own ``sliding_window`` (transformers' modules carry their layer's, None on global
    layers), else the config's where the model
    uses one (``use_sliding_window``, True when the config does not say)."""
    window: Any
    if getattr(module, "attention_type", None) == "local":  # GPT-Neo's local layers
        window = getattr(config, "window_size", None)
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    elif getattr(config, "use_sliding_window", True):
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def _inside(outer: nn.Module, module: nn.Module) -> bool:
    return any(m is module for m in outer.modules())
