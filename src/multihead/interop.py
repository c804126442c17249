"""Exact conversion to and from torch.nn: MultiheadAttention and TransformerEncoderLayer.

Parameters are copied, never shared; the converted module gives the same outputs. multihead's
modules are batch-first whatever the torch module's ``batch_first`` was.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from multihead.attention import MultiHeadAttention
from multihead.layers import TransformerEncoderLayer

__all__ = [
    "mha_from_torch",
    "mha_to_torch",
    "encoder_layer_from_torch",
    "encoder_layer_to_torch",
]


def mha_from_torch(m: nn.MultiheadAttention) -> MultiHeadAttention:
    """Build an exact copy of a torch.nn.MultiheadAttention (same parameters, same outputs).

    The result is batch-first whatever ``m.batch_first`` was: transpose inputs that were
    (T, B, E). ``add_bias_kv`` and ``add_zero_attn`` have no equivalent and raise.
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"m must be a torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError(
            "cannot convert a torch.nn.MultiheadAttention built with add_bias_kv=True or "
            "add_zero_attn=True: multihead has no equivalent"
        )
    ref = m.out_proj.weight
    ours = MultiHeadAttention(
        m.embed_dim,
        m.num_heads,
        kdim=m.kdim,
        vdim=m.vdim,
        bias=m.in_proj_bias is not None,
        dropout=m.dropout,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        if m._qkv_same_embed_dim:
            assert m.in_proj_weight is not None
            weights: tuple[Tensor, ...] = m.in_proj_weight.chunk(3, dim=0)
        else:
            weights = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
        biases = m.in_proj_bias.chunk(3) if m.in_proj_bias is not None else (None,) * 3
        for (w, b), w_src, b_src in zip(ours._qkv_blocks(), weights, biases, strict=True):
            w.copy_(w_src)
            if b is not None and b_src is not None:
                b.copy_(b_src)
        ours.out_proj.weight.copy_(m.out_proj.weight)
        if ours.out_proj.bias is not None and m.out_proj.bias is not None:
            ours.out_proj.bias.copy_(m.out_proj.bias)
    return ours


def mha_to_torch(mha: MultiHeadAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """An exact torch.nn.MultiheadAttention copy of this module.

    torch's module needs H·D == E, one key/value head per query head, and out_dim == E.
    """
    problems = []
    if mha.num_heads * mha.head_dim != mha.embed_dim:
        problems.append(f"num_heads·head_dim ({mha.num_heads}·{mha.head_dim}) != embed_dim")
    if mha.num_kv_heads != mha.num_heads:
        problems.append(f"num_kv_heads ({mha.num_kv_heads}) != num_heads ({mha.num_heads})")
    if mha.out_dim != mha.embed_dim:
        problems.append(f"out_dim ({mha.out_dim}) != embed_dim ({mha.embed_dim})")
    if problems:
        raise ValueError(
            "torch.nn.MultiheadAttention cannot represent this module: " + "; ".join(problems)
        )
    ref = mha.out_proj.weight
    m = nn.MultiheadAttention(
        mha.embed_dim,
        mha.num_heads,
        dropout=mha.dropout,
        bias=mha.out_proj.bias is not None,
        kdim=mha.kdim,
        vdim=mha.vdim,
        batch_first=batch_first,
        device=ref.device,
        dtype=ref.dtype,
    )
    with torch.no_grad():
        blocks = mha._qkv_blocks()
        if m._qkv_same_embed_dim:
            assert m.in_proj_weight is not None
            m.in_proj_weight.copy_(torch.cat([w for w, _ in blocks]))
        else:
            for target, (w, _) in zip(
                (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight), blocks, strict=True
            ):
                target.copy_(w)
        if m.in_proj_bias is not None:
            m.in_proj_bias.copy_(torch.cat([b for _, b in blocks if b is not None]))
        m.out_proj.weight.copy_(mha.out_proj.weight)
        if m.out_proj.bias is not None and mha.out_proj.bias is not None:
            m.out_proj.bias.copy_(mha.out_proj.bias)
    return m


def encoder_layer_from_torch(m: nn.TransformerEncoderLayer) -> TransformerEncoderLayer:
    """An exact copy of a torch.nn.TransformerEncoderLayer (ReLU or GELU activation).

    The copy is batch-first whatever ``m.batch_first`` was.
    """
    if not isinstance(m, nn.TransformerEncoderLayer):
        raise TypeError(f"m must be a torch.nn.TransformerEncoderLayer, got {type(m).__name__}")
    kind = getattr(m, "activation_relu_or_gelu", 0)
    if kind not in (1, 2):
        raise ValueError(
            f"cannot convert the activation {m.activation!r}: only ReLU and GELU have an equivalent"
        )
    attn = m.self_attn
    ref = m.linear1.weight
    ours = TransformerEncoderLayer(
        attn.embed_dim,
        attn.num_heads,
        m.linear1.out_features,
        dropout=attn.dropout,
        norm_first=m.norm_first,
        norm_eps=m.norm1.eps,
        activation="relu" if kind == 1 else "gelu",
        bias=m.linear1.bias is not None,
        device=ref.device,
        dtype=ref.dtype,
    )
    ours.self_attn = mha_from_torch(attn)
    ours.ff.linear1.load_state_dict(m.linear1.state_dict())
    ours.ff.linear2.load_state_dict(m.linear2.state_dict())
    ours.norm1.load_state_dict(m.norm1.state_dict())
    ours.norm2.load_state_dict(m.norm2.state_dict())
    return ours


def encoder_layer_to_torch(layer: TransformerEncoderLayer) -> nn.TransformerEncoderLayer:
    """An exact batch-first torch.nn.TransformerEncoderLayer copy (ReLU or GELU only)."""
    if layer.ff.activation_name not in ("relu", "gelu"):
        raise ValueError(
            f"torch.nn.TransformerEncoderLayer supports activation 'relu' or 'gelu' "
            f"exactly, got {layer.ff.activation_name!r}"
        )
    attn = layer.self_attn
    ref = layer.ff.linear1.weight
    m = nn.TransformerEncoderLayer(
        attn.embed_dim,
        attn.num_heads,
        dim_feedforward=layer.ff.linear1.out_features,
        dropout=attn.dropout,
        activation=layer.ff.activation_name,
        layer_norm_eps=layer.norm1.eps,
        batch_first=True,
        norm_first=layer.norm_first,
        bias=layer.ff.linear1.bias is not None,
        device=ref.device,
        dtype=ref.dtype,
    )
    m.self_attn = mha_to_torch(attn, batch_first=True)
    m.linear1.load_state_dict(layer.ff.linear1.state_dict())
    m.linear2.load_state_dict(layer.ff.linear2.state_dict())
    m.norm1.load_state_dict(layer.norm1.state_dict())
    m.norm2.load_state_dict(layer.norm2.state_dict())
    return m
