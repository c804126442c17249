"""Hugging Face ``config.json`` -> :class:`~multihead.models.bert.BertConfig`.

Hugging Face's names and conventions stop here: its activation names (``hidden_act``), the keys
it requires, the architectures that share its format but not this model's layers
(``model_type``, decoders, relative positions). :class:`BertConfig` then checks the values.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from multihead._checks import check_choice, describe
from multihead._files import read_json  # public here as before; it lives with the other readers
from multihead.models.bert_config import BertConfig

__all__ = [
    "HF_ACTIVATIONS",
    "REQUIRED_KEYS",
    "bert_config_from_dict",
    "read_bert_config",
]

# Hugging Face's hidden_act names -> multihead.layers.ACTIVATIONS names.
HF_ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
    "type_vocab_size",
    "layer_norm_eps",
    "hidden_act",
)
# config.json keys that keep their name in BertConfig.
_SAME_NAME = (*REQUIRED_KEYS[:-1], "hidden_dropout_prob", "attention_probs_dropout_prob")


def bert_config_from_dict(d: Mapping[str, Any]) -> BertConfig:
    """A :class:`BertConfig` from a parsed Hugging Face ``config.json``.

    Keys this model doesn't use are ignored; ``pad_token_id`` null or absent means 0.

    Raises:
        TypeError: ``d`` is not a mapping; a value of the wrong kind.
        ValueError: a required key is missing, a value is invalid, or the config describes
            another architecture (``model_type`` other than "bert", a decoder, positions other
            than "absolute", an activation this library doesn't have).
    """
    if not isinstance(d, Mapping):
        raise TypeError(f"config must be a dict (a JSON object), got {type(d).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in d]
    if missing:
        raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
    model_type = d.get("model_type", "bert")
    if model_type != "bert":
        raise ValueError(
            f"config model_type {describe(model_type)} is not supported: expected 'bert' (other "
            f"BERT-like models differ in positions or layers)"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if d.get(flag):
            raise ValueError(f"config {flag}=true is not supported: this is an encoder")
    positions = d.get("position_embedding_type", "absolute")
    if positions != "absolute":
        raise ValueError(
            f"config position_embedding_type {describe(positions)} is not supported: only "
            f"'absolute' positions are implemented"
        )
    hidden_act = check_choice("config hidden_act", d["hidden_act"], HF_ACTIVATIONS)
    pad = d.get("pad_token_id")
    return BertConfig(
        **{k: d[k] for k in _SAME_NAME if k in d},
        activation=HF_ACTIVATIONS[hidden_act],
        pad_token_id=0 if pad is None else pad,
    )


def read_bert_config(path: str | Path) -> BertConfig:
    """Read a Hugging Face ``config.json``.

    Raises:
        ValueError / TypeError: as :func:`bert_config_from_dict` and :func:`read_json`; every
            message starts with the file's path.
    """
    path = Path(path)
    d = read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got a JSON {type(d).__name__}")
    try:
        return bert_config_from_dict(d)
    except (ValueError, TypeError) as e:
        raise type(e)(f"{path}: {e}") from None
