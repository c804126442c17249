"""A BERT encoder built from multihead's layers (Devlin et al., 2019).

    x = LayerNorm(word[ids] + token_type[types] + position[0..T-1])
    x = TransformerEncoder(post-LN layers)(x, key_mask)          # (B, T, E)

The module names are ours (``embeddings.word``, ``encoder.layers[i].self_attn.qkv_proj``,
``norm1``, ``ff.linear1``, ...); :mod:`multihead.pretrained` maps Hugging Face checkpoint names
onto them. At this model's boundary, and only here, masks follow Hugging Face: ``attention_mask``
is int or bool (B, T) with 1/True at real tokens; inside it becomes the key mask.

When a batch has padding, the forward runs *unpadded*: the embeddings, projections, LayerNorms
and feed-forward networks see only the N real tokens (a :class:`multihead.packing.PackedBatch`
passed down the layers as ``packing=``); only attention sees the (B, T) layout, under the key
mask. Hugging Face's BertModel computes all B·T positions everywhere. The result on real tokens
is the padded computation's; the padding positions of ``last_hidden_state`` hold zeros on every
path. Observers, :func:`multihead.capture` and forward hooks see both paths alike.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead.layers import TransformerEncoder, TransformerEncoderLayer
from multihead.packing import PackedBatch
from multihead.positions import LearnedPositionalEmbedding

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["BertConfig", "BertModel", "BertOutput", "BertBatch", "BertEmbeddings"]

# Hugging Face's hidden_act names -> multihead.layers.ACTIVATIONS names.
HF_ACTIVATIONS: dict[str, str] = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}

_REQUIRED = (
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


@dataclass(frozen=True)
class BertConfig:
    """The hyperparameters of a BERT encoder, read from a Hugging Face ``config.json``.

    Attributes:
        vocab_size: V, rows of the word embedding.
        hidden_size: E.
        num_hidden_layers: the number of encoder layers.
        num_attention_heads: H (E must be divisible by it).
        intermediate_size: the feed-forward hidden width.
        max_position_embeddings: the longest input, in tokens.
        type_vocab_size: rows of the token-type (segment) embedding.
        layer_norm_eps: epsilon of every LayerNorm.
        hidden_act: Hugging Face's activation name: "gelu" (exact), "gelu_new" or
            "gelu_pytorch_tanh" (tanh approximation), "relu", "silu"/"swish".
        pad_token_id: the id of [PAD].
        position_embedding_type: only "absolute" is supported.
        hidden_dropout_prob: dropout on embeddings and residual branches (training only).
        attention_probs_dropout_prob: dropout on attention weights (training only).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
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
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config {name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"config hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.hidden_act not in HF_ACTIVATIONS:
            raise ValueError(
                f"config hidden_act {self.hidden_act!r} is not supported: expected one of "
                f"{', '.join(map(repr, HF_ACTIVATIONS))}"
            )
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"config position_embedding_type {self.position_embedding_type!r} is not "
                f"supported: only 'absolute' positions are implemented"
            )
        if not (isinstance(self.layer_norm_eps, (int, float)) and self.layer_norm_eps > 0):
            raise ValueError(
                f"config layer_norm_eps must be a positive number, got {self.layer_norm_eps!r}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            p = getattr(self, name)
            if not (isinstance(p, (int, float)) and 0.0 <= p < 1.0):
                raise ValueError(f"config {name} must be in [0, 1), got {p!r}")

    @property
    def activation(self) -> str:
        """The activation's name in :data:`multihead.layers.ACTIVATIONS`."""
        return HF_ACTIVATIONS[self.hidden_act]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a parsed ``config.json``; keys this model doesn't use are ignored.

        Raises:
            ValueError: a required key is missing, a value is invalid or unsupported, or the
                config describes another architecture (``model_type`` other than "bert", a
                decoder).
        """
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(
                f"config model_type {model_type!r} is not supported: expected 'bert' (other "
                f"BERT-like models differ in positions or layers)"
            )
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ValueError(f"config {flag}=true is not supported: this is an encoder")
        if d.get("pad_token_id") is None:
            d = {**d, "pad_token_id": 0}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    @classmethod
    def from_json_file(cls, path: str | Path) -> BertConfig:
        """Read a ``config.json``. Raises ValueError for invalid JSON or content."""
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{path}: {e}") from e


@dataclass
class BertOutput:
    """What :meth:`BertModel.forward` returns.

    Attention weights come from :func:`multihead.capture` around the call.

    Attributes:
        last_hidden_state: (B, T, E); zeros at padding positions.
    """

    last_hidden_state: Tensor


@dataclass
class BertBatch:
    """Tokenised text, padded to the batch's longest sequence (see :meth:`BertModel.tokenize`).

    Attributes:
        input_ids: (B, T) int64.
        attention_mask: (B, T) int64, 1 = a real token (Hugging Face's convention).
        token_type_ids: (B, T) int64.
        tokens: each text's tokens, [CLS] and [SEP] included, padding excluded.
        special_mask: (B, T) bool, True at special tokens ([CLS], [SEP], [PAD]).
        truncated: whether each text was cut at ``max_seq_length``.
        offsets: per text, per token (as ``tokens``), the (start, end) characters in the text;
            (0, 0) for special tokens.
        word_ids: per text, per token, the index of the word it belongs to; None for specials.
    """

    input_ids: Tensor
    attention_mask: Tensor
    token_type_ids: Tensor
    tokens: list[list[str]]
    special_mask: Tensor
    truncated: list[bool]
    offsets: list[list[tuple[int, int]]]
    word_ids: list[list[int | None]]

    def to(self, device: torch.device | str) -> BertBatch:
        """The same batch with its tensors on ``device``."""
        return BertBatch(
            self.input_ids.to(device),
            self.attention_mask.to(device),
            self.token_type_ids.to(device),
            self.tokens,
            self.special_mask.to(device),
            self.truncated,
            self.offsets,
            self.word_ids,
        )


class BertEmbeddings(nn.Module):
    """word[ids] + token_type[types] + position[positions], then LayerNorm and dropout.

    Submodules: ``word`` (V, E), ``token_type`` (type_vocab_size, E), ``position``
    (:class:`~multihead.layers.LearnedPositionalEmbedding`, max_position_embeddings × E),
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


def _check_int_tensor(name: str, t: Any, shape: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape (B, T) = {shape}, got {tuple(t.shape)}")
    return t


class BertModel(nn.Module):
    """A BERT encoder: embeddings, then post-LN :class:`~multihead.TransformerEncoderLayer` s.

    Build one from a checkpoint with :func:`multihead.pretrained.load_bert` (or
    :func:`~multihead.pretrained.minilm`); constructed directly it is randomly initialised.

    Args:
        config: the hyperparameters.
        tokenizer: a ``tokenizers.Tokenizer`` for :meth:`tokenize` / :meth:`encode`, or None.
            A copy is kept, set to pad to the batch's longest text and truncate at
            ``max_seq_length`` (whatever padding/truncation its file had).
        max_seq_length: where the text path truncates; default ``max_position_embeddings``.
        device, dtype: as for any torch module.

    Attributes:
        config: the :class:`BertConfig`.
        max_seq_length: where the text path truncates.
        tokenizer: the ``tokenizers.Tokenizer``, or None.
        unpad: run padded batches on their real tokens only (default True); False computes
            every padded position, e.g. to compare the two.

    Submodules: ``embeddings`` (:class:`BertEmbeddings`), ``encoder``
    (:class:`~multihead.TransformerEncoder`; ``encoder.layers[i].self_attn`` is a
    :class:`~multihead.MultiHeadAttention`).

    Example:
        >>> from multihead.pretrained import minilm
        >>> model = minilm()
        >>> model.encode(["A cat sat.", "A dog ran."]).shape
        torch.Size([2, 384])
    """

    def __init__(
        self,
        config: BertConfig,
        *,
        tokenizer: Tokenizer | None = None,
        max_seq_length: int | None = None,
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
        # Run batches with padding unpadded (see the module docstring); False forces the padded
        # computation, e.g. to compare the two.
        self.unpad = True
        self.max_seq_length = (
            config.max_position_embeddings if max_seq_length is None else max_seq_length
        )
        self.tokenizer = tokenizer

    # -- configuration --------------------------------------------------------------------------

    @property
    def max_seq_length(self) -> int:
        """Where :meth:`tokenize` truncates, in tokens ([CLS] and [SEP] included)."""
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        limit = self.config.max_position_embeddings
        if not isinstance(value, int) or isinstance(value, bool) or not 2 <= value <= limit:
            raise ValueError(
                f"max_seq_length must be an int in [2, max_position_embeddings={limit}], "
                f"got {value!r}"
            )
        self._max_seq_length = value

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The ``tokenizers.Tokenizer`` of the text path, or None."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Tokenizer | None) -> None:
        if tokenizer is None:
            self._tokenizer = None
            return
        from tokenizers import Tokenizer

        if not isinstance(tokenizer, Tokenizer):
            raise TypeError(
                f"tokenizer must be a tokenizers.Tokenizer or None, got {type(tokenizer).__name__}"
            )
        tok = Tokenizer.from_str(tokenizer.to_str())  # ours to reconfigure, not the caller's
        shipped = tok.padding or {}
        pad_token = shipped.get("pad_token", "[PAD]")
        pad_id = shipped.get("pad_id", self.config.pad_token_id)
        # Files such as MiniLM's pad every text to a fixed 128 and truncate at 128: pad to the
        # batch's longest instead, and truncate where this model says (set in tokenize()).
        tok.no_padding()
        tok.no_truncation()
        tok.enable_padding(
            direction="right",
            pad_id=pad_id,
            pad_type_id=shipped.get("pad_type_id", 0),
            pad_token=pad_token,
        )
        self._tokenizer = tok

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> BertOutput:
        """Encode token ids.

        Args:
            input_ids: (B, T) integer token ids, T <= ``config.max_position_embeddings``.
            attention_mask: (B, T) int or bool, 1/True = a real token, 0/False = padding
                (Hugging Face's convention); default all real.
            token_type_ids: (B, T) segment ids; default all 0.

        Returns:
            :class:`BertOutput`: ``last_hidden_state`` (B, T, E), zeros at padding.

        Raises:
            TypeError: a non-integer ``input_ids`` / ``token_type_ids``, a float
                ``attention_mask``.
            ValueError: wrong shapes, T above ``max_position_embeddings``, ids out of range.
        """
        _check_int_tensor("input_ids", input_ids)
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be 2-D (B, T), got shape {tuple(input_ids.shape)}; "
                f"add a batch axis with input_ids[None]"
            )
        b, t = input_ids.shape
        limit = self.config.max_position_embeddings
        if t > limit:
            raise ValueError(
                f"input_ids has {t} tokens per sequence, more than this model's "
                f"max_position_embeddings={limit}: truncate the input"
            )
        if t == 0:
            raise ValueError("input_ids must hold at least one token, got shape (B, 0)")
        if input_ids.numel() and (
            int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size
        ):
            raise ValueError(
                f"input_ids must be in [0, vocab_size={self.config.vocab_size}), got values in "
                f"[{int(input_ids.min())}, {int(input_ids.max())}]"
            )
        if token_type_ids is not None:
            _check_int_tensor("token_type_ids", token_type_ids, (b, t))
            if (
                int(token_type_ids.min()) < 0
                or int(token_type_ids.max()) >= self.config.type_vocab_size
            ):
                raise ValueError(
                    f"token_type_ids must be in [0, type_vocab_size={self.config.type_vocab_size})"
                )
        key_mask = self._key_mask(attention_mask, b, t)

        if key_mask is not None and self.unpad:
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

    @staticmethod
    def _key_mask(attention_mask: Tensor | None, b: int, t: int) -> Tensor | None:
        """Hugging Face's attention_mask -> our key mask (B, T) bool, or None when all real."""
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, Tensor):
            raise TypeError(
                "attention_mask must be a torch.Tensor or None, got "
                f"{type(attention_mask).__name__}"
            )
        if attention_mask.is_floating_point() or attention_mask.is_complex():
            raise TypeError(
                f"attention_mask must be int or bool (1/True = a real token), got dtype "
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

    # -- text -----------------------------------------------------------------------------------

    def tokenize(self, texts: str | Sequence[str]) -> BertBatch:
        """Tokenise texts, padded to the longest, truncated at ``max_seq_length``.

        Args:
            texts: one text or a sequence of texts.

        Returns:
            A :class:`BertBatch` on the model's device.

        Raises:
            ValueError: the model has no tokenizer, or ``texts`` is empty.
            TypeError: ``texts`` holds something other than strings.

        Warns:
            UserWarning: when a text is longer than ``max_seq_length`` tokens and is cut.
        """
        if self._tokenizer is None:
            raise ValueError(
                "this model has no tokenizer (load_bert found no tokenizer.json): pass token ids "
                "to model(input_ids, ...) instead"
            )
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise ValueError("texts must hold at least one text, got none")
        bad = [type(x).__name__ for x in texts if not isinstance(x, str)]
        if bad:
            raise TypeError(f"texts must be strings, got {bad[0]}")
        tok = self._tokenizer
        tok.enable_truncation(max_length=self.max_seq_length)
        encodings = tok.encode_batch(texts)
        truncated = [len(e.overflowing) > 0 for e in encodings]
        if any(truncated):
            which = [i for i, cut in enumerate(truncated) if cut]
            warnings.warn(
                f"{len(which)} of {len(texts)} texts are longer than max_seq_length="
                f"{self.max_seq_length} tokens and were truncated (texts {which[:10]})",
                UserWarning,
                stacklevel=2,
            )
        device = self.embeddings.word.weight.device
        input_ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)
        attention_mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64)
        token_type_ids = torch.tensor([e.type_ids for e in encodings], dtype=torch.int64)
        special = torch.tensor([e.special_tokens_mask for e in encodings], dtype=torch.bool)
        special |= attention_mask == 0
        lengths = attention_mask.sum(1).tolist()
        return BertBatch(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            token_type_ids=token_type_ids.to(device),
            tokens=[e.tokens[:n] for e, n in zip(encodings, lengths, strict=True)],
            special_mask=special.to(device),
            truncated=truncated,
            offsets=[list(e.offsets[:n]) for e, n in zip(encodings, lengths, strict=True)],
            word_ids=[list(e.word_ids[:n]) for e, n in zip(encodings, lengths, strict=True)],
        )

    @staticmethod
    def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Mean over real tokens, L2-normalised, as sentence-transformers' Pooling + Normalize.

        Args:
            hidden: (B, T, E). attention_mask: (B, T) int or bool, 1 = real token.

        Returns:
            (B, E), each row of unit length.
        """
        mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
        summed = (hidden * mask).sum(1)  # (B, E)
        counts = mask.sum(1).clamp(min=1e-9)  # (B, 1)
        return F.normalize(summed / counts, p=2, dim=1)

    def encode(self, sentences: str | Sequence[str], *, batch_size: int = 32) -> Tensor:
        """Sentence embeddings: mean over real tokens, L2-normalised (sentence-transformers').

        Texts are sorted by length and run ``batch_size`` at a time (little padding), in eval
        mode without gradients; the result is in the input order.

        Args:
            sentences: one text or a sequence of N texts.
            batch_size: texts per forward.

        Returns:
            (N, E) on the model's device ((1, E) for a single text).

        Warns:
            UserWarning: when a text is longer than ``max_seq_length`` tokens and is cut.
        """
        if isinstance(sentences, str):
            sentences = [sentences]
        sentences = list(sentences)
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        ref = self.embeddings.word.weight
        out = torch.empty(
            len(sentences), self.config.hidden_size, device=ref.device, dtype=ref.dtype
        )
        order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(order), batch_size):
                    idx = order[start : start + batch_size]
                    batch = self.tokenize([sentences[i] for i in idx])
                    hidden = self(batch.input_ids, batch.attention_mask, batch.token_type_ids)
                    out[idx] = self.mean_pool(hidden.last_hidden_state, batch.attention_mask)
        finally:
            self.train(was_training)
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"hidden={c.hidden_size}, max_seq_length={self.max_seq_length}"
        )
