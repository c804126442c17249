"""A BERT encoder built from multihead's layers (Devlin et al., 2019).

    x = LayerNorm(word[ids] + token_type[types] + position[0..T-1])
    x = TransformerEncoder(post-LN layers)(x, key_mask)          # (B, T, E)

The module names are ours (``embeddings.word``, ``encoder.layers[i].self_attn.qkv_proj``,
``norm1``, ``ff.linear1``, ...); :mod:`multihead.pretrained` maps Hugging Face checkpoint names
onto them. At this model's boundary, and only here, masks follow Hugging Face: ``attention_mask``
is int or bool (B, T) with 1/True at real tokens; inside it becomes the key mask.

When a batch has padding, the forward on the CPU runs *unpadded*: the embeddings, projections,
LayerNorms and feed-forward networks see only the N real tokens (a
:class:`multihead.packing.PackedBatch` passed down the layers as ``packing=``); only attention
sees the (B, T) layout, under the key mask. Hugging Face's BertModel computes all B·T positions
everywhere, and so does this model on a GPU (``unpad="auto"``), where the padded positions cost
less than the packing's gathers, scatters and host reads (BENCHMARKS-GPU.md, bench_bert).
The result on real tokens is the padded computation's; the padding positions of
``last_hidden_state`` hold zeros on every path. Observers, :func:`multihead.capture` and forward
hooks see both paths alike.

The hyperparameters, :class:`BertConfig`, live in :mod:`multihead.models.bert_config` (and are
importable from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from multihead._checks import check_tensor
from multihead.layers import TransformerEncoder, TransformerEncoderLayer
from multihead.map_types import ModelMap
from multihead.models.bert_config import BertConfig
from multihead.packing import PackedBatch
from multihead.positions import LearnedPositionalEmbedding

__all__ = ["BertModel", "BertOutput", "BertEmbeddings"]

# Token ids index embeddings: torch takes int32 and int64; narrower ints would wrap silently.
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass
class BertOutput:
    """What :meth:`BertModel.forward` returns.

    Attention weights come from :func:`multihead.capture` around the call.

    Attributes:
        last_hidden_state: (B, T, E); zeros at padding positions.
    """

    last_hidden_state: Tensor


class BertEmbeddings(nn.Module):
    """word[ids] + token_type[types] + position[positions], then LayerNorm and dropout.

    Submodules: ``word`` (V, E), ``token_type`` (type_vocab_size, E), ``position``
    (:class:`~multihead.positions.LearnedPositionalEmbedding`, max_position_embeddings × E),
    ``norm``.

    Shapes: ids, types and positions share a shape (...), e.g. (B, T) or packed (N,);
    the result is (..., E).
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        e = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id, **factory)
        self.token_type = nn.Embedding(config.type_vocab_size, e, **factory)
        self.position = LearnedPositionalEmbedding(config.max_position_embeddings, e, **factory)
        self.norm = nn.LayerNorm(e, eps=config.layer_norm_eps, **factory)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self, input_ids: Tensor, token_type_ids: Tensor | None, positions: Tensor
    ) -> Tensor:
        x = self.word(input_ids)  # (..., E)
        # Type 0 for every token when none are given: add its row, without a lookup.
        x = x + (
            self.token_type.weight[0] if token_type_ids is None else self.token_type(token_type_ids)
        )
        x = x + self.position.embedding(positions)  # the same summation order as Hugging Face
        return self.dropout(self.norm(x))


def _check_ids(name: str, ids: Any, shape: tuple[int, int], count: int, what: str) -> None:
    """``ids`` must be int32/int64 of ``shape`` (B, T), each id in [0, count)."""
    check_tensor(name, ids, dtypes=_ID_DTYPES)
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape (B, T) = {shape}, got {tuple(ids.shape)}")
    low, high = (int(ids.min()), int(ids.max())) if ids.numel() else (0, 0)
    if low < 0 or high >= count:
        raise ValueError(f"{name} must be in [0, {what}={count}), got values in [{low}, {high}]")


