"""The models :func:`multihead.explain` reads: what it needs of one (:class:`TextModel`), the
check, and the default (all-MiniLM-L6-v2 on multihead's own BERT).

Two kinds fit: :class:`~multihead.models.bert.BertModel` and
:class:`~multihead.hf.text.HFTextModel` (any Hugging Face text model). Neither is imported
here unless asked for: transformers is an optional extra.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from torch import Tensor, nn

if TYPE_CHECKING:
    from multihead.models.bert import BertModel
    from multihead.models.text import BertBatch

__all__ = ["TextModel", "check_model", "default_model", "model_name", "DEFAULT_MODEL_NAME"]

DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


@runtime_checkable
class TextModel(Protocol):
    """What ``explain`` and :mod:`multihead.head_effects` use of a model.

    Attributes:
        config: ``num_hidden_layers`` (L) and ``num_attention_heads`` (H).
        max_seq_length: the most tokens a text keeps.
        tokenizer: None when the model cannot read text.
    """

    config: Any
    max_seq_length: int
    tokenizer: Any

    def tokenize(self, texts: str | Sequence[str]) -> BertBatch: ...

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = ...,
        token_type_ids: Tensor | None = ...,
    ) -> Any:
        """An output whose ``last_hidden_state`` is (B, T, E)."""
        ...

    def sentence_embedding(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, E), (B, T) -> (B, E), each row of unit length."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


@functools.lru_cache(maxsize=1)
def default_model() -> BertModel:
    """all-MiniLM-L6-v2 on multihead's BERT, loaded once per process (a notebook calling
    ``explain()`` in a loop shouldn't reload it)."""
    from multihead.pretrained import minilm

    return minilm()


def model_name(model: Any) -> str:
    """A name for titles: the model's ``name`` (or ``name_or_path``), else its class."""
    name = getattr(model, "name", None) or getattr(model, "name_or_path", None)
    return str(name) if name else type(model).__name__


def check_model(model: Any) -> TextModel:
    """``model`` if ``explain`` can read it.

    Raises:
        TypeError: neither a multihead BertModel nor an HFTextModel (a bare transformers model
            is named, with what to do).
        ValueError: a model without a tokenizer.
    """
    if not isinstance(model, TextModel):
        hint = (
            " (wrap a transformers model with multihead.hf.text.HFTextModel(model, tokenizer), "
            "or load one with multihead.hf.text.load_hf)"
            if type(model).__module__.startswith("transformers.")
            else ""
        )
        raise TypeError(
            f"model must be a multihead BertModel or an HFTextModel, got "
            f"{type(model).__name__}{hint}"
        )
    if model.tokenizer is None:
        raise ValueError(
            "model must have a tokenizer to read text, got a BertModel without one (its "
            "directory has no tokenizer.json)"
        )
    return model
