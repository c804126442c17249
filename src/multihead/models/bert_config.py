"""The hyperparameters of a :class:`~multihead.models.bert.BertModel`, checked on construction;
:func:`multihead.pretrained.bert_config_from_dict` builds one from a Hugging Face
``config.json``."""

from __future__ import annotations

from dataclasses import dataclass

from multihead._checks import (
    check_choice,
    check_finite_float,
    check_positive_int,
    check_probability,
    describe,
    is_int,
)
from multihead.layer_parts import ACTIVATIONS

__all__ = ["BertConfig"]


@dataclass(frozen=True)
class BertConfig:
    """The hyperparameters of a BERT encoder.

    :func:`multihead.pretrained.bert_config_from_dict` reads one from a Hugging Face
    ``config.json`` (its names, its activation names, its other architectures rejected).

    Attributes:
        vocab_size: V, rows of the word embedding.
        hidden_size: E.
        num_hidden_layers: the number of encoder layers.
        num_attention_heads: H (E must be divisible by it).
        intermediate_size: the feed-forward hidden width.
        max_position_embeddings: the longest input, in tokens.
        type_vocab_size: rows of the token-type (segment) embedding.
        layer_norm_eps: epsilon of every LayerNorm (> 0).
        activation: the feed-forward activation, a :data:`multihead.layer_parts.ACTIVATIONS` name:
            "gelu" (exact), "gelu_tanh", "relu" or "silu".
        pad_token_id: the id of [PAD], in [0, vocab_size).
        hidden_dropout_prob: dropout on embeddings and residual branches (training only).
        attention_probs_dropout_prob: dropout on attention weights (training only).

    Raises:
        ValueError: a size that is not a positive int, E not divisible by H, an unknown
            activation, a pad_token_id out of range, a dropout outside [0, 1).
        TypeError: a pad_token_id that is not an int.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    activation: str
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
        ):
            check_positive_int(f"config {name}", getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"config hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        check_choice("config activation", self.activation, ACTIVATIONS)
        if check_finite_float("config layer_norm_eps", self.layer_norm_eps) <= 0:
            raise ValueError(f"config layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")
        if not is_int(self.pad_token_id):
            raise TypeError(
                f"config pad_token_id must be an int, got {describe(self.pad_token_id)}"
            )
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(
                f"config pad_token_id must be a token id in [0, vocab_size={self.vocab_size}), "
                f"got {self.pad_token_id}"
            )
        check_probability("config hidden_dropout_prob", self.hidden_dropout_prob)
        check_probability("config attention_probs_dropout_prob", self.attention_probs_dropout_prob)