class BertModel(nn.Module):
    """A BERT encoder: embeddings, then post-LN :class:`~multihead.TransformerEncoderLayer` s.

    A pure module: token ids in, hidden states out. Text (tokenizer, truncation, pooling) is the
    job of :class:`multihead.text.TextModel`; :func:`multihead.pretrained.load_text_model` (or
    :func:`~multihead.pretrained.minilm`) loads a directory as one. Build the encoder alone from
    a checkpoint with :func:`multihead.pretrained.load_bert`; constructed directly it is randomly
    initialised.

    Args:
        config: the hyperparameters.
        device, dtype: as for any torch module.

    Attributes:
        config: the :class:`BertConfig`.
        unpad: ``"auto"`` (default) runs padded batches on their real tokens only on the CPU
            and computes every padded position elsewhere; True or False forces one path, e.g.
            to compare the two.

    Submodules: ``embeddings`` (:class:`BertEmbeddings`), ``encoder``
    (:class:`~multihead.TransformerEncoder`; ``encoder.layers[i].self_attn`` is a
    :class:`~multihead.MultiHeadAttention`).

    Example:
        >>> config = BertConfig(
        ...     vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        ...     intermediate_size=64, max_position_embeddings=16, type_vocab_size=2,
        ...     layer_norm_eps=1e-12, activation="gelu")
        >>> BertModel(config)(torch.tensor([[1, 5, 7, 2]])).last_hidden_state.shape
        torch.Size([1, 4, 32])
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, BertConfig):
            raise TypeError(f"config must be a BertConfig, got {type(config).__name__}")
        self.config = config
        self.embeddings = BertEmbeddings(config, device=device, dtype=dtype)
        layers = [
            TransformerEncoderLayer(
                config.hidden_size,
                config.num_attention_heads,
                config.intermediate_size,
                dropout=config.hidden_dropout_prob,
                norm_first=False,
                norm_eps=config.layer_norm_eps,
                activation=config.activation,
                device=device,
                dtype=dtype,
            )
            for _ in range(config.num_hidden_layers)
        ]
        for layer in layers:
            # BERT has separate dropout rates for attention weights and hidden states.
            layer.self_attn.dropout = float(config.attention_probs_dropout_prob)
        self.encoder = TransformerEncoder(layers)
        self.unpad = "auto"

    @property
    def unpad(self) -> bool | Literal["auto"]:
        """Whether padded batches run on their real tokens only: ``"auto"`` (the default) on
        the CPU, where that is faster, and not elsewhere (see the module docstring); True or
        False forces one path on every device.

        Raises:
            ValueError: on setting anything else.
        """
        return self._unpad

    @unpad.setter
    def unpad(self, value: bool | Literal["auto"]) -> None:
        if value != "auto" and not isinstance(value, bool):
            raise ValueError(f"unpad must be True, False or 'auto', got {value!r}")
        self._unpad: bool | Literal["auto"] = value

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding (vocab_size, E), by the name torch and Hugging Face models use."""
        return self.embeddings.word

    def build_model_map(self) -> ModelMap:
        """Its :class:`~multihead.map_types.ModelMap` (read through :func:`multihead.model_map`):
        post-LN encoder layers (no final norm, no unembedding), word, position and token-type
        embeddings, not causal, ``max_position_embeddings`` positions."""
        e = self.embeddings
        return ModelMap.of_modules(
            self,
            family="bert",
            embeddings=(e.word, e.position, e.token_type),
            position_table=e.position.embedding,
            width=self.config.hidden_size,
            causal=False,
            position_limit=self.config.max_position_embeddings,
            token_types=self.config.type_vocab_size > 0,
        )

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> BertOutput:
        """Encode token ids.

        Args:
            input_ids: (B, T) int64 or int32 token ids, T <= ``config.max_position_embeddings``.
            attention_mask: (B, T) int or bool, 1/True = a real token, 0/False = padding
                (Hugging Face's convention); default all real.
            token_type_ids: (B, T) int64 or int32 segment ids; default all 0.

        Returns:
            :class:`BertOutput`: ``last_hidden_state`` (B, T, E), zeros at padding.

        Raises:
            TypeError: ``input_ids`` / ``token_type_ids`` not int32 or int64, a float
                ``attention_mask``.
            ValueError: wrong shapes, T above ``max_position_embeddings``, ids out of range.
        """
        check_tensor("input_ids", input_ids, dtypes=_ID_DTYPES)
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(
                f"input_ids must be 2-D (B, T) with T >= 1, got shape {tuple(input_ids.shape)}"
                + ("; add a batch axis with input_ids[None]" if input_ids.dim() == 1 else "")
            )
        b, t = input_ids.shape
        c = self.config
        if t > c.max_position_embeddings:
            raise ValueError(
                f"input_ids has {t} tokens per sequence, more than this model's "
                f"max_position_embeddings={c.max_position_embeddings}: truncate the input"
            )
        _check_ids("input_ids", input_ids, (b, t), c.vocab_size, "vocab_size")
        if token_type_ids is not None:
            _check_ids(
                "token_type_ids", token_type_ids, (b, t), c.type_vocab_size, "type_vocab_size"
            )
        key_mask = self._key_mask(attention_mask, b, t)

        if key_mask is not None and self._unpads(input_ids.device):
            # Everything but attention on the N real tokens only; exact on them.
            packing = PackedBatch(key_mask)
            ids = packing.pack(input_ids)  # (N,)
            types = None if token_type_ids is None else packing.pack(token_type_ids)
            x = self.embeddings(ids, types, packing.position_index)  # (N, E)
            x = self.encoder(x, packing=packing)  # (N, E)
            return BertOutput(packing.unpack(x))  # (B, T, E), zeros at padding

        positions = torch.arange(t, device=input_ids.device)  # (T,)
        x = self.embeddings(input_ids, token_type_ids, positions)  # (B, T, E)
        x = self.encoder(x, key_mask=key_mask)
        if key_mask is not None:
            x = x.masked_fill(~key_mask[..., None], 0.0)  # (B, T, E), as the unpadded path
        return BertOutput(x)

    def _unpads(self, device: torch.device) -> bool:
        """Whether a padded batch on ``device`` runs on its real tokens only (``unpad``)."""
        return device.type == "cpu" if self._unpad == "auto" else self._unpad

    @staticmethod
    def _key_mask(attention_mask: Tensor | None, b: int, t: int) -> Tensor | None:
        """Hugging Face's attention_mask -> our key mask (B, T) bool, or None when all real."""
        if attention_mask is None:
            return None
        check_tensor("attention_mask", attention_mask)
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise TypeError(
                "attention_mask must be int or bool (1/True = a real token), got "
                f"{attention_mask.dtype}"
            )
        if tuple(attention_mask.shape) != (b, t):
            raise ValueError(
                f"attention_mask must have the shape of input_ids (B, T) = ({b}, {t}), got "
                f"{tuple(attention_mask.shape)}"
            )
        key_mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask != 0
        # No padding at all: no mask, so attention takes its fastest kernel and nothing is packed.
        return None if bool(key_mask.all()) else key_mask

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"hidden={c.hidden_size}, max_position_embeddings={c.max_position_embeddings}"
        )
