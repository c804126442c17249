"""Any Hugging Face text model, read like multihead's own BERT: :class:`HFTextModel` and
:func:`load_hf`, what :func:`multihead.explain` (and ``multihead explain --model``) runs.

:class:`HFTextModel` wraps a transformers model and its fast tokenizer behind the interface
``explain`` uses on :class:`~multihead.models.bert.BertModel`: ``tokenize`` (a
:class:`~multihead.models.text.BertBatch`, right padding, truncation with a
:class:`~multihead.models.text.TruncationWarning`), a forward returning ``last_hidden_state``,
a sentence embedding, ``config.num_hidden_layers`` / ``config.num_attention_heads``,
``max_seq_length``, ``name`` and ``causal``.

- Encoder-decoder models (T5, BART, ...): only the encoder runs (``get_encoder()``); its
  self-attention is what is explained.
- Decoder-only models (GPT-2, Llama, ...) are ``causal``: each token reads itself and earlier
  tokens. Their sentence embedding is the last real token's hidden state (L2-normalised): the
  state the next-token prediction reads, the one place that has seen the whole text. Encoders
  mean-pool their real tokens, as sentence-transformers does.

Layers are the routed attention modules the forward actually calls, in module order (as
:func:`multihead.capture` numbers them); a probe forward at construction counts them and their
heads, and tells causal models from the weights (every weight above the diagonal exactly 0).

:func:`load_hf` reads the files through :mod:`multihead.hf.loading` (local files only, its
refusals) and wraps what it read here.

Shapes: B texts, T tokens, E hidden width, L layers, H heads.
"""

from __future__ import annotations

import inspect
import os
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from multihead._checks import describe, is_int
from multihead.hf.loading import load_model_and_tokenizer
from multihead.models import text
from multihead.models.text import BertBatch

__all__ = ["HFTextConfig", "HFTextModel", "load_hf"]

# Without a position limit in the config or the tokenizer (T5's relative positions), texts are
# cut here: what T5 itself was trained on, and a page a browser draws comfortably.
_FALLBACK_MAX_LENGTH = 512
# Tokenizers without a limit report this huge number (transformers' VERY_LARGE_INTEGER).
_NO_LIMIT = 10**9
_PROBE = "The cat sat on the mat, and then it slept."
# How whitespace-only tokens are shown (a label of blanks reads as nothing).
_BLANKS = str.maketrans({" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"})
# Word-boundary markers of SentencePiece ("▁") and byte-level BPE ("Ġ", a space); a newline
# ("Ċ") is whitespace of its own, shown as such through _BLANKS.
_MARKERS = "▁Ġ"


@dataclass(frozen=True)
class HFTextConfig:
    """What ``explain`` reads of a model's shape.

    Attributes:
        num_hidden_layers: L, the routed attention modules one forward calls.
        num_attention_heads: H, the query heads of each (the same in every layer).
        hidden_size: E, the width of ``last_hidden_state``.
        model_type: the transformers family (``config.model_type``).
    """

    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    model_type: str


