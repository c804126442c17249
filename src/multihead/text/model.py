"""One text model for every backend: :class:`TextModel` (a model, its tokenizer and its pooling).

Models are pure modules, ids in and hidden states out: multihead's own
:class:`~multihead.models.bert.BertModel`, or any Hugging Face transformers model whose attention
is routed through transformers' AttentionInterface (:mod:`multihead.hf`). A :class:`TextModel`
adds what reading text needs, the same way for both:

- ``tokenize``: :func:`multihead.text.tokenization.tokenize` (display tokens as written, one word
  rule), cut at ``max_seq_length``;
- a sentence embedding (``pooling``): the mean over real tokens for encoders, as
  sentence-transformers does; for decoders (``causal``) the last real token's state, the one
  place that has seen the whole text and what the next-token prediction reads; L2-normalised;
- ``encode(texts)``: sentence embeddings, batched;
- ``name``, ``causal``, ``num_layers``, ``num_heads``.

A TextModel is an ``nn.Module`` holding the model as ``model``: :func:`multihead.capture`,
``head_statistics``, ``intervene``, ``record_heads`` and ``head_importance`` take either the
TextModel or ``text_model.model`` and number the same layers.

Layers, heads, width, causality, the position limit and token types are read off the model's
map (:func:`multihead.model_map`; no forward runs at construction): layers are its attention
sites in module order, as :func:`multihead.capture` numbers them. An encoder-decoder model (T5,
BART, ...) runs its encoder only: its self-attention is what is read. ``head="lm"`` keeps a
causal language model's head (its forward then gives the logits).

Build one from a directory with :func:`multihead.pretrained.load_text_model`.

Shapes: B texts, T tokens, E hidden width, L layers, H heads.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import check_choice, check_positive_int, describe, is_int
from multihead.map_types import ModelMap
from multihead.mapping import model_map
from multihead.text.tokenization import TokenBatch, check_text, prepare_tokenizer, tokenize

__all__ = ["TextModel", "mean_pool", "last_token_pool", "HEADS"]

# The heads a text model may keep: "lm", a causal language model's unembedding.
HEADS = ("lm",)

# Without a position limit in the config or the tokenizer (T5's relative positions), texts are
# cut here: what T5 itself was trained on, and a page a browser draws comfortably.
_FALLBACK_MAX_LENGTH = 512
# Tokenizers without a limit report this huge number (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 10**9


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


def _under(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if name else prefix


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
            AttentionInterface. Without ``head`` an encoder-decoder model runs its encoder only
            and a model with a task head its base model; its forward takes
            ``(input_ids, attention_mask=...)`` and returns ``last_hidden_state``.
        tokenizer: a ``tokenizers.Tokenizer`` or a fast transformers tokenizer; kept as given
            (:attr:`tokenizer`), read through a copy that pads on the right and truncates per
            call. Every id it gives must have a row in the model's token embedding.
        name: a name for titles and reports; default the config's ``name_or_path``, else the
            model's class.
        max_seq_length: where texts are cut, in tokens (special tokens included); default the
            model's position limit (its :func:`multihead.model_map`) or the tokenizer's
            ``model_max_length``, whichever is smaller, else 512.
        head: None, or ``"lm"`` to keep the model's language-modelling head: the text model's
            forward then returns the model's own output (``.logits`` (B, T, V)), as the circuit
            functions' metrics read it; :meth:`encode` still reads the base model's hidden
            states.

    Attributes:
        model: the module that runs (without ``head``: the encoder of an encoder-decoder
            model, the base model of a task head), in eval mode.
        tokenizer: the tokenizer, as given.
        name: the model's name.
        head: None or ``"lm"``.
        causal: whether each token reads only itself and earlier tokens (decoder-only models).
        pooling: "last" (the last real token) for causal models, else "mean".
        num_layers: L, the attention sites of the model's map.
        num_heads: H, the query heads of each (the same in every layer).
        hidden_size: E, the width of ``last_hidden_state``.

    Raises:
        TypeError: ``model`` not an ``nn.Module``; ``tokenizer`` neither kind.
        ValueError: a tokenizer with ids beyond the embedding; a bad ``max_seq_length`` or
            ``head``; ``head="lm"`` for a model without an unembedding; a transformers family
            not routed through the interface (named); layers with different head counts
            (named).

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
        head: Literal["lm"] | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if head is not None:
            check_choice("head", head, HEADS)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {describe(name)}")
        backend = _backend(tokenizer)
        given = model_map(model)
        if head == "lm":
            if given.unembedding is None or given.causal is not True:
                raise ValueError(
                    f"head='lm' keeps a causal language model's head, and "
                    f"{type(model).__name__} ({given.family}) is "
                    f"{'not causal' if given.unembedding is not None else 'without one'}"
                )
            inner = given
        else:
            # an encoder-decoder model's encoder, a task head's base: the hidden states' module
            model = given.base if given.base is not None else model
            inner = model_map(model)
        self.model = model
        self.head = head
        self.eval()  # the wrapper and the model
        self.tokenizer = tokenizer
        config = getattr(model, "config", None)
        self.name = name or given.name or type(model).__name__
        limits = (inner.position_limit, _count(getattr(tokenizer, "model_max_length", None)))
        self._limit = min(
            (v for v in limits if v and 1 < v < _NO_LIMIT), default=_FALLBACK_MAX_LENGTH
        )
        self.max_seq_length = self._limit if max_seq_length is None else max_seq_length
        pad = getattr(tokenizer, "pad_token_id", None)
        pad = pad if is_int(pad) else getattr(config, "pad_token_id", None)
        pad_id = pad if isinstance(pad, int) and not isinstance(pad, bool) else 0
        token = inner.embeddings[0] if inner.embeddings else None
        rows = token.num_embeddings if isinstance(token, nn.Embedding) else None
        # A copy of the tokenizers.Tokenizer: right padding, truncation per call.
        self._tokenizer = prepare_tokenizer(backend, pad_id=pad_id, vocab_size=rows)
        if not inner.sites:
            raise ValueError(
                f"model ({type(model).__name__}) has no attention layer multihead can observe"
            )
        counts = [s.num_heads for s in inner.sites]
        if len(set(counts)) != 1:
            raise ValueError(
                f"{inner.family} ({type(model).__name__}): its layers have different head "
                f"counts ({', '.join(f'layer {i}: {h}' for i, h in enumerate(counts))}); a text "
                f"model needs the same number of heads in every layer"
            )
        self.num_layers, self.num_heads = len(counts), counts[0]
        if inner.width is None:
            raise ValueError(
                f"{inner.family} ({type(model).__name__}): its map does not know the width of "
                f"its hidden states"
            )
        self.hidden_size = inner.width
        self.causal = bool(inner.causal)
        self.pooling: Literal["mean", "last"] = "last" if self.causal else "mean"

    def build_model_map(self) -> ModelMap:
        """The model's map (:func:`multihead.model_map`), its names under ``model.``, no call
        options of its own (:meth:`forward` passes the model's) and no positions argument
        (:meth:`forward` places its tokens itself)."""
        inner = self._inner
        sites = tuple(replace(s, name=_under("model", s.name)) for s in inner.sites)
        blocks = tuple(replace(b, name=_under("model", b.name)) for b in inner.blocks)
        return inner.with_options(
            sites=sites, blocks=blocks, call_options={}, positions_argument=None
        )

    @property
    def _inner(self) -> ModelMap:
        """The model's own map (its call options, its base)."""
        return model_map(self.model)

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

    # -- text in ----------------------------------------------------------------------------

    def tokenize(self, texts: str | Sequence[str]) -> TokenBatch:
        """Tokenise texts, padded on the right to the longest, cut at ``max_seq_length``
        (:func:`multihead.text.tokenization.tokenize`: display tokens as written, one word rule).

        Args:
            texts: one text or a sequence of B texts.

        Returns:
            A :class:`~multihead.text.tokenization.TokenBatch` on the model's device, tensors
            (B, T).

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

    def token_ids(self, text: str) -> list[int]:
        """The ids of ``text`` alone: no special tokens, no padding, no truncation (e.g. to
        check that an answer is one token of the vocabulary).

        Raises:
            ValueError: ``text`` empty or not valid Unicode.
            TypeError: ``text`` not a str.
        """
        check_text("text", text)
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    # -- tensors out ------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        *,
        last_logits_only: bool = False,
    ) -> Any:
        """The model's output for (B, T) ids; ``.last_hidden_state`` is (B, T, E).

        Args:
            input_ids: (B, T) int64 or int32 token ids.
            attention_mask: (B, T) int or bool, 1/True = a real token; default all real.
            token_type_ids: (B, T) segment ids, passed on where the model embeds them.
            last_logits_only: with ``head="lm"``, ``.logits`` is (B, 1, V), the last position's
                only (the unembedding of the other positions is skipped where the model takes
                transformers' ``logits_to_keep``, else sliced off).
        """
        extra: dict[str, Any] = (
            {"token_type_ids": token_type_ids} if self._inner.token_types else {}
        )
        if last_logits_only and self.head != "lm":
            raise ValueError(
                f"last_logits_only needs head='lm', this model's head is {self.head!r}"
            )
        keeps = last_logits_only and _takes_argument(self.model, "logits_to_keep")
        if keeps:
            extra["logits_to_keep"] = 1
        output = self.model(
            input_ids=input_ids, attention_mask=attention_mask, **extra, **self._inner.call_options
        )
        if last_logits_only and not keeps:
            output.logits = output.logits[:, -1:]
        return output

    def hidden_states(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """(B, T, E): the base model's ``last_hidden_state`` for (B, T) ids (with ``head``, the
        states the head reads; without, :meth:`forward`'s own)."""
        if self.head is None:
            out = self(input_ids, attention_mask, token_type_ids)
        else:
            base = self._inner.base if self._inner.base is not None else self.model
            base_map = model_map(base)
            extra = {"token_type_ids": token_type_ids} if base_map.token_types else {}
            out = base(
                input_ids=input_ids, attention_mask=attention_mask, **extra, **base_map.call_options
            )
        hidden: Tensor = out.last_hidden_state
        return hidden

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
                    hidden = self.hidden_states(
                        batch.input_ids, batch.attention_mask, batch.token_type_ids
                    )
                    out[idx] = self.sentence_embedding(hidden, batch.attention_mask).to(out.dtype)
        finally:
            self.train(was_training)
        return out

    def extra_repr(self) -> str:
        return (
            f"name={self.name!r}, layers={self.num_layers}, heads={self.num_heads}, "
            f"causal={self.causal}, max_seq_length={self.max_seq_length}"
            + (f", head={self.head!r}" if self.head else "")
        )


def _takes_argument(module: nn.Module, argument: str) -> bool:
    """Whether ``module.forward`` takes the keyword ``argument``."""
    try:
        return argument in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
