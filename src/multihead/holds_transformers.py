"""Whether a module tree holds a transformers model, told without importing transformers."""

from __future__ import annotations

import weakref

from torch import nn

__all__ = ["holds_transformers"]

# module class -> whether it is a transformers PreTrainedModel. Every block a user enters asks, so
# each class is looked at once; weak keys let classes made per model (torch.fx) go.
_PRETRAINED: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def holds_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is or holds a transformers ``PreTrainedModel`` (a subclass too: a
    user's own or remote-code model lives in another module), told from the classes' bases
    without importing transformers.

    :mod:`multihead.observe` then finds the attention sites through :mod:`multihead.hf`; other
    transformers modules (an activation, a decoder layer alone) do not count, so a model of
    multihead's own modules that borrows one keeps its own attention modules.
    """
    for module in model.modules():
        cls = type(module)
        found = _PRETRAINED.get(cls)
        if found is None:
            found = any(
                c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
                for c in cls.__mro__
            )
            _PRETRAINED[cls] = found
        if found:
            return True
    return False