class HFTextModel(nn.Module):
    """A transformers model and its fast tokenizer, presented as ``explain`` reads a BertModel.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention is routed through
            transformers' AttentionInterface; an encoder-decoder model runs its encoder only.
        tokenizer: its fast tokenizer (``PreTrainedTokenizerFast``: offsets and word ids).
        name: a name for titles; default ``config.name_or_path``.
        max_seq_length: where texts are cut, in tokens; default the smallest of the config's
            position limit and the tokenizer's ``model_max_length`` (else 512).

    Attributes:
        model: the module that runs (the encoder of an encoder-decoder model).
        tokenizer: the fast tokenizer, as given.
        config: an :class:`HFTextConfig`.
        causal: whether each token reads only itself and earlier tokens (decoder-only models).
        name: the model's name.
        max_seq_length: the most tokens a text keeps, specials included.

    Raises:
        ValueError: a family not routed through the interface (named), attention modules not
            called exactly once each, or layers with different head counts (named).
        TypeError: ``tokenizer`` is not a fast tokenizer.
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
        hf_config = model.config
        if getattr(hf_config, "is_encoder_decoder", False):
            model = model.get_encoder()  # type: ignore[operator]
        if not getattr(tokenizer, "is_fast", False):
            raise TypeError(
                f"tokenizer must be a fast tokenizer (PreTrainedTokenizerFast, from a "
                f"tokenizer.json), got {type(tokenizer).__name__}"
            )
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or str(getattr(hf_config, "name_or_path", "") or type(model).__name__)
        limit = _max_length(model, tokenizer)
        if max_seq_length is not None and not (
            is_int(max_seq_length) and 1 < max_seq_length <= limit
        ):
            raise ValueError(
                f"max_seq_length must be an int in 2..{limit} (the most positions this model "
                f"and tokenizer take), got {describe(max_seq_length)}"
            )
        self.max_seq_length = int(max_seq_length) if max_seq_length is not None else limit
        pad = tokenizer.pad_token_id
        pad = pad if pad is not None else getattr(hf_config, "pad_token_id", None)
        # A copy of the tokenizers.Tokenizer underneath: right padding, truncation per call.
        self._backend = text.prepare_tokenizer(
            tokenizer.backend_tokenizer, pad_id=pad or 0, vocab_size=_embedding_rows(model)
        )
        # Token types only where the model has an embedding for them: GPT-2's forward accepts
        # token_type_ids and adds its *word* embedding of them, changing every hidden state.
        self._token_types = int(getattr(hf_config, "type_vocab_size", 0) or 0) > 0 and (
            "token_type_ids" in inspect.signature(model.forward).parameters
        )
        layers, heads, causal = self._probe()
        self.causal = causal
        self.config = HFTextConfig(
            num_hidden_layers=layers,
            num_attention_heads=heads,
            hidden_size=int(_first(hf_config, ("hidden_size", "d_model", "n_embd", "dim")) or 0),
            model_type=str(getattr(hf_config, "model_type", type(model).__name__)),
        )

    def _probe(self) -> tuple[int, int, bool]:
        """One short forward under capture: (layers called, heads per layer, causal)."""
        from multihead.observe.recorder import capture
        from multihead.observe.rows import attention_modules

        sites = attention_modules(self)  # refuses a family the interface does not route
        with warnings.catch_warnings():  # a model shorter than the probe: its start is enough
            warnings.simplefilter("ignore", text.TruncationWarning)
            batch = self.tokenize(_PROBE)
            if batch.input_ids.shape[1] < 2:  # causality shows only between two tokens
                batch = self.tokenize(" ".join([_PROBE] * 4))
        with torch.no_grad(), capture(self, device="cpu") as rec:
            self(batch.input_ids, batch.attention_mask, batch.token_type_ids)
        called = [r.layer for r in rec.records]
        family = getattr(self.model.config, "model_type", type(self.model).__name__)
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
                f"({', '.join(f'layer {i}: {h}' for i, h in enumerate(counts))}); multihead "
                f"explain needs the same number of heads in every layer"
            )
        causal = all(bool((w[0].triu(1) == 0).all()) for w in rec.weights)  # (H, T, T)
        return len(counts), counts[0], causal

    # -- text in ----------------------------------------------------------------------------

    def tokenize(self, texts: str | Sequence[str]) -> BertBatch:
        """Tokenise texts, padded on the right to the longest, cut at ``max_seq_length``.

        ``tokens`` are display strings: the text each token covers (byte-level "Ġthe" and
        SentencePiece "▁the" read "the"; the byte pieces of one character are numbered,
        "東1/3" ...), the tokenizer's own strings for special tokens.
        ``offsets`` exclude the whitespace a token carries, so words are found by their letters
        (a token of whitespace alone, shown as "␣", gets the empty span where the next text
        starts). ``word_ids`` come from the text, not the tokenizer (whose pre-tokenizer may
        see one "word" in a whole sentence, as SentencePiece's without splitting does): a word
        is a run of characters between whitespace, each punctuation character a word of its
        own (Unicode category P; BERT's pre-tokenizer also splits symbols such as "$" and "+",
        which stay inside their word here); whitespace-only pieces belong to no word.

        Raises:
            ValueError: ``texts`` empty or not valid Unicode.

        Warns:
            TruncationWarning: (a UserWarning) a text was longer than ``max_seq_length`` tokens.
        """
        device = next((p.device for p in self.parameters()), torch.device("cpu"))
        batch = text.tokenize(
            self._backend, texts, max_seq_length=self.max_seq_length, device=device, stacklevel=3
        )
        items = [texts] if isinstance(texts, str) else list(texts)
        for i, source in enumerate(items):
            special = batch.special_mask[i].tolist()
            words = _word_of_each_character(source)
            tokens: list[str] = []
            spans: list[tuple[int, int]] = []
            word_ids: list[int | None] = []
            for j, (tok, (s, e)) in enumerate(zip(batch.tokens[i], batch.offsets[i], strict=True)):
                if special[j]:
                    tokens.append(tok)
                    spans.append((s, e))
                    word_ids.append(None)
                    continue
                # A piece that is only a word-boundary marker ("▁", "Ġ") is whitespace, whatever
                # characters its offsets point at (SentencePiece maps a prepended "▁" onto the
                # first letter).
                marker_only = not tok.strip(_MARKERS + " ")
                start, end = (s, s) if marker_only else _trim(source, s, e)
                shown = source[start:end] or (source[s:e] or " ").translate(_BLANKS)
                if marker_only:
                    shown = "␣"
                tokens.append(shown)
                spans.append((start, end))
                word_ids.append(words[start] if end > start else None)
            _number_byte_pieces(tokens, spans)
            batch.tokens[i], batch.offsets[i], batch.word_ids[i] = tokens, spans, word_ids
        return batch

    # -- tensors out ------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Any:
        """The model's output for (B, T) ids; ``.last_hidden_state`` is (B, T, E)."""
        extra = {"token_type_ids": token_type_ids} if self._token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)

    def sentence_embedding(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, E) unit-length: the last real token's state for causal models (what the next-token
        prediction reads), else the mean over real tokens (:meth:`mean_pool`).

        Args:
            hidden: (B, T, E), padded on either side.
            attention_mask: (B, T), 1 = a real token.
        """
        if not self.causal:
            return self.mean_pool(hidden, attention_mask)
        t = attention_mask.shape[1]
        last = t - 1 - attention_mask.long().flip(1).argmax(1)  # (B,) the last 1, either padding
        states = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, E)
        return F.normalize(states, p=2, dim=1)

    mean_pool = staticmethod(text.mean_pool)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"name={self.name!r}, layers={c.num_hidden_layers}, heads={c.num_attention_heads}, "
            f"causal={self.causal}, max_seq_length={self.max_seq_length}"
        )


def _trim(source: str, start: int, end: int) -> tuple[int, int]:
    """(start, end) without the whitespace at either end; (end, end) for whitespace alone, so
    that a word's text never starts with the space its first token carries."""
    piece = source[start:end]
    core = piece.strip()
    if not core:
        return end, end
    s = start + piece.index(core)
    return s, s + len(core)


