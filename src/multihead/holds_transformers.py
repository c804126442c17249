"""Whether a module tree holds transformers modules, told without importing transformers."""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["holds_transformers"]

# module class -> whether it or a base comes from transformers. Every block a user enters asks,
# so each class is looked at once; weak keys let classes made per model (torch.fx) go.
_FROM_TRANSFORMERS: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def holds_transformers(model: nn.Module) -> bool:
    """Whether ``model`` or a module inside it is a transformers module: its class or a base of
    it comes from the ``transformers`` package (a user's own or remote-code ``PreTrainedModel``
    subclass lives in another module, a decoder layer alone is no ``PreTrainedModel``).

    :mod:`multihead.observe` then finds the attention sites through :mod:`multihead.hf`.
    """
    for module in model.modules():
        cls = type(module)
        found = _FROM_TRANSFORMERS.get(cls)
        if found is None:
            found = any(c.__module__.startswith("transformers.") for c in cls.__mro__)
            _FROM_TRANSFORMERS[cls] = found
        if found:
            return True
    return False
