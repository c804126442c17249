"""``multihead.explain``: one text's attention in every layer and head, with a focus word.

``explaining.py`` computes it (the focus token, the weights, head statistics, importance and
ablation); ``result.py`` is the :class:`Explanation` it returns (pictures, page, files);
``focus.py`` finds the focus word and what each layer reads from it; ``head_effects.py`` scores
heads on one sentence (importance, ``--ablate``).
"""

from __future__ import annotations

from multihead.explanation.explaining import (
    DEFAULT_FOCUS,
    DEFAULT_TEXT,
    explain,
    explain_peak_bytes,
)
from multihead.explanation.result import Explanation

__all__ = ["explain", "explain_peak_bytes", "Explanation", "DEFAULT_TEXT", "DEFAULT_FOCUS"]