def _first(obj: object, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _embedding_rows(model: nn.Module) -> int | None:
    """The rows of the model's token embedding (every id must have one); None when the model
    does not say."""
    try:
        rows = getattr(model.get_input_embeddings(), "num_embeddings", None)  # type: ignore[operator]
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return rows if is_int(rows) else None


def _max_length(model: nn.Module, tokenizer: Any) -> int:
    """The most tokens a text may keep: the config's position limit (less the positions a
    RoBERTa-style embedding reserves: it numbers positions from padding_idx + 1) and the
    tokenizer's ``model_max_length``, whichever is smaller."""
    positions = _first(model.config, ("max_position_embeddings", "n_positions", "n_ctx"))
    base = getattr(model, "base_model", model)  # RobertaForMaskedLM -> its RobertaModel
    table = getattr(getattr(base, "embeddings", None), "position_embeddings", None)
    reserved = getattr(table, "padding_idx", None)
    if positions is not None and isinstance(reserved, int):
        positions -= reserved + 1
    limits = [
        v
        for v in (positions, getattr(tokenizer, "model_max_length", None))
        if isinstance(v, int) and 1 < v < _NO_LIMIT
    ]
    return min(limits, default=_FALLBACK_MAX_LENGTH)


def _number_byte_pieces(tokens: list[str], spans: list[tuple[int, int]]) -> None:
    """Label in place the pieces of a character that byte-level BPE split ("東" as three
    bytes, each piece spanning the whole character): "東1/3", "東2/3", "東3/3", so that a
    picture does not show one character three times over."""
    i = 0
    while i < len(tokens):
        j = i
        while j + 1 < len(tokens) and spans[j + 1] == spans[i] and spans[i][1] > spans[i][0]:
            j += 1
        if j > i:
            for k in range(i, j + 1):
                tokens[k] = f"{tokens[k]}{k - i + 1}/{j - i + 1}"
        i = j + 1


def _word_of_each_character(source: str) -> list[int | None]:
    """Per character of ``source``, the index of its word (None for whitespace): words are runs
    of characters between whitespace, each punctuation character a word of its own."""
    words: list[int | None] = []
    count, inside = 0, False
    for ch in source:
        if ch.isspace():
            words.append(None)
            inside = False
        elif unicodedata.category(ch).startswith("P"):
            words.append(count)
            count, inside = count + 1, False
        else:
            if not inside:
                count, inside = count + 1, True
            words.append(count - 1)
    return words


# -- loading (the files are read by multihead.hf.loading) -------------------------------------


def load_hf(
    dir_or_name: str | os.PathLike[str],
    *,
    cache_dir: str | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> HFTextModel:
    """Load a Hugging Face text model and its fast tokenizer from local files only.

    Never downloads: a directory is read as it is, a name is looked up in the local Hugging
    Face cache only (``HF_HOME`` / ``HF_HUB_CACHE``, or ``cache_dir``). The model runs on
    ``attn_implementation="multihead"``, in eval mode.

    Args:
        dir_or_name: a directory with ``config.json``, the weights and ``tokenizer.json``; or a
            model name such as ``"gpt2"`` already in the local cache.
        cache_dir: the cache to look names up in; default transformers' own.
        device: where the model runs (``"auto"``: the GPU if any); default CPU. With accelerate
            installed the weights are read straight onto it.
        dtype: a floating torch.dtype or its name (``"bfloat16"``); default the one config.json
            declares, except that half types load as float32 on the CPU.

    Returns:
        An :class:`HFTextModel` (its encoder only for encoder-decoder models).

    Raises:
        FileNotFoundError: no such directory, a name not in the local cache, or a directory
            without ``config.json``.
        ValueError: no fast tokenizer (``tokenizer.json``), or one with ids beyond the
            embedding; a config transformers cannot read, or whose sizes the weights don't have
            (checked before anything is built); a family not routed through transformers'
            AttentionInterface; layers with different head counts; a device this machine lacks.
        TypeError: ``dir_or_name`` is not a str or path; a bad ``dtype``.
        ImportError: transformers (>= 5) is not installed.

    Warns:
        UserWarning: weights the model needs are missing from the files (initialised at random).
    """
    model, tokenizer, name = load_model_and_tokenizer(
        dir_or_name, cache_dir=cache_dir, device=device, dtype=dtype
    )
    return HFTextModel(model, tokenizer, name=name)
