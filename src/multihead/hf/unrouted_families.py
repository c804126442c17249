"""The families whose attention transformers computes inside the module, not through its
attention interface: where each one's heads are, and how its scores are made.

A head exists wherever a module's output projection reads the heads' concatenated outputs
(B, T, H·Dv): :class:`UnroutedFamily` names that projection (``output``), so a pre-hook there
splits them and every observer that reads or replaces the per-head output (steering, patching
``z``/``result``, direct logit attribution, edge senders) works on the family. Its ``recipe``
works out what the module's own code attends with (queries, keys, values per head, the additive
or bool mask with the family's position term, causality and the scale) from the module's
inputs, so capture, statistics and the page run the core's row-chunked weights path on it.

A recipe is checked on its site's first calls: the heads' outputs recomputed from it must equal
the module's own (:mod:`multihead.hf.unrouted_site`); a family it does not reproduce is refused
by name. Each recipe follows the family's forward in the installed transformers, reusing the
family's own helpers (head splits, rotary) where it has them.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from multihead import kernels

__all__ = ["Recomputed", "UnroutedFamily", "UNROUTED_FAMILIES", "unrouted_family"]


class Recomputed(NamedTuple):
    """What one call of an unrouted module attends with, as :func:`multihead.functional.attention`
    takes it.

    Attributes:
        q: (B, H, T, D) queries (after the family's rotary, if any).
        k: (B, Hk, S, D) keys.
        v: (B, Hk, S, Dv) values.
        mask: None, or a bool (True = attend) or float (added to the scaled scores) mask
            broadcastable to (B, H, T, S): padding, causality or a window, and the family's
            position term (ALiBi, a relative position bias, disentangled attention).
        is_causal: bottom-right causal masking on top of ``mask``.
        scale: the factor on q·k.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    is_causal: bool
    scale: float


# recipe(module, arguments): the family's attention module (its parts read by name) and its
# forward's arguments by name (defaults applied, its **kwargs merged in)
Recipe = Callable[[Any, dict[str, Any]], Recomputed]


@dataclass(frozen=True)
class UnroutedFamily:
    """One unrouted family's attention module: where its heads are and how its scores are made.

    Attributes:
        output: the output projection reading the heads' concatenated outputs, as a dotted path
            from the attention module (``"out_proj"``), or from the module holding it
            (``"../output.dense"``: BERT-style layers keep the projection in a sibling).
        recipe: how the module's scores are made (None: its heads can be read and steered,
            their weights cannot be recomputed).
        refused: a reason a module of the family cannot be observed (a configuration whose
            forward bypasses the output projection), or None.
    """

    output: str
    recipe: Recipe | None = None
    refused: Callable[[nn.Module], str | None] | None = None


def _heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, H·D) -> (B, H, T, D)."""
    return x.unflatten(-1, (heads, -1)).transpose(1, 2)


def _causal(buffer: Tensor, t: int, given: Tensor | None) -> Tensor:
    """A family's causal buffer (1, 1, P, P) cut for T queries, as its forward cuts it: the
    last T rows of the first S columns (S the mask's keys, a cache's earlier tokens too)."""
    s = given.shape[-1] if given is not None else t
    return buffer[:, :, s - t : s, :s]


def _own(module: nn.Module, name: str) -> Any:
    """A function of the module's family (the file in transformers its class, or the class it
    derives from, is defined in), e.g. its rotary."""
    for cls in inspect.getmro(type(module)):
        found = getattr(sys.modules.get(cls.__module__), name, None)
        if found is not None:
            return found
    raise AttributeError(f"{type(module).__name__}'s family has no {name}")


def _self_attention(arguments: dict[str, Any], *names: str) -> None:
    """Refuse cross-attention: a recipe follows the self-attention path of the forward."""
    for name in names:
        if arguments.get(name) is not None:
            raise ValueError(
                f"the module was given {name} (cross-attention): its weights are recomputed for "
                f"self-attention only"
            )


def _gpt_neo(m: Any, a: dict[str, Any]) -> Recomputed:
    # GPTNeoSelfAttention._attn: no scale; the bias buffer is causal, or windowed on local
    # layers; masked scores become the dtype's lowest value, then the model's mask is added
    h = a["hidden_states"]
    q, k, v = (_heads(p(h), m.num_heads) for p in (m.q_proj, m.k_proj, m.v_proj))
    given = a["attention_mask"]
    mask = kernels.combine_masks(_causal(m.bias, q.shape[-2], given), given)
    return Recomputed(q, k, v, mask, False, 1.0)


def _mpnet(m: Any, a: dict[str, Any]) -> Recomputed:
    # MPNetSelfAttention: scores / sqrt(D) + the relative position bias the encoder computes
    # once per forward + the padding mask
    h = a["hidden_states"]
    q, k, v = (_heads(p(h), m.num_attention_heads) for p in (m.q, m.k, m.v))
    mask = kernels.combine_masks(a["position_bias"], a["attention_mask"])
    return Recomputed(q, k, v, mask, False, m.attention_head_size**-0.5)


def _xglm(m: Any, a: dict[str, Any]) -> Recomputed:
    # XGLMAttention: the scaled query projection against the keys, plus the model's mask
    _self_attention(a, "key_value_states")
    h = a["hidden_states"]
    q, k, v = (_heads(p(h), m.num_heads) for p in (m.q_proj, m.k_proj, m.v_proj))
    return Recomputed(q, k, v, a["attention_mask"], False, float(m.scaling))


def _bloom(m: Any, a: dict[str, Any]) -> Recomputed:
    # BloomAttention: one fused projection, (H, 3, D) per token; ALiBi (B·H, 1, S) added
    # unscaled (baddbmm's beta = 1), the scores scaled by inv_norm_factor
    q, k, v = m._reshape(m.query_key_value(a["hidden_states"]))
    b, heads = q.shape[0], q.shape[1]
    alibi = a["alibi"].view(b, heads, 1, -1)
    return Recomputed(
        q, k, v, kernels.combine_masks(alibi, a["attention_mask"]), False, float(m.inv_norm_factor)
    )


def _bloom_refused(m: Any) -> str | None:
    if getattr(m, "pretraining_tp", 1) > 1 and getattr(m, "slow_but_exact", False):
        return (
            "its config's pretraining_tp > 1 with slow_but_exact multiplies slices of the output "
            "projection's weight itself, so no module is given the heads' outputs"
        )
    return None


def _falcon(m: Any, a: dict[str, Any]) -> Recomputed:
    # FalconAttention: one fused projection (new decoder architecture: per key/value group its
    # H/G queries, then one key and one value; multi-query: H queries, one key, one value;
    # else (H, 3, D)), rotary or ALiBi, sdpa or eager as the config and output_attentions choose
    fused = m.query_key_value(a["hidden_states"])
    b, t, _ = fused.shape
    d = m.head_dim
    if m.new_decoder_architecture:
        qkv = fused.view(b, t, -1, m.num_heads // m.num_kv_heads + 2, d)
        q = qkv[:, :, :, :-2].flatten(2, 3).transpose(1, 2)
        k, v = qkv[:, :, :, -2].transpose(1, 2), qkv[:, :, :, -1].transpose(1, 2)
    else:
        q, k, v = (x.transpose(1, 2) for x in m._split_heads(fused))
    alibi = a["alibi"]
    mask = a["attention_mask"]
    sdpa = m.config._attn_implementation == "sdpa" and not a["output_attentions"]
    causal = False
    if alibi is None:
        cos, sin = a["position_embeddings"]
        q, k = _own(m, "apply_rotary_pos_emb")(q, k, cos, sin)
    elif not sdpa:  # (q·k + alibi) · inv_norm_factor: the bias is scaled too
        mask = kernels.combine_masks(alibi.view(b, m.num_heads, 1, -1) * m.inv_norm_factor, mask)
    if sdpa:
        causal = bool(m.is_causal and mask is None and t > 1)
    return Recomputed(q, k, v, mask, causal, float(m.inv_norm_factor))


def _roformer(m: Any, a: dict[str, Any]) -> Recomputed:
    # RoFormerSelfAttention: rotary on queries and keys (and values with rotary_value) from the
    # encoder's sinusoidal positions, scores / sqrt(D) + the mask
    _self_attention(a, "encoder_hidden_states")
    h = a["hidden_states"]
    q, k, v = (_heads(p(h), m.num_attention_heads) for p in (m.query, m.key, m.value))
    positions = a["sinusoidal_pos"]
    if positions is not None:
        if m.rotary_value:
            q, k, v = m.apply_rotary_position_embeddings(positions, q, k, v)
        else:
            q, k = m.apply_rotary_position_embeddings(positions, q, k)
    return Recomputed(q, k, v, a["attention_mask"], False, m.attention_head_size**-0.5)


def _openai_gpt(m: Any, a: dict[str, Any]) -> Recomputed:
    # OpenAI-GPT's Attention: one fused Conv1D split in three, scaled by 1/sqrt(D) only when
    # built with scale=True; the causal buffer replaces a later key's score with -1e4, so far
    # below the scores that softmax gives it no weight, read here as a removed key
    q, k, v = (_heads(x, m.n_head) for x in m.c_attn(a["x"]).split(m.split_size, dim=2))
    given = a["attention_mask"]
    causal = _causal(m.bias, q.shape[-2], given).bool()
    scale = v.shape[-1] ** -0.5 if m.scale else 1.0
    return Recomputed(q, k, v, kernels.combine_masks(causal, given), False, scale)


def _deberta_v2(m: Any, a: dict[str, Any]) -> Recomputed:
    # DisentangledSelfAttention: content scores / sqrt(D · (1 + c2p + p2c)) plus the family's
    # own disentangled content->position and position->content terms; padding removed
    h = a["hidden_states"]
    given = a["query_states"]
    heads = m.num_attention_heads
    query = m.transpose_for_scores(m.query_proj(h if given is None else given), heads)
    key = m.transpose_for_scores(m.key_proj(h), heads)
    value = m.transpose_for_scores(m.value_proj(h), heads)  # (B·H, T, D)
    factor = 1 + ("c2p" in m.pos_att_type) + ("p2c" in m.pos_att_type)
    b = h.shape[0]
    relative = None
    if m.relative_attention:
        embeddings = m.pos_dropout(a["rel_embeddings"])
        relative = m.disentangled_attention_bias(
            query, key, a["relative_pos"], embeddings, factor
        ).unflatten(0, (b, heads))
    q, k, v = (x.unflatten(0, (b, heads)) for x in (query, key, value))
    mask = kernels.combine_masks(relative, a["attention_mask"].bool())
    return Recomputed(q, k, v, mask, False, 1.0 / math.sqrt(q.shape[-1] * factor))


def _bert(m: Any, a: dict[str, Any]) -> Recomputed:
    # BERT's self-attention as the families that kept their own copy compute it (Megatron-BERT,
    # RemBERT, TAPAS, VisualBERT): scores / sqrt(D) + the extended mask
    _self_attention(a, "encoder_hidden_states")
    h = a["hidden_states"]
    q, k, v = (_heads(p(h), m.num_attention_heads) for p in (m.query, m.key, m.value))
    return Recomputed(q, k, v, a["attention_mask"], False, m.attention_head_size**-0.5)


def _xlm(m: Any, a: dict[str, Any]) -> Recomputed:
    # XLM's (and FlauBERT's) MultiHeadAttention: queries / sqrt(D); the mask is (B, S) or
    # (B, T, S) (causal models), nonzero where a key is seen
    _self_attention(a, "kv")
    x = a["input"]
    q, k, v = (_heads(p(x), m.n_heads) for p in (m.q_lin, m.k_lin, m.v_lin))
    given = a["mask"]
    b, t = x.shape[0], x.shape[1]
    mask = (given != 0).view((b, 1, t, -1) if given.dim() == 3 else (b, 1, 1, -1))
    return Recomputed(q, k, v, mask, False, m.head_dim**-0.5)


def _imagegpt(m: Any, a: dict[str, Any]) -> Recomputed:
    # ImageGPTAttention (GPT-2's before it was routed): one fused Conv1D; the scale by 1/sqrt(D)
    # and by 1/(layer + 1) as the config asks; the causal buffer, then the model's mask
    _self_attention(a, "encoder_hidden_states")
    q, k, v = (_heads(x, m.num_heads) for x in m.c_attn(a["hidden_states"]).split(m.split_size, 2))
    scale = v.shape[-1] ** -0.5 if m.scale_attn_weights else 1.0
    if m.scale_attn_by_inverse_layer_idx:
        scale /= float(m.layer_idx + 1)
    given = a["attention_mask"]
    return Recomputed(
        q, k, v, kernels.combine_masks(_causal(m.bias, q.shape[-2], given), given), False, scale
    )


def _gpt_neox_japanese(m: Any, a: dict[str, Any]) -> Recomputed:
    # GPTNeoXJapaneseAttention: one fused projection, per head its query, key and value side by
    # side; rotary on the first rotary_ndims of each query and key; scores / sqrt(D) + the mask
    qkv = m.query_key_value(a["hidden_states"]).unflatten(-1, (m.num_attention_heads, -1))
    d = m.head_size
    q, k, v = (qkv[..., i * d : (i + 1) * d].transpose(1, 2) for i in range(3))
    cos, sin = a["position_embeddings"]
    r = m.rotary_ndims
    turned_q, turned_k = _own(m, "apply_rotary_pos_emb")(q[..., :r], k[..., :r], cos, sin)
    q = torch.cat((turned_q, q[..., r:]), dim=-1)
    k = torch.cat((turned_k, k[..., r:]), dim=-1)
    return Recomputed(q, k, v, a["attention_mask"], False, 1.0 / float(m.norm_factor))


# Keyed by the attention class as "family.ClassName" (its file's package in transformers); a
# subclass (a family's flash-attention variant) finds its parent's entry.
UNROUTED_FAMILIES: dict[str, UnroutedFamily] = {
    "gpt_neo.GPTNeoSelfAttention": UnroutedFamily("out_proj", _gpt_neo),
    "mpnet.MPNetSelfAttention": UnroutedFamily("o", _mpnet),
    "xglm.XGLMAttention": UnroutedFamily("out_proj", _xglm),
    "bloom.BloomAttention": UnroutedFamily("dense", _bloom, _bloom_refused),
    "falcon.FalconAttention": UnroutedFamily("dense", _falcon),
    "roformer.RoFormerSelfAttention": UnroutedFamily("../output.dense", _roformer),
    "openai.Attention": UnroutedFamily("c_proj", _openai_gpt),
    "deberta_v2.DisentangledSelfAttention": UnroutedFamily("../output.dense", _deberta_v2),
    "megatron_bert.MegatronBertSelfAttention": UnroutedFamily("../output.dense", _bert),
    "rembert.RemBertSelfAttention": UnroutedFamily("../output.dense", _bert),
    "tapas.TapasSelfAttention": UnroutedFamily("../output.dense", _bert),
    "visual_bert.VisualBertSelfAttention": UnroutedFamily("../output.dense", _bert),
    "xlm.MultiHeadAttention": UnroutedFamily("out_lin", _xlm),
    "flaubert.MultiHeadAttention": UnroutedFamily("out_lin", _xlm),
    "imagegpt.ImageGPTAttention": UnroutedFamily("c_proj", _imagegpt),
    "gpt_neox_japanese.GPTNeoXJapaneseAttention": UnroutedFamily("dense", _gpt_neox_japanese),
}


def _key(cls: type) -> str:
    return f"{cls.__module__.split('.')[-2]}.{cls.__name__}"


def unrouted_family(module: nn.Module) -> UnroutedFamily | None:
    """The entry of ``module``'s attention class (or of the nearest transformers class it
    derives from), or None."""
    for cls in inspect.getmro(type(module)):
        if cls.__module__.startswith("transformers.") and "." in cls.__module__:
            found = UNROUTED_FAMILIES.get(_key(cls))
            if found is not None:
                return found
    return None
