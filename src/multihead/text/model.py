"""One text model for every backend: :class:`TextModel` (a model, its tokenizer and its pooling).

Models are pure modules, ids in and hidden states out: multihead's own
:class:`~multihead.models.bert.BertModel`, or any Hugging Face transformers model whose attention
is routed through transformers' AttentionInterface (:mod:`multihead.hf`). A :class:`TextModel`
adds what reading text needs, the same way for both:

- ``tokenize``: :func:`multihead.tokenization.tokenize` (display tokens as written, one word
  rule), cut at ``max_seq_length``;
- a sentence embedding (``pooling``): the mean over real tokens for encoders, as
  sentence-transformers does; for decoders (``causal``) the last real token's state, the one
  place that has seen the whole text and what the next-token prediction reads; L2-normalised;
- ``encode(texts)``: sentence embeddings, batched;
- ``name``, ``causal``, ``num_layers``, ``num_heads``.

A TextModel is an ``nn.Module`` holding the model as ``model``: :func:`multihead.capture`,
``head_statistics``, ``intervene``, ``record_heads`` and ``head_importance`` take either the
TextModel or ``text_model.model`` and number the same layers.

Layers are the attention modules the forward actually calls, in module order (as
:func:`multihead.capture` numbers them); a probe forward at construction counts them and their
heads, and tells causal models from the weights (every weight above the diagonal exactly 0).
An encoder-decoder model (T5, BART, ...) runs its encoder only: its self-attention is what is
read.

Build one from a directory with :func:`multihead.pretrained.load_text_model`.

Shapes: B texts, T tokens, E hidden width, L layers, H heads.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import check_positive_int, describe, is_int
from multihead.observe.recorder import capture
from multihead.observe.rows import attention_modules
from multihead.tokenization import (
    TokenBatch,
    TruncationWarning,
    check_text,
    prepare_tokenizer,
    tokenize,
)

__all__ = ["TextModel", "mean_pool", "last_token_pool", "position_limit"]

# Without a position limit in the config or the tokenizer (T5's relative positions), texts are
# cut here: what T5 itself was trained on, and a page a browser draws comfortably.
_FALLBACK_MAX_LENGTH = 512
# Tokenizers without a limit report this huge number (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 10**9
_PROBE = "The cat sat on the mat, and then it slept."


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """Mean over real tokens, L2-normalised, as sentence-transformers' Pooling + Normalize.

    Args:
        hidden: (B, T, E).
        attention_mask: (B, T) int or bool, 1 = a real token.

    Returns:
        (B, E), each row of unit length.
    """
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    summed = (hidden * mask).sum(1)  # (B, E)
    counts = mask.sum(1).clamp(min=1e-9)  # (B, 1)
    return F.normalize(summed / counts, p=2, dim=1)


def last_token_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """The last real token's state, L2-normalised, whichever side the padding is on.

    Args:
        hidden: (B, T, E).
        attention_mask: (B, T) int or bool, 1 = a real token.

    Returns:
        (B, E), each row of unit length.
    """
    t = attention_mask.shape[1]
    last = t - 1 - attention_mask.long().flip(1).argmax(1)  # (B,) the position of the last 1
    states = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, E)
    return F.normalize(states, p=2, dim=1)


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


def _embedding_rows(model: nn.Module) -> int | None:
    """The rows of the model's token embedding (every id must have one); None when the model
    does not say."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return _count(rows)


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of ``tokenizer`` (itself, or a fast transformers
    tokenizer's ``backend_tokenizer``)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "is_fast", False) and isinstance(backend, Tokenizer):
        return backend
    raise TypeError(
        f"tokenizer must be a tokenizers.Tokenizer or a fast transformers tokenizer "
        f"(PreTrainedTokenizerFast, from a tokenizer.json), got {type(tokenizer).__name__}"
    )


class TextModel(nn.Module):
    """A model and its tokenizer, read as text in and vectors out (see the module docstring).

    Args:
        model: multihead's :class:`~multihead.models.bert.BertModel`, or a transformers
            ``PreTrainedModel`` whose attention is routed through transformers'
            AttentionInterface (an encoder-decoder model runs its encoder only, a model with a
            task head its base model). Its forward takes ``(input_ids, attention_mask=...)``
            and returns ``last_hidden_state``.
        tokenizer: a ``tokenizers.Tokenizer`` or a fast transformers tokenizer; kept as given
            (:attr:`tokenizer`), read through a copy that pads on the right and truncates per
            call. Every id it gives must have a row in the model's token embedding.
        name: a name for titles and reports; default the config's ``name_or_path``, else the
            model's class.
        max_seq_length: where texts are cut, in tokens (special tokens included); default the
            model's position limit (:func:`position_limit`) or the tokenizer's
            ``model_max_length``, whichever is smaller, else 512.

    Attributes:
        model: the module that runs (the encoder of an encoder-decoder model, the base model
            of a task head), in eval mode.
        tokenizer: the tokenizer, as given.
        name: the model's name.
        causal: whether each token reads only itself and earlier tokens (decoder-only models).
        pooling: "last" (the last real token) for causal models, else "mean".
        num_layers: L, the attention modules one forward calls.
        num_heads: H, the query heads of each (the same in every layer).
        hidden_size: E, the width of ``last_hidden_state``.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``tokenizer`` neither kind.
        ValueError: a tokenizer with ids beyond the embedding; a bad ``max_seq_length``; a
            transformers family not routed through the interface (named); attention modules
            not called exactly once each; layers with different head counts (named).

    Example:
        >>> from multihead.pretrained import minilm
        >>> model = minilm()  # doctest: +SKIP
        >>> model.tokenize("Hello world!").tokens  # doctest: +SKIP
        [['[CLS]', 'Hello', 'world', '!', '[SEP]']]
        >>> model.encode(["A cat sat.", "A dog ran."]).shape  # doctest: +SKIP
        torch.Size([2, 384])
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        name: str | None = None,
        max_seq_length: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        config = getattr(model, "config", None)
        if getattr(config, "is_encoder_decoder", False):
            model = model.get_encoder()  # type: ignore[operator]
        # a task head (GPT2LMHeadModel, RobertaForMaskedLM): the hidden states are its base's
        base = getattr(model, "base_model", None)
        model = base if isinstance(base, nn.Module) else model
        backend = _backend(tokenizer)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {describe(name)}")
        self.model = model
        self.eval()  # the wrapper and the model
        self.tokenizer = tokenizer
        self.name = name or str(getattr(config, "name_or_path", "") or type(model).__name__)
        limits = (position_limit(model), _count(getattr(tokenizer, "model_max_length", None)))
        self._limit = min(
            (v for v in limits if v and 1 < v < _NO_LIMIT), default=_FALLBACK_MAX_LENGTH
        )
        self.max_seq_length = self._limit if max_seq_length is None else max_seq_length
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if is_int(pad) else getattr(config, "pad_token_id", None)
        pad_id = pad if isinstance(pad, int) and not isinstance(pad, bool) else 0
        # A copy of the tokenizers.Tokenizer: right padding, truncation per call.
        self._tokenizer = prepare_tokenizer(
            backend, pad_id=pad_id, vocab_size=_embedding_rows(model)
        )
        # Token types only where the model has an embedding for them: GPT-2's forward accepts
        # token_type_ids and adds its *word* embedding of them, changing every hidden state.
        self._token_types = int(getattr(config, "type_vocab_size", 0) or 0) > 0 and (
            "token_type_ids" in inspect.signature(model.forward).parameters
        )
        self.num_layers, self.num_heads, self.hidden_size, self.causal = self._probe()
        self.pooling: Literal["mean", "last"] = "last" if self.causal else "mean"

    @property
    def max_seq_length(self) -> int:
        """The most tokens a text keeps, special tokens included."""
        return self._max_seq_length

    @max_seq_length.setter
    def max_seq_length(self, value: int) -> None:
        if _count(value) is None or not 1 < value <= self._limit:
            raise ValueError(
                f"max_seq_length must be an int in 2..{self._limit} (the most positions this "
                f"model and tokenizer take), got {describe(value)}"
            )
        self._max_seq_length = value

    @property
    def config(self) -> Any:
        """The model's own config (a :class:`~multihead.models.bert_config.BertConfig`, or the
        transformers config)."""
        return self.model.config

    def _probe(self) -> tuple[int, int, int, bool]:
        """One short forward under capture: (layers called, heads per layer, width, causal)."""
        sites = attention_modules(self)  # refuses a family the interface does not route
        family = getattr(self.config, "model_type", None) or type(self.model).__name__
        if not sites:
            raise ValueError(
                f"model ({type(self.model).__name__}) has no attention layer multihead can observe"
            )
        with warnings.catch_warnings():  # a model shorter than the probe: its start is enough
            warnings.simplefilter("ignore", TruncationWarning)
            batch = self.tokenize(_PROBE)
            if batch.input_ids.shape[1] < 2:  # causality shows only between two tokens
                batch = self.tokenize(" ".join([_PROBE] * 4))
        with torch.no_grad(), capture(self, device="cpu") as rec:
            out = self(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        called = [r.layer for r in rec.records]
        if called != list(range(len(sites))):
            raise ValueError(
                f"{family} ({type(self.model).__name__}): one forward called its {len(sites)} "
                f"attention modules in the order {called}, not each once in module order; its "
                f"layers cannot be numbered"
            )
        counts = [r.weights.shape[1] for r in rec.records]
        if len(set(counts)) != 1:
            raise ValueError(
                f"{family} ({type(self.model).__name__}): its layers have different head counts "
                f"({', '.join(f'layer {i}: {h}' for i, h in enumerate(counts))}); a text model "
                f"needs the same number of heads in every layer"
            )
        causal = all(bool((w[0].triu(1) == 0).all()) for w in rec.weights)  # (H, T, T)
        return len(counts), counts[0], int(out.last_hidden_state.shape[-1]), causal

    # -- text in ----------------------------------------------------------------------------

    def tokenize(self, texts: str | Sequence[str]) -> TokenBatch:
        """Tokenise texts, padded on the right to the longest, cut at ``max_seq_length``
        (:func:`multihead.tokenization.tokenize`: display tokens as written, one word rule).

        Args:
            texts: one text or a sequence of B texts.

        Returns:
            A :class:`~multihead.tokenization.TokenBatch` on the model's device, tensors (B, T).

        Raises:
            ValueError: ``texts`` empty or not valid Unicode.
            TypeError: ``texts`` holds something other than strings.

        Warns:
            TruncationWarning: (a UserWarning) a text was longer than ``max_seq_length`` tokens.
        """
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        return tokenize(
            self._tokenizer, texts, max_seq_length=self.max_seq_length, device=device, stacklevel=3
        )

    # -- tensors out ------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Any:
        """The model's output for (B, T) ids; ``.last_hidden_state`` is (B, T, E).

        Args:
            input_ids: (B, T) int64 or int32 token ids.
            attention_mask: (B, T) int or bool, 1/True = a real token; default all real.
            token_type_ids: (B, T) segment ids, passed on where the model embeds them.
        """
        extra = {"token_type_ids": token_type_ids} if self._token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)

    def sentence_embedding(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, E) unit-length sentence embeddings of hidden states (B, T, E): the mean over real
        tokens (:func:`mean_pool`), or for a causal model the last real token's state
        (:func:`last_token_pool`).

        Args:
            hidden: (B, T, E), padded on either side.
            attention_mask: (B, T), 1 = a real token.
        """
        pool = last_token_pool if self.pooling == "last" else mean_pool
        return pool(hidden, attention_mask)

    def encode(self, sentences: str | Sequence[str], *, batch_size: int = 32) -> Tensor:
        """Sentence embeddings (:meth:`sentence_embedding` of each text).

        Texts are sorted by length and run ``batch_size`` at a time (little padding), in eval
        mode without gradients; the result is in the input order.

        Args:
            sentences: one text or a sequence of N texts.
            batch_size: texts per forward.

        Returns:
            (N, E) on the model's device, in its dtype ((1, E) for a single text).

        Warns:
            TruncationWarning: when a text is longer than ``max_seq_length`` tokens and is cut.
        """
        items = [sentences] if isinstance(sentences, str) else list(sentences)
        for i, text in enumerate(items):
            check_text(f"sentences[{i}]", text)
        check_positive_int("batch_size", batch_size)
        ref = next(self.parameters())
        out = torch.empty(len(items), self.hidden_size, device=ref.device, dtype=ref.dtype)
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))  # longest first
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(order), batch_size):
                    idx = order[start : start + batch_size]
                    batch = self.tokenize([items[i] for i in idx])
                    hidden = self(
                        batch.input_ids, batch.attention_mask, batch.token_type_ids
                    ).last_hidden_state
                    out[idx] = self.sentence_embedding(hidden, batch.attention_mask).to(out.dtype)
        finally:
            self.train(was_training)
        return out

    # -- names kept for one release ---------------------------------------------------------

    @staticmethod
    def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """Deprecated: :func:`multihead.text.model.mean_pool` (or :meth:`sentence_embedding`)."""
        warnings.warn(
            "TextModel.mean_pool is deprecated: use model.sentence_embedding(hidden, mask) or "
            "multihead.text.mean_pool",
            DeprecationWarning,
            stacklevel=2,
        )
        return mean_pool(hidden, attention_mask)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # minilm() returned the BertModel itself before the text floor: its attributes (encoder,
            # embeddings, ...) are the model's now, read through here for one release.
            model = self.__dict__.get("_modules", {}).get("model")
            if name.startswith("_") or model is None or not hasattr(model, name):
                raise
        warnings.warn(
            f"TextModel.{name} is deprecated: the model's attributes are text_model.model.{name}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(model, name)

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, layers={self.num_layers}, heads={self.num_heads}, "
            f"causal={self.causal}, max_seq_length={self.max_seq_length}"
        )
