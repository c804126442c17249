"""See attention through MultiHeadAttention's one observer channel.

``capture`` records chosen layers, heads and query rows (a ``Recorder`` of
``CapturedAttention``); ``head_statistics`` summarises heads as ``HeadStatistics`` (the
``METRICS`` it computes; ``statistics_over_batches`` over many token batches;
``head_distances_over_batches`` maps heads by how alike they attend, a ``HeadMap``); the loops
over texts, ``corpus_statistics`` and ``head_distances``, are :mod:`multihead.text`'s: nothing
here reads text. ``attention_modules`` (from :mod:`multihead.mapping`) lists a model's sites.
Steering heads and finding the ones a behaviour runs through (``intervene``, ``patch_heads``,
...) is :mod:`multihead.circuits`, floors up. Everything here is an observer
(:meth:`multihead.MultiHeadAttention.register_observer`).
"""

from __future__ import annotations

from multihead._lazy import lazy_getattr

_LAZY: dict[str, str] = {
    "capture": "multihead.observe.recorder",
    "Recorder": "multihead.observe.recorder",
    "CapturedAttention": "multihead.observe.recorder",
    "head_statistics": "multihead.observe.statistics",
    "HeadStatistics": "multihead.observe.head_summary",
    "METRICS": "multihead.observe.head_metrics",
    "statistics_over_batches": "multihead.observe.corpus",
    "head_distances_over_batches": "multihead.observe.head_distance",
    "HeadMap": "multihead.observe.head_distance",
    "attention_modules": "multihead.mapping",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
