"""The attention function registered as ``"multihead"`` in transformers, and its mask function.

:func:`attention_forward` follows transformers' sdpa function step by step, computing with
:func:`multihead.functional.attention`. A module that carries a site under :data:`SITE` (an
:class:`~multihead.observers.ObservableAttention`: :mod:`multihead.hf.sites` attaches them) has
its q/k/v editors run before attention and its observers on the per-head output (B, T, H, Dv).
This module sits below :mod:`multihead.hf.sites`: it reads a site through that protocol alone.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn, cast

from torch import Tensor, nn

from multihead import functional, kernels
from multihead.head_shard import held_heads
from multihead.observers import AttentionCall, ObservableAttention
from multihead.score_mods import ScoreMods

# The oldest transformers the bridge is tested on (pyproject.toml's hf extra says the same;
# a test holds them equal). Older 5.x releases route fewer families (T5 from 5.15) and lack
# helpers the bridge reads.
MIN_TRANSFORMERS = "5.15"


def check_transformers_version(installed: str) -> None:
    """Raise ImportError naming ``installed`` and the minimum when it is too old."""
    from packaging.version import Version  # a dependency of transformers

    if Version(installed) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"multihead.hf needs transformers>={MIN_TRANSFORMERS}, but {installed} is installed: "
            f"pip install -U 'multihead[hf]'"
        )


try:
    import transformers
except ImportError as error:
    raise ImportError(
        f"multihead.hf needs transformers>={MIN_TRANSFORMERS}: pip install 'multihead[hf]'"
    ) from error
check_transformers_version(transformers.__version__)
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask  # noqa: E402

try:  # which outputs the running forward collects (families that drop output_attentions)
    from transformers.utils import output_capturing as _capturing
except ImportError:  # pragma: no cover - an older or newer layout: the kwarg alone decides
    _capturing = None  # type: ignore[assignment]


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the forward returns attention weights (``output_attentions=True``).

    Most families pass ``output_attentions`` down; some (GPT-2, ...) drop it and let
    transformers' output collector read the weights off every attention call, so its active
    collection is asked too. Weights cost (B, H, T, S): they are computed only when asked for.
    """
    if kwargs.get("output_attentions"):
        return True
    collector = getattr(_capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return isinstance(collected, dict) and any("attention" in key for key in collected)


NAME = "multihead"
# The attribute under which a routed attention module keeps its site (set by hf/sites.py).
SITE = "_multihead_site"


def family_name(module: nn.Module) -> str:
    """The model family (``config.model_type``) of an attention module, for error messages."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", None)
    return f"{model_type} ({type(module).__name__})" if model_type else type(module).__name__


def _refuse(module: nn.Module, feature: str) -> NoReturn:
    raise NotImplementedError(
        f"attn_implementation={NAME!r} does not support {feature}, which the {family_name(module)} "
        f"attention passed; load this model with attn_implementation='eager' instead"
    )


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention function for ``attn_implementation="multihead"``.

    Follows ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` step by step
    (same causal flag, same key cropping, same position-bias mask), computing with
    :func:`multihead.functional.attention`.

    Args:
        module: the model's attention module (``module.is_causal`` is the default causality).
        query: (B, H, T, D).
        key: (B, Hk, S, D), H a multiple of Hk (grouped-query heads are not repeated).
        value: (B, Hk, S, Dv).
        attention_mask: None, a bool mask (True = attend) or a float mask added to the scores,
            broadcastable to (B, H, T, S).
        dropout: dropout on the weights (transformers passes 0 in eval).
        scaling: the factor on the scores; default 1 / sqrt(D).
        is_causal: overrides ``module.is_causal``.
        position_bias: (B or 1, H, T, S) added to the scores (T5-style relative bias).
        **kwargs: ``output_attentions`` (return the weights), ``softcap`` (attention-logit
            softcapping: scores → c · tanh(scores / c) after the scale, before the mask),
            ``s_aux`` / ``sinks`` (attention sinks: one logit per head (H,), or per query,
            (B, H, T, 1)), and what the mask already encodes (``sliding_window``, ...).

    Returns:
        ``(out (B, T, H, Dv), weights (B, H, T, S) or None)``: ``out`` after the module's
        observers, ``weights`` only with ``output_attentions=True``, with sinks in the family's
        own convention (:func:`sink_weights_of`). The module's q/k/v editors (if any) replace
        q, k, v before attention; weights are then those of the edited call.
    """
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    unknown = sorted(k for k, v in kwargs.items() if k not in _HARMLESS and _carries_data(v))
    if unknown:
        # a tensor or number sdpa would ignore but eager may honour (sparse indices, head masks,
        # ...): refuse rather than risk a different result; flags (output_router_logits, ...)
        # are bookkeeping
        _refuse(module, f"the keyword argument(s) {', '.join(unknown)}")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        _refuse(module, "a paged KV cache (continuous batching)")
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As sdpa: causal only when the mask was skipped, never for one query (decoding).
    causal = bool(q_length > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_length:
        # Prefill into an empty static cache: transformers aligns is_causal top-left, i.e. the
        # keys after the first T are padding; drop them (bottom-right then equals top-left).
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        if position_bias is not None:
            position_bias = position_bias[..., :q_length]
    mask = attention_mask
    if position_bias is not None:
        # The bias becomes the additive mask, as transformers' sdpa path builds it
        # (create_position_bias_mask, which older transformers lack); causality, if any, stays
        # a flag (the mask was None, so S == T here and bottom-right equals top-left).
        mask = functional.combine_masks(position_bias, attention_mask)
    if sinks is not None:
        sinks = _sink_logits(module, sinks, query)
    mods = ScoreMods(
        softcap=float(softcap) if softcap is not None else None,
        sinks=sinks,
        sink_weights=sink_weights_of(module),
    )
    want_weights = _weights_requested(kwargs)
    site: ObservableAttention | None = getattr(module, SITE, None)
    call: AttentionCall | None = None
    if site is not None and site.observers:
        _check_heads(module, site, query, value)
        scale = _scale(scaling, query)
        call = AttentionCall(
            site, (query, key, value), mask, causal, scale, real_queries(mask), mods=mods
        )
        if site.observers.editing:
            call = site.observers.edit(call)
            query, key, value = call.q, call.k, call.v
    common: dict[str, Any] = dict(
        mask=mask,
        is_causal=causal,
        scale=scaling,
        dropout_p=dropout,
        softcap=mods.softcap,
        sinks=mods.sinks,
        sink_weights=mods.sink_weights,
    )
    weights: Tensor | None = None
    if want_weights:
        out, weights = functional.attention(query, key, value, need_weights=True, **common)
    else:
        out = functional.attention(query, key, value, **common)
    out = out.transpose(1, 2)  # (B, H, T, Dv) -> (B, T, H, Dv)
    if call is not None:
        assert site is not None
        out = site.observers.run(call, out)
    return out.contiguous(), weights


def _check_heads(
    module: nn.Module, site: ObservableAttention, query: Tensor, value: Tensor
) -> None:
    """Refuse a call whose heads disagree with what the site told the observe functions (under
    tensor parallelism: the heads this rank holds)."""
    shard = site.head_shard
    heads = len(held_heads(site.num_heads, shard))
    if query.shape[1] != heads or value.shape[-1] != site.head_dim:
        read = f"{site.num_heads} heads" if shard is None else shard.describe()
        raise ValueError(
            f"{family_name(module)}: the attention call has {query.shape[1]} heads of width "
            f"{value.shape[-1]}, but the module was read as {read} of width "
            f"{site.head_dim}; its heads cannot be observed"
        )


# Keywords the attention call may carry that change nothing here: the mask already encodes
# them (sliding_window, packed sequences), they are bookkeeping, or they are handled above
# (softcap and sinks go to the core function).
_HARMLESS = frozenset(
    {
        "output_attentions",
        "output_hidden_states",
        "softcap",
        "s_aux",
        "sinks",
        "cache",
        "sliding_window",
        "position_ids",
        "cache_position",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "deterministic",
        "use_cache",
        "past_key_values",
        "past_key_value",
        "layer_idx",
        "return_dict",
        "token_type_ids",
    }
)


# What each family's eager attention returns as its weights with sinks (read from transformers'
# source, held to eager's output_attentions by tests/test_hf_score_mods.py): GPT-OSS and its kin
# drop the sink's share of the softmax over keys and sink (rows sum to less than 1); Granite's
# SWA models scale the output by the keys' share, sigmoid(logsumexp(scores) - sink), and return
# the softmax over the keys alone. A family not listed gets "dropped", the common choice;
# capture(..., sink_weights=) picks any convention for any family.
SINK_WEIGHTS: dict[str, str] = {
    "deepseek_v4": "dropped",
    "flint": "dropped",
    "gpt_oss": "dropped",
    "inkling2_text": "dropped",
    "mimo_v2_flash": "dropped",
    "openai_privacy_filter": "dropped",
    "granite_swa": "plain",
    "granitemoe_swa": "plain",
}


def sink_weights_of(module: nn.Module) -> str:
    """The weights convention with sinks of ``module``'s family (``"dropped"`` or
    ``"plain"``: see :data:`SINK_WEIGHTS` and :mod:`multihead.score_mods`)."""
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    return SINK_WEIGHTS.get(str(model_type), "dropped")


def _sink_logits(module: nn.Module, sinks: Tensor, query: Tensor) -> Tensor:
    """The sinks as the core takes them: one logit per head (H,), or per query (B, H, T) from
    a family's (B, H, T, 1) (Inkling-2 projects one from each token)."""
    h = query.shape[1]
    if sinks.dim() == 1 and sinks.shape[0] == h:
        return sinks
    if sinks.dim() == 4 and sinks.shape[-1] == 1:
        return sinks[..., 0]
    _refuse(module, f"attention sinks of shape {tuple(sinks.shape)}")


def real_queries(mask: Tensor | None) -> Tensor | None:
    """(B or 1, T) bool, True at real (not padding) queries, read off the mask's diagonal: a
    padding token's key is masked for every query, itself included, and a real token always
    sees itself (causal, bidirectional or windowed alike). None where that does not hold: no
    mask (no padding), or a KV cache (T != S: the diagonal is not the query's own key)."""
    if mask is None or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return None
    diagonal = mask.diagonal(dim1=-2, dim2=-1)  # (B|1, H|1, T)
    return kernels.allowed(diagonal).any(1)


def _carries_data(value: object) -> bool:
    """Whether a keyword's value could change the attention: a tensor or a number."""
    if isinstance(value, bool) or value is None:
        return False
    return isinstance(value, (Tensor, int, float))


def _scale(scaling: float | None, query: Tensor) -> float:
    return float(scaling) if scaling is not None else query.shape[-1] ** -0.5


@functools.cache
def _sdpa_family(config_type: Any) -> bool:
    """Whether the base model of this config class supports sdpa (and so sdpa's bool masks)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        model_cls: Any = MODEL_MAPPING[config_type]
    except (KeyError, ValueError, ImportError):
        return False
    if isinstance(model_cls, (tuple, list)):
        model_cls = model_cls[0]
    return bool(getattr(model_cls, "_supports_sdpa", False))


def mask_function(*args: Any, **kwargs: Any) -> Tensor | None:
    """The mask for ``"multihead"``: sdpa's where the family supports sdpa, else eager's.

    sdpa's mask is bool (True = attend) and skipped (None) when plainly causal or full: the
    fused path, no (T, S) buffer. A family without sdpa support may add the mask to its scores
    in code that is not routed through the interface (BigBird-Pegasus's encoder, ...): it gets
    eager's additive float mask, which :func:`attention_forward` reads as well.
    """
    config = kwargs.get("config")
    if config is not None and _sdpa_family(cast(Any, type(config))):
        return sdpa_mask(*args, **kwargs)
    return eager_mask(*args, **kwargs)


AttentionInterface.register(NAME, attention_forward)
# Without a mask function of its own, a registered name receives attention_mask=None even with
# padding.
AttentionMaskInterface.register(NAME, mask_function)
