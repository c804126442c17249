"""Observe and steer attention through MultiHeadAttention's one observer channel.

``capture`` records chosen layers, heads and query rows; ``head_statistics`` summarises heads
(``statistics_over_batches`` over many token batches; ``head_distances_over_batches`` maps heads
by how alike they attend; the loops over texts, ``corpus_statistics`` and ``head_distances``, are
:mod:`multihead.text`'s: nothing here reads text);
``intervene`` ablates, scales or patches heads, ``record_heads`` records their outputs and
``head_importance`` scores them; ``patch_heads`` finds the heads that carry what differs between
two inputs, ``path_patching`` through which later head's queries, keys or values. Everything here
is an observer (:meth:`multihead.MultiHeadAttention.register_observer`) or a q/k/v editor.
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
    "attention_modules": "multihead.observe.rows",
    "intervene": "multihead.observe.steering",
    "record_heads": "multihead.observe.steering",
    "HeadRecording": "multihead.observe.steering",
    "head_importance": "multihead.observe.importance",
    "patch_heads": "multihead.observe.patching",
    "attribution_patching": "multihead.observe.attribution",
    "path_patching": "multihead.observe.paths",
    "logit_attribution": "multihead.observe.direct_logit_attribution",
    "LogitAttribution": "multihead.observe.direct_logit_attribution",
}

__all__ = list(_LAZY)

__getattr__ = lazy_getattr(__name__, _LAZY)
